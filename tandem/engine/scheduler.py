"""Continuous batching at step granularity over any `Executor`.

Every step the scheduler admits waiting requests (up to the executor's `max_batch` sequences), then
runs ONE forward over all running sequences: a prefill chunk for each new sequence (at most
`prefill_budget` prompt tokens per step, shared) and one decode token for each sequence already
generating. A sequence whose prompt is fully in the cache is sampled from its row of the logits, so a
request that arrives mid-generation joins the very next step instead of waiting for the batch to
drain. Each request samples with its own parameters and its own seeded generator, so its output does
not depend on what else shares its steps.

Failures are contained: what goes wrong with one request (a seed it cannot take, logits it cannot
sample from, a callback that raises) finishes that request with "error" and the loop goes on; an
executor failure fails every request (the group is broken); and if the loop itself dies, every
waiting request is failed and `failure` says why, so health checks turn unhealthy instead of
requests hanging. An executor that re-formed its group after losing a rank
(`tandem.engine.recovery`) raises `ExecutorReformed`: every KV cache is gone, so each running
sequence is replayed (its cache length set to 0, prompt + tokens so far prefilled again) and
its stream goes on.

With a prefix cache (`tandem.engine.prefix_cache`), a finished request's sequence is kept in the
executor instead of released, indexed by the tokens its KV cache holds, and every running
sequence is indexed by its prompt as it prefills. A new request whose prompt shares a long enough
head with one prefills only the rest: it continues a kept sequence it extends exactly (the next
chat turn), else it gets a fresh sequence into which the executor copies the shared positions
(`Executor.copy_prefix`), at the start of the first step after they are written (until then the
request sits the steps out). A kept sequence holds a slot: admitting a request that needs a fresh
one when none is free releases the least recently used. A re-formed executor holds none of them,
so a replay forgets them all.

Positions: for a sequence with `cached` tokens in the executor's KV cache, the next chunk starts at
`start_pos = cached`; a decode step feeds the last sampled token at position len(tokens) - 1.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.engine.executor import Executor, Pipelined, Step, StepResult, StepSequence
from tandem.engine.histogram import STEP_BUCKETS, TTFT_BUCKETS, Histogram
from tandem.engine.logits_process import SequenceSampler, TokenLogprobs, TokenMask
from tandem.engine.prefix_cache import PrefixCache, PrefixHit
from tandem.engine.recovery import ExecutorReformed
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequences import PrefixCopyError

log = logging.getLogger(__name__)

FinishCallback = Callable[[str, BaseException | None], None]
TokenCallback = Callable[[int], bool]
LogprobsCallback = Callable[[TokenLogprobs], None]


class SchedulerError(RuntimeError):
    """Base class of the scheduler's errors."""


class EngineUnavailable(SchedulerError):
    """The executor failed (e.g. a rank died): no request can be served until a restart."""


class RequestRejected(SchedulerError, ValueError):
    """A request that can never run: empty prompt, or a prompt that does not fit the context."""


class RequestFailed(SchedulerError):
    """This request failed on its own (its parameters or its callbacks); the others run on."""


class SchedulerDied(EngineUnavailable):
    """The scheduler's thread is no longer running: nothing more will be served."""


@dataclass
class Request:
    """One generation. `on_token(id)` sees each sampled token (return True to stop here, e.g. a stop
    string matched); `on_finish(reason, error)` is called exactly once, reason in
    {"stop", "length", "cancelled", "error"}. With `params.logprobs` set, `on_logprobs` sees each
    token's logprobs just before `on_token` sees the token (a token that ends the request as EOS
    or a stop id is in neither). `mask`: the tokens it may take at each step (`TokenMask`).
    `reuse_prefix`: False prefills the whole prompt even where the prefix cache holds its head
    (llama.cpp's `cache_prompt: false`); its sequence is still indexed for later requests. The
    callbacks run on the scheduler's thread: keep them short."""

    prompt_ids: list[int]
    params: SamplingParams
    on_token: TokenCallback
    on_finish: FinishCallback
    on_logprobs: LogprobsCallback | None = None
    mask: TokenMask | None = None
    reuse_prefix: bool = True
    submitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    cancelled: bool = False
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache, not prefilled

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class _Running:
    req: Request
    seq_id: int
    tokens: list[int]  # prompt + generated so far
    cached: int = 0  # tokens of `tokens` already in the executor's KV cache
    generated: int = 0
    sampler: SequenceSampler | None = None
    busy: bool = False  # in a pipeline step that has not come back yet
    copy: PrefixHit | None = None  # a prefix copy planned into this sequence, not yet made


@dataclass
class SchedulerStats:
    """Cumulative counters; read by the server's /metrics."""

    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    step_seconds: float = 0.0
    decode_steps: int = 0
    decode_seconds: float = 0.0  # steps that carried no prefill: the per-token decode latency
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    decode_latency: Histogram = field(default_factory=lambda: Histogram(STEP_BUCKETS))
    replayed_sequences: int = 0  # sequences prefilled again after their executor re-formed


class Scheduler:
    """Owns the step loop over one executor; thread-safe `submit`, callbacks on its own thread."""

    def __init__(
        self,
        executor: Executor,
        eos_token_ids: tuple[int, ...] = (),
        prefill_budget: int = 512,
        idle_wait_s: float = 0.05,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        """`prefix_cache`: keep finished sequences for later prompts that start like them (None:
        release each sequence as its request finishes)."""
        if prefill_budget < 1:
            raise ValueError("prefill_budget must be at least 1 token")
        self.executor = executor
        self.eos_token_ids = frozenset(eos_token_ids)
        self.prefill_budget = prefill_budget
        self.idle_wait_s = idle_wait_s
        self.stats = SchedulerStats()
        self.prefix_cache = prefix_cache
        self._failure: BaseException | None = None
        self._waiting: deque[Request] = deque()
        self._running: list[_Running] = []
        self._ids = itertools.count()
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        # An executor that can keep several steps in flight (a pipeline) gets one group per stage.
        self._pipelined = isinstance(executor, Pipelined) and executor.num_stages > 1
        self._depth = executor.num_stages if isinstance(executor, Pipelined) else 1
        self._inflight: deque = deque()

    # ---- public API ----------------------------------------------------------------------------

    @property
    def max_seq_len(self) -> int:
        return self.executor.max_seq_len

    @property
    def failure(self) -> BaseException | None:
        """Why nothing can be served any more (a failed executor, a dead loop), else None."""
        if self._failure is not None:
            return self._failure
        th = self._thread
        if th is not None and not th.is_alive() and not self._stop:
            return SchedulerDied("the scheduler thread is not running")
        return None

    def submit(self, req: Request) -> Request:
        """Queues `req`; raises `RequestRejected` or `EngineUnavailable` at once when it cannot run."""
        if not req.prompt_ids:
            raise RequestRejected("the prompt is empty")
        if len(req.prompt_ids) >= self.max_seq_len:
            raise RequestRejected(
                f"the prompt has {len(req.prompt_ids)} tokens; this model's context is "
                f"{self.max_seq_len} tokens (prompt plus completion)"
            )
        vocab = self.executor.vocab_size
        bad = [t for t in req.prompt_ids if not 0 <= t < vocab]
        if bad:  # refused here: a bad id must not reach (and fail) the executor for everyone
            raise RequestRejected(
                f"token id(s) {bad[:5]} outside this model's vocabulary [0, {vocab})"
            )
        bad = [t for t, _ in req.params.logit_bias if not 0 <= t < vocab]
        if bad:
            raise RequestRejected(
                f"logit_bias token id(s) {bad[:5]} outside this model's vocabulary [0, {vocab})"
            )
        with self._cv:
            failure = self.failure
            if failure is not None:
                raise EngineUnavailable(f"the engine failed: {failure}")
            self._waiting.append(req)
            self._cv.notify()
        return req

    def load(self) -> tuple[int, int]:
        """(running, waiting) request counts."""
        with self._cv:
            return len(self._running), len(self._waiting)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="tandem-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
        for r in self._running:
            self._finish(r, "cancelled", None)
        self._running.clear()
        while self._waiting:
            self._waiting.popleft().on_finish("cancelled", None)

    # ---- the loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._stop and not self._waiting and not self._running:
                        self._cv.wait(self.idle_wait_s)
                    if self._stop:
                        return
                self.step()
        except BaseException as e:  # a bug in the loop: fail closed instead of hanging requests
            log.exception("the scheduler loop died")
            self._fail_all(SchedulerDied(f"the scheduler stopped: {type(e).__name__}: {e}"))

    def step(self) -> bool:
        """Runs one batched forward (or, over a pipeline, one submit or collect); False when there
        was nothing to do."""
        self._admit()
        self._drop_cancelled()
        if not self._copy_prefixes():
            return True  # the executor re-formed (a replay) or failed
        if self._pipelined:
            return self._pipeline_step()
        if not self._running:
            return False
        seqs, rows, prefill_tokens = self._build(self._running)
        if not seqs:
            return True  # every sequence awaits a copy whose source is in a pipeline step
        t0 = time.perf_counter()
        try:
            # argmax ids (B,) come back only when no row needs its logits (sampling, logprobs,
            # a bias, a penalty or a mask); one such row brings every row's logits
            greedy = not any(r.sampler.needs_logits for r in rows if r.sampler is not None)
            result = self.executor.run(Step(sequences=seqs, greedy=greedy))
        except ExecutorReformed:
            self._replay()
            return True
        except Exception as e:  # a dead rank or a broken executor: fail closed, loudly
            self._fail_all(e)
            return False
        self._record_step(time.perf_counter() - t0, prefill_tokens)
        self._absorb(rows, seqs, result)
        return True

    def _pipeline_step(self) -> bool:
        """Keeps up to `num_stages` groups of sequences in flight, so every stage has work: submit
        a group of idle sequences while there is room, else collect the oldest group. A sequence is
        in at most one step in flight (its next token depends on this one)."""
        ex = self.executor
        assert isinstance(ex, Pipelined)
        idle = [r for r in self._running if not r.busy and r.copy is None]
        try:
            if idle and len(self._inflight) < self._depth:
                size = -(-len(self._running) // self._depth)  # ceil: one group per stage
                seqs, rows, prefill_tokens = self._build(idle[:size])
                tag = ex.submit(Step(sequences=seqs))
                for r in rows:
                    r.busy = True
                self._inflight.append((tag, rows, seqs, prefill_tokens, time.perf_counter()))
                return True
            if not self._inflight:
                return False
            tag, rows, seqs, prefill_tokens, t0 = self._inflight.popleft()
            got, result = ex.collect()
        except ExecutorReformed:
            self._replay()
            return True
        except Exception as e:
            self._fail_all(e)
            return False
        if got != tag:
            self._fail_all(SchedulerError(f"pipeline returned step {got}, expected {tag}"))
            return False
        for r in rows:
            r.busy = False
        self._record_step(time.perf_counter() - t0, prefill_tokens)
        self._absorb(rows, seqs, result)
        return True

    def _build(self, group: list[_Running]) -> tuple[tuple[StepSequence, ...], list[_Running], int]:
        """The step for `group`: a prefill chunk (within the token budget) or one decode token each.
        Returns (sequences, the running entry of each row, prefill tokens)."""
        seqs: list[StepSequence] = []
        rows: list[_Running] = []
        budget = self.prefill_budget
        prefill_tokens = 0
        for r in group:
            if r.copy is not None:
                continue  # its prefix is not copied in yet
            pending = len(r.tokens) - r.cached
            if pending > 1:  # still prefilling
                if budget == 0:
                    continue
                n = min(pending, budget)
                budget -= n
                prefill_tokens += n
            else:
                n = 1
            chunk = tuple(r.tokens[r.cached : r.cached + n])
            seqs.append(StepSequence(seq_id=r.seq_id, token_ids=chunk, start_pos=r.cached))
            rows.append(r)
        return tuple(seqs), rows, prefill_tokens

    def _absorb(
        self, rows: list[_Running], seqs: tuple[StepSequence, ...], result: StepResult
    ) -> None:
        """Advances each row's cache, samples where a prompt or decode ended, finishes the done."""
        finished: list[tuple[_Running, str, BaseException | None]] = []
        for row, (r, seq) in enumerate(zip(rows, seqs)):
            r.cached += len(seq.token_ids)
            if self.prefix_cache is not None:
                self.prefix_cache.advance(r.seq_id, r.cached)
            if r.cached < len(r.tokens):
                continue  # prompt chunk: nothing to sample yet
            try:
                assert r.sampler is not None
                token, logprobs = r.sampler.choose(result, row)
                reason = self._sample_and_emit(r, token, logprobs)
            except Exception as e:  # this request's sampling or callback: it alone fails
                finished.append((r, "error", RequestFailed(f"{type(e).__name__}: {e}")))
                continue
            if reason is not None:
                finished.append((r, reason, None))
        if finished:
            done = {id(r) for r, _, _ in finished}
            self._running = [r for r in self._running if id(r) not in done]
            gone = [r.seq_id for r, reason, _ in finished if not self._keep(r, reason)]
            self._release(gone + self._trimmed())
            for r, reason, error in finished:
                self._finish(r, reason, error)

    # ---- helpers -------------------------------------------------------------------------------

    def _admit(self) -> None:
        evicted: list[int] = []
        with self._cv:
            while self._waiting and len(self._running) < self.executor.max_batch:
                req = self._waiting.popleft()
                if req.cancelled:
                    req.on_finish("cancelled", None)
                    continue
                r = _Running(req=req, seq_id=-1, tokens=list(req.prompt_ids))
                try:
                    r.sampler = SequenceSampler(req.params, req.prompt_ids, req.mask)
                except Exception as e:  # e.g. a seed that is not an int
                    self._finish(r, "error", RequestFailed(f"seed {req.params.seed!r}: {e}"))
                    continue
                if not self._place(r, evicted):
                    self._waiting.appendleft(req)  # every slot is running or about to be read
                    break
                self.stats.prompt_tokens += len(req.prompt_ids)
                self._running.append(r)
        self._release(evicted)

    def _place(self, r: _Running, evicted: list[int]) -> bool:
        """Gives `r` its sequence: a kept one its prompt continues exactly (then only the rest is
        prefilled), else a new one, into which a shared prefix is to be copied (`r.copy`, made by
        `_copy_prefixes`); the least recently used kept sequence is evicted (into `evicted`, for
        the caller to release) when every slot is taken. False, placing nothing, when no slot can
        be freed (every kept sequence is the source of a copy not yet made)."""
        cache = self.prefix_cache
        r.seq_id = next(self._ids)
        if cache is None:
            return True
        free = self.executor.max_batch - len(self._running) - len(cache)
        hit = cache.claim(r.tokens, free_slots=free) if r.req.reuse_prefix else None
        if hit is not None and not hit.copy:
            r.seq_id, r.cached = hit.seq_id, hit.reused
            r.req.cached_tokens = hit.reused
        elif free < 1:
            seq_id = cache.evict(spare=hit.seq_id if hit is not None else None)
            if seq_id is None:
                cache.undo(hit)  # claimed again once a slot frees
                return False
            evicted.append(seq_id)
        r.copy = hit if hit is not None and hit.copy else None
        cache.track(r.seq_id, r.tokens, r.cached)
        return True

    def _copy_prefixes(self) -> bool:
        """Makes each planned copy whose source holds the shared prefix by now: the executor
        copies it into the request's fresh sequence, which then prefills only the rest. A copy
        that can never be made (its source released or rewound first) or that the executor
        refuses (`PrefixCopyError`, e.g. a hybrid's state that moved past the prefix) becomes a
        whole prefill. False when the executor re-formed (replayed) or failed meanwhile."""
        cache = self.prefix_cache
        made = False
        for r in self._running:
            hit = r.copy
            if hit is None or cache is None:
                continue
            state = cache.ready(hit, r.tokens)
            if state is False:
                continue  # its source's prefill has not reached the prefix yet
            r.copy = None
            if state is None:
                cache.withdraw(hit)
                continue
            try:
                self.executor.copy_prefix(hit.seq_id, r.seq_id, hit.reused)
            except PrefixCopyError as e:
                log.info("prefix copy refused, prefilling whole: %s", e)
                cache.withdraw(hit)
                continue
            except ExecutorReformed:
                self._replay()
                return False
            except Exception as e:  # a broken executor: fail closed, as a failed step does
                self._fail_all(e)
                return False
            cache.done(hit, into=r.seq_id)
            made = True
            r.cached = hit.reused
            r.req.cached_tokens = hit.reused
            cache.advance(r.seq_id, r.cached)
        if made:  # an entry a copy pinned past `max_entries` may go now
            self._release(self._trimmed())
        return True

    def _keep(self, r: _Running, reason: str) -> bool:
        """Whether `r`'s finished sequence stays in the executor as a prefix cache entry (else it
        is released): the tokens whose KV it holds, `tokens[:cached]`, are indexed."""
        cache = self.prefix_cache
        if cache is not None and r.copy is not None:  # a copy never made: nothing to keep
            cache.withdraw(r.copy)
            r.copy = None
        if cache is None or reason == "error" or r.cached == 0:
            if cache is not None:
                cache.forget(r.seq_id)
            return False
        return cache.put(r.seq_id, r.tokens[: r.cached])

    def _trimmed(self) -> list[int]:
        """Kept sequences past the cache's `max_entries`, least recently used first, out of the
        index (for the caller to release)."""
        return self.prefix_cache.trim() if self.prefix_cache is not None else []

    def _release(self, seq_ids: list[int]) -> None:
        if not seq_ids:
            return
        try:
            self.executor.release(seq_ids)
        except Exception as e:  # a broken executor: fail closed, as a failed step does
            self._fail_all(e)

    def _drop_cancelled(self) -> None:
        gone = [r for r in self._running if r.req.cancelled and not r.busy]
        if gone:
            ids = {id(r) for r in gone}
            self._running = [r for r in self._running if id(r) not in ids]
            kept = [self._keep(r, "cancelled") for r in gone]  # every one leaves the index
            # cached == 0: the executor never saw the sequence
            ids = [r.seq_id for r, k in zip(gone, kept) if r.cached > 0 and not k]
            self._release(ids + self._trimmed())
            for r in gone:
                self._finish(r, "cancelled", None)

    def _sample_and_emit(
        self, r: _Running, token: int, logprobs: TokenLogprobs | None = None
    ) -> str | None:
        r.tokens.append(token)
        r.generated += 1
        self.stats.generated_tokens += 1
        if r.req.first_token_at is None:
            r.req.first_token_at = time.perf_counter()
            self.stats.ttft.observe(r.req.first_token_at - r.req.submitted_at)
        eos = token in self.eos_token_ids and not r.req.params.ignore_eos
        if eos or token in r.req.params.stop_token_ids:
            return "stop"
        if logprobs is not None and r.req.on_logprobs is not None:
            r.req.on_logprobs(logprobs)
        if r.req.on_token(token):
            return "stop"
        if r.generated >= r.req.params.max_tokens or len(r.tokens) >= self.max_seq_len:
            return "length"
        return None

    def _record_step(self, dt: float, prefill_tokens: int) -> None:
        s = self.stats
        s.steps += 1
        s.step_seconds += dt
        if prefill_tokens == 0:
            s.decode_steps += 1
            s.decode_seconds += dt
            s.decode_latency.observe(dt)

    def _finish(self, r: _Running, reason: str, error: BaseException | None) -> None:
        try:
            r.req.on_finish(reason, error)
        except Exception:  # a broken callback must not take the loop down
            pass

    def _replay(self) -> None:
        """The executor's caches are empty (a re-formed group): every running sequence starts
        over at position 0 with the tokens it holds, so the next steps prefill them again."""
        self._inflight.clear()
        if self.prefix_cache is not None:  # their KV caches went with the old group
            self.prefix_cache.drop_all()
        for r in self._running:
            r.cached = 0
            r.busy = False
            r.copy = None
            r.req.cached_tokens = 0  # every prompt token is prefilled again
            if self.prefix_cache is not None:
                self.prefix_cache.track(r.seq_id, r.tokens)
        self.stats.replayed_sequences += len(self._running)
        log.warning("replaying %d sequence(s) on the re-formed executor", len(self._running))

    def _fail_all(self, error: BaseException) -> None:
        with self._cv:
            self._failure = error
            waiting = list(self._waiting)
            self._waiting.clear()
        running, self._running = self._running, []
        self._inflight.clear()
        if self.prefix_cache is not None:
            self.prefix_cache.drop_all()
        wrapped = EngineUnavailable(f"the engine failed: {error}")
        for r in running:
            self._finish(r, "error", wrapped)
        for req in waiting:
            req.on_finish("error", wrapped)
