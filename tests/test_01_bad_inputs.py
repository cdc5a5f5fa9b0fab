"""Issue 11, chapter 01: the accounting and workload edges answer with named errors or a defined result."""

import math

import numpy as np
import pytest

from minipaged.accounting import MODEL_PRESETS, capacity, expected_saving, kv_bytes_per_token
from minipaged.workload import MAX_DRAWS, LogNormal, make_workload, poisson_arrivals, prompt_token_ids

pytestmark = pytest.mark.ch01

MODEL = next(iter(MODEL_PRESETS))


def test_capacity_below_one_fixed_reservation_states_no_ratio():
    one_seq = 64 * kv_bytes_per_token(MODEL)
    report = capacity(MODEL, one_seq - 1, 16, 64, "tiny_chat")  # was "paging admits infx"
    assert report.fixed.num_seqs == 0 and math.isnan(report.gain)
    assert "inf" not in str(report) and "nan" not in str(report)
    assert f"paging admits {report.paged.num_seqs}" in str(report)
    assert capacity(MODEL, one_seq, 16, 64, "tiny_chat").fixed.num_seqs == 1


@pytest.mark.parametrize("kwargs, name", [({"num_samples": 0}, "num_samples"), ({"block_size": 0}, "block_size")])
def test_expected_saving_edges_are_named_errors(kwargs, name):
    args = {"preset": "tiny_chat", "block_size": 16, "max_len": 64} | kwargs
    with pytest.raises(ValueError, match=name):
        expected_saving(**args)


def test_an_empty_workload_is_legal():
    assert make_workload(0, 1.0) == []


def test_prompt_token_ids_with_an_empty_vocabulary_is_a_named_error():
    with pytest.raises(ValueError, match="vocab_size"):
        prompt_token_ids(0, 3, 0)


def test_more_than_max_draws_samples_or_requests_is_refused_before_allocating():
    # Was: a NumPy MemoryError after trying to allocate terabytes.
    with pytest.raises(ValueError, match=r"budget_bytes = 1,000,000,000,000,000,000 .* limit of 10,000,000"):
        capacity(MODEL, 10**18, 16, 64, "tiny_chat")
    with pytest.raises(ValueError, match=r"num_requests = 1,000,000,000,000 is more than the limit of 10,000,000"):
        make_workload(10**12, 1.0)
    with pytest.raises(ValueError, match=r"num_samples = 10,000,001 .* limit of 10,000,000"):
        expected_saving("tiny_chat", 16, 64, num_samples=MAX_DRAWS + 1)
    with pytest.raises(ValueError, match=r"\bn = 10,000,001 .* limit"):
        LogNormal(10, 1.0, 1, 100).sample(MAX_DRAWS + 1, np.random.default_rng(0))
    assert len(make_workload(3, 1.0)) == 3


def test_numpy_scalars_are_real_numbers_in_the_workload():
    assert len(poisson_arrivals(3, np.float32(2.0), np.random.default_rng(0))) == 3
    assert LogNormal(np.float32(10), np.float64(0.5), 1, 100).sample(2, np.random.default_rng(0)).shape == (2,)
    with pytest.raises(ValueError, match="median must be > 0"):
        LogNormal(np.float32(0), 1.0, 1, 10)
    with pytest.raises(ValueError, match="rate must be > 0"):
        poisson_arrivals(3, np.float64(0), np.random.default_rng(0))
