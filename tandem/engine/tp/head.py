"""The head's side of a tensor-parallel group: an `Executor` that drives the workers.

One generation loop, on the head (rank 0). For each step the head broadcasts a control frame
(`tandem.engine.tp.control`) over the group's communicator, then runs its own shard of the forward;
the workers, having received the same frame, run theirs, and the layers' collectives meet. The
vocab-parallel LM head delivers the logits to rank 0 only, where the caller samples. Finished
sequences are released on the head at once and on the workers with the next frame (they free
before they run it), so every rank's cache slots stay in step without an extra broadcast.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tandem.cluster.exits import exit_cause
from tandem.comm.base import Communicator
from tandem.comm.metered import CommStats, MeteredCommunicator
from tandem.engine import cluster_info as ci
from tandem.engine.executor import Step, StepResult
from tandem.engine.rope_rewind import LongRopeRewind
from tandem.engine.runner import ShardRunner
from tandem.engine.tp import control
from tandem.engine.tp.balance import ComputeClock, balance_entry, gather_clocks
from tandem.engine.tp.control import Control, send_control

if TYPE_CHECKING:
    from tandem.engine.tp.layout import GroupLayout, RankInfo, WorkerProcesses


class GroupFailedError(RuntimeError):
    """A step could not complete on the group: a worker died, hung or refused it. The group is
    unusable afterwards (its communicator is broken); close it and start a new one."""


class TPExecutor:
    """`Executor` over a TP group whose rank 0 is this process; `runner` holds rank 0's shard.

    With `keepalive_s`, a daemon thread sends a PING frame whenever the group has been idle that
    long, so workers blocked on the next frame stay inside their op timeout while a server waits
    for requests; a lock keeps pings and steps from interleaving on the wire. A ping or step that
    fails closes the communicator at once, so the workers see the group end without waiting out
    their own op timeout. A rank the ring's heartbeat declares lost (`transport.heartbeat`) makes
    `health()` failed at once, naming the rank and the heartbeat, and fails the waiting step. The same thread asks
    `diagnose` (when given) whether a worker process has exited, and records the group as failed
    at once, so the next step fails fast instead of waiting out the op timeout.
    """

    def __init__(
        self,
        runner: ShardRunner,
        comm: Communicator,
        vocab_size: int,
        on_close: Callable[[], None] | None = None,
        keepalive_s: float | None = None,
        diagnose: Callable[[], str | None] | None = None,
        *,
        facts: Sequence[ci.RankFacts] = (),
        ranks: Sequence[RankInfo] = (),
        layout: GroupLayout | None = None,
        local_workers: WorkerProcesses | None = None,
        join_rtt_ms: dict[int, float] | None = None,
        ring_probe: tuple[float, float] | None = None,
        placement: str = "",
    ) -> None:
        if comm.rank != 0:
            raise ValueError(
                f"the head is rank 0 of its group, this communicator is rank {comm.rank}"
            )
        self.runner = runner
        self.rewind = LongRopeRewind.for_config(
            runner.model.config
        )  # longrope: crossing recomputes
        self.comm = comm
        self.vocab_size = vocab_size
        self.max_seq_len = runner.max_seq_len
        self.max_batch = runner.max_batch
        self._on_close = on_close
        self._diagnose = diagnose
        self._pending_release: list[int] = []
        self._closed = False
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._failure: BaseException | None = None
        # what the group is, for describe() and reports: given by whoever formed it
        self.facts = list(facts)
        self.ranks = list(ranks)  # each rank's dtype, device and threads
        self.layout = layout  # the weights, batch and length the ranks agreed on
        self.local_workers = local_workers  # the worker processes, when this process started them
        self.join_rtt_ms = dict(join_rtt_ms or {})  # rank -> its RTT to the head when it joined
        self.ring_probe = ring_probe  # (all-reduce ms, goodput Mbit/s) measured as it formed
        self.placement = placement  # the TP weights chosen and why (`tp.probe.choose_weights`)
        self.clock = ComputeClock(comm)  # this rank's compute per step (`tp.balance`)
        if keepalive_s is not None and comm.world_size > 1:
            threading.Thread(
                target=self._keepalive, args=(keepalive_s,), name="tp-keepalive", daemon=True
            ).start()

    @property
    def comm_stats(self) -> CommStats | None:
        """The communicator's counters when it is metered (`MeteredCommunicator`), else None."""
        return self.comm.stats if isinstance(self.comm, MeteredCommunicator) else None

    def _keepalive(self, every: float) -> None:
        while not self._stop.wait(every / 4):
            with self._lock:
                if self._closed or self._failure is not None:
                    return
                why = self._diagnose() if self._diagnose is not None else None
                if why is not None:
                    self._failure = GroupFailedError(f"a worker of the group exited: {why}")
                    return
                if time.monotonic() - self._last < every:
                    continue
                try:
                    send_control(self.comm, Control(control.KIND_PING))
                except BaseException as e:  # surfaced by the next run()
                    self._failure = e
                    self._abandon()
                    return
                self._last = time.monotonic()

    def run(self, step: Step) -> StepResult:
        """The step's result at each sequence's last new token (see `StepResult`)."""
        with self._lock:
            if self._failure is not None:
                raise self._failure
            step = self.rewind.expand(step)  # every rank gets the rewound rows
            self.runner.check(step)  # refused here, before any rank sees it
            release = tuple(self._pending_release)
            self._pending_release.clear()
            try:
                send_control(self.comm, Control(control.KIND_STEP, step, release))
                with self.clock.step():
                    logits = self.runner.forward(step)
            except Exception as e:
                self._failure = GroupFailedError(self._explain(e))
                self._abandon()
                raise self._failure from e
            finally:
                self._last = time.monotonic()
        assert logits is not None  # rank 0 of a group holding the head always gets the logits
        return StepResult.of(step, logits)

    def _abandon(self) -> None:
        """Closes the broken group's links at once (the caller holds the lock): a worker whose
        own link still works then sees the head leave now instead of at its op timeout."""
        try:
            self.comm.close()
        except Exception:  # noqa: BLE001 - a broken link may fail to close cleanly
            pass

    def _explain(self, e: BaseException) -> str:
        lost = self._lost()
        if lost is not None:  # hung, not dead: no exit to wait for
            return f"the tensor-parallel group failed during a step: {lost}"
        msg = (
            f"the tensor-parallel group failed during a step ({type(e).__name__}: {e}); "
            f"a worker died, hung past the op timeout, or refused the step"
        )
        if self._diagnose is not None:
            deadline = time.monotonic() + 2.0  # a killed worker may not be reaped yet
            while time.monotonic() < deadline:
                why = self._diagnose()
                if why is not None:
                    return f"{msg}\n{why}"
                time.sleep(0.05)
        return msg

    def _state(self) -> tuple[str, str]:
        if self._failure is not None:
            return "failed", str(self._failure).splitlines()[0]
        if self._closed:
            return "failed", "the group was shut down"
        lost = self._lost()
        if lost is not None:
            return "failed", lost
        gone = self.local_workers.exited() if self.local_workers is not None else None
        if gone is not None:
            return "failed", f"worker {gone[0]} exited with {exit_cause(gone[1])}"
        up = f"all {self.comm.world_size} ranks are up"
        return "whole", f"{up}; {self.placement}" if self.placement else up

    def _lost(self) -> str | None:
        """Why the ring's heartbeat declared a rank lost (`transport.heartbeat`), or None; the
        group is failed from that moment, idle or mid-step."""
        inner = getattr(self.comm, "inner", self.comm)  # a MeteredCommunicator's backend
        lost = getattr(inner, "lost", None)
        return lost() if callable(lost) else None

    def health(self) -> tuple[bool, str]:
        state, detail = self._state()
        return state == "whole", detail

    def stats(self) -> dict[str, float]:
        """The metered communicator's counters: collectives, their time and the bytes moved."""
        s = self.comm_stats
        if s is None:
            return {}
        return {
            "collectives": s.collectives,
            "collective_seconds": s.seconds,
            "wire_bytes": s.bytes_moved,
        }

    def describe(self) -> dict[str, Any]:
        state, detail = self._state()
        stats = self.comm_stats
        counters = ci.Counters()
        if stats is not None:
            counters = ci.Counters(stats.seconds, stats.bytes_moved, stats.collectives)
        n = self.comm.world_size
        links = ci.ring_links(range(n))
        for x in links:  # a link to the head: the other end measured its RTT when it joined
            other = x["b"] if x["a"] == 0 else x["a"] if x["b"] == 0 else None
            x["rtt_ms"] = self.join_rtt_ms.get(other) if other is not None else None
            if self.ring_probe is not None:  # else the group's one-float all-reduce at join
                x["rtt_ms"] = x["rtt_ms"] if x["rtt_ms"] is not None else self.ring_probe[0]
                x["goodput_mbit_s"] = self.ring_probe[1]
        out = ci.Description("tp", n, 1, list(self.facts), state, detail, links, counters).as_dict()
        out["balance"] = self.measured_balance() if state == "whole" else None
        return out

    def measured_balance(self) -> dict[str, Any] | None:
        """Every rank's compute per step since the group formed and the TP weights that would
        balance it (`tp.balance`): a STATS frame between steps, then one all-gather. None before
        the first step, on one rank, or where a rank's clock is unknown."""
        if self.comm.world_size < 2 or self.layout is None:
            return None
        with self._lock:
            if self._closed or self._failure is not None or self.clock.steps == 0:
                return None
            try:
                send_control(self.comm, Control(control.KIND_STATS))
                clocks = gather_clocks(self.comm, self.clock)
            except Exception as e:
                self._failure = GroupFailedError(self._explain(e))
                self._abandon()
                return None
            finally:
                self._last = time.monotonic()
        shares = [f.work_share or 0.0 for f in self.facts]
        return balance_entry(shares, self.layout.weights, clocks)

    def copy_prefix(self, src_seq: int, dst_seq: int, n: int) -> None:
        """New sequence `dst_seq` holds `src_seq`'s first `n` cached positions on every rank:
        one COPY frame (`control`: the pending releases, then (src, dst, n)), after which each
        rank copies its own shard of the KV cache (k[i][dst, :, :n] = k[i][src, :, :n] over its
        kv heads of every layer), and the head its own. The head checks the copy first
        (`PrefixCopyError`), so a copy it refuses reaches no rank."""
        with self._lock:
            if self._failure is not None:
                raise self._failure
            self.runner.seqs.check_copy(src_seq, dst_seq, n)
            release = tuple(self._pending_release)
            self._pending_release.clear()
            try:
                send_control(
                    self.comm, Control(control.KIND_COPY, None, release, (src_seq, dst_seq, n))
                )
                self.runner.copy_prefix(src_seq, dst_seq, n)
            except Exception as e:
                self._failure = GroupFailedError(self._explain(e))
                self._abandon()
                raise self._failure from e
            finally:
                self._last = time.monotonic()
            self.rewind.copy(src_seq, dst_seq, n)

    def release(self, seq_ids: list[int]) -> None:
        with self._lock:
            self.runner.release(seq_ids)
            self._pending_release.extend(seq_ids)
            self.rewind.release(seq_ids)

    def close(self) -> None:
        """Tells the workers to leave their loop, closes the communicator, then `on_close`."""
        self._stop.set()
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # a group that lost a local worker cannot take a STOP: at N=2 the broadcast is a
        # shared-memory swap that would wait the whole op timeout for the dead peer
        gone = self.local_workers.exited() if self.local_workers is not None else None
        try:
            if self._failure is None and gone is None:
                send_control(self.comm, Control(control.KIND_STOP))
        except Exception:  # noqa: BLE001 - a dead worker must not keep the head from cleaning up
            pass
        finally:
            try:
                self.comm.close()
            finally:
                if self._on_close is not None:
                    self._on_close()
