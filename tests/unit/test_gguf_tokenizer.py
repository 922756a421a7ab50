"""The tokenizer a GGUF carries, against the references that define it.

- The real SmolLM2-135M-Instruct GGUF (`gpt2`, pre `smollm`): transformers' GGUF loader, on the
  hostile text set, the chat template and the stop ids. Where that loader and llama.cpp disagree
  (non-ASCII numerals: llama.cpp and SmolLM2's own tokenizer.json split every `\\p{N}` alone,
  transformers' loader has no rule for `smollm`), the published pipeline is the reference.
- A SentencePiece BPE with byte fallback (`llama`): SentencePiece itself, with llama.cpp's
  special-token split in front; transformers only where its `Metaspace` agrees with SentencePiece
  (transformers adds no `▁` to text that already starts with a space or follows a special token).
- A `qwen2`-pre byte-level BPE: the tokenizer it was trained as, and transformers.
- llama.cpp's own golden vocab tests, where a llama.cpp source tree is at hand.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import gguf
import pytest
from _gguf_vocab import (
    HOSTILE,
    NUMERALS,
    byte_level_fields,
    sentencepiece_fields,
    smollm2_gguf,
    train_qwen2_bpe,
    train_sentencepiece,
    write_gguf,
)
from tokenizers import AddedToken, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from tandem.cli.generate import prompt_ids
from tandem.engine.serving import ServingEngine
from tandem.loaders.gguf.tokenizer import load_gguf_tokenizer

T = gguf.TokenType

SMOLLM2_SPECIAL_TEXT = [
    "<|im_start|>user\nhi<|im_end|>\n",
    "text<|endoftext|>more",
    "<|im_end|><|im_start|>",
    "<|im_start|> spaced <|im_end|>",
    "<|im_start",
    "im_start|>",
    "<repo_name>x<file_sep>",
]
CHAT = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "Hi 👋, what's 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And\tthen  \n?"},
]


def load(path: Path):
    return load_gguf_tokenizer(gguf.GGUFReader(path), path)


@pytest.fixture(scope="module")
def smollm2():
    transformers = pytest.importorskip("transformers")
    path = smollm2_gguf()
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    reader = gguf.GGUFReader(path)
    return load_gguf_tokenizer(reader, path), ref, reader


def test_smollm2_ids_equal_transformers_on_hostile_text(smollm2):
    tok, ref, _ = smollm2
    for text in HOSTILE + SMOLLM2_SPECIAL_TEXT:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False), repr(text)


def test_smollm2_numerals_split_like_its_published_tokenizer(smollm2):
    """SmolLM2's tokenizer.json: Digits(individual) then GPT-2 byte level, on the file's vocab."""
    tok, _, reader = smollm2
    tokens = reader.fields[gguf.Keys.Tokenizer.LIST].contents()
    merges = reader.fields[gguf.Keys.Tokenizer.MERGES].contents()
    vocab = {t: i for i, t in enumerate(tokens)}
    published = HFTokenizer(
        models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges])
    )
    published.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(False)]
    )
    for text in NUMERALS + HOSTILE:
        assert tok.encode(text) == published.encode(text).ids, repr(text)


def test_smollm2_decode_round_trips_and_drops_control_tokens(smollm2):
    tok, _, _ = smollm2
    for text in HOSTILE + NUMERALS:
        assert tok.decode(tok.encode(text)) == text, repr(text)
    assert tok.decode(tok.encode("a<|im_end|>b<|endoftext|>")) == "ab"


def test_smollm2_chat_template_renders_as_transformers(smollm2):
    tok, ref, _ = smollm2
    for add in (True, False):
        for msgs in (CHAT, CHAT[1:2]):  # without a system turn the template writes its own
            text = tok.apply_chat_template(msgs, add_generation_prompt=add)
            assert text == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add)
            want = ref.apply_chat_template(msgs, add_generation_prompt=add, return_dict=False)
            assert tok.encode_prompt(text) == list(want)


def test_smollm2_stops_on_eos_and_end_of_turn(smollm2):
    tok, ref, _ = smollm2
    assert tok.eos_token_ids[0] == ref.eos_token_id == ref.convert_tokens_to_ids("<|im_end|>")
    assert set(tok.eos_token_ids) == {2, ref.convert_tokens_to_ids("<|endoftext|>")}
    assert tok.bos_token_id == ref.bos_token_id and not tok.add_bos_token
    assert tok.encode_prompt("hi") == tok.encode("hi")


def _special_split(text: str, specials: dict[str, int]) -> list[str | int]:
    """llama.cpp's `tokenizer_st_partition`: each special token, longest first, cut out of every
    fragment of text still raw."""
    parts: list[str | int] = [text] if text else []
    for s in sorted(specials, key=len, reverse=True):
        out: list[str | int] = []
        for p in parts:
            if isinstance(p, int):
                out.append(p)
                continue
            pieces = p.split(s)
            for k, piece in enumerate(pieces):
                if k:
                    out.append(specials[s])
                if piece:
                    out.append(piece)
        parts = out
    return parts


SPM_SPECIAL_TEXT = [
    "<|im_start|>user\nhi<|im_end|>",
    "call <tool> now",
    "<tool><tool>x",
    "<s>x</s> y<unk>z",
    "<|im_start|> lead",
]


@pytest.fixture(scope="module", params=[True, False], ids=["prefix", "no-prefix"])
def sentencepiece_gguf(request, tmp_path_factory):
    sp = train_sentencepiece(request.param)
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    write_gguf(path, "llama", sentencepiece_fields(sp, request.param))
    return sp, path, load(path), request.param


def test_sentencepiece_ids_equal_sentencepiece_after_llama_cpp_special_split(sentencepiece_gguf):
    sp, _, tok, _ = sentencepiece_gguf
    specials = {
        sp.id_to_piece(i): i
        for i in range(sp.get_piece_size())
        if sp.is_control(i) or sp.is_unknown(i) or sp.id_to_piece(i) == "<tool>"
    }
    for text in HOSTILE + NUMERALS + SPM_SPECIAL_TEXT:
        want = [
            i
            for part in _special_split(text, specials)
            for i in ([part] if isinstance(part, int) else sp.encode(part))
        ]
        assert tok.encode(text) == want, repr(text)


# transformers' GGUF loader ignores add_space_prefix (it always prepends ▁): prefix files only
@pytest.mark.parametrize("sentencepiece_gguf", [True], indirect=True, ids=["prefix"])
def test_sentencepiece_ids_equal_transformers_where_metaspace_agrees(sentencepiece_gguf):
    transformers = pytest.importorskip("transformers")
    _, path, tok, _ = sentencepiece_gguf
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    texts = [t for t in HOSTILE + NUMERALS if t and not t[0].isspace()]
    assert len(texts) > 25
    for text in texts:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False), repr(text)


def test_sentencepiece_decode_round_trips(sentencepiece_gguf):
    _, _, tok, _ = sentencepiece_gguf
    for text in HOSTILE + NUMERALS:
        assert tok.decode(tok.encode(text)) == text, repr(text)


def test_sentencepiece_prompts_start_with_exactly_one_bos(sentencepiece_gguf):
    """add_bos_token defaults to true for SentencePiece; a template writing `bos_token` itself
    still gives one, on the CLI path and the server path alike."""
    _, _, tok, _ = sentencepiece_gguf
    assert tok.add_bos_token and tok.bos_token_id == 1
    assert tok.eos_token_ids == (2, tok.encode("<|im_end|>")[0])  # EOS, then an end-of-turn text
    assert tok.encode_prompt("hi") == [1, *tok.encode("hi")]
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered.startswith("<s>[user] hi</s>")
    args = argparse.Namespace(prompt_ids=None, model="m.gguf", prompt="hi", chat=True)
    ids = prompt_ids(args, tok, tok.vocab_size)
    assert ids == tok.encode(rendered) and ids[0] == 1 and ids.count(1) == 1
    engine = ServingEngine(None, tok, "m")  # type: ignore[arg-type]
    assert engine.encode(rendered) == ids
    assert engine.encode("hi") == [1, *tok.encode("hi")]


@pytest.fixture(scope="module")
def qwen2_gguf(tmp_path_factory):
    trained = train_qwen2_bpe()
    path = tmp_path_factory.mktemp("qwen2") / "qwen2.gguf"
    write_gguf(path, "qwen2", byte_level_fields(trained, "qwen2"))
    return trained, path, load(path)


QWEN2_SPECIAL_TEXT = ["<|im_start|>user\nhi<|im_end|>\n", "a<think>b</think>", "x<|endoftext|>"]


def test_qwen2_pre_ids_equal_the_trained_tokenizer_and_transformers(qwen2_gguf):
    transformers = pytest.importorskip("transformers")
    trained, path, tok = qwen2_gguf
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in HOSTILE + NUMERALS + QWEN2_SPECIAL_TEXT:
        ids = tok.encode(text)
        assert ids == trained.encode(text, add_special_tokens=False).ids, repr(text)
        assert ids == ref.encode(text, add_special_tokens=False), repr(text)
    for text in HOSTILE + NUMERALS:
        assert tok.decode(tok.encode(text)) == text, repr(text)
    im_end = trained.token_to_id("<|im_end|>")
    assert tok.eos_token_ids == (im_end, trained.token_to_id("<|endoftext|>"))
    assert tok.decode(tok.encode("a<think>b<|im_end|>")) == "a<think>b"


HARMONY = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>")


@pytest.mark.parametrize("markers", [HARMONY, ("<|end|>",)])
def test_a_harmony_file_stops_on_return_and_call_and_others_on_end(tmp_path, markers):
    """gpt-oss's `<|end|>` closes its analysis message mid-answer: with `<|return|>` and
    `<|call|>` in the vocabulary they end the turn and it does not; elsewhere (Phi-3) it does."""
    trained = train_qwen2_bpe()
    trained.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in markers])
    fields = byte_level_fields(trained, "qwen2")
    control = set(markers) | {"<|im_end|>", "<|endoftext|>", "<|im_start|>"}
    types = [
        int(T.CONTROL) if t in control else int(T.NORMAL) for t in fields[gguf.Keys.Tokenizer.LIST]
    ]
    fields[gguf.Keys.Tokenizer.TOKEN_TYPE] = types
    tok = load(write_gguf(tmp_path / "harmony.gguf", "qwen2", fields))
    stops = {trained.id_to_token(i) for i in tok.eos_token_ids}
    if "<|return|>" in markers:
        assert {"<|return|>", "<|call|>"} <= stops and "<|end|>" not in stops
    else:
        assert "<|end|>" in stops


LLAMA_CPP = Path(os.environ.get("TANDEM_LLAMACPP_SRC", Path.home() / ".cache/tandem-llamacpp/src"))


@pytest.mark.parametrize("vocab", ["llama-spm", "starcoder"])
def test_ids_equal_llama_cpp_golden_vocab_tests(vocab):
    """llama.cpp's tests/test-tokenizer-0 cases (models/ggml-vocab-*.gguf.inp/.out): `llama-spm` is
    Llama's SentencePiece vocabulary, `starcoder` runs the same regexes as SmolLM2's `smollm`."""
    path = LLAMA_CPP / "models" / f"ggml-vocab-{vocab}.gguf"
    if not path.exists():
        pytest.skip(f"no llama.cpp source tree at {LLAMA_CPP} (set TANDEM_LLAMACPP_SRC)")
    tok = load(path)
    texts = Path(f"{path}.inp").read_text().split("\n__ggml_vocab_test__\n")
    wants = Path(f"{path}.out").read_text().split("\n")
    assert len(texts) > 40
    for text, want in zip(texts, wants):
        assert tok.encode(text) == [int(x) for x in want.split()], repr(text)
