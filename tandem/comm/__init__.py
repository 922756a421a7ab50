"""Collectives behind one protocol (`base.Communicator`), one backend per module:

- `reference.ReferenceCommunicator`: in-process, one thread per rank; the conformance oracle.
- `solo.SoloCommunicator`: world size 1.
- `ring.RingCommunicator`: host-staged TCP ring (any device); `RingCommunicator.create(...)`.
- `star.StarCommunicator`: rooted at rank 0; `StarCommunicator.create(...)`.
- `torchdist.TorchDistCommunicator`: torch.distributed gloo (or NCCL when every rank is CUDA).

`from_env()` builds the one the environment describes (TANDEM_COMM, RING_CONFIG or torchrun vars).
"""

from tandem.comm.base import Communicator
from tandem.comm.env import CommConfigError, from_env

__all__ = ["CommConfigError", "Communicator", "from_env"]
