"""Co-located ranks split the machine's threads (tandem/cli/threads.py)."""

import os

from tandem.cli.threads import local_threads, machine_threads


def test_ranks_split_omp_num_threads_and_keep_at_least_one(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert machine_threads() == 4
    assert [local_threads(n) for n in (1, 2, 3, 4, 8)] == [4, 2, 1, 1, 1]


def test_without_omp_num_threads_the_cores_this_process_may_use_count(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert machine_threads() == len(os.sched_getaffinity(0))
    monkeypatch.setenv("OMP_NUM_THREADS", "junk")  # not a count: ignored
    assert machine_threads() == len(os.sched_getaffinity(0))
