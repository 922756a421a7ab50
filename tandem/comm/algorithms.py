"""Which algorithm a collective runs, and how it cuts a tensor: pure functions every rank evaluates
identically, so every rank makes the same choice from the same (size, world size).

Two all-reduce algorithms exist (float addition is commutative but not associative, so the order
is part of the result; `reference.py` mirrors both):

- RANK_ORDER (latency-optimal for small tensors): every rank sees every rank's values (the ring:
  an all-gather of whole tensors, N-1 hops; the star: through its root) and sums them.
- RING (bandwidth-optimal for large tensors): the tensor is cut into N chunks; chunk c's partial
  sum starts at rank c+1 and travels right, so its order is ((x_{c+1} + x_{c+2}) + ...) + x_c;
  rank c ends the reduce-scatter owning chunk c, and an all-gather ring hands every chunk to
  every rank. Each rank sends 2(N-1)/N of the tensor.

The ring's all-reduce sums every element in one order whatever the tensor's size and whichever
algorithm carries it, so a row's sum does not depend on how many rows share the tensor (batch
invariance, on the float32 wire): the ring chunks are `column_bounds`, N slices of the LAST
dimension (the same columns of every row, so an element's chunk is a function of its column
alone), and RANK_ORDER sums an element of column chunk c in that chunk's ring order
(`ring_order`). At N = 2 every order is the same sum (commutativity). The star, and the ring
on a narrower wire (whose ring rounds each forwarded partial), sum small tensors in rank order,
((x_0 + x_1) + x_2) + ... .
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


def column_bounds(shape: tuple[int, ...], world_size: int) -> list[tuple[int, int]]:
    """The ring all-reduce's chunks of a tensor of `shape`: `chunk_bounds` of its last dimension
    (of one element for a scalar), as [start, end) column ranges shared by every row."""
    return chunk_bounds(shape[-1] if shape else 1, world_size)


def ring_order(chunk: int, world_size: int) -> list[int]:
    """The ranks whose values chunk `chunk`'s sum adds, in order: c+1, c+2, ..., c (mod N)."""
    return [(chunk + k) % world_size for k in range(1, world_size + 1)]


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
