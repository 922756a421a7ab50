"""A group that loses a rank is formed again and the scheduler replays every sequence in flight:
the scheduler over `RecoveringExecutor` and executor doubles that break on cue (the real
processes are exercised in tests/e2e/test_launch_recovery.py)."""

import threading
import time

import pytest
from _serving_doubles import HistoryExecutor

from tandem.engine.recovery import (
    FAILED,
    REFORMING,
    RecoveringExecutor,
    ReformFailed,
    with_recovery,
)
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Request, Scheduler
from tandem.engine.tp.layout import cluster_id_for
from tandem.loaders.errors import ModelFileChangedError
from tandem.transport.endpoints import ConnectTimeoutError, Listener, connect
from tandem.transport.handshake import ClaimMismatchError, Identity


class BreakingExecutor(HistoryExecutor):
    """A group whose rank dies after `fail_after` steps: the step raises and `health()` says the
    group is no longer whole. `kill()` breaks it while idle."""

    def __init__(self, epoch=0, **kw):
        super().__init__(**kw)
        self.epoch = epoch
        self.dead = False
        self.closed = False

    def run(self, step):
        if self.dead:
            raise ConnectionError("rank 1 closed the connection")
        try:
            return super().run(step)
        except ConnectionError:
            self.dead = True
            raise

    def copy_prefix(self, src, dst, n):
        if self.dead:
            raise ConnectionError("rank 1 closed the connection")
        super().copy_prefix(src, dst, n)

    def kill(self):
        self.dead = True

    def health(self):
        return (not self.dead, "rank 1 exited with code -9" if self.dead else "ok")

    def close(self):
        self.closed = True


def _request(prompt, out, done, **params):
    def on_finish(reason, err):
        out["reason"], out["error"] = reason, err
        done.set()

    return Request(
        list(prompt), SamplingParams(**params), out.setdefault("tokens", []).append, on_finish
    )


def _serve(sched, prompts, **params):
    outs = []
    for p in prompts:
        out, done = {}, threading.Event()
        sched.submit(_request(p, out, done, **params))
        outs.append(out)
    while sched.step():
        pass
    return outs


PROMPTS = [[1, 2, 3], [9, 8, 7, 6], [4], [5, 5, 5, 5, 5]]


def _reference(**params):
    return [o["tokens"] for o in _serve(Scheduler(HistoryExecutor()), PROMPTS, **params)]


def test_sequences_in_flight_are_replayed_and_equal_an_uninterrupted_run():
    built = []

    def build(epoch):
        ex = BreakingExecutor(epoch, fail_after=5 if epoch == 0 else None)
        built.append(ex)
        return ex

    ex = with_recovery(build, deadline_s=10)
    try:
        sched = Scheduler(ex)
        params = dict(max_tokens=12, temperature=0)
        outs = _serve(sched, PROMPTS, **params)
        assert [o["tokens"] for o in outs] == _reference(**params)
        assert all(o["reason"] == "length" and o["error"] is None for o in outs)
        assert [b.epoch for b in built] == [0, 1] and built[0].closed
        assert ex.epoch == 1 and ex.health() == (True, "ok")
        assert sched.stats.replayed_sequences == 4
        counts = {k: ex.stats()[k] for k in ("group_failures", "group_reforms")}
        assert counts == {"group_failures": 1, "group_reforms": 1}
        assert ex.stats()["group_reform_attempts_failed"] == 0
        # the re-formed group saw each sequence from position 0: prompt + tokens so far
        first = {s.seq_id: s for s in built[1].steps[0].sequences}
        assert all(s.start_pos == 0 for s in first.values())
        assert len(first[0].token_ids) > len(PROMPTS[0])
    finally:
        ex.close()


def test_seeded_sampling_continues_its_draws_across_a_replay():
    params = dict(max_tokens=10, temperature=0.8, top_k=20, seed=7)
    ex = with_recovery(lambda e: BreakingExecutor(e, fail_after=4 if e == 0 else None), 10)
    try:
        outs = _serve(Scheduler(ex), PROMPTS, **params)
        assert [o["tokens"] for o in outs] == _reference(**params)
    finally:
        ex.close()


def test_a_group_broken_while_idle_is_reformed_and_health_says_so_meanwhile():
    gate = threading.Event()
    built = []

    def build(epoch):
        if epoch > 0:
            assert gate.wait(10)  # the new processes are still loading their shards
        ex = BreakingExecutor(epoch)
        built.append(ex)
        return ex

    ex = RecoveringExecutor(build(0), build, deadline_s=10, poll_s=0.02)
    try:
        assert ex.health() == (True, "ok")
        built[0].kill()
        ok, detail = ex.health()
        assert not ok and detail.startswith(REFORMING) and "exited with code -9" in detail
        assert ex.describe()["state"] == REFORMING
        gate.set()
        deadline = time.monotonic() + 10
        while ex.epoch == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ex.epoch == 1 and ex.health() == (True, "ok")
        assert ex.describe()["epoch"] == 1
        params = dict(max_tokens=6, temperature=0)
        outs = _serve(Scheduler(ex), PROMPTS, **params)  # fresh sequences run on the new group
        assert [o["tokens"] for o in outs] == _reference(**params)
    finally:
        ex.close()


def test_the_broken_group_is_freed_before_the_new_one_is_built():
    import gc
    import weakref

    refs = []
    alive_at_build = []

    def build(epoch):
        if epoch > 0:
            gc.collect()
            alive_at_build.append(refs[0]() is not None)
        ex = BreakingExecutor(epoch, fail_after=3 if epoch == 0 else None)
        refs.append(weakref.ref(ex))
        return ex

    ex = with_recovery(build, deadline_s=10)
    try:
        outs = _serve(Scheduler(ex), PROMPTS[:2], max_tokens=6, temperature=0)
        assert all(o["reason"] == "length" for o in outs)
        assert alive_at_build == [False]  # its shard and caches were gone when epoch 1 loaded
    finally:
        ex.close()


def test_requests_fail_with_the_reason_when_the_group_cannot_reform_in_time():
    def build(epoch):
        if epoch > 0:
            raise ConnectionRefusedError("rank 1 never came back")
        return BreakingExecutor(epoch, fail_after=2)

    ex = RecoveringExecutor(build(0), build, deadline_s=0.5, retry_s=0.05)
    try:
        sched = Scheduler(ex)
        outs = _serve(sched, PROMPTS[:2], max_tokens=8, temperature=0)
        assert all(o["reason"] == "error" for o in outs)
        assert all("could not be re-formed within 0.5 s" in str(o["error"]) for o in outs)
        assert "rank 1 never came back" in str(outs[0]["error"])
        ok, detail = ex.health()
        assert not ok and detail.startswith(FAILED)
        assert ex.stats()["group_reforms"] == 0
        assert ex.stats()["group_reform_attempts_failed"] >= 1
        with pytest.raises(ReformFailed):
            ex.run(None)
    finally:
        ex.close()


def test_a_reform_whose_model_file_changed_gives_up_at_once_and_says_so():
    """Not 120 s of retries under the old cause: the file will not change back."""

    def build(epoch):
        if epoch > 0:
            raise ModelFileChangedError(
                "the model file /m.gguf changed since it was opened: it was truncated to 0 bytes"
            )
        return BreakingExecutor(epoch, fail_after=2)

    ex = RecoveringExecutor(build(0), build, deadline_s=120, retry_s=0.05)
    try:
        t0 = time.monotonic()
        outs = _serve(Scheduler(ex), PROMPTS[:2], max_tokens=8, temperature=0)
        assert time.monotonic() - t0 < 5
        assert all(o["reason"] == "error" for o in outs)
        ok, detail = ex.health()
        assert not ok and detail.startswith(FAILED)
        assert "cannot be re-formed: the model file /m.gguf changed" in detail
        assert "within" not in detail  # no deadline was waited for
        assert ex.stats()["group_reform_attempts_failed"] == 1
    finally:
        ex.close()


def test_a_step_the_group_refuses_is_not_a_failure():
    ex = with_recovery(lambda e: BreakingExecutor(e), 10)
    try:
        with pytest.raises(AssertionError):  # the double's own refusal of a bad position
            from tandem.engine.executor import Step, StepSequence

            ex.run(Step((StepSequence(0, (1,), start_pos=3),)))
        assert ex.health() == (True, "ok") and ex.epoch == 0
    finally:
        ex.close()


def test_reform_timeout_is_validated_and_zero_means_no_recovery():
    plain = BreakingExecutor()
    assert with_recovery(lambda e: plain, 0) is plain
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="re-form timeout"):
            with_recovery(lambda e: plain, bad)


def test_a_rank_of_an_earlier_epoch_is_refused_at_the_handshake():
    secret = b"same-secret-both-epochs"
    lis = Listener("127.0.0.1", 0, Identity(cluster_id_for(2), 0, 2), secret)
    out: dict = {}

    def accept():
        try:
            out["channel"] = lis.accept({1}, timeout=1.5, op_timeout=5, max_frame_bytes=1 << 20)
        except Exception as e:
            out["error"] = e

    th = threading.Thread(target=accept, daemon=True)
    th.start()
    stale = Identity(cluster_id_for(1), 1, 2)
    with pytest.raises(ClaimMismatchError, match="cluster id mismatch.*epoch-1.*epoch-2"):
        connect("127.0.0.1", lis.port, stale, secret, expect_rank=0, handshake_timeout=5)
    th.join(10)
    lis.close()
    assert isinstance(out.get("error"), ConnectTimeoutError)
    assert cluster_id_for(0) == "tandem-tp"  # epoch 0 keeps the id every existing rank speaks


def _ring_pair(op_timeout):
    from tandem.cluster.launcher import free_ports
    from tandem.comm.ring import RingCommunicator

    ports = free_ports(2)
    out: dict = {}

    def make(rank):
        out[rank] = RingCommunicator.create(
            rank,
            2,
            right=("127.0.0.1", ports[1 - rank]),
            listen=("127.0.0.1", ports[rank]),
            secret=b"s",
            op_timeout=op_timeout,
            handshake_timeout=10,
        )

    ths = [threading.Thread(target=make, args=(r,), daemon=True) for r in (0, 1)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(20)
    return out[0], out[1]


def test_setup_ops_wait_for_a_slow_loader_past_the_op_timeout_and_steps_do_not():
    from tandem.comm.metered import MeteredCommunicator
    from tandem.engine.tp.setup import setup_bound

    head, worker = _ring_pair(op_timeout=0.3)
    try:
        metered = MeteredCommunicator(head)

        def slow_loader():
            time.sleep(1.0)  # loading its shard for longer than a step may take
            worker.barrier()

        th = threading.Thread(target=slow_loader, daemon=True)
        th.start()
        with setup_bound(metered, 10.0):
            metered.barrier()  # waits the second out
        th.join(10)
        with pytest.raises(TimeoutError):  # the step bound is back: a silent peer times out
            metered.barrier()
    finally:
        head.close()
        worker.close()


def test_a_rank_that_never_returns_is_given_up_and_the_group_shrinks_and_replays():
    built = []

    def build(epoch):  # the full layout: its lost rank never comes back
        if epoch > 0:
            raise ConnectionRefusedError("rank 2 never came back")
        return BreakingExecutor(epoch, fail_after=5)

    def shrink(epoch):  # the survivors, re-planned over fewer ranks
        ex = BreakingExecutor(epoch, fail_after=4 if not built else None)
        built.append(ex)
        return ex

    ex = with_recovery(build, 10, shrink=shrink, shrink_after_s=0.2)
    ex.retry_s = 0.05
    try:
        sched = Scheduler(ex)
        params = dict(max_tokens=12, temperature=0)
        outs = _serve(sched, PROMPTS, **params)
        assert [o["tokens"] for o in outs] == _reference(**params)
        assert all(o["error"] is None for o in outs)
        # shrunk once; its own later failure re-formed the smaller layout (not the lost one)
        assert [b.epoch for b in built] == [1, 2] and ex.epoch == 2
        stats = ex.stats()
        assert (stats["group_shrinks"], stats["group_reforms"]) == (1, 2)
        assert stats["group_reform_attempts_failed"] >= 1
    finally:
        ex.close()


def test_when_the_smaller_group_cannot_form_either_the_error_says_why():
    def build(epoch):
        if epoch > 0:
            raise ConnectionRefusedError("rank 2 never came back")
        return BreakingExecutor(epoch, fail_after=2)

    def shrink(epoch):
        raise MemoryError("the model needs 3 ranks' memory")

    ex = with_recovery(build, 0.6, shrink=shrink, shrink_after_s=0.1)
    ex.retry_s = 0.05
    try:
        outs = _serve(Scheduler(ex), PROMPTS[:1], max_tokens=8, temperature=0)
        assert outs[0]["reason"] == "error"
        msg = str(outs[0]["error"])
        assert "rank 2 never came back" in msg and "needs 3 ranks' memory" in msg, msg
        assert ex.stats()["group_shrinks"] == 0
    finally:
        ex.close()
    with pytest.raises(ValueError, match="shrink-after"):
        with_recovery(build, 10, shrink=shrink, shrink_after_s=-1)


class BreakingPipeline(BreakingExecutor):
    """A two-stage pipeline double: `submit` runs the step, `collect` hands results back in
    order (the face a `PipelineExecutor` gives the scheduler)."""

    num_stages = 2

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._done, self._tag = [], 0

    def submit(self, step):
        self._tag += 1
        self._done.append((self._tag, self.run(step)))
        return self._tag

    def collect(self):
        return self._done.pop(0)


def test_a_pipeline_shrunk_to_one_group_keeps_the_pipeline_face_and_replays():
    def build(epoch):  # the lost stage never comes back
        if epoch > 0:
            raise ConnectionRefusedError("stage 1 never came back")
        return BreakingPipeline(epoch, fail_after=5)

    alone = []

    def shrink(epoch):  # the head alone: no submit/collect of its own
        alone.append(BreakingExecutor(epoch))
        return alone[-1]

    ex = with_recovery(build, 10, shrink=shrink, shrink_after_s=0.2)
    ex.retry_s = 0.05
    try:
        sched = Scheduler(ex)  # chooses its pipeline loop by the first group
        params = dict(max_tokens=12, temperature=0)
        outs = _serve(sched, PROMPTS, **params)
        assert [o["tokens"] for o in outs] == _reference(**params)
        assert all(o["error"] is None for o in outs)
        assert len(alone) == 1 and ex.stats()["group_shrinks"] == 1 and ex.num_stages == 1
    finally:
        ex.close()
