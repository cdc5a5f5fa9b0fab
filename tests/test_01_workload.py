"""Chapter 01: workloads (length distributions, presets, Poisson arrivals, request specs)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged import workload as wl

pytestmark = pytest.mark.ch01

bounds_st = st.tuples(st.integers(1, 3000), st.integers(0, 3000)).map(lambda t: (t[0], t[0] + t[1]))


def _dists(low, high):
    return [
        wl.LogNormal(100.0, 1.0, low, high),
        wl.Pareto(32.0, 1.1, low, high),
        wl.Uniform(low, high),
        wl.Geometric(50.0, low, high),
    ]


# ---------------------------------------------------------------- length distributions


@settings(max_examples=40, deadline=None)
@given(bounds=bounds_st, n=st.integers(0, 300), seed=st.integers(0, 2**32))
def test_samples_are_int64_and_clipped_to_bounds(bounds, n, seed):
    low, high = bounds
    for dist in [*_dists(low, high), wl.Constant(low)]:
        s = dist.sample(n, np.random.default_rng(seed))
        assert s.dtype == np.int64 and s.shape == (n,)
        assert ((s >= dist.low) & (s <= dist.high)).all()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32), name=st.sampled_from(sorted(wl.LENGTH_PRESETS)))
def test_samples_are_deterministic_per_seed(seed, name):
    p = wl.LENGTH_PRESETS[name]
    a = p.prompt_len.sample(50, np.random.default_rng(seed))
    b = p.prompt_len.sample(50, np.random.default_rng(seed))
    np.testing.assert_array_equal(a, b)


def test_shapes_have_their_stated_centre():
    rng = np.random.default_rng(0)
    n = 200_000
    assert np.median(wl.LogNormal(300.0, 0.9, 1, 10**9).sample(n, rng)) == pytest.approx(300, rel=0.02)
    assert wl.Geometric(96.0, 1, 10**9).sample(n, rng).mean() == pytest.approx(96, rel=0.02)
    assert wl.Uniform(10, 20).sample(n, rng).mean() == pytest.approx(15, rel=0.01)
    assert wl.Pareto(64.0, 1.5, 1, 10**9).sample(n, rng).min() == 64  # Pareto's minimum is its scale
    assert (wl.Constant(7).sample(5, rng) == 7).all()


def test_clipping_piles_the_tail_on_high():
    s = wl.LogNormal(100.0, 2.0, 1, 128).sample(10_000, np.random.default_rng(1))
    assert s.max() == 128 and (s == 128).mean() > 0.3


@pytest.mark.parametrize("make, exc, match", [
    (lambda: wl.LogNormal(0, 1.0, 1, 10), ValueError, "median"),
    (lambda: wl.LogNormal(10, -1.0, 1, 10), ValueError, "sigma"),
    (lambda: wl.LogNormal("10", 1.0, 1, 10), TypeError, "median"),
    (lambda: wl.Pareto(10, 0, 1, 10), ValueError, "alpha"),
    (lambda: wl.Uniform(5, 4), ValueError, "low"),
    (lambda: wl.Uniform(0, 4), ValueError, "low"),
    (lambda: wl.Uniform(1.0, 4), TypeError, "low"),
    (lambda: wl.Geometric(0.5, 1, 10), ValueError, "mean"),
    (lambda: wl.Constant(True), TypeError, "value"),
    (lambda: wl.WorkloadPreset("x", [1, 2], wl.Constant(1)), TypeError, "prompt_len"),
])
def test_bad_distribution_arguments_name_the_argument(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_sample_checks_its_arguments():
    d = wl.Uniform(1, 10)
    with pytest.raises(TypeError, match="rng"):
        d.sample(3, 0)
    with pytest.raises(TypeError, match="n"):
        d.sample(2.0, np.random.default_rng(0))
    with pytest.raises(ValueError, match="n"):
        d.sample(-1, np.random.default_rng(0))


# ---------------------------------------------------------------- presets


def test_presets_have_one_meaning_per_name():
    assert {"chat", "long_tail", "uniform", "tiny_chat", "tiny_long_tail"} <= set(wl.LENGTH_PRESETS)
    assert all(name == p.name for name, p in wl.LENGTH_PRESETS.items())
    tiny = wl.LENGTH_PRESETS["tiny_chat"]
    assert tiny.prompt_len == wl.LogNormal(48, 0.6, 4, 192) and tiny.output_len == wl.LogNormal(32, 0.6, 2, 128)
    tail = wl.LENGTH_PRESETS["tiny_long_tail"]
    assert tail.prompt_len == wl.LogNormal(32, 1.2, 4, 384) and tail.output_len == wl.LogNormal(24, 1.2, 2, 256)


def test_sequence_lengths_are_prompt_plus_output_as_make_workload_draws_them():
    p = wl.LENGTH_PRESETS["chat"]
    seq = p.sequence_lengths(20, np.random.default_rng(4))
    rng = np.random.default_rng(4)
    np.testing.assert_array_equal(seq, p.prompt_len.sample(20, rng) + p.output_len.sample(20, rng))


# ---------------------------------------------------------------- arrivals and workloads


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 200), rate=st.floats(0.01, 1000), seed=st.integers(0, 2**32))
def test_arrivals_start_at_zero_and_never_decrease(n, rate, seed):
    t = wl.poisson_arrivals(n, rate, np.random.default_rng(seed))
    assert t.shape == (n,)
    if n:
        assert t[0] == 0.0 and (np.diff(t) >= 0).all()


def test_arrival_gaps_have_mean_one_over_rate():
    t = wl.poisson_arrivals(20_000, 20.0, np.random.default_rng(0))
    assert np.diff(t).mean() == pytest.approx(1 / 20.0, rel=0.03)


@pytest.mark.parametrize("rate, exc", [(0, ValueError), (-1.0, ValueError), (float("nan"), ValueError),
                                       ("1", TypeError), (True, TypeError)])
def test_bad_rate(rate, exc):
    with pytest.raises(exc, match="rate"):
        wl.poisson_arrivals(3, rate, np.random.default_rng(0))


@settings(max_examples=20, deadline=None)
@given(n=st.integers(0, 60), seed=st.integers(0, 2**32), name=st.sampled_from(sorted(wl.LENGTH_PRESETS)))
def test_make_workload_is_deterministic_and_within_the_preset(n, seed, name):
    w = wl.make_workload(n, 5.0, name, seed=seed)
    assert w == wl.make_workload(n, 5.0, wl.LENGTH_PRESETS[name], seed=seed)
    p = wl.LENGTH_PRESETS[name]
    assert len(w) == n and all(isinstance(r, wl.RequestSpec) for r in w)
    assert all(p.prompt_len.low <= r.num_prompt_tokens <= p.prompt_len.high for r in w)
    assert all(p.output_len.low <= r.num_output_tokens <= p.output_len.high for r in w)
    times = [r.arrival_time for r in w]
    assert times == sorted(times)


def test_infinite_rate_is_an_offline_batch_with_the_same_lengths():
    offline = wl.make_workload(6, math.inf, seed=2)
    online = wl.make_workload(6, 3.0, seed=2)
    assert all(r.arrival_time == 0.0 for r in offline)
    lengths = [[(r.num_prompt_tokens, r.num_output_tokens) for r in w] for w in (offline, online)]
    assert lengths[0] == lengths[1]


def test_make_workload_rejects_unknown_presets_and_bad_seeds():
    with pytest.raises(ValueError, match="preset"):
        wl.make_workload(3, 1.0, preset="nope")
    with pytest.raises(TypeError, match="preset"):
        wl.make_workload(3, 1.0, preset=3)
    with pytest.raises(TypeError, match="seed"):
        wl.make_workload(3, 1.0, seed=1.5)
    with pytest.raises(ValueError, match="num_requests"):
        wl.make_workload(-1, 1.0)


def test_request_spec_is_immutable_and_checked():
    r = wl.RequestSpec(0.5, np.int64(3), 4)
    assert type(r.num_prompt_tokens) is int
    with pytest.raises(AttributeError):
        r.num_prompt_tokens = 5
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        wl.RequestSpec(0.0, 0, 4)
    with pytest.raises(TypeError, match="num_output_tokens"):
        wl.RequestSpec(0.0, 3, 4.0)
    with pytest.raises(ValueError, match="arrival_time"):
        wl.RequestSpec(-1.0, 3, 4)
    with pytest.raises(ValueError, match="arrival_time"):
        wl.RequestSpec(math.inf, 3, 4)


def test_prompt_token_ids_are_seeded_per_request():
    a = wl.prompt_token_ids(3, 20, vocab_size=50, seed=1)
    assert a == wl.prompt_token_ids(3, 20, vocab_size=50, seed=1)
    assert a != wl.prompt_token_ids(4, 20, vocab_size=50, seed=1)
    assert a != wl.prompt_token_ids(3, 20, vocab_size=50, seed=2)
    assert len(a) == 20 and all(type(x) is int and 0 <= x < 50 for x in a)
    with pytest.raises(ValueError, match="vocab_size"):
        wl.prompt_token_ids(0, 3, vocab_size=0)
