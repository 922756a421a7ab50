"""A group re-formed around the head's kept shard (`tandem.engine.tp.rejoin`): only the returning
worker loads, the head's runner is the same object, and the steps of the new epoch give the
logits of the first epoch bit for bit (in-process ranks over the reference communicator)."""

import threading

import pytest
import torch
from tp_support import tiny_config, write_random_model

import tandem.engine.tp.probe as tp_probe
import tandem.engine.tp.setup as tp_setup
from tandem.cli.cluster_epochs import forming_epoch
from tandem.cluster.ring_config import RingConfigError, epoch_cluster_id
from tandem.comm.metered import MeteredCommunicator
from tandem.comm.reference import ReferenceCommunicator, run_ranks
from tandem.engine.executor import Step, StepSequence
from tandem.engine.tp.rejoin import KeptShardError, keepable, rejoin_head
from tandem.parallel.fit import HEADROOM_BYTES

HEADROOM_GB = HEADROOM_BYTES / 1e9

STEPS = [
    Step((StepSequence(0, (3, 5, 7, 11), 0), StepSequence(1, (2, 4), 0))),
    Step((StepSequence(0, (13,), 4), StepSequence(1, (6,), 2))),
]


def _loads(monkeypatch) -> list[int]:
    """Each rank's shard loads, by rank, as they happen."""
    loaded: list[int] = []
    real = tp_setup.build_shard

    def counting(md, comm, *a, **k):
        loaded.append(comm.rank)
        return real(md, comm, *a, **k)

    monkeypatch.setattr(tp_setup, "build_shard", counting)
    return loaded


def _worker(model_dir, comm):
    return tp_setup.run_worker(model_dir, comm, dtype="float32", device="cpu")


def test_a_group_re_formed_around_the_kept_shard_loads_only_the_worker_and_equals_the_first(
    tmp_path, monkeypatch
):
    model_dir = write_random_model(tmp_path, tiny_config())
    loaded = _loads(monkeypatch)

    def first(comm):
        if comm.rank != 0:
            return _worker(model_dir, comm)
        ex = tp_setup.start_head(model_dir, MeteredCommunicator(comm), max_batch=2, max_seq_len=32)
        out = [ex.run(s).logits.clone() for s in STEPS]
        ex.close()  # the group of epoch 0 ends (here by STOP; a lost worker ends it by failing)
        return ex, out

    (ex, before), _ = run_ranks(ReferenceCommunicator.group(2), first)
    assert sorted(loaded) == [0, 1] and keepable(ex) is ex
    loaded.clear()

    def again(comm):
        if comm.rank != 0:
            return _worker(model_dir, comm)
        new = rejoin_head(model_dir, ex, comm)
        out = [new.run(s).logits.clone() for s in STEPS]  # replayed from position 0
        new.close()
        return new, out

    (new, after), _ = run_ranks(ReferenceCommunicator.group(2), again)
    assert loaded == [1]  # only the returning worker read its shard
    assert new.runner is ex.runner and new.health()[0] is False  # closed at the end
    assert new.placement == ex.placement != ""  # the weights and why, as the first group chose
    for a, b in zip(before, after):
        assert torch.equal(a, b)


def test_a_kept_shard_counts_as_free_memory_so_a_head_full_with_it_re_forms(tmp_path, monkeypatch):
    model_dir = write_random_model(tmp_path, tiny_config())
    head_thread: dict[str, int] = {}

    def free_gb(_device):  # the head's device is full (of its own shard) up to the headroom
        return HEADROOM_GB if threading.get_ident() == head_thread.get("id") else 100.0

    monkeypatch.setattr(tp_probe, "free_gb", free_gb)

    def first(comm):
        if comm.rank != 0:
            return _worker(model_dir, comm)
        ex = tp_setup.start_head(model_dir, MeteredCommunicator(comm), max_batch=2, max_seq_len=32)
        ex.close()
        return ex

    ex, _ = run_ranks(ReferenceCommunicator.group(2), first)

    def again(comm):
        if comm.rank != 0:
            return _worker(model_dir, comm)
        head_thread["id"] = threading.get_ident()
        new = rejoin_head(model_dir, ex, comm)
        new.close()
        return new

    new, _ = run_ranks(ReferenceCommunicator.group(2), again)
    assert new.runner is ex.runner  # formed: without its own bytes counted the plan is refused


def test_a_kept_shard_refuses_a_group_of_another_size(tmp_path):
    model_dir = write_random_model(tmp_path, tiny_config())

    def first(comm):
        if comm.rank != 0:
            return _worker(model_dir, comm)
        ex = tp_setup.start_head(model_dir, MeteredCommunicator(comm), max_batch=1, max_seq_len=16)
        ex.close()
        return ex

    ex, _ = run_ranks(ReferenceCommunicator.group(2), first)
    (solo,) = ReferenceCommunicator.group(1)
    with pytest.raises(KeptShardError, match="rank 0 of 2"):
        rejoin_head(model_dir, ex, solo)
    assert keepable(object()) is None


def test_epoch_cluster_ids_differ_per_epoch_and_the_head_health_names_the_epoch_forming():
    assert epoch_cluster_id("lab", 0) == "lab"
    assert epoch_cluster_id("lab", 2) == "lab/epoch-2" != epoch_cluster_id("lab", 1)
    with pytest.raises(RingConfigError):
        epoch_cluster_id("lab", -1)
    assert forming_epoch("re-forming (epoch 3): GroupFailedError: x") == 3
    assert forming_epoch("all 2 ranks are up") is None
    assert forming_epoch("failed: re-forming (epoch 3)") is None
