"""Scenarios the spawned ranks run (module-level so "spawn" children can import them)."""

from __future__ import annotations

import hashlib
import os
import resource
import time
from typing import Any

import torch

from tandem.comm import reference


def rank_input(
    seed: int, rank: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    scale = 10.0 ** ((rank % 3) - 1)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[
        :16
    ]


def conformance(comm: Any, cases: list[tuple], mirror: dict) -> list[tuple[str, bool, str]]:
    """Run each case on this rank and compare with `reference` computed from every rank's inputs
    (regenerated here from the same seeds). Returns (case name, equals reference, digest)."""
    r, n = comm.rank, comm.world_size
    out = []
    for case in cases:
        kind, size, seed = case
        name = f"{kind}:{size}"
        if kind == "all_reduce":
            xs = [rank_input(seed, j, (size,)) for j in range(n)]
            got = comm.all_reduce_sum(xs[r])
            want = reference.all_reduce_sum(xs, **mirror)[r]
        elif kind == "all_reduce_2d":  # rows of 37 columns: column chunks of uneven widths
            xs = [rank_input(seed, j, (size, 37)) for j in range(n)]
            got = comm.all_reduce_sum(xs[r])
            want = reference.all_reduce_sum(xs, **mirror)[r]
        elif kind == "row_invariant":  # a row's sum is the same bits among `size` rows or alone
            x = rank_input(seed, r, (size, 96))
            picks = [0, size // 2, size - 1]
            got = comm.all_reduce_sum(x)[picks]
            want = torch.cat([comm.all_reduce_sum(x[k : k + 1].clone()) for k in picks])
            name = f"all_reduce==rowwise:{size}"
        elif kind == "reduce_scatter":
            dim = seed % 2
            shape = (n * size, 3) if dim == 0 else (2, n * size)
            xs = [rank_input(seed, j, shape) for j in range(n)]
            got = comm.reduce_scatter(xs[r], dim)
            want = reference.reduce_scatter(xs, dim, **mirror)[r]
        elif kind == "all_gather":
            xs = [rank_input(seed, j, (size + j, 2)) for j in range(n)]
            got = comm.all_gather(xs[r], 0)
            want = reference.all_gather(xs, 0, wire_dtype=mirror.get("wire_dtype", "float32"))[r]
        elif kind == "broadcast":
            src = seed % n
            xs = [rank_input(seed, j, (size,)) for j in range(n)]
            got = comm.broadcast(xs[r], src)
            want = xs[src]
        elif kind == "all_to_all":
            parts = [
                [rank_input(seed + k, j, (size + k, j + 1)) for k in range(n)] for j in range(n)
            ]
            back = comm.all_to_all(comm.all_to_all(parts[r]))
            got = torch.cat([p.flatten() for p in back])
            want = torch.cat([p.flatten() for p in parts[r]])
            name = f"all_to_all.all_to_all==identity:{size}"
        elif kind == "rs_ag_identity":
            # 1-D: the all-reduce's chunks (columns of the last dimension) are then exactly the
            # reduce-scatter's parts, so the two orders agree (`algorithms`)
            x = rank_input(seed, r, (n * size,))
            got = comm.all_gather(comm.reduce_scatter(x, 0), 0)
            want = comm.all_reduce_sum(x)
            name = f"all_reduce==all_gather.reduce_scatter:{size}"
        elif kind == "ids":
            x = torch.arange(size, dtype=torch.int64) + (r << 40)
            got = comm.all_gather(x, 0)
            want = torch.cat([torch.arange(size, dtype=torch.int64) + (j << 40) for j in range(n)])
        else:
            raise ValueError(kind)
        out.append((name, bool(got.shape == want.shape and torch.equal(got, want)), digest(got)))
    return out


def mixed_dtypes(comm: Any, dtypes: list[str]) -> tuple[list[float], str, list[float]]:
    """Rank j computes in dtypes[j]; values exactly representable in float16 and bfloat16."""
    dt = getattr(torch, dtypes[comm.rank])
    vals = torch.tensor([1.5, -2.25, 0.75, 96.0, 3.0], dtype=torch.float32) * (comm.rank + 1)
    out = comm.all_reduce_sum(vals.to(dt))
    raw = vals.to(dt).view(torch.int16)  # what a raw-bytes wire would have carried
    return out.float().tolist(), str(out.dtype), raw.tolist()


def stall_or_die(comm: Any, mode: str, victim: int, seconds: float) -> dict:
    """Rank `victim` dies (os._exit) or stalls; the others time an all_reduce."""
    x = torch.ones(1000)
    comm.all_reduce_sum(x)  # the ring works first
    if comm.rank == victim:
        if mode == "die":
            os._exit(3)
        time.sleep(seconds)
        return {"victim": True}
    return _timed_all_reduce(comm, x)


def desync(comm: Any) -> str:
    x = torch.ones(8)
    comm.all_reduce_sum(x) if comm.rank == 0 else comm.all_gather(x, 0)
    return "no error"


def big_all_reduce(comm: Any, n: int) -> tuple[bool, str, int]:
    xs = [rank_input(7, j, (n,)) for j in range(comm.world_size)]
    got = comm.all_reduce_sum(xs[comm.rank])
    want = reference.all_reduce_sum(xs)[comm.rank]
    return (
        bool(torch.equal(got, want)),
        digest(got),
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    )


def simple_sum(comm: Any) -> list[float]:
    return comm.all_reduce_sum(torch.full((4,), float(comm.rank + 1))).tolist()


def fast_path_meets_general_path(comm: Any) -> dict:
    """At N = 2 a float32 host tensor takes the ring's one-exchange fast path; rank 1 passes a
    bfloat16 tensor (the general path) and a 3-d one; both must meet and agree with reference."""
    out = {}
    vals = torch.tensor([1.5, -2.25, 0.75, 96.0, 3.0, 0.5], dtype=torch.float32) * (comm.rank + 1)
    mine = vals if comm.rank == 0 else vals.to(torch.bfloat16)
    out["mixed"] = comm.all_reduce_sum(mine.reshape(1, 2, 3)).float().reshape(-1).tolist()
    xs = [rank_input(11, j, (1, 1, 1024)) for j in range(comm.world_size)]
    got = comm.all_reduce_sum(xs[comm.rank])
    out["equal"] = bool(torch.equal(got, reference.all_reduce_sum(xs)[comm.rank]))
    out["shape"] = list(got.shape)
    out["digest"] = digest(got)
    out["same_host"] = comm.same_host
    # a transposed view and a tensor that requires grad take the same path's host crossing
    ys = [rank_input(12, j, (8, 16)).t() for j in range(comm.world_size)]
    want = reference.all_reduce_sum([y.contiguous() for y in ys])[comm.rank]
    out["noncontiguous_equal"] = bool(torch.equal(comm.all_reduce_sum(ys[comm.rank]), want))
    g = comm.all_reduce_sum(ys[comm.rank].contiguous().requires_grad_(True))
    out["grad_input_equal"] = bool(torch.equal(g, want)) and not g.requires_grad
    # an array of a shape the fast path knows is refused, typed, before anything is sent; the
    # ring stays usable
    from tandem.comm.base import UnsupportedDtypeError

    try:
        comm.all_reduce_sum(xs[comm.rank].numpy())
        out["array_refused"] = False
    except UnsupportedDtypeError:
        out["array_refused"] = True
    again = comm.all_reduce_sum(xs[comm.rank])
    out["usable_after_refusal"] = bool(torch.equal(again, reference.all_reduce_sum(xs)[comm.rank]))
    return out


def fast_path_shape_desync(comm: Any) -> str:
    """Same element count, other shape: the fingerprints differ, so both ranks fail closed."""
    comm.all_reduce_sum(torch.ones(8) if comm.rank == 0 else torch.ones(2, 4))
    return "no error"


def metered_counts(comm: Any) -> dict:
    """The decode path's accounting: MeteredCommunicator over the real ring, three all-reduces
    (a decode-sized float32 and a bfloat16 one on the rank-order path, a large float32 one on the
    ring path) and an int64 broadcast; results unchanged by the wrapper."""
    from tandem.comm.metered import MeteredCommunicator

    m = MeteredCommunicator(comm)
    x = rank_input(13, comm.rank, (1, 1, 1024))
    got = m.all_reduce_sum(x)
    m.all_reduce_sum(torch.ones(4, dtype=torch.bfloat16))
    m.all_reduce_sum(torch.ones(70_000))
    ints = m.broadcast(torch.arange(5) + comm.rank, 0)
    st = m.stats
    return {
        "collectives": st.collectives,
        "bytes": st.bytes_moved,
        "timed": st.seconds > 0,
        "ints": ints.tolist(),
        "digest": digest(got),
    }


def broadcast_desync(comm: Any, kind: str) -> str:
    """A small broadcast (same-host shared memory at N = 2) that the ranks call differently:
    another shape, another root, or another op on rank 1. Both must fail closed."""
    if comm.rank == 0 or kind == "root":
        comm.broadcast(torch.ones(8), 0 if comm.rank == 0 else 1)
    elif kind == "shape":
        comm.broadcast(torch.ones(2, 4), 0)
    else:
        comm.all_reduce_sum(torch.ones(8))
    return "no error"


def big_prime_all_reduce(comm: Any, n: int, algorithm: str | None) -> tuple[bool, str]:
    """An all-reduce of n (a prime near 16M) elements, equal to `reference` on every rank."""
    xs = [rank_input(13, j, (n,)) for j in range(comm.world_size)]
    got = comm.all_reduce_sum(xs[comm.rank])
    want = reference.all_reduce_sum(xs, algorithm=algorithm)[comm.rank]
    return bool(torch.equal(got, want)), digest(got)


def broadcast_with_roots(comm: Any, roots: list[int], n: int) -> tuple[str, float]:
    """Rank r broadcasts n elements from roots[r] (the ranks may disagree); what it got, or the
    error type (the harness reports errors)."""
    got = comm.broadcast(torch.full((n,), float(comm.rank + 1)), roots[comm.rank])
    return "no error", float(got[0])


def _stop_me_for(seconds: float, after: float = 0.0) -> None:
    """SIGSTOP this process `after` seconds from now and SIGCONT it `seconds` later, from a
    helper shell: hung, not dead, every socket left open."""
    import subprocess

    pid = os.getpid()
    subprocess.Popen(
        [
            "sh",
            "-c",
            f"sleep {after}; kill -STOP {pid}; sleep {seconds}; kill -CONT {pid} 2>/dev/null",
        ]
    )


def _timed_all_reduce(comm: Any, x: torch.Tensor) -> dict:
    t0 = time.monotonic()
    try:
        out = comm.all_reduce_sum(x)
    except Exception as e:
        return {
            "error": type(e).__name__,
            "mro": [c.__name__ for c in type(e).__mro__],
            "elapsed": time.monotonic() - t0,
            "msg": str(e),
            "lost_rank": getattr(e, "rank", None),
        }
    return {"error": None, "elapsed": time.monotonic() - t0, "sum": float(out[0])}


def hang_or_busy(comm: Any, mode: str, victim: int, seconds: float) -> dict:
    """Rank `victim` is stopped (SIGSTOP for `seconds`: the survivors wait in an all_reduce it
    never reaches) or busy for `seconds` (in torch compute, "busy", or in pure Python,
    "busy_python") before it joins; the others time the all_reduce."""
    x = torch.ones(1000)
    comm.all_reduce_sum(x)  # the ring works first
    if comm.rank == victim:
        if mode == "stop":
            _stop_me_for(seconds)
            time.sleep(seconds + 2.0)  # stopped for most of it
            return {"victim": True}
        a, t0, n = torch.randn(384, 384) / 20, time.monotonic(), 0
        while time.monotonic() - t0 < seconds:
            if mode == "busy":  # torch kernels: the GIL is released in them
                a = torch.tanh(a @ a)
            else:  # "busy_python": pure Python, the GIL handed over every switch interval
                sum(i * i for i in range(20_000))
            n += 1
        res = _timed_all_reduce(comm, x)
        res["busy_s"], res["matmuls"] = time.monotonic() - t0, n
        return res
    return _timed_all_reduce(comm, x)


def stopped_mid_stream(comm: Any, victim: int, seconds: float) -> dict:
    """Every rank runs large all_reduces (the RING algorithm, many frames each) back to back;
    rank `victim` is stopped half a second in, inside one of them. The survivors report the op
    that failed and how long it waited."""
    x = torch.ones(4_000_000)
    if comm.rank == victim:
        _stop_me_for(seconds, after=0.5)
    ops, t_end = 0, time.monotonic() + seconds + 5.0
    while time.monotonic() < t_end:
        res = _timed_all_reduce(comm, x)
        if res["error"] is not None:
            res["ops"] = ops
            return res
        ops += 1
    return {"error": None, "ops": ops, "victim": comm.rank == victim}
