"""The head of a pipeline: the `Executor` that drives stages 1..M-1 from rank 0 of stage 0.

Per step, for each micro-batch (see `split_microbatches`):

    tokens (B, T) --embed--> h (B, T, D) --stage 0 layers--> h --wire--> stage 1 --> ... --> stage M-1
    stage M-1 --wire--> h_last (B, 1, D) --final norm + LM head--> logits (B, vocab) --> sampling

so each step crosses each stage boundary once with one hidden state, and no logits cross the wire.
The head sends every micro-batch before it awaits the first result, so while stage 1 runs micro-batch
0 the head runs stage 0 on micro-batch 1, and so on (pipelined sends: a send never waits for the
peer); the LM head then runs once over all of them. A step is split only when it is compute-heavy
(prefill): in memory-bound decode every micro-batch would re-read each stage's weights. Decode keeps
all stages busy across steps instead: `submit` starts a step without waiting and `collect` returns
the oldest one's logits, so a loop that keeps one group of sequences in flight per stage
(`tandem.engine.pp.generate`) has every stage working on a different group at once.

When stage 0 is itself a tensor-parallel group, the head sends each micro-batch's embedded hidden
state to stage 0's other ranks first (they hold layer shards only; the head keeps the whole
embedding and LM head), then runs its own shard with them.

Every stage process also beats to the head on its own connection (`tandem.engine.pp.beats`): a
rank silent for the heartbeat timeout fails `health()` at once, idle or mid-step, naming it, and
the head shuts down its stage links so a step waiting on the last stage wakes instead of waiting
out the op timeout.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tandem.cluster.exits import exit_cause
from tandem.engine import cluster_info as ci
from tandem.engine.executor import Step, StepResult, StepSequence, split_microbatches
from tandem.engine.pp import frames as pp
from tandem.engine.pp.beats import named_loss
from tandem.engine.pp.frames import StageLinkError, StageMessage, StageTransport
from tandem.engine.pp.layout import StageSpec
from tandem.engine.pp.stage import StageRunner
from tandem.engine.rope_rewind import LongRopeRewind
from tandem.engine.sequences import SequenceCache
from tandem.models.llama import Transformer
from tandem.transport.channel import Channel
from tandem.transport.heartbeat import Heartbeat, PeerLostError
from tandem.transport.socketio import PeerTimeoutError

MICROBATCH_MIN_TOKENS = 32


class PipelineFailedError(RuntimeError):
    """A stage failed, died, or did not answer within the timeout; the message says which."""


class PipelineExecutor:
    """`Executor` over a pipeline whose stage 0 runs in this process.

    `embed_head` holds the embedding, final norm and LM head; `stage0` runs stage 0's layers (it may
    share `embed_head`'s module when stage 0 is not tensor-parallel). `to_stage0_peers` are links to
    stage 0's other TP ranks, `to_next` to every rank of stage 1, `from_last` carries stage M-1's
    output back. `diagnose` names a dead process, if the launcher knows one. `stages`, `grid`,
    `facts`, `worker_pids` and `worker_procs` describe what the launcher started (for `describe`,
    `health` and reports).
    """

    def __init__(
        self,
        embed_head: Transformer,
        stage0: StageRunner,
        *,
        to_next: Sequence[StageTransport],
        from_last: StageTransport | None,
        to_stage0_peers: Sequence[StageTransport] = (),
        num_stages: int,
        max_batch: int,
        max_seq_len: int,
        wire_dtype: str = "float32",
        timeout: float = 120.0,
        microbatches: int | None = None,
        diagnose: Callable[[], str | None] | None = None,
        on_close: Callable[[], None] | None = None,
        stages: Sequence[StageSpec] = (),
        grid: Sequence[Sequence[int]] = ((0,),),
        facts: Sequence[ci.RankFacts] = (),
        worker_pids: dict[str, int] | None = None,
        worker_procs: Sequence[Any] = (),
    ) -> None:
        self.embed_head = embed_head
        self.stage0 = stage0
        self.to_next = list(to_next)
        self.from_last = from_last
        self.to_stage0_peers = list(to_stage0_peers)
        self.num_stages = num_stages
        self.vocab_size = embed_head.config.vocab_size
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.wire_dtype = wire_dtype
        self.timeout = timeout
        self.microbatches = microbatches
        self._pending: deque[tuple[int, tuple[StepSequence, ...]]] = deque()
        self._diagnose = diagnose
        self._on_close = on_close
        self._tag = 0
        self._local: dict[int, torch.Tensor] = {}
        # the head's record of every sequence (the stages keep their own by the same rule)
        self.seqs = SequenceCache(
            max_batch, max_seq_len, vocab_size=self.vocab_size,
            recurrent=embed_head.config.hybrid,
        )  # fmt: skip
        self.rewind = LongRopeRewind.for_config(embed_head.config)  # longrope: crossing recomputes
        self._failed: str | None = None
        self._lost: str | None = None  # why the heartbeat declared a rank lost (`_lose`)
        self._heartbeat: Heartbeat | None = None
        self.steps = 0
        self.tokens_in = 0
        self.stage_hops = 0
        self.wait_seconds = 0.0  # blocked on the last stage's answer (the other stages' time)
        # what the pipeline is, for describe() and reports: given by whoever launched it
        self.stages = list(stages)  # each stage's layers, TP degree, dtype and device
        self.grid = [list(g) for g in grid]  # global rank ids of each stage's TP ranks
        self.facts = list(facts)
        self.worker_pids = dict(worker_pids or {})  # process name -> pid, if ours
        self.worker_procs = list(worker_procs)  # subprocess.Popen of each stage process, if ours

    # ---- the Executor protocol ------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, step: Step) -> StepResult:
        """The step's result at each sequence's last new token (see `StepResult`)."""
        self._check_usable()
        step = self.rewind.expand(step)  # every stage gets the rewound rows
        self.seqs.check(step)
        try:
            groups = split_microbatches(step.sequences, self._microbatches_for(step))
            tags = [self._launch(g) for g in groups]
            hidden = [self._receive(t, g) for t, g in zip(tags, groups)]
            logits = self._head(torch.cat(hidden))  # one LM head pass (one weight read) per step
        except (StageLinkError, pp.StageMessageError, PeerTimeoutError) as e:
            raise self._fail(str(e)) from e
        self._account(step)
        if step.greedy:
            return StepResult(token_ids=logits.argmax(-1))  # (B,)
        return StepResult(logits=logits)  # (B, vocab)

    # ---- pipelining across steps ----------------------------------------------------------------

    @torch.inference_mode()
    def submit(self, step: Step) -> int:
        """Starts `step` through the pipeline without waiting for it; returns its tag. Results come
        back in submission order (`collect`). A caller that keeps one group of sequences in flight
        per stage keeps every stage busy (see `tandem.engine.pp.generate`)."""
        self._check_usable()
        step = self.rewind.expand(step)
        self.seqs.check(step)
        try:
            tag = self._launch(step.sequences)
        except (StageLinkError, pp.StageMessageError, PeerTimeoutError) as e:
            raise self._fail(str(e)) from e
        self._pending.append((tag, step.sequences))
        self._account(step)
        return tag

    @torch.inference_mode()
    def collect(self) -> tuple[int, StepResult]:
        """The oldest submitted step's tag and its logits (B, vocab_size), float32 on the host."""
        self._check_usable()
        if not self._pending:
            raise ValueError("no step in flight")
        tag, seqs = self._pending.popleft()
        try:
            return tag, StepResult(logits=self._head(self._receive(tag, seqs)))
        except (StageLinkError, pp.StageMessageError) as e:
            raise self._fail(str(e)) from e

    def copy_prefix(self, src_seq: int, dst_seq: int, n: int) -> None:
        """New sequence `dst_seq` holds `src_seq`'s first `n` cached positions on every stage:
        stage 0 here copies its layers' KV, and one COPY frame (`frames`) travels, in order
        behind any step in flight, to stage 0's other TP ranks and down the pipeline, each rank
        copying its own layers (its kv-head shard in a TP stage). Checked here first against the
        head's record and stage 0's rule (`PrefixCopyError`), so a refused copy reaches no stage."""
        self._check_usable()
        self.seqs.check_copy(src_seq, dst_seq, n)
        self.stage0.seqs.check_copy(src_seq, dst_seq, n)
        self.stage0.copy_prefix(src_seq, dst_seq, n)
        self.seqs.copy(src_seq, dst_seq, n)
        self.rewind.copy(src_seq, dst_seq, n)
        frame = pp.encode(
            StageMessage(pp.KIND_COPY, seq_ids=(src_seq, dst_seq), start_pos=(0, 0), lengths=(n, n))
        )
        try:
            pp.send_to_all(self.to_stage0_peers, frame)
            pp.send_to_all(self.to_next, frame)
        except StageLinkError as e:
            raise self._fail(str(e)) from e

    def release(self, seq_ids: list[int]) -> None:
        """Frees the sequences' caches here and, in order behind any step in flight, on every stage."""
        self._check_usable()
        self.stage0.release(seq_ids)
        self.seqs.release(seq_ids)
        self.rewind.release(seq_ids)
        frame = pp.encode(
            StageMessage(
                pp.KIND_RELEASE,
                seq_ids=tuple(seq_ids),
                start_pos=(0,) * len(seq_ids),
                lengths=(0,) * len(seq_ids),
            )
        )
        try:
            pp.send_to_all(self.to_stage0_peers, frame)
            pp.send_to_all(self.to_next, frame)
        except StageLinkError as e:
            raise self._fail(str(e)) from e

    def watch(self, beats: Sequence[Channel], timeout: float) -> None:
        """Starts watching every stage process's heartbeat channel (`tandem.engine.pp.beats`): one
        silent for `timeout` seconds is lost (`_lose`)."""
        if beats:
            self._heartbeat = Heartbeat(0, beats, timeout, self._lose)

    def _lose(self, e: PeerLostError) -> None:
        """The heartbeat declared rank `e.rank` lost (on the heartbeat thread): the pipeline is
        failed from now, and its stage links are shut down so a step waiting on them wakes. The
        reason names the rank's place right after the loss (`named_loss`)."""
        self._lost = named_loss(str(e), e.rank, self.grid)
        for link in (*self.to_stage0_peers, *self.to_next, self.from_last):
            shutdown = getattr(link, "shutdown", None)
            if shutdown is not None:
                shutdown()

    def _state(self) -> tuple[str, str]:
        if self._lost is not None:  # the cause, even when a stage's ERROR frame came first
            return "failed", self._lost
        if self._failed is not None:
            return "failed", self._failed.splitlines()[0]
        dead = [c for c in (p.poll() for p in self.worker_procs) if c is not None]
        if dead:
            return (
                "failed",
                f"{len(dead)} stage process(es) exited, the first with {exit_cause(dead[0])}",
            )
        return "whole", f"all {len(self.facts) or 1} ranks are up"

    def health(self) -> tuple[bool, str]:
        state, detail = self._state()
        return state == "whole", detail

    def stats(self) -> dict[str, float]:
        """Bytes the head has put on and read from its stage links (the stages' own sends are
        not counted)."""
        return {"wire_bytes": self.bytes_sent + self.bytes_received}

    def describe(self) -> dict[str, Any]:
        state, detail = self._state()
        counters = ci.Counters(self.wait_seconds, self.bytes_sent + self.bytes_received, 0)
        tp = max(len(g) for g in self.grid)
        return ci.Description(
            "pp", tp, self.num_stages, list(self.facts), state, detail,
            ci.pipeline_links(self.grid), counters, sum(len(g) for g in self.grid),
        ).as_dict()  # fmt: skip

    def close(self) -> None:
        """Stops every stage (STOP travels the whole ring and back) and closes the links. A
        pipeline that is not whole (a stage process exited, a rank was lost) gets no STOP, which
        would wait on a ring that cannot carry it, and its links are shut down before they close,
        so a step still waiting on one wakes now: a link held open and silent (a cut cable whose
        far end exited) would otherwise hold that step until the op timeout."""
        if self._heartbeat is not None:
            self._heartbeat.close()  # a closed heartbeat connection is not a loss to a stage
        whole = self._state()[0] == "whole"
        try:
            if whole and self.to_next:
                stop = pp.encode(StageMessage(pp.KIND_STOP))
                pp.send_to_all(self.to_stage0_peers, stop)
                pp.send_to_all(self.to_next, stop)
                deadline = time.monotonic() + min(self.timeout, 10.0)
                while self.from_last is not None and time.monotonic() < deadline:
                    msg = pp.decode(self.from_last.recv(max(0.1, deadline - time.monotonic())))
                    if msg.kind in (pp.KIND_STOP, pp.KIND_ERROR):
                        break
        except (StageLinkError, pp.StageMessageError):
            pass
        finally:
            links = [x for x in (*self.to_stage0_peers, *self.to_next, self.from_last) if x]
            for link in links:
                shutdown = getattr(link, "shutdown", None)
                if shutdown is not None:
                    shutdown()  # wakes a thread waiting on it, which close() alone does not
            for link in links:
                link.close()
            if self._on_close is not None:
                self._on_close()

    # ---- one micro-batch ------------------------------------------------------------------------

    def _launch(self, seqs: tuple[StepSequence, ...]) -> int:
        """Embeds, runs stage 0 and sends the hidden state on; returns the micro-batch tag."""
        tag = self._tag
        self._tag += 1
        m = self.embed_head
        lengths = tuple(len(s.token_ids) for s in seqs)
        T = max(lengths)
        rows = [list(s.token_ids) + [0] * (T - len(s.token_ids)) for s in seqs]
        tokens = torch.tensor(rows, dtype=torch.int64, device=m.device)  # (B, T)
        ids = tuple(s.seq_id for s in seqs)
        starts = tuple(s.start_pos for s in seqs)
        h = m.embed(tokens)  # (B, T, D)
        if self.to_stage0_peers:
            frame = pp.encode(
                StageMessage(pp.KIND_FORWARD, tag, ids, starts, lengths, h), self.wire_dtype
            )
            pp.send_to_all(self.to_stage0_peers, frame)
        last_only = self.num_stages == 1
        h = self.stage0.forward(ids, starts, lengths, h, last_only=last_only)
        if last_only:
            self._local[tag] = h
            return tag
        frame = pp.encode(
            StageMessage(pp.KIND_FORWARD, tag, ids, starts, lengths, h), self.wire_dtype
        )
        pp.send_to_all(self.to_next, frame)
        self.stage_hops += 1
        return tag

    def _receive(self, tag: int, seqs: tuple[StepSequence, ...]) -> torch.Tensor:
        """Stage M-1's last-token hidden state (B, 1, D) for micro-batch `tag`."""
        m = self.embed_head
        if self.num_stages == 1:
            h = self._local.pop(tag)
        else:
            t0 = time.perf_counter()
            raw = self.from_last.recv(self.timeout)
            self.wait_seconds += time.perf_counter() - t0
            msg = pp.decode(
                raw,
                wire_dtype=self.wire_dtype,
                dtype=m.dtype,
                device=m.device,
            )
            if msg.kind == pp.KIND_ERROR:
                raise self._fail(f"a stage failed: {msg.text}")
            ids = tuple(s.seq_id for s in seqs)
            if msg.kind != pp.KIND_FORWARD or msg.tag != tag or msg.seq_ids != ids:
                raise self._fail(
                    f"out of step: expected micro-batch {tag} of {ids}, got kind {msg.kind} "
                    f"tag {msg.tag} of {msg.seq_ids}"
                )
            h = msg.hidden
        return h.to(m.dtype)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: (B, 1, D) -> logits (B, vocab) float32 on the host."""
        return self.embed_head.head(h)[:, 0].float().cpu()

    def _microbatches_for(self, step: Step) -> int:
        """Decode is memory-bound: every micro-batch re-reads each stage's weights, so one step is
        split only when it is compute-heavy (a prefill of at least `MICROBATCH_MIN_TOKENS` tokens
        per micro-batch). Decode throughput comes from `submit`/`collect` across steps instead."""
        if self.microbatches is not None:
            return self.microbatches
        tokens = sum(len(s.token_ids) for s in step.sequences)
        return max(1, min(self.num_stages, tokens // MICROBATCH_MIN_TOKENS))

    def _account(self, step: Step) -> None:
        self.seqs.advance(step)
        self.steps += 1
        self.tokens_in += sum(len(s.token_ids) for s in step.sequences)

    # ---- bookkeeping ----------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise PipelineFailedError(f"the pipeline failed earlier: {self._failed}")

    def _fail(self, why: str) -> PipelineFailedError:
        if self._lost is not None:  # hung, not dead: no exit to wait for
            self._failed = f"the pipeline failed during a step: {self._lost}"
            return PipelineFailedError(self._failed)
        extra = self._diagnose() if self._diagnose is not None else None
        self._failed = why + (f" ({extra})" if extra else "")
        return PipelineFailedError(self._failed)

    @property
    def bytes_sent(self) -> int:
        """Bytes this head has put on its stage links (the stages' own sends are not counted)."""
        return sum(link.bytes_sent for link in (*self.to_stage0_peers, *self.to_next))

    @property
    def socket_bytes(self) -> int:
        """Bytes on the head's sockets both ways, transport frame headers included."""
        links = (*self.to_stage0_peers, *self.to_next, self.from_last)
        return sum(link.socket_bytes() for link in links if hasattr(link, "socket_bytes"))

    @property
    def bytes_received(self) -> int:
        """Bytes the head has read from the last stage."""
        return self.from_last.bytes_received if self.from_last is not None else 0
