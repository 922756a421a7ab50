"""The head's side of a tensor-parallel group: an `Executor` that drives the workers.

One generation loop, on the head (rank 0). For each step the head broadcasts a control frame
(`tandem.engine.control`) over the group's communicator, then runs its own shard of the forward;
the workers, having received the same frame, run theirs, and the layers' collectives meet. The
vocab-parallel LM head delivers the logits to rank 0 only, where the caller samples. Finished
sequences are released on the head at once and on the workers with the next frame (they free
before they run it), so every rank's cache slots stay in step without an extra broadcast.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.comm.base import Communicator
from tandem.engine import control
from tandem.engine.control import Control
from tandem.engine.executor import Step
from tandem.engine.shard_runner import ShardRunner


def send_control(comm: Communicator, msg: Control, src: int = 0) -> None:
    """Broadcasts `msg` from `src` (the frame, then the long payload if there is one)."""
    frame, extra = control.encode(msg)
    comm.broadcast(frame, src)
    if extra is not None:
        comm.broadcast(extra, src)


def recv_control(comm: Communicator, src: int = 0) -> Control:
    """The receiving side of `send_control` on every rank but `src`."""
    frame = comm.broadcast(torch.zeros(control.FRAME, dtype=torch.int64), src)
    n = control.payload_len(frame)
    extra = comm.broadcast(torch.zeros(n, dtype=torch.int64), src) if n else None
    return control.decode(frame, extra)


class TPExecutor:
    """`Executor` over a TP group whose rank 0 is this process; `runner` holds rank 0's shard."""

    def __init__(
        self,
        runner: ShardRunner,
        comm: Communicator,
        vocab_size: int,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        if comm.rank != 0:
            raise ValueError(
                f"the head is rank 0 of its group, this communicator is rank {comm.rank}"
            )
        self.runner = runner
        self.comm = comm
        self.vocab_size = vocab_size
        self.max_seq_len = runner.max_seq_len
        self.max_batch = runner.max_batch
        self._on_close = on_close
        self._pending_release: list[int] = []
        self._closed = False

    def run(self, step: Step) -> torch.Tensor:
        """Logits (B, vocab_size) float32 at each sequence's last new token."""
        release = tuple(self._pending_release)
        self._pending_release.clear()
        send_control(self.comm, Control(control.KIND_STEP, step, release))
        logits = self.runner.forward(step)
        assert logits is not None  # rank 0 of a group holding the head always gets the logits
        return logits

    def release(self, seq_ids: list[int]) -> None:
        self.runner.release(seq_ids)
        self._pending_release.extend(seq_ids)

    def close(self) -> None:
        """Tells the workers to leave their loop, closes the communicator, then `on_close`."""
        if self._closed:
            return
        self._closed = True
        try:
            send_control(self.comm, Control(control.KIND_STOP))
        except Exception:  # noqa: BLE001 - a dead worker must not keep the head from cleaning up
            pass
        finally:
            try:
                self.comm.close()
            finally:
                if self._on_close is not None:
                    self._on_close()
