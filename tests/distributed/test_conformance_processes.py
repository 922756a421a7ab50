"""The numerical conformance check across real processes on loopback: a worker process whose
kernel is wrong (a fault this test injects into that process alone, through a `sitecustomize` on
its PYTHONPATH; the product has no such switch) is refused when the group forms, with a message
naming the rank, its device and dtype, the error and the tolerance. (Honest float32, bfloat16 and
float16 worker processes pass it in every mixed-dtype group test, e.g. `test_tp_mixed_dtype.py`.)"""

import os
import textwrap

import pytest
from tp_support import tiny_config, write_random_model

from tandem.engine.tp.conformance import ConformanceError
from tandem.engine.tp.local import LocalGroupError, launch_local_tp

# Loaded by the worker's interpreter at start-up: every column-parallel product comes out 1.5x.
FAULT = textwrap.dedent(
    """
    import tandem.parallel.tensor as t

    _honest = t.ColumnParallelLinear.forward
    t.ColumnParallelLinear.forward = lambda self, x: _honest(self, x) * 1.5
    """
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("conf"), tiny_config(intermediate_size=256))


def test_a_worker_with_a_wrong_kernel_is_refused_at_join_by_name(model_dir, tmp_path, monkeypatch):
    (tmp_path / "sitecustomize.py").write_text(FAULT)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    )
    with pytest.raises((ConformanceError, LocalGroupError)) as e:
        launch_local_tp(model_dir, 2, dtypes=["float32", "bfloat16"], threads=1, max_seq_len=64)
    msg = str(e.value)
    assert "rank 1 (cpu, bfloat16) failed the numerical conformance check" in msg
    assert "tolerance" in msg and "rank 0 (" not in msg
