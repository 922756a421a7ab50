"""Which reasoning format a tokenizer gets (`reasoning_format.choose`), where a choice's output
starts (the prompt's tail), the engine's marks (marker tokens kept out of the text at their
offsets, through the real scheduler, stop strings included), and the grammar that holds a
chat's answer after the reasoning (`reasoning_grammar`): what it takes reads back as the answer."""

import json
import time
from pathlib import Path

import pytest
from _serving_doubles import CharTokenizer, HistoryExecutor
from tokenizers import AddedToken

from tandem.engine.grammar import GrammarSpec, GrammarVocab
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Scheduler
from tandem.engine.serving import Mark, ServingEngine
from tandem.loaders.tokenizer import Tokenizer
from tandem.loaders.tokenizer_build import build_byte_bpe
from tandem.server import harmony
from tandem.server.reasoning import THINK_CLOSE, THINK_OPEN, Marker, ToolCall
from tandem.server.reasoning_format import ReasoningFormatError, choose
from tandem.server.reasoning_grammar import harmony_call, hold_answer
from tandem.server.tools import call_grammar

HARMONY = list(harmony.MARKERS)
THINK = [THINK_OPEN, THINK_CLOSE]
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Oslo"]}}},
    },
}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def tokenizer(special=(), added=()) -> Tokenizer:
    """A small byte-level BPE with harmony-like special tokens and Qwen3-like added ones."""
    tok = build_byte_bpe(300)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    eos = "<|return|>" if "<|return|>" in special else "<|im_end|>"
    return Tokenizer(tok, {"eos_token": eos}, Path("."))


@pytest.fixture(scope="module")
def toks():
    return {
        "harmony": tokenizer(special=HARMONY),
        "think": tokenizer(added=THINK),
        "both": tokenizer(special=HARMONY, added=THINK),
        "none": tokenizer(),
    }


def test_auto_picks_harmony_then_think_by_marker_tokens_and_a_forced_format_reads_text(toks):
    assert choose(toks["harmony"]).kind == "harmony"
    assert choose(toks["both"]).kind == "harmony"
    think = choose(toks["think"])
    assert think.kind == "think" and sorted(think.ids.values()) == sorted(THINK)
    assert choose(toks["none"]).kind == "none"
    assert choose(toks["think"], "none").kind == "none"
    forced = choose(toks["none"], "think")
    assert forced.kind == "think" and forced.on_text and not forced.marker_ids
    assert choose(CharTokenizer(), "harmony").on_text  # a tokenizer without token lookup
    with pytest.raises(ReasoningFormatError):
        choose(toks["none"], "deepseek")


def read(fmt, tok, prompt: str, output: list) -> tuple:
    """`output` (text and marker strings) after `prompt`, as the engine would hand it over."""
    tail = fmt.prompt_tail(tok.encode(prompt), tok.decode)
    text, marks = "", []
    for p in output:
        if isinstance(p, Marker):
            marks.append(Mark(len(text), fmt.token(p.text)))
        else:
            text += p
    parsed = fmt.reader(tail).whole(text, marks)
    return parsed.reasoning, parsed.content, parsed.calls


def test_the_prompt_says_where_the_output_starts(toks):
    tok, fmt = toks["think"], choose(toks["think"])
    out = ["idea", Marker(THINK_CLOSE), "\n\nanswer"]
    # DeepSeek-R1 / Qwen3's templates opening <think>: the output starts in the reasoning
    assert read(fmt, tok, "<|im_start|>assistant\n<think>\n", out) == ("idea", "answer", [])
    # Qwen3 with enable_thinking false: an empty block, the output is the answer
    plain = ["answer <think> as text"]
    prompt = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert read(fmt, tok, prompt, plain) == ("", "answer <think> as text", [])
    opened = [Marker(THINK_OPEN), "\nidea\n", Marker(THINK_CLOSE), "\n\nanswer"]
    assert read(fmt, tok, "<|im_start|>assistant\n", opened) == ("idea", "answer", [])
    h, hfmt = toks["harmony"], choose(toks["harmony"])
    prompt = "<|start|>user<|message|>hi<|end|><|start|>assistant"
    C, M, E, S = (Marker(m) for m in (harmony.CHANNEL, harmony.MESSAGE, harmony.END, harmony.START))
    out = [C, "analysis", M, "think <|end|>", E, S, "assistant", C, "final", M, "Hi!"]
    assert read(hfmt, h, prompt, out) == ("think <|end|>", "Hi!", [])
    # a forced format on text: the markers found in the prompt's and the output's text
    tfmt = choose(toks["none"], "think")
    got = read(tfmt, toks["none"], "assistant\n<think>\n", ["idea</thi", "nk>\n\nanswer"])
    assert got == ("idea", "answer", [])


def test_marker_tokens_are_kept_out_of_the_text_at_their_offsets_stop_strings_included():
    """Through the real scheduler: the double's greedy letters, one letter taken as a marker."""

    def run(markers=frozenset(), stop=()):
        ex = HistoryExecutor(vocab=128, span=26, offset=97, max_seq_len=256)
        sched = Scheduler(ex, eos_token_ids=(0,))
        sched.start()
        engine = ServingEngine(sched, CharTokenizer(), "m")
        deltas, done = [], []
        params = SamplingParams(max_tokens=16, temperature=0.0)
        on_done = lambda c, e: done.append((c, e))  # noqa: E731
        engine.generate([104, 105], params, stop, deltas.append, on_done, markers=markers)
        deadline = time.monotonic() + 30
        while not done and time.monotonic() < deadline:
            time.sleep(0.01)
        sched.stop()
        ((completion, error),) = done
        assert error is None
        return deltas, completion

    _, plain = run()
    letters = plain.text
    # a letter written once, between two others: the marker
    k = next(k for k in range(1, len(letters) - 1) if letters.count(letters[k]) == 1)
    marker = ord(letters[k])
    kept = "".join(c for c in letters if ord(c) != marker)
    offsets = [
        sum(ord(c) != marker for c in letters[:k])
        for k, c in enumerate(letters)
        if ord(c) == marker
    ]
    deltas, done = run(frozenset({marker}))
    assert done.text == kept and done.token_ids == plain.token_ids
    assert done.marks == [Mark(o, marker) for o in offsets]
    seen = 0
    for d in deltas:  # each mark in the delta that shows the text before it
        assert all(seen <= m.offset <= seen + len(d.text) for m in d.marks)
        seen += len(d.text)
    assert [m for d in deltas for m in d.marks] == done.marks
    # a stop string held across the marker: the mark waits with the text before it, then goes
    # with it; one that completes across the marker cuts the text, and the mark after it goes
    _, held = run(frozenset({marker}), stop=(letters[k - 1] + "\x01",))
    assert held.text == kept and held.marks == done.marks
    _, cut = run(frozenset({marker}), stop=(letters[k - 1] + letters[k + 1],))
    end = kept.find(letters[k - 1] + letters[k + 1])
    assert cut.text == kept[:end] and all(m.offset <= end for m in cut.marks)
    assert cut.marks == [m for m in done.marks if m.offset <= end]


def walk(vocab: GrammarVocab, spec: GrammarSpec, tok: Tokenizer, fmt, output: list) -> tuple:
    """Feeds `output` (text, text in parts encoded apart, or markers as their tokens) to the
    grammar's mask; None where it refuses a token, else whether it accepts, and the text and
    marks as the engine would hand them to a reader."""
    mask = vocab.mask(spec)
    text, marks = "", []
    for p in output:
        if isinstance(p, Marker):
            ids = [fmt.token(p.text)]
            marks.append(Mark(len(text), ids[0]))
        else:  # a part that spells a marker in pieces is text, not the marker's token
            parts = (p,) if isinstance(p, str) else p
            ids = [i for part in parts for i in tok.encode(part)]
            text += "".join(parts)
        for i in ids:
            if not mask.allowed()[i]:
                return None
            mask.advance(i)
    return mask.accepting, text, marks


@pytest.mark.parametrize("which", ["think", "none"])
def test_a_held_answer_takes_reasoning_first_and_reads_back_as_the_answer(toks, which):
    tok = toks[which]
    fmt = choose(tok, "think")  # on tokens, and on the text where the tokenizer has none
    vocab = GrammarVocab.of(tok)
    op, C = Marker(THINK_OPEN), Marker(THINK_CLOSE)
    if fmt.on_text:
        op, C = THINK_OPEN, THINK_CLOSE
    spec = hold_answer(fmt, GrammarSpec("json", schema=SCHEMA), [])
    answer = '{"a": 3}'
    for output, reasoning in (([op, "an idea", C, "\n\n", answer], "an idea"), ([answer], "")):
        accepting, text, marks = walk(vocab, spec, tok, fmt, output)
        parsed = fmt.reader([]).whole(text, marks)
        assert accepting and (parsed.reasoning, parsed.content) == (reasoning, answer)
    # before </think> a JSON object is still reasoning; the answer must follow it
    accepting, *_ = walk(vocab, spec, tok, fmt, [op, answer])
    assert not accepting
    if not fmt.on_text:  # so is one after </think> spelled in text, not its token
        accepting, text, marks = walk(vocab, spec, tok, fmt, [op, ("</", "think>"), answer])
        assert not accepting and fmt.reader([]).whole(text, marks).content == ""
    inside = hold_answer(fmt, GrammarSpec("json", schema=SCHEMA), [Marker(THINK_OPEN), "\n"])
    assert walk(vocab, inside, tok, fmt, [answer])[0] is False
    accepting, text, marks = walk(vocab, inside, tok, fmt, ["hm", C, answer])
    parsed = fmt.reader([Marker(THINK_OPEN)]).whole(text, marks)
    assert accepting and (parsed.reasoning, parsed.content) == ("hm", answer)
    forced = hold_answer(fmt, call_grammar([TOOL]), [])
    block = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert walk(vocab, forced, tok, fmt, [op, "x", C, "\n", block])[0]


def test_harmony_grammars_hold_the_final_message_and_calls_after_an_analysis(toks):
    tok, fmt = toks["harmony"], choose(toks["harmony"])
    vocab = GrammarVocab.of(tok)
    tail = [Marker(harmony.START), "assistant"]
    C, M, E, S, R, K, CALL = (
        Marker(m)
        for m in (harmony.CHANNEL, harmony.MESSAGE, harmony.END, harmony.START, harmony.RETURN)
        + (harmony.CONSTRAIN, harmony.CALL)
    )
    spec = hold_answer(fmt, GrammarSpec("json", schema=SCHEMA), tail)
    spelled = ("the <|", "end|> of it")
    out = [C, "analysis", M, spelled, E, S, "assistant", C, "final", M, '{"a": 1}', R]
    accepting, text, marks = walk(vocab, spec, tok, fmt, out)
    parsed = fmt.reader(tail).whole(text, marks)
    assert accepting and (parsed.reasoning, parsed.content) == ("the <|end|> of it", '{"a": 1}')
    assert walk(vocab, spec, tok, fmt, [C, "final", M, '{"a": 1}', R])[0]
    assert walk(vocab, spec, tok, fmt, ['{"a": 1}']) is None  # the header comes first
    call = harmony_call(fmt, [TOOL], tail)
    out = [C, "commentary to=functions.get_weather ", K, "json", M, '{"city": "Oslo"}', CALL]
    accepting, text, marks = walk(vocab, call, tok, fmt, out)
    assert accepting
    assert fmt.reader(tail).whole(text, marks).calls == [
        ToolCall("get_weather", json.dumps({"city": "Oslo"}))
    ]
    # a prompt that does not end in an assistant header: the grammar stays the request's own
    assert harmony_call(fmt, [TOOL], []) is None
    plain = GrammarSpec("json", schema=SCHEMA)
    assert hold_answer(fmt, plain, []) == plain
