"""Checks for chapter 07: the smallest setting that starts, a block size chosen and defended, an ablation predicted.

- Task 7.1 runs the learner's :func:`minipaged.planner.min_utilization` (a hole in their copy of the
  package) and judges the answer by its contract, with the package's given :func:`~minipaged.planner.plan`
  as the oracle: vLLM starts at the returned ``u`` and not at the float just below it, or, when
  no setting in (0, 1] starts, the answer is None. The boundary is a float, so the answer is unique and
  equals the reference's; the judge names the classic mistake a wrong one shows: a fraction of the
  *free* memory instead of the whole GPU, the non-torch memory or the activation peak forgotten, tokens
  instead of whole blocks, the ``max_model_len`` fit ignored, a float a byte short or one that is not
  the smallest, a number above 1.0 or a request above what is free instead of None.
- Task 7.2 checks the chosen block size against the stated workload's requirements.
- Task 7.4 compares the prediction, direction by direction, with the ablation the learner
  predicted, run on the virtual clock (so the answer is fixed) on the instructor's side.

The references and hidden cases are in ``minipaged.checks.instructor.ch07``.
"""

from __future__ import annotations

import math

from minipaged import planner
from minipaged.checks import CheckFailed, check

# The package modules this exercise rebuilds in a notebook cell: none. Task 7.1's piece is a hole in the
# learner's own minipaged/planner.py, which the exercise's cells import and check.
REBUILDS = ()

HINTS = {
    "7.1": [
        "run plan backwards: find the fewest bytes a start needs, then the smallest float u whose request "
        "floor(gpu bytes x u) reaches them; None when no u up to 1.0 gets there",
        "a start needs the weights, the activation peak, the non-torch memory and the whole blocks of one "
        "max_model_len sequence inside the request, and the request itself inside what other processes leave free",
        "the quotient of two byte counts is a float: compare floor(gpu bytes x u) with what is needed and move u one "
        "float at a time (math.nextafter), up while it falls short and down while the float below still reaches it",
    ],
    "7.2": [
        "utilisation is tokens over allocated slots (accounting.utilisation); only whole blocks of a prefix are "
        "shared, and a prompt's last token is never shared",
        "a shared prefix of P tokens shares floor(P / B) blocks of B tokens; compute both measures for every "
        "candidate, with the stated workload's lengths",
        "try each candidate block size against all three requirements; more than one may pass",
    ],
    "7.4": [
        "half the pool holds half the blocks: think about how many sequences fit at once, how often one must be "
        "preempted, and what a step costs when it carries fewer sequences",
        "on the virtual clock a step costs a fixed 10 ms plus 0.1 ms per computed token: a decode's time per "
        "output token is the length of the steps it runs in",
        "list what a step carries with half the blocks (how many decodes, how many recomputed prompts), then price "
        "that step on the virtual clock",
    ],
}

# The hint a FAIL of Task 7.1 prints for each mistake the judge recognises (none is the solution).
UTIL_HINTS = {
    "type": "return a Python float (or None): plan takes gpu_memory_utilization as a fraction",
    "over_one": "gpu_memory_utilization is a fraction of the GPU, at most 1.0: when even 1.0 does not start, "
                "the answer is None",
    "free": "gpu_memory_utilization is a fraction of the WHOLE GPU, whatever other processes hold: divide by the "
            "GPU's bytes, not by what is free",
    "others": "other processes' memory (other_bytes) does not change the fraction, but vLLM refuses to start when "
              "its request is more than what is free: then no setting starts",
    "non_torch": "the request must also cover the non-torch memory (CUDA context, NCCL, graphs)",
    "activations": "the request must also cover the activation peak of the profile run",
    "blocks": "the pool holds whole blocks: one max_model_len sequence needs ceil(max_model_len / B) of them",
    "fit": "starting is not enough: the pool must hold one whole max_model_len sequence (plan's last check)",
    "short": "plan requests floor(gpu bytes x u): the float quotient can land a byte short of what is needed; "
             "step u up with math.nextafter until the floor reaches it",
    "smallest": "the answer is the smallest float that starts: when floor(gpu bytes x the float just below) still "
                "reaches what is needed, step down with math.nextafter(u, 0.0)",
    "spare": "only the blocks of one max_model_len sequence are needed, no spare block",
    "none": "None only when no setting in (0, 1] starts: not even the whole GPU, or more than is free",
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
PREDICTED = ("preemptions", "mean_running", "ttft_p99", "tpot_p50")


# ---------------------------------------------------------------------------
# Task 7.1: the smallest gpu_memory_utilization that starts
# ---------------------------------------------------------------------------


def _util_label(case) -> str:
    kw = ", ".join(f"{k}={v!r}" for k, v in case["kwargs"].items())
    return f"min_utilization({case['model']!r}, {case['gpu_memory']!r}, max_model_len={case['max_model_len']}, {kw})"


def _plan(case, u: float) -> planner.Plan:
    return planner.plan(case["model"], case["gpu_memory"], u, max_model_len=case["max_model_len"], **case["kwargs"])


@check("ch07.min_utilization", hint=HINTS["7.1"][0], label=_util_label,
       summary="{n} deployments: vLLM starts at each answer and not at the float just below it, or none starts")
def check_min_utilization(case, min_utilization):
    """``case`` = {"model", "gpu_memory", "max_model_len", "kwargs": plan's other arguments}."""
    return min_utilization(case["model"], case["gpu_memory"], max_model_len=case["max_model_len"],
                           **dict(case["kwargs"]))


def _missing(case, p: planner.Plan, need: int, short: int) -> str:
    """The diagnosis of a request ``short`` bytes below ``need``: which part of a start was left out."""
    whole = p.blocks_per_sequence * p.block_bytes
    parts = {"non_torch": p.non_torch_bytes, "activations": p.activation_bytes, "fit": whole - p.block_bytes,
             "blocks": whole - case["max_model_len"] * p.kv_bytes_per_token}  # fmt: skip
    for name, size in parts.items():
        if size > 0 and abs(short - size) <= 2:
            return name
    return "short" if 0 < short <= 2 else "fit"


@check_min_utilization.judge
def _judge_min_utilization(case, got, want):
    if got is not None and type(got) is not float:
        raise CheckFailed(f"returned {got!r} ({type(got).__name__}), expected a float or None", UTIL_HINTS["type"])
    if got is not None and not 0 < got <= 1:
        raise CheckFailed(f"returned {got!r}: a gpu_memory_utilization is in (0, 1]", UTIL_HINTS["over_one"])
    if want is None:
        if got is not None:
            p = _plan(case, got)
            why = "others" if p.outcome == "startup_free_memory" else "none"
            raise CheckFailed(f"returned {got!r}, where vLLM fails ({p.outcome}); no setting in (0, 1] starts, so "
                              "the answer is None", UTIL_HINTS[why])
        return
    if got is None:
        raise CheckFailed(f"returned None, but vLLM starts at {want!r}", UTIL_HINTS["none"])
    need, p = _plan(case, want).requested_bytes, _plan(case, got)
    free = p.free_bytes
    if not p.starts:
        why = "others" if p.outcome == "startup_free_memory" else _missing(case, p, need, need - p.requested_bytes)
        if why == "others" and p.other_bytes and math.isclose(got * free, need, rel_tol=1e-9):
            why = "free"
        raise CheckFailed(f"returned {got!r}: vLLM requests {p.requested_bytes:,} B there and fails ({p.outcome}); "
                          f"{need:,} B is the least that starts", UTIL_HINTS[why])
    if _plan(case, math.nextafter(got, 0.0)).starts:
        extra = p.requested_bytes - need
        why = "smallest" if extra <= 2 else "spare" if abs(extra - p.block_bytes) <= 2 else "none"
        if p.other_bytes and math.isclose(got * free, need, rel_tol=1e-9):
            why = "free"
        raise CheckFailed(f"returned {got!r}, but vLLM starts at a smaller setting too: it needs {need:,} B and "
                          f"{got!r} requests {p.requested_bytes:,} B", UTIL_HINTS[why] if why != "none" else "")


# ---------------------------------------------------------------------------
# Task 7.2: choose a block size
# ---------------------------------------------------------------------------


def _choice_summary(cases, seen) -> str:
    passing = [B for B in CANDIDATES if not cases[0]["missed"][str(B)]]
    return f"B={seen[0]} meets all three requirements (so do {passing}): now defend it in words"


@check("ch07.block_size_choice", hint=HINTS["7.2"][0], label=lambda c: "choose_block_size()", summary=_choice_summary)
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


@check("ch07.pool_prediction", hint=HINTS["7.4"][0], label=lambda c: "predict()",
       summary=lambda cases, seen: f"all {len(PREDICTED)} directions right: {seen[0]}")
def check_pool_prediction(case, predict):
    """``case`` = {}: ``predict()`` returns {measure: "more" | "fewer" | "same"} for a pool of half the blocks."""
    return predict()


@check_pool_prediction.judge
def _judge_prediction(case, prediction, actual):
    if type(prediction) is not dict or set(prediction) != set(PREDICTED):
        raise CheckFailed(f"prediction must be a dict with the keys {PREDICTED}, got {prediction!r}")
    bad = {k: v for k, v in prediction.items() if v not in DIRECTIONS}
    if bad:
        raise CheckFailed(f"each prediction is one of {DIRECTIONS}, got {bad}")
    wrong = [f"{k}: you predicted {prediction[k]!r}, the run gave {actual[k]!r}" for k in PREDICTED
             if prediction[k] != actual[k]]
    if wrong:
        raise CheckFailed("; ".join(wrong) + ": what does a pool of half the blocks do to admission, to "
                          "preemption, and to the length of a step?")
