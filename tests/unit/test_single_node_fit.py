"""One node checks its KV cache (and weights) against its free memory before allocating: a
context of 2^24 positions is a `PlanDoesNotFitError` naming the bytes, on the torch-free path
and the torch one, before anything is loaded or allocated, not an allocator's traceback."""

from __future__ import annotations

import resource
import time
from dataclasses import replace

import pytest

from tandem.devices import host_available_bytes
from tandem.engine.build import Layout, Limits, build_executor
from tandem.engine.lean import LeanExecutor, lean_executor_for
from tandem.loaders.gguf.writer import write_preset_gguf
from tandem.models.presets import get_preset
from tandem.parallel.fit import HEADROOM_BYTES, PlanDoesNotFitError, check_node, kv_cache_bytes

HUGE = 1 << 24  # --max-seq-len 16777216


@pytest.fixture(scope="module")
def long_context_gguf(tmp_path_factory):
    """tiny-qwen3 whose config allows 2^24 positions (its KV cache at 8 slots: 68.7 GB)."""
    config = replace(get_preset("tiny-qwen3").config, max_position_embeddings=HUGE)
    _, (f,) = write_preset_gguf(
        tmp_path_factory.mktemp("g") / "long.gguf", "tiny-qwen3", "Q8_0", config=config
    )
    return f


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_the_node_check_names_the_kv_cache_bytes_and_what_to_lower():
    config = get_preset("tiny-qwen3").config
    kv = kv_cache_bytes(config, 8, HUGE, 4)
    assert kv == 2 * 2 * 8 * HUGE * 2 * 16 * 4
    with pytest.raises(PlanDoesNotFitError) as e:
        check_node(
            config, kv_elem_bytes=4, weight_bytes=0, free_bytes=8 << 30, max_batch=8,
            max_seq_len=HUGE,
        )  # fmt: skip
    text = str(e.value)
    assert f"{kv} bytes) of KV cache for 8 sequences of {HUGE} positions" in text
    assert "--max-seq-len" in text and "8.590 GB free" in text
    fits = kv_cache_bytes(config, 8, 2048, 4) + HEADROOM_BYTES
    check_node(config, kv_elem_bytes=4, weight_bytes=0, free_bytes=fits, max_batch=8,
               max_seq_len=2048)  # fmt: skip
    check_node(
        config, kv_elem_bytes=4, weight_bytes=0, free_bytes=None, max_batch=8, max_seq_len=HUGE
    )  # fmt: skip  (unknown free memory: no verdict)


def test_the_torch_free_path_refuses_a_context_past_free_ram_before_allocating(long_context_gguf):
    assert kv_cache_bytes(get_preset("tiny-qwen3").config, 8, HUGE, 4) > host_available_bytes()
    before, t0 = _peak_mb(), time.monotonic()
    with pytest.raises(PlanDoesNotFitError, match="of KV cache for 8 sequences of 16777216"):
        lean_executor_for(long_context_gguf, device="cpu", max_batch=8, max_seq_len=HUGE)
    assert time.monotonic() - t0 < 5 and _peak_mb() - before < 64
    small = LeanExecutor.from_file(long_context_gguf, max_batch=1, max_seq_len=4096)
    assert small.max_seq_len == 4096


def test_the_torch_path_refuses_it_before_loading_the_weights(long_context_gguf):
    before, t0 = _peak_mb(), time.monotonic()
    with pytest.raises(PlanDoesNotFitError, match="KV cache"):
        build_executor(long_context_gguf, Layout(), Limits(8, HUGE))
    assert time.monotonic() - t0 < 30 and _peak_mb() - before < 64
