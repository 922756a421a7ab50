"""One pipeline stage: its layers, their KV cache keyed by sequence id, and the loop that serves them.

A stage holds the contiguous global layers `[start, end)` of the model (a `Transformer` built with
`layer_range`, no embedding, no head; possibly a tensor-parallel shard whose projections join the
stage's own communicator). It is stateless between steps except for the KV cache: a sequence gets the
lowest free cache slot when first seen and keeps it until a RELEASE names it.

The loop: receive a frame from upstream, run it, and (on the stage's leader, TP rank 0) pass the
result downstream to every rank of the next stage, or back to the head from the last stage (each
row's last token only: `(B, T, D) -> (B, 1, D)`). Every rank of a TP stage receives the same frames
in the same order, so all of them run the same collectives; only the leader sends.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.engine.pp import frames as pp
from tandem.engine.pp.frames import StageLinkError, StageMessage, StageTransport
from tandem.engine.runner import ShardRunner
from tandem.engine.sequences import SequenceError
from tandem.models.llama import Transformer

log = logging.getLogger(__name__)


class UpstreamFailedError(StageLinkError):
    """An upstream stage failed; its ERROR frame has been passed on towards the head."""


# the one sequence error under the name a stage has always raised
StageOrderError = SequenceError


class StageRunner:
    """The compute half of a stage: the one runner (`ShardRunner`) over a prepared stage model,
    fed rows, since a frame carries ids, positions and lengths rather than a `Step`."""

    def __init__(self, model: Transformer, max_batch: int, max_seq_len: int) -> None:
        self.runner = ShardRunner(model, max_batch, max_seq_len, swap=False, owner="this stage")
        self.model = model
        self.layer_range = model.layer_range
        self.seqs = self.runner.seqs

    def forward(
        self,
        seq_ids: Sequence[int],
        start_pos: Sequence[int],
        lengths: Sequence[int],
        h: torch.Tensor,
        last_only: bool = False,
    ) -> torch.Tensor:
        """h (B, T, D) -> (B, T, D), or (B, 1, D) at each row's last real token when `last_only`."""
        return self.runner.forward_rows(seq_ids, start_pos, lengths, h, last_only)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """New sequence `dst` holds `src`'s first `n` positions of this stage's layers."""
        self.runner.copy_prefix(src, dst, n)

    def release(self, seq_ids: Sequence[int]) -> None:
        self.runner.release(seq_ids)

    @property
    def live_sequences(self) -> int:
        return len(self.seqs)


@dataclass
class StageLinks:
    """A stage rank's links: `upstream` delivers its frames; `downstream` (the leader's only) goes to
    every rank of the next stage, or to the head when `to_head`."""

    upstream: StageTransport
    downstream: Sequence[StageTransport] = ()
    to_head: bool = False


def serve_stage(
    runner: StageRunner,
    links: StageLinks,
    *,
    name: str,
    wire_dtype: str = "float32",
    idle_timeout: float = 3600.0,
) -> None:
    """Serves frames until STOP (passed on) or a failure, which is reported downstream as an ERROR
    frame (so the head raises it) before this function re-raises."""
    model = runner.model
    try:
        while True:
            try:
                frame = links.upstream.recv(idle_timeout)
            except StageLinkError as e:
                raise StageLinkError(f"{name} lost its upstream link: {e}") from e
            msg = pp.decode(frame, wire_dtype=wire_dtype, dtype=model.dtype, device=model.device)
            if msg.kind == pp.KIND_FORWARD:
                out = runner.forward(
                    msg.seq_ids, msg.start_pos, msg.lengths, msg.hidden, links.to_head
                )
                frame = pp.encode(
                    StageMessage(
                        pp.KIND_FORWARD, msg.tag, msg.seq_ids, msg.start_pos, msg.lengths, out
                    ),
                    wire_dtype,
                )
            elif msg.kind in (pp.KIND_RELEASE, pp.KIND_COPY):
                if msg.kind == pp.KIND_RELEASE:
                    runner.release(msg.seq_ids)
                else:
                    runner.copy_prefix(*msg.seq_ids, msg.lengths[0])
                if links.to_head:
                    continue  # the head did its own; nothing to return
            pp.send_to_all(links.downstream, frame)
            if msg.kind == pp.KIND_STOP:
                return
            if msg.kind == pp.KIND_ERROR:
                raise UpstreamFailedError(msg.text)
    except UpstreamFailedError:
        raise
    except Exception as e:
        text = (
            e.args[0]
            if isinstance(e, StageLinkError) and e.args
            else f"{name}: {type(e).__name__}: {e}"
        )
        log.error("%s", text)
        try:
            pp.send_to_all(links.downstream, pp.encode(StageMessage(pp.KIND_ERROR, text=text)))
            for link in links.downstream:
                flush = getattr(link, "flush", None)
                if flush is not None:
                    flush(5.0)
        except Exception:  # noqa: BLE001 - the downstream may be gone too; the head times out then
            pass
        raise
