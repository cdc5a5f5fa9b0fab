"""The chapter 07 exercise checks pass the reference answers and catch the classic planning and sizing mistakes.

Each wrong implementation below is one mistake; the check must FAIL on it.
"""

import math

import pytest

from minipaged.accounting import kv_bytes_per_token
from minipaged.checks import FAIL, PASS, TODO, ch07

pytestmark = pytest.mark.ch07


# -- Task 7.1 ---------------------------------------------------------------------


def kv_blocks(model, gpu_bytes, util, weights, activations, non_torch, kv_dtype, block_size):
    budget = math.floor(gpu_bytes * util) - weights - activations - non_torch
    return max(budget // (block_size * kv_bytes_per_token(model, kv_dtype)), 0)


def fraction_of_what_is_left(model, gpu_bytes, util, weights, activations, non_torch, kv_dtype, block_size):
    budget = math.floor((gpu_bytes - weights - activations - non_torch) * util)
    return max(budget // (block_size * kv_bytes_per_token(model, kv_dtype)), 0)


def forgets_activations(model, gpu_bytes, util, weights, activations, non_torch, kv_dtype, block_size):
    budget = math.floor(gpu_bytes * util) - weights - non_torch
    return max(budget // (block_size * kv_bytes_per_token(model, kv_dtype)), 0)


def forgets_non_torch(model, gpu_bytes, util, weights, activations, non_torch, kv_dtype, block_size):
    budget = math.floor(gpu_bytes * util) - weights - activations
    return max(budget // (block_size * kv_bytes_per_token(model, kv_dtype)), 0)


def model_dtype_for_kv(model, gpu_bytes, util, weights, activations, non_torch, kv_dtype, block_size):
    budget = math.floor(gpu_bytes * util) - weights - activations - non_torch
    return max(budget // (block_size * kv_bytes_per_token(model)), 0)


def rounds_up(model, gpu_bytes, util, weights, activations, non_torch, kv_dtype, block_size):
    budget = math.floor(gpu_bytes * util) - weights - activations - non_torch
    return max(-(-budget // (block_size * kv_bytes_per_token(model, kv_dtype))), 0)


def negative_blocks(model, gpu_bytes, util, weights, activations, non_torch, kv_dtype, block_size):
    budget = math.floor(gpu_bytes * util) - weights - activations - non_torch
    return budget // (block_size * kv_bytes_per_token(model, kv_dtype))


def tokens_not_blocks(model, gpu_bytes, util, weights, activations, non_torch, kv_dtype, block_size):
    budget = math.floor(gpu_bytes * util) - weights - activations - non_torch
    return max(budget // kv_bytes_per_token(model, kv_dtype), 0)


def test_kv_blocks_reference_passes():
    assert ch07.check_kv_blocks(kv_blocks).status == PASS


@pytest.mark.parametrize("wrong", [fraction_of_what_is_left, forgets_activations, forgets_non_torch,
                                   model_dtype_for_kv, rounds_up, negative_blocks, tokens_not_blocks])
def test_kv_blocks_catches(wrong):
    assert ch07.check_kv_blocks(wrong).status == FAIL


def test_kv_blocks_stub_is_todo():
    def stub(*args):
        raise NotImplementedError("Task 7.1")

    assert ch07.check_kv_blocks(stub).status == TODO


# -- Task 7.2 ---------------------------------------------------------------------


def utilisation(lengths, block_size):
    return sum(lengths) / sum(block_size * -(-n // block_size) for n in lengths)


def shared_prefix_tokens(prefix_len, prompt_len, block_size):
    return min(prefix_len // block_size, (prompt_len - 1) // block_size) * block_size


def utilisation_floor(lengths, block_size):  # drops the partly filled block
    return sum(lengths) / sum(max(block_size, block_size * (n // block_size)) for n in lengths)


def utilisation_mean_of_ratios(lengths, block_size):
    return sum(n / (block_size * -(-n // block_size)) for n in lengths) / len(lengths)


def shares_partial_blocks(prefix_len, prompt_len, block_size):
    return min(prefix_len, prompt_len - 1)


def shares_the_last_token(prefix_len, prompt_len, block_size):
    return min(prefix_len // block_size, prompt_len // block_size) * block_size


def test_block_size_measures_reference_passes():
    assert ch07.check_block_size_measures(utilisation, shared_prefix_tokens).status == PASS


@pytest.mark.parametrize("wrong_u, wrong_s", [(utilisation_floor, shared_prefix_tokens),
                                              (utilisation_mean_of_ratios, shared_prefix_tokens),
                                              (utilisation, shares_partial_blocks),
                                              (utilisation, shares_the_last_token)])
def test_block_size_measures_catch(wrong_u, wrong_s):
    assert ch07.check_block_size_measures(wrong_u, wrong_s).status == FAIL


def test_block_size_choice_accepts_exactly_the_sizes_that_meet_the_requirements():
    results = {B: ch07.check_block_size_choice(lambda B=B: B).status for B in ch07.CANDIDATES}
    assert results[16] == results[32] == PASS
    assert results[8] == FAIL  # the kernel requirement
    assert results[128] == FAIL  # the system prompt loses a third of its sharing
    # Recomputed independently of the check's own helper: utilisation and sharing per candidate.
    for B, status in results.items():
        ok = (B >= 16 and utilisation(ch07.WORKLOAD_LENGTHS, B) >= 0.9
              and shared_prefix_tokens(200, 201, B) >= 0.9 * 200)
        assert (status == PASS) == ok
    assert ch07.check_block_size_choice(lambda: 24).status == FAIL  # not a candidate
    assert ch07.check_block_size_choice(lambda: "16").status == FAIL


# -- Task 7.3 ---------------------------------------------------------------------

RIGHT = {"preemptions": "fewer", "mean_running": "fewer", "ttft_p99": "more"}


def test_watermark_prediction_right_passes():
    assert ch07.check_watermark_prediction(lambda: dict(RIGHT)).status == PASS


@pytest.mark.parametrize("wrong", [
    {**RIGHT, "preemptions": "more"},
    {**RIGHT, "mean_running": "same"},
    {**RIGHT, "ttft_p99": "fewer"},
    {"preemptions": "fewer", "mean_running": "fewer"},
    {**RIGHT, "ttft_p99": "higher"},
    "fewer preemptions",
])
def test_watermark_prediction_catches(wrong):
    assert ch07.check_watermark_prediction(lambda: wrong).status == FAIL


def test_unfinished_choice_and_prediction_are_todo():
    def stub():
        raise NotImplementedError("Task 7.2")

    assert ch07.check_block_size_choice(stub).status == TODO
    assert ch07.check_watermark_prediction(stub).status == TODO


def test_hints_are_staged_and_never_the_answer():
    for task, hints in ch07.HINTS.items():
        assert len(hints) >= 2, task
        for h in hints:
            assert "def " not in h and "return " not in h
