"""The chapter 07 exercise checks pass the reference answers and catch the classic planning and sizing mistakes.

Each wrong implementation below is one mistake; the check must FAIL on it.
"""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged import planner
from minipaged.checks import FAIL, PASS, TODO, ch07
from minipaged.checks.instructor import ch07 as ref07

pytestmark = pytest.mark.ch07


# -- Task 7.1 ---------------------------------------------------------------------


def _need(p, blocks=None, non_torch=True, activations=True):
    blocks = p.blocks_per_sequence if blocks is None else blocks
    return (p.weight_bytes + (p.activation_bytes if activations else 0) + (p.non_torch_bytes if non_torch else 0)
            + blocks * p.block_bytes)


def _smallest(total, need):
    u = need / total
    while math.floor(total * u) < need:
        u = math.nextafter(u, 2.0)
    while math.floor(total * math.nextafter(u, 0.0)) >= need:
        u = math.nextafter(u, 0.0)
    return u


def _closed_form(need_of, divide_by_free=False, check_free=True, cap=True):
    def min_utilization(model, gpu_memory, *, max_model_len, **kwargs):
        p = planner.plan(model, gpu_memory, 1.0, max_model_len=max_model_len, **kwargs)
        need = need_of(p)
        if (check_free and need > p.free_bytes) or (cap and need > p.gpu_bytes):
            return None
        return _smallest(p.free_bytes if divide_by_free else p.gpu_bytes, need)

    return min_utilization


def bisection(model, gpu_memory, *, max_model_len, **kwargs):
    """Correct, and unlike the package: bisect the floats on plan's own request, then ask plan whether it starts."""

    def enough(u):
        return planner.plan(model, gpu_memory, u, max_model_len=max_model_len, **kwargs).outcome not in (
            "no_cache_blocks", "max_model_len")

    lo, hi = 0.0, 1.0
    if not enough(hi):
        return None
    while math.nextafter(lo, 1.0) < hi:
        mid = (lo + hi) / 2
        mid = mid if lo < mid < hi else math.nextafter(lo, 1.0)
        lo, hi = (lo, mid) if enough(mid) else (mid, hi)
    return hi if planner.plan(model, gpu_memory, hi, max_model_len=max_model_len, **kwargs).starts else None


of_free_memory = _closed_form(_need, divide_by_free=True)
forgets_non_torch = _closed_form(lambda p: _need(p, non_torch=False))
forgets_activations = _closed_form(lambda p: _need(p, activations=False))
tokens_not_blocks = _closed_form(lambda p: p.weight_bytes + p.activation_bytes + p.non_torch_bytes
                                 + p.max_model_len * p.kv_bytes_per_token)
ignores_max_model_len = _closed_form(lambda p: _need(p, blocks=1))
one_spare_block = _closed_form(lambda p: _need(p, blocks=p.blocks_per_sequence + 1))
ignores_other_processes = _closed_form(_need, check_free=False)


def over_one_not_none(model, gpu_memory, *, max_model_len, **kwargs):
    p = planner.plan(model, gpu_memory, 1.0, max_model_len=max_model_len, **kwargs)
    return _need(p) / p.gpu_bytes if _need(p) > p.gpu_bytes else _smallest(p.gpu_bytes, _need(p))


def a_byte_short(model, gpu_memory, *, max_model_len, **kwargs):  # the plain quotient, never corrected
    p = planner.plan(model, gpu_memory, 1.0, max_model_len=max_model_len, **kwargs)
    return None if _need(p) > p.free_bytes else _need(p) / p.gpu_bytes


def not_the_smallest_float(model, gpu_memory, *, max_model_len, **kwargs):  # corrected upwards only
    p = planner.plan(model, gpu_memory, 1.0, max_model_len=max_model_len, **kwargs)
    if _need(p) > p.free_bytes:
        return None
    u = _need(p) / p.gpu_bytes
    while math.floor(p.gpu_bytes * u) < _need(p):
        u = math.nextafter(u, 2.0)
    return u


def whole_gpu_is_none(model, gpu_memory, *, max_model_len, **kwargs):  # >= where > belongs
    p = planner.plan(model, gpu_memory, 1.0, max_model_len=max_model_len, **kwargs)
    return None if _need(p) >= p.free_bytes else _smallest(p.gpu_bytes, _need(p))


def returns_numpy(model, gpu_memory, *, max_model_len, **kwargs):
    import numpy as np

    u = planner.min_utilization(model, gpu_memory, max_model_len=max_model_len, **kwargs)
    return None if u is None else np.float64(u)


@pytest.mark.parametrize("right", [planner.min_utilization, bisection])
def test_min_utilization_right_answers_pass(right):
    assert ch07.check_min_utilization(right).status == PASS


WRONG_UTILS = [
    (of_free_memory, "vLLM starts at a smaller setting too", "fraction of the WHOLE GPU"),
    (forgets_non_torch, "fails (max_model_len)", "non-torch memory"),
    (forgets_activations, "fails (max_model_len)", "activation peak"),
    (tokens_not_blocks, "fails (max_model_len)", "ceil(max_model_len / B)"),
    (ignores_max_model_len, "fails (max_model_len)", "one whole max_model_len sequence"),
    (one_spare_block, "vLLM starts at a smaller setting too", "no spare block"),
    (ignores_other_processes, "where vLLM fails (startup_free_memory)", "more than what is free"),
    (over_one_not_none, "a gpu_memory_utilization is in (0, 1]", "at most 1.0"),
    (a_byte_short, "fails (max_model_len)", "a byte short"),
    (not_the_smallest_float, "vLLM starts at a smaller setting too", "step down with math.nextafter"),
    (whole_gpu_is_none, "returned None, but vLLM starts at 1.0", "not even the whole GPU"),
    (returns_numpy, "return plain Python values", ch07.HINTS["7.1"][0]),
]  # fmt: skip


@pytest.mark.parametrize("wrong, message, hint", WRONG_UTILS, ids=[w[0].__name__ for w in WRONG_UTILS])
def test_min_utilization_catches(wrong, message, hint, capsys):
    result = ch07.check_min_utilization(wrong)
    assert result.status == FAIL and message in result.message and hint in result.hint, result
    capsys.readouterr()


def test_min_utilization_stub_is_todo():
    def stub(*args, **kwargs):
        raise NotImplementedError("Task 7.1")

    assert ch07.check_min_utilization(stub).status == TODO


def test_the_public_cases_cover_each_rounding_and_none():
    cases = ref07.UTIL_CASES
    answers = [planner.min_utilization(c["model"], c["gpu_memory"], max_model_len=c["max_model_len"], **c["kwargs"])
               for c in cases]  # fmt: skip
    assert answers.count(None) == 2 and 1.0 in answers
    assert any(a_byte_short(c["model"], c["gpu_memory"], max_model_len=c["max_model_len"], **c["kwargs"]) != a
               for c, a in zip(cases, answers))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_bisection_and_the_package_agree_on_hidden_cases(seed):
    import random

    for case in ref07.SIDES["min_utilization"].hidden(random.Random(seed)):
        args = (case["model"], case["gpu_memory"])
        u = planner.min_utilization(*args, max_model_len=case["max_model_len"], **case["kwargs"])
        assert u == bisection(*args, max_model_len=case["max_model_len"], **case["kwargs"])
        if u is not None:  # the boundary, by plan itself
            assert ch07._plan(case, u).starts and not ch07._plan(case, math.nextafter(u, 0.0)).starts


# -- Task 7.2 ---------------------------------------------------------------------


def utilisation(lengths, block_size):
    return sum(lengths) / sum(block_size * -(-n // block_size) for n in lengths)


def shared_prefix_tokens(prefix_len, prompt_len, block_size):
    return min(prefix_len // block_size, (prompt_len - 1) // block_size) * block_size


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


# -- Task 7.4 ---------------------------------------------------------------------

RIGHT = {"preemptions": "more", "mean_running": "fewer", "ttft_p99": "more", "tpot_p50": "fewer"}


def test_pool_prediction_right_passes():
    assert ref07.pool_ablation() == RIGHT
    assert ch07.check_pool_prediction(lambda: dict(RIGHT)).status == PASS


@pytest.mark.parametrize("wrong", [
    {**RIGHT, "preemptions": "fewer"},
    {**RIGHT, "mean_running": "same"},
    {**RIGHT, "ttft_p99": "fewer"},
    {**RIGHT, "tpot_p50": "more"},  # the intuition that less memory slows every step
    {"preemptions": "more", "mean_running": "fewer", "ttft_p99": "more"},
    {**RIGHT, "ttft_p99": "higher"},
    "fewer preemptions",
])
def test_pool_prediction_catches(wrong):
    assert ch07.check_pool_prediction(lambda: wrong).status == FAIL


def test_unfinished_choice_and_prediction_are_todo():
    def stub():
        raise NotImplementedError("Task 7.2")

    assert ch07.check_block_size_choice(stub).status == TODO
    assert ch07.check_pool_prediction(stub).status == TODO


def test_hints_are_staged_and_never_the_answer():
    for task, hints in ch07.HINTS.items():
        assert len(hints) == 3, task
        for h in hints:
            assert "def " not in h and "return " not in h
