"""An executor that survives losing a rank: end the broken group, form a new one, replay.

`RecoveringExecutor` wraps the executor of a group (TP, PP) together with the function that built
it. When the group breaks (a step fails and the group's `health()` says it is no longer whole, or
the group turns unhealthy while idle), a recovery thread ends the group's epoch (`close()`: every
surviving process leaves the old group and the supervisor brings the rest down), then builds a
fresh group for the same layout through `build(epoch)` (a TP head's builder keeps the head's
loaded shard, `tp.rejoin`: only the returning ranks load), retrying until `deadline_s` has passed
since the failure. Epoch e+1's ranks authenticate under a cluster id that names their epoch (and,
for local groups, a fresh secret), so a frame or a handshake from epoch e is refused.

Every KV cache of the broken group is gone, but the head (the scheduler) still holds each
sequence's prompt and generated tokens. So the first `run` after a re-form raises
`ExecutorReformed` instead of running: the scheduler sets each running sequence's cache length to
0 and re-prefills prompt + tokens so far, then decodes on as if nothing happened. With greedy
decoding the text equals an uninterrupted run's (up to near-ties the re-prefill may break
differently from incremental decode); a seeded sampler keeps its generator, so it continues its
stream of draws.

A rank that does not come back: with a `shrink` builder, once the full layout has failed to form
for `shrink_after_s` since the failure, the group is re-planned over fewer ranks (`shrink(epoch)`;
for a local TP group TP=N-1, every rank started again and loading its new, wider shard: the
survivors are not kept; a pipeline one stage fewer, at one stage the head alone, which keeps the
pipeline face the caller was given, `_Stepwise`) and later re-forms keep that smaller layout (it
shrinks once). If the
smaller layout cannot form either (the model does not fit), retries go on until the deadline and
the final error says why the smaller one failed too. A shrink replays exactly as a re-form does:
the head's tokens do not depend on the layout.

A model file that changed since the group first formed (`ModelFileChangedError` from `build`,
which checks the files' identity before it starts anything) is not retried: it will not change
back, and the re-form gives up at once with that reason instead of failing for the whole
deadline under the old one.

While a re-form is under way `health()` is (False, "re-forming ..."), and after the deadline
(False, "failed ..."): `/health` is 503 with the reason either way, and `tandem launch` tells
"re-forming" (wait) from "failed" (shut down) by that first word. New requests queue meanwhile;
if the re-form fails they fail with the reason, as every running one does.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import itertools
import logging
import math
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.engine.executor import Executor, Step, StepResult
from tandem.engine.group_state import FAILED, REFORMING
from tandem.loaders.errors import ModelFileChangedError

log = logging.getLogger(__name__)


class ExecutorReformed(RuntimeError):
    """The group was re-formed under a new epoch: every KV cache is empty. Re-prefill each running
    sequence from its tokens (start_pos 0) and go on."""


class ReformFailed(RuntimeError):
    """The group could not be re-formed within the deadline: nothing can be served."""


@dataclass
class RecoveryCounts:
    """Cumulative counters for /metrics, and the last failure's timings for reports."""

    failures: int = 0  # groups that broke
    reforms: int = 0  # groups formed again
    reform_failures: int = 0  # build attempts that failed
    shrinks: int = 0  # groups formed again over fewer ranks
    last_reform_s: float | None = None  # from the failure seen to a new group whole


class _Lost:
    """Stands in for a broken group while the next one forms: what it looked like, and why it
    broke; it runs nothing. Holds none of the broken group's memory."""

    def __init__(self, broken: Any, why: str) -> None:
        try:
            self._desc = dict(broken.describe())
        except Exception:  # noqa: BLE001 - a broken group may not describe itself
            self._desc = {}
        self._why = why or "the group broke"
        self.vocab_size, self.max_seq_len = broken.vocab_size, broken.max_seq_len
        self.max_batch = broken.max_batch

    def run(self, *args: Any) -> Any:
        raise ReformFailed(f"the group is being re-formed: {self._why}")

    submit = collect = copy_prefix = run

    def release(self, seq_ids: list[int]) -> None:
        pass  # its caches went with it

    def health(self) -> tuple[bool, str]:
        return False, self._why

    def describe(self) -> dict[str, Any]:
        return dict(self._desc)

    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


class _Stepwise:
    """A group that runs one step at a time, behind the pipeline face (`submit` runs the step at
    once, `collect` hands the results back in order) for a caller that was given a pipeline: what
    a pipeline shrunk to the head alone is (the scheduler chose its loop by the first group)."""

    num_stages = 1

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._done: deque[tuple[int, StepResult]] = deque()
        self._tags = itertools.count()

    def submit(self, step: Step) -> int:
        tag = next(self._tags)
        self._done.append((tag, self.inner.run(step)))
        return tag

    def collect(self) -> tuple[int, StepResult]:
        return self._done.popleft()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def _trim_heap() -> None:
    """Hands the heap pages a broken group freed back to the OS: glibc otherwise keeps them in its
    arenas, and the head's RSS would grow with each re-form though nothing leaks."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def _whole(ex: Executor) -> bool:
    """`ex.health()`'s verdict: is the group that just raised still whole?"""
    return bool(ex.health()[0])


class RecoveringExecutor:
    """`Executor` over the current epoch's group; see the module docstring.

    `build(epoch)` returns a new executor with the same `vocab_size`, `max_seq_len` and
    `max_batch`; it is called from the recovery thread (a long-lived thread, so processes it
    starts with a parent-death signal live as long as this object). Anything else read off the
    executor (`comm_stats`, `facts`, ...) is the current group's."""

    def __init__(
        self,
        first: Any,
        build: Callable[[int], Any],
        *,
        deadline_s: float = 120.0,
        poll_s: float = 0.1,
        retry_s: float = 1.0,
        shrink: Callable[[int], Any] | None = None,
        shrink_after_s: float = math.inf,
    ) -> None:
        self._current = first
        self._current_face = type(first)  # what the caller was given: a pipeline or not
        self._build = build
        self._shrink = shrink
        self.deadline_s = deadline_s
        self.shrink_after_s = shrink_after_s
        self.retry_s = retry_s
        self.vocab_size = first.vocab_size
        self.max_seq_len = first.max_seq_len
        self.max_batch = first.max_batch
        self.epoch = 0
        self.counts = RecoveryCounts()
        self._seen_epoch = 0  # the epoch the caller's sequence state belongs to
        self._calls = 0  # calls into the current group under way (each holds a reference)
        self._given_up: BaseException | None = None
        self._reforming: str | None = None  # why, while a re-form is under way
        self._kick = threading.Event()
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, args=(poll_s,), name="tandem-recovery", daemon=True
        )
        self._thread.start()

    # ---- the Executor face ---------------------------------------------------------------------

    def run(self, step: Step) -> StepResult:
        return self._guarded("run", step)

    def submit(self, step: Step) -> int:
        """Pipelines only (the caller checks `num_stages`): as `run`, for `submit`."""
        return self._guarded("submit", step)

    def collect(self) -> tuple[int, StepResult]:
        return self._guarded("collect")

    def copy_prefix(self, src_seq: int, dst_seq: int, n: int) -> None:
        """As `run`: a group that broke is re-formed first (`ExecutorReformed`)."""
        self._guarded("copy_prefix", src_seq, dst_seq, n)

    def release(self, seq_ids: list[int]) -> None:
        ex = self._current
        try:
            ex.release(seq_ids)
        except Exception:  # a broken group: its caches are gone with it, nothing to free
            if _whole(ex):
                raise

    def health(self) -> tuple[bool, str]:
        if self._given_up is not None:
            return False, f"{FAILED}: {self._given_up}"
        if self._reforming is not None:
            return False, f"{REFORMING} (epoch {self.epoch + 1}): {self._reforming}"
        ok, detail = self._current.health()
        if not ok:  # seen before the recovery thread took it up
            return False, f"{REFORMING} (epoch {self.epoch + 1}): {detail}"
        return True, detail

    def describe(self) -> dict[str, Any]:
        desc = dict(self._current.describe())
        ok, detail = self.health()
        if not ok:
            desc["state"] = FAILED if self._given_up is not None else REFORMING
            desc["detail"] = detail.splitlines()[0]
        desc["epoch"] = self.epoch
        return desc

    def stats(self) -> dict[str, float]:
        """The current group's counters (they start again at 0 in each epoch) and the
        recovery's own, for /metrics."""
        out = dict(self._current.stats())
        c = self.counts
        out.update(
            group_failures=c.failures,
            group_reforms=c.reforms,
            group_reform_attempts_failed=c.reform_failures,
            group_shrinks=c.shrinks,
        )
        return out

    def close(self) -> None:
        self._stop.set()
        self._kick.set()
        self._thread.join(timeout=5.0)  # a group still forming is closed by that thread
        self._current.close()

    def __getattr__(self, name: str) -> Any:
        # the current group's own figures (comm_stats, facts, num_stages, ...); only reached for
        # names this class does not define
        if name.startswith("__") or name == "_current":
            raise AttributeError(name)
        return getattr(self._current, name)

    # ---- recovery ------------------------------------------------------------------------------

    def _guarded(self, method: str, *args: Any) -> Any:
        """`current.method(*args)`; a group that broke is re-formed (ExecutorReformed) first."""
        ex, epoch = self._usable()
        with self._changed:
            self._calls += 1
        try:
            try:
                return getattr(ex, method)(*args)
            except Exception as e:
                if _whole(ex):
                    raise  # a step the group refused; it is still whole
                why = f"{type(e).__name__}: {e}"
            del ex  # the broken group is freed before the new one loads, not after
        finally:
            with self._changed:
                self._calls -= 1
                self._changed.notify_all()
        self._await_reform(epoch, why)
        raise ExecutorReformed(self._reformed_msg())

    def _usable(self) -> tuple[Any, int]:
        """(the current group, its epoch), or ExecutorReformed when it changed since the caller
        last ran."""
        if self._given_up is not None:
            raise ReformFailed(str(self._given_up))
        if self._reforming is not None or not _whole(self._current):
            self._await_reform(self.epoch, self._reforming or "the group is not whole")
        if self._seen_epoch != self.epoch:
            raise ExecutorReformed(self._reformed_msg())
        return self._current, self.epoch

    def _reformed_msg(self) -> str:
        self._seen_epoch = self.epoch
        return f"the group was re-formed (epoch {self.epoch}); replay every sequence in flight"

    def _await_reform(self, epoch: int, why: str) -> None:
        """Blocks until the group of `epoch` is replaced (returns) or the re-form gave up
        (ReformFailed)."""
        with self._changed:
            if self.epoch == epoch and self._reforming is None:
                self._reforming = why
            self._kick.set()
            while self.epoch == epoch and self._given_up is None:
                self._changed.wait(0.5)
                if self._stop.is_set():
                    raise ReformFailed("the executor was closed during a re-form")
        if self._given_up is not None:
            raise ReformFailed(str(self._given_up))

    def _watch(self, poll_s: float) -> None:
        while not self._stop.is_set():
            self._kick.wait(poll_s)
            self._kick.clear()
            if self._stop.is_set() or self._given_up is not None:
                return
            if self._reforming is None and _whole(self._current):
                continue
            t_seen = time.monotonic()
            why = self._reforming or self.health()[1]
            with self._changed:
                self._reforming = why.removeprefix(f"{REFORMING} (epoch {self.epoch + 1}): ")
            self._reform(t_seen)

    def _reform(self, t_seen: float) -> None:
        c = self.counts
        c.failures += 1
        log.warning("the group of epoch %d broke: %s; re-forming", self.epoch, self._reforming)
        broken = self._current
        t_close = time.monotonic()
        self._current = _Lost(broken, self._reforming or "")
        try:
            broken.close()  # every survivor leaves the old epoch; the supervisor ends the rest
        except Exception as e:  # noqa: BLE001 - a broken group may fail to close cleanly
            log.warning("closing the broken group: %s", e)
        # its shard and caches go now, before the new group loads: once the call that saw it
        # fail has let go (closed, it fails at once), and through the collector (a failure's
        # traceback keeps the executor in a reference cycle)
        del broken
        with self._changed:
            self._changed.wait_for(lambda: self._calls == 0, timeout=10.0)
        gc.collect()
        _trim_heap()
        log.warning(
            "the group of epoch %d is closed (%.1f s)", self.epoch, time.monotonic() - t_close
        )
        deadline = t_seen + self.deadline_s
        last: BaseException | None = None
        shrink_why = ""
        while not self._stop.is_set():  # at least one attempt, then retries until the deadline
            try:
                fresh = self._build(self.epoch + 1)
            except ModelFileChangedError as e:  # not retried: the file will not change back
                last = e
                c.reform_failures += 1
                log.warning("re-forming epoch %d: %s", self.epoch + 1, e)
                break
            except Exception as e:  # noqa: BLE001 - retried until the deadline
                last = e
                c.reform_failures += 1
                log.warning("re-forming epoch %d failed: %s", self.epoch + 1, e)
                fresh = None
                if self._shrink is not None and time.monotonic() - t_seen >= self.shrink_after_s:
                    fresh, shrink_why = self._shrunk(shrink_why)
            if fresh is None:
                if time.monotonic() + self.retry_s >= deadline:
                    break
                self._stop.wait(self.retry_s)
                continue
            if self._stop.is_set():  # closed while this group formed: it is not wanted
                fresh.close()
                break
            with self._changed:
                self._current = fresh
                self.epoch += 1
                self._reforming = None
                c.reforms += 1
                c.last_reform_s = time.monotonic() - t_seen
                self._changed.notify_all()
            log.warning("re-formed as epoch %d in %.1f s", self.epoch, c.last_reform_s)
            _trim_heap()  # what forming it allocated and let go of
            return
        with self._changed:
            if isinstance(last, ModelFileChangedError):
                self._given_up = ReformFailed(f"the group cannot be re-formed: {last}")
            else:
                self._given_up = ReformFailed(
                    f"the group could not be re-formed within {self.deadline_s:g} s"
                    + (f" (last attempt: {type(last).__name__}: {last})" if last else "")
                    + (f"; over fewer ranks: {shrink_why}" if shrink_why else "")
                )
            self._reforming = None
            self._changed.notify_all()

    def _shrunk(self, why_before: str) -> tuple[Any | None, str]:
        """The group re-planned over fewer ranks (`shrink(epoch)`), or (None, why it could not
        be). Once formed, the smaller layout is what later re-forms build."""
        try:
            fresh = self._shrink(self.epoch + 1)  # type: ignore[misc]
        except Exception as e:  # noqa: BLE001 - retried until the deadline, and reported
            self.counts.reform_failures += 1
            log.warning("re-forming epoch %d over fewer ranks failed: %s", self.epoch + 1, e)
            return None, f"{type(e).__name__}: {e}"
        if hasattr(self._current_face, "submit") and not hasattr(fresh, "submit"):
            fresh = _Stepwise(fresh)  # a pipeline shrunk to the head alone: the same face
        log.warning(
            "the lost rank did not come back: epoch %d runs over fewer ranks", self.epoch + 1
        )
        self._build, self._shrink = self._shrink, None  # type: ignore[assignment]
        self.counts.shrinks += 1
        return fresh, why_before


def with_recovery(
    build: Callable[[int], Any],
    deadline_s: float,
    *,
    shrink: Callable[[int], Any] | None = None,
    shrink_after_s: float = 0.0,
) -> Any:
    """`build(0)`, wrapped in a `RecoveringExecutor` when `deadline_s` > 0 (else as it is).
    With `shrink` and `shrink_after_s` > 0: a lost rank that has not come back that long after the
    failure is given up, and the group re-forms through `shrink(epoch)` over fewer ranks."""
    for name, v in (("re-form timeout", deadline_s), ("shrink-after time", shrink_after_s)):
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"the {name} must be a finite number of seconds >= 0, got {v}")
    first = build(0)
    if deadline_s <= 0:
        return first
    after = shrink_after_s if shrink is not None and shrink_after_s > 0 else math.inf
    return RecoveringExecutor(
        first, build, deadline_s=deadline_s, shrink=shrink, shrink_after_s=after
    )
