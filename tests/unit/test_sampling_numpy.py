"""`sample_next` on numpy: greedy ties, temperature, top_k, top_p, seeded reproducibility, and the
same token from a numpy row and a torch tensor row."""

import numpy as np
import pytest
import torch

from tandem.engine.sampling_params import (
    SEED_RANGE,
    SamplingError,
    SamplingParams,
    make_generator,
    numpy_seed,
    sample_next,
)

ROW = np.array([1.0, 3.0, 2.5, -1.0, 3.0, 0.0], dtype=np.float32)


def _draws(row, n=400, seed=0, **params) -> list[int]:
    g = make_generator(seed)
    p = SamplingParams(**params)
    return [sample_next(row, p, g) for _ in range(n)]


def test_greedy_takes_the_argmax_ties_to_the_lowest_id() -> None:
    g = make_generator(0)
    assert sample_next(ROW, SamplingParams(temperature=0.0), g) == 1
    assert sample_next(ROW, SamplingParams(temperature=1e-9), g) == 1
    assert sample_next(np.zeros(5, dtype=np.float32), SamplingParams(temperature=0.0), g) == 0


def test_a_0_d_integer_is_a_token_already_chosen() -> None:
    g = make_generator(0)
    assert sample_next(np.int64(7), SamplingParams(), g) == 7
    assert sample_next(np.array(7), SamplingParams(), g) == 7
    assert sample_next(torch.tensor(7), SamplingParams(), g) == 7


def test_the_same_seed_and_logits_draw_the_same_tokens() -> None:
    params = dict(temperature=0.9, top_k=4, top_p=0.95)
    assert _draws(ROW, seed=42, **params) == _draws(ROW, seed=42, **params)
    assert _draws(ROW, seed=42, **params) != _draws(ROW, seed=43, **params)


def test_every_seed_of_the_range_maps_to_its_own_numpy_seed() -> None:
    lo, hi = SEED_RANGE
    seeds = [lo, lo + 1, -1, 0, 1, (1 << 63) - 1, 1 << 63, hi]
    mapped = [numpy_seed(s) for s in seeds]
    assert len(set(mapped)) == len(seeds) and min(mapped) >= 0
    first = [make_generator(s).random() for s in (-1, hi)]
    assert first[0] != first[1]  # -1 and 2**64 - 1 are different streams


def test_top_k_keeps_the_logits_at_or_above_the_kth() -> None:
    # the two 3.0s tie for the top: top_k=1 keeps both; top_k=3 adds 2.5 only
    assert set(_draws(ROW, top_k=1)) == {1, 4}
    assert set(_draws(ROW, top_k=3)) == {1, 2, 4}


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass() -> None:
    row = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    assert set(_draws(row, top_p=0.5)) == {0}  # the top token alone reaches 0.5
    assert set(_draws(row, top_p=0.7)) == {0, 1}
    assert set(_draws(row, top_p=0.85)) == {0, 1, 2}
    assert set(_draws(row, top_p=0.01)) == {0}  # always at least the top token


def test_temperature_sharpens_and_flattens() -> None:
    row = np.array([0.0, 1.0], dtype=np.float32)
    cold = _draws(row, n=2000, temperature=0.1)
    hot = _draws(row, n=2000, temperature=10.0)
    assert cold.count(1) / 2000 > 0.99
    assert 0.4 < hot.count(1) / 2000 < 0.6
    warm = _draws(row, n=4000, temperature=1.0)  # p(1) = e / (1 + e) = 0.731
    assert abs(warm.count(1) / 4000 - 0.731) < 0.03


def test_a_torch_row_and_a_numpy_row_draw_the_same_token() -> None:
    rng = np.random.default_rng(0)
    row = rng.standard_normal(1000).astype(np.float32)
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9)
    for seed in range(20):
        a = sample_next(row, params, make_generator(seed))
        b = sample_next(torch.from_numpy(row.copy()), params, make_generator(seed))
        assert a == b


def test_a_bfloat16_tensor_row_is_read_as_float32() -> None:
    row = torch.tensor([0.0, 4.0, 1.0]).bfloat16()
    assert sample_next(row, SamplingParams(temperature=0.0), make_generator(0)) == 1
    assert sample_next(row, SamplingParams(temperature=0.5), make_generator(0)) in (0, 1, 2)


def test_sampling_never_draws_a_token_of_zero_mass() -> None:
    row = np.full(64, -np.inf, dtype=np.float32)
    row[[5, 9]] = 0.0
    assert set(_draws(row, n=500)) == {5, 9}


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_logits_no_token_can_be_drawn_from_raise_a_typed_error(bad: float) -> None:
    row = ROW.copy()
    row[2] = bad
    with pytest.raises(SamplingError):
        sample_next(row, SamplingParams(temperature=1.0), make_generator(0))
    with pytest.raises(SamplingError):
        sample_next(np.full(4, -np.inf, dtype=np.float32), SamplingParams(), make_generator(0))


def _top_p_by_full_sort(w: np.ndarray, mass: float) -> np.ndarray:
    order = np.argsort(-w, kind="stable")
    sorted_w = w[order].astype(np.float64)
    return np.sort(order[np.cumsum(sorted_w) - sorted_w < mass])


# 2.0: no weight reaches it (the top's is 1)
@pytest.mark.parametrize("floors", [(1e-3, 1e-5, 1e-7), (0.3,), (2.0,), (0.5, 0.05, 2e-3)])
def test_top_p_over_the_largest_candidates_equals_a_full_sort(monkeypatch, floors) -> None:
    from tandem.engine import sampling_params

    monkeypatch.setattr(sampling_params, "TOP_P_CANDIDATES", (16, 256))
    monkeypatch.setattr(sampling_params, "TOP_P_FLOORS", floors)
    rng = np.random.default_rng(1)
    for trial in range(200):
        n = int(rng.integers(2, 3000))
        x = rng.standard_normal(n) * rng.uniform(0.1, 20)
        if trial % 3 == 0:
            x = np.round(x)  # ties, also at the candidates' cut
        if trial % 5 == 0:
            x[rng.random(n) < 0.5] = -np.inf  # zero mass (what top_k leaves)
        w = np.exp(x - x.max()).astype(np.float32)
        mass = float(rng.uniform(0.01, 0.999)) * float(w.sum(dtype=np.float64))
        got = sampling_params._top_p_ids(w, mass)
        assert np.array_equal(got, _top_p_by_full_sort(w, mass)), trial
