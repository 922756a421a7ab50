import os
from pathlib import Path

import pytest

# Keep each test process to the 2 cores CI has, and make worker subprocesses do the same.
os.environ.setdefault("OMP_NUM_THREADS", "2")

UNIT = Path(__file__).parent / "unit"


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread_beside_processes(request):
    """Outside tests/unit the test process computes beside the processes it starts (a TP group's
    head in-process next to its worker ranks) or as the reference on small models: one torch
    thread, restored after the module. Two OpenMP threads beside other work oversubscribe 2 cores
    and a descheduled spin-waiting thread stalls every op: SmolLM2-135M's greedy steps measured
    20x (reference modules) to 60x (native kernels) slower at 2 threads than at 1 on the shared
    2-core machine. An in-process head then reports the threads of its `threads=1` workers, so a
    group given no weights is split by the facts its test sets (dtype, device), not by this
    process's pool. Subprocesses keep OMP_NUM_THREADS. A tests/unit module marked
    `ranks_in_process` (its ranks are threads of this process computing side by side) takes it too."""
    if UNIT in request.path.parents and not request.node.get_closest_marker("ranks_in_process"):
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
