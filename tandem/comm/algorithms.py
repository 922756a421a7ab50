"""Which algorithm a collective runs, and how it cuts a tensor: pure functions every rank evaluates
identically, so every rank makes the same choice from the same (size, world size).

Two all-reduce algorithms exist, and each fixes a reduction order (float addition is commutative
but not associative, so the order is part of the result; `reference.py` mirrors both):

- RANK_ORDER (latency-optimal for small tensors): every rank sees every rank's values and sums
  them in rank order, ((x_0 + x_1) + x_2) + ... . Used by the ring for small tensors (a ring
  all-gather of whole tensors, N-1 hops) and always by the star.
- RING (bandwidth-optimal for large tensors): the flat tensor is cut into N chunks by
  `chunk_bounds`; chunk c's partial sum starts at rank c+1 and travels right, so its order is
  ((x_{c+1} + x_{c+2}) + ...) + x_c; rank c ends the reduce-scatter owning chunk c, and an
  all-gather ring hands every chunk to every rank. Each rank sends 2(N-1)/N of the tensor.
"""

from __future__ import annotations

RANK_ORDER = "rank_order"
RING = "ring"

# A decode step's hidden state is a few KB; the crossover where the ring's 2(N-1) steps beat the
# all-gather's N-1 full-size hops is about latency x bandwidth x N/(N-2), ~100 KB on loopback.
DEFAULT_SMALL_MAX_BYTES = 64 * 1024


def chunk_bounds(n: int, world_size: int) -> list[tuple[int, int]]:
    """Half-open [start, end) element ranges of `n` split into `world_size` contiguous chunks;
    the first n % world_size chunks hold one extra element (chunks may be empty when n < N)."""
    base, extra = divmod(n, world_size)
    bounds, start = [], 0
    for c in range(world_size):
        end = start + base + (1 if c < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def choose_all_reduce(wire_nbytes: int, world_size: int, small_max_bytes: int) -> str:
    """RANK_ORDER for tensors of at most `small_max_bytes` on the wire, RING above; a function of
    values every rank shares, so every rank picks the same algorithm."""
    return RANK_ORDER if wire_nbytes <= small_max_bytes else RING


def ring_reduce_steps(rank: int, world_size: int) -> list[tuple[int, int]]:
    """Reduce-scatter schedule of `rank`: per step s, (chunk sent right, chunk received from left).

    Step s sends chunk (r - s - 1) and receives chunk (r - s - 2), so the partial sum of chunk c
    starts at rank c+1 and, after N-1 steps, rank r holds the full sum of chunk r.
    """
    n = world_size
    return [((rank - s - 1) % n, (rank - s - 2) % n) for s in range(n - 1)]


def ring_gather_steps(rank: int, world_size: int) -> list[tuple[int, int]]:
    """All-gather schedule of `rank`: per step s, (chunk sent right, chunk received from left);
    rank r starts by sending its own chunk r."""
    n = world_size
    return [((rank - s) % n, (rank - s - 1) % n) for s in range(n - 1)]
