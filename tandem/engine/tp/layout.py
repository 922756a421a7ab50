"""What the modules of a TP group share, below all of them: the layout the head and its workers
agree on (`GroupLayout`), what each rank says of itself (`RankInfo`), the ring's cluster id per
epoch (`cluster_id_for`) and what the head needs of its local worker processes (`WorkerProcesses`,
which `local.LocalWorkers` is).

    layout  <-  head, placement, worker  <-  setup  <-  rejoin  <-  local

(the import order pyproject.toml's contract holds: a module imports only those to its left.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tandem.engine.tp.probe import RankKind
from tandem.parallel.plan import TPPlan, plan_for_source

if TYPE_CHECKING:
    from tandem.loaders.source import ModelSource


def cluster_id_for(epoch: int) -> str:
    """The ring's cluster id in `epoch` (what every rank claims in its handshake, so a rank of an
    earlier epoch is refused): "tandem-tp", then "tandem-tp/epoch-1", ..."""
    return "tandem-tp" if epoch == 0 else f"tandem-tp/epoch-{epoch}"


@dataclass(frozen=True)
class GroupLayout:
    world_size: int
    weights: tuple[float, ...]
    max_batch: int
    max_seq_len: int
    fingerprint: str
    attn_ranks: int = 0  # attention on the first A ranks only (`TPPlan.attn_ranks`); 0: all
    probed: int = 0  # 1: the weights came from the probe, refined at join (`tp.refine`)
    moe: str = "tp"  # a mixture of experts' placement (`TPPlan.moe`)

    def plan(self, md: ModelSource) -> TPPlan:
        """The group's TP plan for `md` (every rank computes the same one)."""
        return plan_for_source(md, self.world_size, self.weights, self.attn_ranks or None, self.moe)


@dataclass(frozen=True)
class RankInfo:
    rank: int
    dtype: str
    device: str
    threads: int = 0  # the rank's torch CPU threads (its OpenMP pool)
    pid: int = 0
    host: str = ""
    cpu_quota: float = 0.0  # CPUs its cgroup's CFS quota allows; 0: none

    def kind(self) -> RankKind:
        return RankKind(self.device, self.dtype, self.host, self.threads, self.cpu_quota)


class WorkerProcesses(Protocol):
    """A head's worker ranks running as its own child processes (`local.LocalWorkers`)."""

    def exited(self) -> tuple[str, int] | None:
        """(name, exit code) of a worker that has exited, or None while all run."""
        ...

    def pids(self) -> frozenset[int]:
        """The worker processes' pids."""
        ...
