"""Issue 11, chapter 01: the accounting and workload edges answer with named errors or a defined result."""

import math

import pytest

from minipaged.accounting import MODEL_PRESETS, capacity, expected_saving, kv_bytes_per_token
from minipaged.workload import make_workload, prompt_token_ids

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
