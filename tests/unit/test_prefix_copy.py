"""`copy_prefix` on the single-node executors: a sequence that starts from another's first n
cached positions, then prefills the rest of its prompt and decodes, gives logits bit-identical to
the same prompt run cold in a fresh executor (the cold run prefilled in the same chunks: batch
invariance makes the chunking immaterial too, tests/unit/test_batch_invariance.py). The source
goes on untouched. The copy rule's refusals are typed (`PrefixCopyError`) and change nothing.

Over `LocalExecutor` (F32, Q8_0, BF16) and `LeanExecutor` (BF16, Q8_0) on tiny GGUF files, and
the hybrid tiny-qwen35 (Gated DeltaNet layers) in memory: a whole copy (state and conv window
included) equals the cold run; a partial one is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from invariance_support import write_tiny_gguf
from prefix_copy_support import check_copy_equals_cold, chunks, decode, prompt_of, run

from tandem.engine.lean import LeanExecutor
from tandem.engine.local import LocalExecutor
from tandem.engine.sequences import PrefixCopyError
from tandem.kernels import native
from tandem.models.llama import Transformer
from tandem.models.presets import get_preset, random_weights

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no native: {native.why()}")

MAX_BATCH, MAX_LEN = 4, 96
CASES = [("local", "F32"), ("local", "Q8_0"), ("local", "BF16"), ("lean", "BF16"), ("lean", "Q8_0")]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = tmp_path_factory.mktemp("copy")
    return {q: write_tiny_gguf(out / f"tiny-{q}.gguf", q) for q in ("F32", "Q8_0", "BF16")}


def _executor(kind: str, f):
    if kind == "lean":
        return LeanExecutor.from_file(f, max_batch=MAX_BATCH, max_seq_len=MAX_LEN, threads=1)
    return LocalExecutor.from_dir(f, max_batch=MAX_BATCH, max_seq_len=MAX_LEN)


@pytest.mark.parametrize(("kind", "qtype"), CASES)
@pytest.mark.parametrize("n", [40, 57])
def test_a_request_from_a_copied_prefix_gives_the_cold_runs_logits(files, kind, qtype, n):
    check_copy_equals_cold(_executor(kind, files[qtype]), _executor(kind, files[qtype]), n)


@pytest.mark.parametrize("kind", ["local", "lean"])
def test_a_copy_the_rule_refuses_is_typed_and_changes_nothing(files, kind):
    ex = _executor(kind, files["BF16"])
    run(ex, 0, prompt_of(2, 10), 0)
    for src, dst, n, why in [
        (3, 1, 5, "does not hold"),
        (0, 1, 11, "holds 10"),
        (0, 1, 0, "holds 10"),
        (0, 0, 5, "already live"),
    ]:
        with pytest.raises(PrefixCopyError, match=why):
            ex.copy_prefix(src, dst, n)
    for sid in (1, 2, 3):
        run(ex, sid, [1], 0)
    with pytest.raises(PrefixCopyError, match="slots are live"):
        ex.copy_prefix(0, 4, 5)
    ex.release([1])
    ex.copy_prefix(0, 4, 5)  # a slot freed: taken
    with pytest.raises(Exception, match="starts at 6"):
        run(ex, 4, [1], 6)  # it holds 5 positions, not more


def _hybrid() -> LocalExecutor:
    c = get_preset("tiny-qwen35").config
    m = Transformer(c)
    m.load_state_dict(random_weights(c, 11, torch.float32))
    return LocalExecutor(m.eval(), max_batch=MAX_BATCH, max_seq_len=MAX_LEN)


def test_a_hybrid_sequence_is_copied_whole_state_included_and_never_in_part():
    ex = _hybrid()
    source = prompt_of(3, 30, 500)
    chunks(ex, 0, source, 0, 12)
    with pytest.raises(PrefixCopyError, match="hybrid"):
        ex.copy_prefix(0, 1, 20)
    ex.copy_prefix(0, 1, 30)
    prompt = source + prompt_of(4, 9, 500)
    got = [chunks(ex, 1, prompt, 30, 12)]
    got += decode(ex, 1, len(prompt), int(got[0][0].argmax()), 3)
    cold = _hybrid()
    chunks(cold, 2, source, 0, 12)  # the same chunks as the source's
    want = [chunks(cold, 2, prompt, 30, 12)]
    want += decode(cold, 2, len(prompt), int(want[0][0].argmax()), 3)
    for g, w in zip(got, want):
        assert np.array_equal(g, w), float(np.abs(g - w).max())


def _pages(ex):
    """The executor's shared KV pages (`models.kv_pages`)."""
    return ex.model.pages if isinstance(ex, LeanExecutor) else ex.runner.seqs.kv.pages


@pytest.mark.parametrize(("kind", "qtype"), [("local", "F32"), ("lean", "Q8_0")])
def test_a_sharer_outlives_its_released_and_reused_source(files, kind, qtype):
    """Three sequences copy a 60-token source's first 50 positions: its whole blocks are one set
    of pages (the file's memory grows by the partial blocks only); the source is released and
    its slot taken by another prompt, one sharer released too: the last sharer's greedy run
    equals a cold one's token for token."""
    ex, cold = _executor(kind, files[qtype]), _executor(kind, files[qtype])
    pages = _pages(ex)
    source = prompt_of(0, 60)
    chunks(ex, 0, source, 0, 16)
    held = pages.resident_bytes()
    for dst in (1, 2, 3):
        ex.copy_prefix(0, dst, 50)
    whole = pages.blocks(50) * pages.b
    assert whole > 0
    block = pages.bb * len(pages.pg)  # one block of every layer's k and v heads
    assert held >= pages.blocks(60) * block
    assert pages.resident_bytes() - held <= 3 * block  # each copy's partial block only
    ex.release([0, 2])
    chunks(ex, 4, prompt_of(5, 40), 0, 16)  # takes slot 0, writes fresh pages
    prompt = source[:50] + prompt_of(1, 15)
    got = [chunks(ex, 3, prompt, 50, 16)]
    got += decode(ex, 3, len(prompt), int(got[0][0].argmax()), 4)
    want = [chunks(cold, 0, prompt, 0, 16)]
    want += decode(cold, 0, len(prompt), int(want[0][0].argmax()), 4)
    assert [int(g[0].argmax()) for g in got] == [int(w[0].argmax()) for w in want]
    for g, w in zip(got, want):
        assert np.array_equal(g, w), float(np.abs(g - w).max())
