"""Checks for chapter 07: plan a capacity, choose a block size and defend it, predict an ablation.

- Task 7.1 compares the learner's block count with :func:`minipaged.planner.plan` on cases
  built to catch the classic planning mistakes: taking ``gpu_memory_utilization`` of the
  *free* memory instead of the whole GPU, forgetting the activation peak or the non-torch
  memory, sizing the KV with the model's dtype instead of the KV dtype, rounding blocks up,
  and a negative budget.
- Task 7.2 checks the two numbers a block size is chosen by (utilisation and the shared prefix
  tokens, chapter 01's formula and chapter 06's whole-block rule), then checks the chosen
  block size against the stated workload's requirements.
- Task 7.4 compares the prediction, direction by direction, with the ablation the learner
  predicted, run on the virtual clock (so the answer is fixed) on the instructor's side.

The references and hidden cases are in ``minipaged.checks.instructor.ch07``.
"""

from __future__ import annotations

from minipaged import planner
from minipaged.checks import CheckFailed, check, expect_close, expect_equal

# The package modules this exercise rebuilds: none (its tasks plan with the package, they do not rebuild it)
REBUILDS = ()

HINTS = {
    "7.1": [
        "vLLM takes gpu_memory_utilization of the WHOLE GPU, subtracts the weights, the activation peak and the "
        "non-torch memory, and fills what is left with whole blocks",
        "one block holds block_size tokens of K and V in every layer: block_size x kv_bytes_per_token, with the "
        "KV dtype's bytes, not the model's",
        "whole blocks only: floor division; and a budget at or below zero holds no block at all",
    ],
    "7.2": [
        "utilisation is tokens over allocated slots, Σn / Σ B·ceil(n/B); only whole blocks of a prefix are shared",
        "a shared prefix of P tokens shares floor(P / B) blocks, B tokens each; the prompt's last token is never "
        "shared, so a prompt no longer than the prefix shares fewer",
        "try each candidate block size against all three requirements; more than one may pass",
    ],
    "7.4": [
        "a watermark keeps blocks free at admission: think about how many sequences run at once and how often "
        "one must be preempted",
        "fewer sequences admitted means less batching per step, and requests wait longer in the queue",
    ],
}


GiB = planner.GiB

# The stated workload of Task 7.2: every prompt starts with a 200-token system prompt.
SYSTEM_PROMPT = 200
# Final lengths (system prompt + user turn + answer) of a sample of its requests.
WORKLOAD_LENGTHS = [SYSTEM_PROMPT + u + a for u, a in ((12, 40), (25, 61), (7, 90), (40, 33), (18, 75), (30, 58),
                                                       (9, 120), (22, 47), (15, 66), (35, 81))]  # fmt: skip
CANDIDATES = (8, 16, 32, 64, 128)
MIN_KERNEL_BLOCK = 16  # the requirement: the kernel's block-table reads stay at most one per 16 tokens
MIN_UTILISATION = 0.9
MIN_SHARED = 0.9  # of the system prompt's tokens

DIRECTIONS = ("more", "fewer", "same")
PREDICTED = ("preemptions", "mean_running", "ttft_p99")


# ---------------------------------------------------------------------------
# Task 7.1: the number of KV blocks
# ---------------------------------------------------------------------------


def _plan_label(case) -> str:
    model, gpu, util, weights, act, non_torch, kv_dtype, B = case
    return (f"kv_blocks({model!r}, {gpu / GiB:g} GiB, {util}, weights {weights / GiB:g} GiB, activations "
            f"{act / GiB:g} GiB, non-torch {non_torch / GiB:.2f} GiB, {kv_dtype!r}, {B})")


@check("ch07.kv_blocks", hint=HINTS["7.1"][0], label=_plan_label,
       summary="{n} plans agree with vLLM's start-up arithmetic (planner.plan)")
def check_kv_blocks(case, kv_blocks):
    """``case`` = (model, GPU bytes, utilisation, weights, activations, non-torch bytes, KV dtype, block size)."""
    return kv_blocks(*case)


@check_kv_blocks.judge
def _judge_plan(case, got, want):
    if want == 0 and got != 0:
        raise CheckFailed(f"returned {got!r}, expected 0: the weights, activations and non-torch memory already take "
                          "more than the requested fraction, so no block fits")
    expect_equal(got, want)


# ---------------------------------------------------------------------------
# Task 7.2: choose a block size
# ---------------------------------------------------------------------------


def _measure_label(case) -> str:
    if "utilisation" in case:
        lengths, B = case["utilisation"]
        return f"utilisation({lengths[:4]}{'...' if len(lengths) > 4 else ''}, {B})"
    return f"shared_prefix_tokens({', '.join(map(str, case['shared']))})"


@check("ch07.block_size_measures", hint=HINTS["7.2"][0], label=_measure_label,
       summary="utilisation and whole-block sharing agree with chapters 01 and 06")
def check_block_size_measures(case, utilisation, shared_prefix_tokens):
    """``case`` = {"utilisation": [lengths, B]} or {"shared": [prefix_len, prompt_len, B]}."""
    if "utilisation" in case:
        lengths, B = case["utilisation"]
        return utilisation(list(lengths), B)
    return shared_prefix_tokens(*case["shared"])


@check_block_size_measures.judge
def _judge_measure(case, got, want):
    if "utilisation" in case:
        expect_close(got, want, "")
        return
    prefix = case["shared"][0]
    if got != want and got == prefix:
        raise CheckFailed(f"returned {got}: only whole blocks are shared, expected {want}")
    expect_equal(got, want)


def _choice_summary(cases, seen) -> str:
    passing = [B for B in CANDIDATES if not cases[0]["missed"][str(B)]]
    return f"B={seen[0]} meets all three requirements (so do {passing}): now defend it in words"


@check("ch07.block_size_choice", hint=HINTS["7.2"][2], label=lambda c: "choose_block_size()", summary=_choice_summary)
def check_block_size_choice(case, choose_block_size):
    """``case`` = {"missed": {str(B): [requirements B misses]}}, written on the instructor's side."""
    return choose_block_size()


@check_block_size_choice.judge
def _judge_choice(case, got, want):
    if type(got) is not int or got not in CANDIDATES:
        raise CheckFailed(f"choose one of {CANDIDATES}, got {got!r}")
    missed = case["missed"][str(got)]
    if missed:
        raise CheckFailed("; ".join(missed))


# ---------------------------------------------------------------------------
# Task 7.4: predict an ablation
# ---------------------------------------------------------------------------


@check("ch07.watermark_prediction", hint=HINTS["7.4"][0], label=lambda c: "predict()",
       summary=lambda cases, seen: f"all {len(PREDICTED)} directions right: {seen[0]}")
def check_watermark_prediction(case, predict):
    """``case`` = {}: ``predict()`` returns {measure: "more" | "fewer" | "same"} for a 30% watermark."""
    return predict()


@check_watermark_prediction.judge
def _judge_prediction(case, prediction, actual):
    if type(prediction) is not dict or set(prediction) != set(PREDICTED):
        raise CheckFailed(f"prediction must be a dict with the keys {PREDICTED}, got {prediction!r}")
    bad = {k: v for k, v in prediction.items() if v not in DIRECTIONS}
    if bad:
        raise CheckFailed(f"each prediction is one of {DIRECTIONS}, got {bad}")
    wrong = [f"{k}: you predicted {prediction[k]!r}, the run gave {actual[k]!r}" for k in PREDICTED
             if prediction[k] != actual[k]]
    if wrong:
        raise CheckFailed("; ".join(wrong) + ": what does holding 30% of the blocks back do to admission?")
