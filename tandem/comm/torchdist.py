"""torch.distributed as a Communicator: gloo between hosts (tensors staged to the host in float32),
NCCL only when every rank is a CUDA device (tensors stay on the device).

Under gloo the default is exact mode: an all-reduce is an all-gather followed by a float32 sum in
rank order, so the result equals `reference` with algorithm="star" (RANK_ORDER) bit for bit;
`exact=False` uses gloo's own all_reduce (ranks still agree with each other, but its reduction
order is gloo's). NCCL always uses its own all_reduce. Ragged all_gather and all_to_all first
exchange shapes as int64 tensors: nothing is pickled (no *_object collectives).

    comm = TorchDistCommunicator.create(rank, world_size, master=("10.0.0.1", 29500), backend="gloo")

torch.distributed keeps one process-wide default group; this object owns it and destroys it on close.

Neither torch's rendezvous store nor gloo's links are authenticated: the cluster secret plays no
part, and whoever reaches the master's port can read and write the store. So rank 0's store listens
only on the master address it was given (never every interface), and a master that is not a
loopback address is refused (UntrustedNetworkError) unless the caller says the network is trusted
(`trusted_network=True`; `from_env` reads TANDEM_TRUSTED_NETWORK=1). Between hosts, the ring and
the star (HMAC-authenticated) are the backends for networks you do not control.
"""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

from tandem.comm import base
from tandem.comm.staging import stage_to_host
from tandem.transport.endpoints import is_loopback

_MAX_NDIM = 8


class BackendUnavailableError(base.CommError):
    """The requested torch.distributed backend cannot run here (e.g. NCCL without CUDA)."""


class UntrustedNetworkError(base.CommError):
    """torch.distributed (unauthenticated) asked to rendezvous beyond this host on a network
    nobody said is trusted."""


def _store(
    rank: int, world_size: int, master: tuple[str, int], timeout: datetime.timedelta
) -> dist.TCPStore:
    """The rendezvous store; on rank 0 its server listens on the master address alone."""
    host, port = master
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout)
    try:
        listener = socket.create_server((host, port))
    except OSError as e:
        raise BackendUnavailableError(f"rank 0 cannot listen on {host}:{port} ({e})") from e
    # the store takes the descriptor over (and closes it): Python must not
    return dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=listener.detach())


class TorchDistCommunicator:
    """Rank `rank` of a torch.distributed group (backend "gloo" or "nccl")."""

    def __init__(self, rank: int, world_size: int, backend: str, exact: bool) -> None:
        self._rank, self._size, self._backend, self._exact = rank, world_size, backend, exact
        self._device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )
        self._closed = False

    @classmethod
    def create(
        cls,
        rank: int,
        world_size: int,
        *,
        master: tuple[str, int],
        backend: str = "gloo",
        timeout: float = 120.0,
        exact: bool | None = None,
        trusted_network: bool = False,
    ) -> TorchDistCommunicator:
        if backend not in ("gloo", "nccl"):
            raise BackendUnavailableError(
                f"torch.distributed backend must be gloo or nccl, got {backend!r}"
            )
        if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise BackendUnavailableError(
                "TANDEM_COMM=nccl needs every rank on a CUDA device with NCCL; this rank has none "
                "(use ring, star or gloo for mixed or CPU clusters)"
            )
        if dist.is_initialized():
            raise BackendUnavailableError(
                "torch.distributed is already initialised in this process"
            )
        if world_size > 1 and not is_loopback(master[0]) and not trusted_network:
            raise UntrustedNetworkError(
                f"TANDEM_COMM={backend} across hosts (master {master[0]}:{master[1]}): "
                "torch.distributed's rendezvous and links are not authenticated and do not use "
                "the cluster secret, so anyone who reaches that port can join or read the group. "
                "Use TANDEM_COMM=ring or star (HMAC-authenticated), or set "
                "TANDEM_TRUSTED_NETWORK=1 if this network is yours alone"
            )
        span = datetime.timedelta(seconds=timeout)
        dist.init_process_group(
            backend,
            store=_store(rank, world_size, master, span),
            rank=rank,
            world_size=world_size,
            timeout=span,
        )
        return cls(rank, world_size, backend, backend == "gloo" if exact is None else exact)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._size

    def _check_open(self) -> None:
        if self._closed:
            raise base.CommClosedError(f"rank {self._rank}: communicator is closed")

    def _stage(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor as this backend moves it: float32 (floats) on the backend's device."""
        if self._backend == "nccl":
            return (
                t.detach()
                .to(self._device, torch.float32 if t.dtype.is_floating_point else t.dtype)
                .contiguous()
            )
        dtype = torch.float32 if t.dtype.is_floating_point else t.dtype
        return torch.from_numpy(stage_to_host(t, dtype).copy()).reshape(t.shape)

    def _sum(self, x: torch.Tensor) -> torch.Tensor:
        if not self._exact:
            dist.all_reduce(x)
            return x
        parts = [torch.empty_like(x) for _ in range(self._size)]
        dist.all_gather(parts, x)
        acc = parts[0].clone()
        for p in parts[1:]:
            acc += p
        return acc

    def _shapes(self, t: torch.Tensor) -> list[tuple[int, ...]]:
        row = torch.zeros(_MAX_NDIM + 1, dtype=torch.int64, device=self._device)
        if t.ndim > _MAX_NDIM:
            raise base.RaggedPartsError(f"at most {_MAX_NDIM} dims, got shape {tuple(t.shape)}")
        row[0] = t.ndim
        row[1 : 1 + t.ndim] = torch.tensor(t.shape, dtype=torch.int64)
        rows = [torch.empty_like(row) for _ in range(self._size)]
        dist.all_gather(rows, row)
        return [tuple(int(v) for v in r[1 : 1 + int(r[0])]) for r in rows]

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        self._check_open()
        base.check_tensor(t, "all_reduce_sum", reduce=True)
        return self._sum(self._stage(t)).to(t.device, t.dtype)

    def reduce_scatter(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        self._check_open()
        base.check_tensor(t, "reduce_scatter", reduce=True)
        d = base.check_dim(t, dim, "reduce_scatter")
        part = base.check_divisible(t, d, self._size, "reduce_scatter")
        full = self._sum(self._stage(t))
        return full.narrow(d, self._rank * part, part).contiguous().to(t.device, t.dtype)

    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        self._check_open()
        base.check_tensor(t, "all_gather", reduce=False)
        d = base.check_dim(t, dim, "all_gather")
        shapes = self._shapes(t)
        base.check_gather_shapes(shapes, d, "all_gather")
        x = self._stage(t)
        longest = max(s[d] for s in shapes)
        pad = list(x.shape)
        pad[d] = longest
        padded = torch.zeros(pad, dtype=x.dtype, device=x.device)
        padded.narrow(d, 0, x.shape[d]).copy_(x)
        parts = [torch.empty_like(padded) for _ in range(self._size)]
        dist.all_gather(parts, padded)
        whole = torch.cat([p.narrow(d, 0, s[d]) for p, s in zip(parts, shapes)], dim=d)
        return whole.to(t.device, t.dtype)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        self._check_open()
        base.check_tensor(t, "broadcast", reduce=False)
        base.check_src(src, self._size)
        base.check_same_shape(self._shapes(t), "broadcast")
        x = self._stage(t)
        dist.broadcast(x, src)
        return x.to(t.device, t.dtype)

    def all_to_all(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        self._check_open()
        parts = base.check_parts(parts, self._size, "all_to_all")
        # every rank learns every part's shape: table[i][k] is the shape rank i sends rank k
        rows = torch.zeros(self._size, _MAX_NDIM + 1, dtype=torch.int64, device=self._device)
        for k, p in enumerate(parts):
            if p.ndim > _MAX_NDIM:
                raise base.RaggedPartsError(f"at most {_MAX_NDIM} dims, got shape {tuple(p.shape)}")
            rows[k, 0] = p.ndim
            rows[k, 1 : 1 + p.ndim] = torch.tensor(p.shape, dtype=torch.int64)
        table = [torch.empty_like(rows) for _ in range(self._size)]
        dist.all_gather(table, rows)
        like = parts[0]
        dtype = torch.float32 if like.dtype.is_floating_point else like.dtype
        out: list[torch.Tensor] = [None] * self._size  # type: ignore[list-item]
        reqs = []
        for i in range(self._size):
            r = table[i][self._rank]
            shape = tuple(int(v) for v in r[1 : 1 + int(r[0])])
            if i == self._rank:
                out[i] = self._stage(parts[i])
            else:
                out[i] = torch.empty(shape, dtype=dtype, device=self._device)
                reqs.append(dist.irecv(out[i], src=i))
        sends = [self._stage(p) for p in parts]
        for k in range(self._size):
            if k != self._rank:
                reqs.append(dist.isend(sends[k], dst=k))
        for q in reqs:
            q.wait()
        return [o.to(like.device, like.dtype) for o in out]

    def barrier(self) -> None:
        self._check_open()
        dist.barrier()

    def close(self) -> None:
        if not self._closed and dist.is_initialized():
            dist.destroy_process_group()
        self._closed = True
