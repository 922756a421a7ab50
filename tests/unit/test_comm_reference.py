"""The in-process oracle and the world-size-1 backend: sums, identities and fail-closed validation."""

from __future__ import annotations

import pytest
import torch

from tandem.comm import algorithms as alg
from tandem.comm import base, reference
from tandem.comm.reference import ReferenceCommunicator, run_ranks
from tandem.comm.solo import SoloCommunicator


def _inputs(n_ranks: int, shape: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) * (10.0 ** (r % 3)) for r in range(n_ranks)]


@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize("algorithm", [alg.RANK_ORDER, alg.RING])
def test_reference_all_reduce_is_the_sum_on_every_rank(world: int, algorithm: str) -> None:
    xs = _inputs(world, (7, 13))
    outs = reference.all_reduce_sum(xs, algorithm=algorithm)
    exact = torch.stack([x.double() for x in xs]).sum(0)
    for out in outs:
        assert torch.equal(out, outs[0])
        torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-4)


def test_reference_orders_are_distinct_algorithms() -> None:
    # Non-associative float sums: the two orders must be mirrored separately, not interchanged.
    xs = [
        torch.tensor([1e8, 0.0, 0.0]),
        torch.tensor([-1e8, 0.0, 0.0]),
        torch.tensor([1.0, 0.0, 0.0]),
    ]
    by_rank = reference.all_reduce_sum(xs, algorithm=alg.RANK_ORDER)[0]
    by_ring = reference.all_reduce_sum(xs, algorithm=alg.RING)[0]
    # element 0 is chunk 0: rank order (1e8 - 1e8) + 1 = 1; ring order (-1e8 + 1) + 1e8 = 0
    assert by_rank[0] == 1.0 and by_ring[0] == 0.0


def test_reference_picks_algorithm_by_size_like_the_ring() -> None:
    assert alg.choose_all_reduce(4096, 3, alg.DEFAULT_SMALL_MAX_BYTES) == alg.RANK_ORDER
    assert alg.choose_all_reduce(1 << 20, 3, alg.DEFAULT_SMALL_MAX_BYTES) == alg.RING


@pytest.mark.parametrize("n", [0, 1, 2, 5, 7, 16])
@pytest.mark.parametrize("world", [2, 3, 5])
def test_chunk_bounds_tile_the_tensor_half_open(n: int, world: int) -> None:
    b = alg.chunk_bounds(n, world)
    assert b[0][0] == 0 and b[-1][1] == n and len(b) == world
    assert all(b[i][1] == b[i + 1][0] for i in range(world - 1))
    assert max(e - s for s, e in b) - min(e - s for s, e in b) <= 1


@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize("small_max_bytes", [0, 1 << 30])
def test_reference_all_reduce_equals_all_gather_of_reduce_scatter(
    world: int, small_max_bytes: int
) -> None:
    # 1-D: the all-reduce's column chunks are the reduce-scatter's parts (`algorithms`)
    comms = ReferenceCommunicator.group(world, small_max_bytes=small_max_bytes)
    xs = _inputs(world, (world * 3 * 5,), seed=1)

    def body(c: ReferenceCommunicator) -> tuple[torch.Tensor, torch.Tensor]:
        x = xs[c.rank]
        return c.all_reduce_sum(x), c.all_gather(c.reduce_scatter(x, 0), 0)

    for full, composed in run_ranks(comms, body):
        assert torch.equal(full, composed)


@pytest.mark.parametrize("world", [2, 3, 5])
def test_reference_all_to_all_twice_is_identity(world: int) -> None:
    comms = ReferenceCommunicator.group(world)
    parts = [[torch.randn(r + 1, j + 2) for j in range(world)] for r in range(world)]

    def body(c: ReferenceCommunicator) -> list[torch.Tensor]:
        return c.all_to_all(c.all_to_all(parts[c.rank]))

    for r, back in enumerate(run_ranks(comms, body)):
        assert all(torch.equal(a, b) for a, b in zip(back, parts[r]))


def test_reference_broadcast_and_gather_carry_integer_ids_exactly() -> None:
    comms = ReferenceCommunicator.group(3)
    ids = [torch.tensor([2**40 + r, 7]) for r in range(3)]
    outs = run_ranks(comms, lambda c: (c.broadcast(ids[c.rank], 2), c.all_gather(ids[c.rank])))
    for b, g in outs:
        assert torch.equal(b, ids[2]) and torch.equal(g, torch.cat(ids))


def test_f16_rank_and_bf16_rank_sum_through_the_float32_wire() -> None:
    a = torch.tensor([1.5, -2.25, 1000.0], dtype=torch.float16)
    b = torch.tensor([0.5, 3.0, 24.0], dtype=torch.bfloat16)
    out_a, out_b = reference.all_reduce_sum([a, b])
    assert out_a.dtype == torch.float16 and out_b.dtype == torch.bfloat16
    assert out_a.float().tolist() == [2.0, 0.75, 1024.0] == out_b.float().tolist()


def test_validation_refuses_unsupported_dtype() -> None:
    for comm in [SoloCommunicator(), ReferenceCommunicator.group(2)[0]]:
        with pytest.raises(base.UnsupportedDtypeError, match="float64"):
            comm.all_reduce_sum(torch.zeros(3, dtype=torch.float64))
        with pytest.raises(base.UnsupportedDtypeError, match="int64"):
            comm.all_reduce_sum(torch.zeros(3, dtype=torch.int64))
        with pytest.raises(base.UnsupportedDtypeError):
            comm.all_reduce_sum([1.0, 2.0])  # type: ignore[arg-type]


def test_validation_refuses_indivisible_reduce_scatter() -> None:
    comm = ReferenceCommunicator.group(3)[0]
    with pytest.raises(base.IndivisibleError, match="size 4"):
        comm.reduce_scatter(torch.zeros(4, 2), 0)


def test_validation_refuses_ragged_parts() -> None:
    with pytest.raises(base.RaggedPartsError, match="rank 1"):
        reference.all_reduce_sum([torch.zeros(2, 3), torch.zeros(2, 4)])
    with pytest.raises(base.RaggedPartsError, match="only along dim 0"):
        reference.all_gather([torch.zeros(2, 3), torch.zeros(2, 4)], 0)
    assert reference.all_gather([torch.zeros(2, 3), torch.ones(4, 3)], 0)[0].shape == (6, 3)
    comm = ReferenceCommunicator.group(2)[0]
    with pytest.raises(base.RaggedPartsError, match="one part per rank"):
        comm.all_to_all([torch.zeros(1)])
    with pytest.raises(base.RaggedPartsError, match="dtype"):
        comm.all_to_all([torch.zeros(1), torch.zeros(1, dtype=torch.float16)])


def test_reference_detects_op_desync() -> None:
    comms = ReferenceCommunicator.group(2)

    def body(c: ReferenceCommunicator) -> None:
        x = torch.zeros(4)
        c.all_reduce_sum(x) if c.rank == 0 else c.all_gather(x)

    with pytest.raises(base.OpDesyncError, match="all_gather"):
        run_ranks(comms, body)


def test_reference_times_out_when_a_rank_never_arrives() -> None:
    c0, _ = ReferenceCommunicator.group(2, timeout=0.2)
    with pytest.raises(base.CommTimeoutError):
        c0.all_reduce_sum(torch.zeros(2))


def test_solo_is_the_identity() -> None:
    s = SoloCommunicator()
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    assert (s.rank, s.world_size) == (0, 1)
    assert s.all_reduce_sum(x) is x and s.all_gather(x, 1) is x and s.reduce_scatter(x, 1) is x
    assert s.broadcast(x, 0) is x and s.all_to_all([x])[0] is x
    assert isinstance(s, base.Communicator) and isinstance(
        ReferenceCommunicator.group(1)[0], base.Communicator
    )


@pytest.mark.parametrize("world", [3, 5])
def test_the_rings_all_reduce_gives_a_row_the_same_bits_among_any_rows(world: int) -> None:
    # 700 rows of 96 float32 columns cross the small cut-over (RING) where one row does not
    # (RANK_ORDER): both sum an element in its column chunk's ring order
    xs = _inputs(world, (700, 96))
    whole = reference.all_reduce_sum(xs)[0]
    assert 700 * 96 * 4 > alg.DEFAULT_SMALL_MAX_BYTES >= 96 * 4
    for k in (0, 1, 350, 699):
        row = reference.all_reduce_sum([x[k : k + 1].clone() for x in xs])[0]
        assert torch.equal(whole[k : k + 1], row), k
