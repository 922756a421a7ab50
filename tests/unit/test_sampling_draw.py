"""The draw of `sampling_params.sample_row` against its definition written the long way: the
weights of every id of the vocabulary (the float32 softmax of the row over the temperature, top_k,
min_p, then top_p by a full stable sort over float64 running sums), one float64 running sum over
the whole vocabulary and one uniform number. The kept-ids form (`_kept`, `_draw`: the softmax over
top_k's ids only, the draw by blocks of ids) must give the same float32 weights bit for bit, the
same probabilities up to the float64 rounding of their total, and the same id, with the generator
left in the same state."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.engine.sampling_params import SamplingParams, draw_probs, make_generator, sample_row


def _long_way_probs(row: np.ndarray, p: SamplingParams) -> np.ndarray:
    scaled = np.divide(row, np.float32(p.temperature), dtype=np.float32)
    n = len(scaled)
    if 0 < p.top_k < n:
        kth = np.sort(scaled)[n - p.top_k]
        scaled[scaled < kth] = -np.inf
    w = np.exp(scaled - scaled.max())  # float32
    if p.min_p > 0.0:
        w[w < np.float32(p.min_p)] = 0.0
    probs = w.astype(np.float64)
    total = probs.sum()
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        sorted_p = probs[order]
        keep = np.cumsum(sorted_p) - sorted_p < p.top_p * total
        out = np.zeros_like(probs)
        out[order[keep]] = sorted_p[keep]
        probs = out
    return probs / total


def _long_way_draw(probs: np.ndarray, g: np.random.Generator) -> int:
    cdf = np.cumsum(probs)
    i = int(np.searchsorted(cdf, g.random() * cdf[-1], side="right"))
    return i if i < len(probs) else int(np.flatnonzero(probs)[-1])


def _rows(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    peaked = (rng.standard_normal(n) * 4).astype(np.float32)
    peaked[rng.integers(0, n, 3)] += 25.0  # a few dominant tokens, as a trained model gives
    flat = (rng.standard_normal(n) * 0.5).astype(np.float32)  # top_p needs many candidates
    ties = np.round(rng.standard_normal(n)).astype(np.float32)  # many exact ties
    return [peaked, flat, ties]


@pytest.mark.parametrize("n", [50, 2000, 49152])
@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k", "min_p"),
    [(0.8, 0.95, 0, 0.0), (1.0, 1.0, 0, 0.0), (0.7, 0.5, 40, 0.0), (1.3, 0.9, 0, 0.05),
     (0.8, 0.999, 0, 0.0), (2.0, 0.2, 5000, 0.0)],
)  # fmt: skip
def test_the_kept_ids_draw_is_the_whole_vocabularys_draw(n, temperature, top_p, top_k, min_p):
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    rng = np.random.default_rng(n)
    for row in _rows(rng, n):
        want = _long_way_probs(row, params)
        got = draw_probs(row, params)
        assert np.array_equal(np.flatnonzero(got), np.flatnonzero(want))
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=0)
        a, b = make_generator(11), make_generator(11)
        for _ in range(20):
            assert sample_row(row, params, a) == _long_way_draw(want, b)
        assert a.random() == b.random()
