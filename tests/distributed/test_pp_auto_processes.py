"""`--pp-weights auto` across real processes on loopback: every stage process measures its decode
GEMV speed and free memory before it loads a layer, reports them with its listening port, and the
head splits the layers from those reports. The test makes stage 1 report a very slow GEMV (a fault
injected into the stage processes alone through a `sitecustomize` on their PYTHONPATH; the product
has no such switch): stage 1 then gets the one-layer minimum, the reported probes are the ones the
split was computed from, and greedy ids still equal the single-node reference."""

import os
import textwrap

import pytest
import torch
from pp_support import (
    executor_greedy,
    prompts,
    reference_greedy,
    reference_model,
    tiny_config,
    write_model,
)

from tandem.engine.pp.launch import StageSpec, launch_pipeline
from tandem.engine.pp.layout import StageProbe, auto_ranges
from tandem.parallel.partition import LayerRange as R

SLOW_GB_S = 1e-3
# Loaded by each stage process's interpreter at start-up: stage 1's GEMV probe reports SLOW_GB_S.
FAULT = textwrap.dedent(
    f"""
    import sys
    import tandem.engine.device_probe as p

    _honest = p.gemv_gb_s

    def slow_gemv_gb_s(device, dtype):
        argv = sys.argv
        if "--stage" in argv and argv[argv.index("--stage") + 1] == "1":
            return {SLOW_GB_S!r}
        return _honest(device, dtype)

    p.gemv_gb_s = slow_gemv_gb_s
    """
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    ref = reference_model(tiny_config(num_hidden_layers=5, vocab_size=97))
    return ref, write_model(ref, tmp_path_factory.mktemp("ppauto") / "tiny")


def test_auto_ranges_come_from_the_stages_probes_and_match_single_node(
    model_dir, tmp_path, monkeypatch
):
    ref, path = model_dir
    (tmp_path / "sitecustomize.py").write_text(FAULT)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    )
    placeholder = [StageSpec(R(0, 2)), StageSpec(R(2, 5))]  # replaced from the probes
    ex = launch_pipeline(
        path, placeholder, max_batch=4, max_seq_len=64, timeout=30, threads=1, auto_layers=True
    )
    try:
        probes = ex.stage_probes
        assert probes[1]["gemv_gb_s"] == [SLOW_GB_S]
        assert probes[0]["gemv_gb_s"][0] > 100 * SLOW_GB_S and probes[0]["free_gb"][0] > 0
        assert [s.layers for s in ex.stages] == [R(0, 4), R(4, 5)]
        rows = [StageProbe(tuple(p["gemv_gb_s"]), tuple(p["free_gb"])) for p in probes]
        again = auto_ranges(ref.config, placeholder, rows)
        assert [s.layers for s in again] == [s.layers for s in ex.stages]
        first, ids = executor_greedy(ex, prompts(1, 97), 16)
        ref_first, ref_ids = reference_greedy(ref, prompts(1, 97), 16)
        torch.testing.assert_close(first, ref_first, atol=1e-4, rtol=0)
        assert ids == ref_ids
    finally:
        ex.close()
