"""The row of logits between the executor and the draw (`tandem.engine.logits_process`) against
plain-Python references: logit_bias, the repetition / frequency / presence penalties, min_p,
log-softmax and the top logprobs; property tests of the logprobs; the token mask's place."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from tandem.engine.executor import StepResult
from tandem.engine.logits_process import (
    SequenceSampler,
    TokenHistory,
    log_softmax,
    top_logprobs,
)
from tandem.engine.sampling_params import (
    SamplingError,
    SamplingParams,
    SamplingParamsError,
    draw_probs,
    make_generator,
)

VOCAB = 12
logit_rows = arrays(
    np.float32,
    VOCAB,
    elements=st.floats(-30, 30, width=32, allow_nan=False, allow_infinity=False),
)
token_lists = st.lists(st.integers(0, VOCAB - 1), max_size=20)


def _reference_penalized(row, prompt, output, params):
    """The penalties one token at a time in Python floats, as transformers / llama.cpp (repetition)
    and OpenAI (frequency, presence) define them."""
    x = [float(v) for v in row]
    for t, b in params.logit_bias:
        x[t] += b
    history = list(prompt) + list(output)
    window = history[-params.repetition_window :] if params.repetition_window else history
    for t in set(window):
        x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t in set(output):
        x[t] -= output.count(t) * params.frequency_penalty + params.presence_penalty
    return x


def _sampler(params, prompt, output=()):
    s = SequenceSampler(params, prompt)
    for t in output:
        s.accept(t)
    return s


@settings(max_examples=150, deadline=None)
@given(
    row=logit_rows,
    prompt=token_lists.filter(bool),
    output=token_lists,
    rep=st.floats(0.5, 3.0),
    window=st.integers(0, 8),
    freq=st.floats(-2, 2),
    pres=st.floats(-2, 2),
    bias=st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=4),
)
def test_bias_and_penalties_equal_the_one_token_at_a_time_reference(
    row, prompt, output, rep, window, freq, pres, bias
):
    params = SamplingParams(
        repetition_penalty=rep,
        repetition_window=window,
        frequency_penalty=freq,
        presence_penalty=pres,
        logit_bias=tuple(bias.items()),
    )
    got = _sampler(params, prompt, output).process(row)
    want = _reference_penalized(row, prompt, output, params)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_frequency_and_presence_read_the_output_only_and_repetition_the_prompt_too():
    row = np.array([2.0, -2.0, 1.0, 4.0], dtype=np.float32)
    s = _sampler(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [0, 1], [3, 3])
    assert s.process(row).tolist() == [2.0, -2.0, 1.0, 4.0 - 2 * 0.5 - 0.25]
    s = _sampler(SamplingParams(repetition_penalty=2.0), [0, 1], [3])
    assert s.process(row).tolist() == [1.0, -4.0, 1.0, 2.0]
    s = _sampler(SamplingParams(repetition_penalty=2.0, repetition_window=1), [0, 1], [3])
    assert s.process(row).tolist() == [2.0, -2.0, 1.0, 2.0]  # only the last token


def test_a_row_nothing_changes_is_drawn_from_as_it_came():
    row = np.arange(5, dtype=np.float32)
    assert SequenceSampler(SamplingParams(), [1]).process(row) is row


@settings(max_examples=150, deadline=None)
@given(row=logit_rows, temperature=st.floats(0.1, 2.0), min_p=st.floats(0.0, 1.0))
def test_min_p_keeps_the_tokens_at_least_min_p_times_the_top_ones(row, temperature, min_p):
    probs = draw_probs(row, SamplingParams(temperature=temperature, min_p=min_p))
    # the weights in float32, as the sampler defines them: exp(x / t - the top one), 0 more than
    # ~103 under the top (past float32's range: a probability under 1e-45)
    scaled = np.divide(row, np.float32(temperature), dtype=np.float32)
    w = np.exp(scaled - scaled.max())
    kept = {i for i, p in enumerate(w) if p >= np.float32(min_p) and p > 0}
    assert set(np.flatnonzero(probs).tolist()) == kept
    total = math.fsum(float(w[i]) for i in kept)
    for i in kept:
        assert probs[i] == pytest.approx(float(w[i]) / total, rel=1e-12)
        # and within float32 rounding of the exact softmax: x / t rounded to float32 moves by up
        # to half an ulp of max|x / t|, so each exponent by one ulp, a weight by |s| 2^-23
        # relative, and a ratio of weights by twice that (plus exp's own few ulps)
        exact = [math.exp(float(v) / temperature - float(row.max()) / temperature) for v in row]
        bound = 1e-5 + 2 * float(np.abs(scaled).max()) * 2.0**-23
        assert probs[i] == pytest.approx(exact[i] / math.fsum(exact[j] for j in kept), rel=bound)


def test_min_p_one_leaves_only_the_top_tokens():
    row = np.array([1.0, 3.0, 2.9, 3.0], dtype=np.float32)
    g = make_generator(0)
    params = SamplingParams(temperature=1.5, min_p=1.0)
    assert {
        SequenceSampler(params, [0], generator=g).choose(_logits(row), 0)[0] for _ in range(50)
    } == {1, 3}


@settings(max_examples=200, deadline=None)
@given(row=logit_rows)
def test_log_softmax_equals_the_float64_reference(row):
    lp = log_softmax(row)
    xs = [float(v) for v in row]
    top = max(xs)
    lse = top + math.log(math.fsum(math.exp(v - top) for v in xs))
    np.testing.assert_allclose(lp, [v - lse for v in xs], rtol=0, atol=1e-12)


@settings(max_examples=200, deadline=None)
@given(row=logit_rows, k=st.integers(0, 20))
def test_top_logprobs_are_sorted_normalized_and_the_greedy_token_leads(row, k):
    params = SamplingParams(temperature=0.0, logprobs=k)
    token, lps = SequenceSampler(params, [0]).choose(_logits(row), 0)
    assert token == int(np.argmax(row))
    assert lps is not None and lps.token == token
    assert len(lps.top) == min(k, VOCAB)
    values = [v for _, v in lps.top]
    assert values == sorted(values, reverse=True)
    assert math.fsum(math.exp(v) for v in values) <= 1.0 + 1e-12
    if k:
        assert lps.top[0] == (token, lps.logprob)
    assert lps.logprob == float(log_softmax(row)[token])


def test_top_logprob_ties_go_to_the_lower_id():
    x = np.array([0.0, 1.0, 1.0, 1.0, 0.5])
    lp = log_softmax(x)
    assert [i for i, _ in top_logprobs(x, lp, 2)] == [1, 2]
    assert [i for i, _ in top_logprobs(x, lp, 4)] == [1, 2, 3, 4]


def test_logits_a_hair_apart_rank_by_the_logit_though_their_logprobs_round_equal():
    x = np.array([0.0, 1e-45, 0.0], dtype=np.float32)  # found by Hypothesis
    lp = log_softmax(x)
    assert lp[0] == lp[1]
    assert [i for i, _ in top_logprobs(x, lp, 2)] == [1, 0] and int(np.argmax(x)) == 1


@settings(max_examples=100, deadline=None)
@given(row=logit_rows, seed=st.integers(0, 2**32), temperature=st.floats(0.2, 2.0))
def test_logprobs_are_taken_before_the_temperature_and_do_not_change_the_draw(
    row, seed, temperature
):
    plain = SamplingParams(temperature=temperature, seed=seed)
    logged = SamplingParams(temperature=temperature, seed=seed, logprobs=3)
    a, _ = SequenceSampler(plain, [0]).choose(_logits(row), 0)
    b, lps = SequenceSampler(logged, [0]).choose(_logits(row), 0)
    assert a == b and lps is not None
    assert lps.logprob == float(log_softmax(row)[b])  # the temperature is not in them


def test_logprobs_are_read_after_the_bias_and_the_penalties():
    row = np.array([0.0, 1.0, 2.0], dtype=np.float32)
    params = SamplingParams(
        temperature=0.0, logprobs=3, logit_bias=((0, 5.0),), presence_penalty=1.0
    )
    s = _sampler(params, [1], [2])
    token, lps = s.choose(_logits(row), 0)
    x = np.array([5.0, 1.0, 1.0])
    assert token == 0 and lps.logprob == float(log_softmax(x)[0])


def test_a_bias_of_100_forces_a_token_and_minus_100_removes_the_greedy_one():
    row = np.array([0.0, 9.0, 8.5, 3.0], dtype=np.float32)
    greedy = SamplingParams(temperature=0.0)
    assert SequenceSampler(greedy, [0]).choose(_logits(row), 0)[0] == 1
    down = SamplingParams(temperature=0.0, logit_bias=((1, -100.0),))
    assert SequenceSampler(down, [0]).choose(_logits(row), 0)[0] == 2
    up = SamplingParams(temperature=1.0, seed=1, logit_bias=((3, 100.0),))
    s = SequenceSampler(up, [0])
    assert {s.choose(_logits(row), 0)[0] for _ in range(30)} == {3}


class OnlyMask:
    """A token mask allowing one token per step, from a script; records what it was told."""

    def __init__(self, script):
        self.script = list(script)
        self.told = []

    def allowed(self):
        keep = np.zeros(VOCAB - 2, dtype=bool)  # shorter than the row: the last two never
        keep[self.script[len(self.told)]] = True
        return keep

    def advance(self, token):
        self.told.append(token)


def test_a_token_mask_applies_before_the_bias_and_is_told_each_choice():
    row = np.zeros(VOCAB, dtype=np.float32)
    row[VOCAB - 1] = 50.0  # outside the mask's length
    mask = OnlyMask([4, 7, 2])
    params = SamplingParams(temperature=0.8, seed=0, logit_bias=((5, 100.0),), logprobs=1)
    s = SequenceSampler(params, [0], mask)
    assert s.needs_logits
    got = [s.choose(_logits(row), 0) for _ in range(3)]
    assert [t for t, _ in got] == [4, 7, 2] == mask.told
    assert all(lp.logprob == 0.0 for _, lp in got)  # the only token allowed


def test_a_mask_that_allows_nothing_fails_the_choice():
    class Nothing(OnlyMask):
        def allowed(self):
            return np.zeros(VOCAB, dtype=bool)

    with pytest.raises(SamplingError, match="allows no token"):
        SequenceSampler(SamplingParams(), [0], Nothing([])).choose(_logits(np.zeros(VOCAB)), 0)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), density=st.sampled_from([0.01, 0.1, 0.5, 0.99, 1.0]),
       short=st.integers(0, 3))  # fmt: skip
def test_a_mask_sets_minus_inf_exactly_where_it_disallows_sparse_or_dense(seed, density, short):
    # the sparse (write the few allowed) and dense (copy, overwrite the rest) paths alike: the
    # row as float64, -inf outside the mask and past its end
    rng = np.random.default_rng(seed)
    n = 400
    row = rng.standard_normal(n).astype(np.float32)
    keep = rng.random(n - short) < density
    keep[rng.integers(0, n - short)] = True

    class Fixed(OnlyMask):
        def allowed(self):
            return keep

    got = SequenceSampler(SamplingParams(temperature=1.0), [0], Fixed([])).process(row)
    want = row.astype(np.float64)
    want[np.flatnonzero(~np.concatenate([keep, np.zeros(short, bool)]))] = -np.inf
    assert got.dtype == np.float64 and np.array_equal(got, want)


@settings(max_examples=200, deadline=None)
@given(row=arrays(np.float32, VOCAB, elements=st.sampled_from([-np.inf, -1.0, 0.0, 7.0, np.nan])),
       keep=arrays(np.bool_, st.integers(1, VOCAB)))  # fmt: skip
def test_a_masked_greedy_choice_is_the_argmax_of_the_masked_row(row, keep):
    # few distinct values: ties everywhere, -inf and NaN, a mask shorter than the row; the
    # quick read of an allowed argmax and the masked copy's argmax give one token, or one error
    class Fixed(OnlyMask):
        def allowed(self):
            return keep

    def choose(sampler):
        try:
            return sampler.choose(_logits(row), 0)[0]
        except SamplingError as e:
            return type(e)

    greedy = SequenceSampler(SamplingParams(temperature=0), [0], Fixed([]))
    masked = row.astype(np.float64)
    masked[np.flatnonzero(~np.concatenate([keep, np.zeros(VOCAB - len(keep), bool)]))] = -np.inf
    want = int(np.argmax(masked)) if keep.any() else SamplingError
    assert choose(greedy) == want


def test_greedy_ids_are_refused_for_a_row_that_needs_its_logits():
    ids = StepResult(token_ids=np.array([3]))
    assert SequenceSampler(SamplingParams(temperature=0.0), [0]).choose(ids, 0) == (3, None)
    for params in (
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=0.0, presence_penalty=0.5),
        SamplingParams(temperature=0.0, logit_bias=((1, 1.0),)),
        SamplingParams(temperature=0.7),
    ):
        with pytest.raises(SamplingError):
            SequenceSampler(params, [0]).choose(ids, 0)


def test_the_choices_of_one_seed_are_distinct_streams_and_choice_0_is_the_seed_s_own():
    firsts = [make_generator(7, c).random() for c in range(4)]
    assert len(set(firsts)) == 4
    assert firsts[0] == make_generator(7).random()
    assert make_generator(7, 2).random() == firsts[2]  # reproducible


def test_history_counts_the_output_and_windows_prompt_plus_output():
    h = TokenHistory([1, 2, 2])
    for t in (3, 3, 1):
        h.append(t)
    ids, counts = h.output_counts()
    assert dict(zip(ids.tolist(), counts.tolist())) == {3: 2, 1: 1}
    assert h.recent_ids(2).tolist() == [1, 3] and h.recent_ids(0).tolist() == [1, 2, 3]


@pytest.mark.parametrize(
    "field,value",
    [
        ("frequency_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("presence_penalty", float("nan")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 101.0),
        ("min_p", 1.5),
        ("min_p", float("nan")),
        ("logprobs", 21),
        ("logit_bias", ((1, 100.5),)),
        ("logit_bias", ((-1, 1.0),)),
    ],
)
def test_out_of_range_controls_are_refused_naming_the_field(field, value):
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**{field: value})


def _logits(row):
    return StepResult(logits=np.asarray(row, dtype=np.float32)[None, :])
