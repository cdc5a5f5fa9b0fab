"""Checks for chapter 07: plan a capacity, choose a block size and defend it, predict an ablation.

- Task 7.1 compares the learner's block count with :func:`minipaged.planner.plan` on cases
  built to catch the classic planning mistakes: taking ``gpu_memory_utilization`` of the
  *free* memory instead of the whole GPU, forgetting the activation peak or the non-torch
  memory, sizing the KV with the model's dtype instead of the KV dtype, rounding blocks up,
  and a negative budget.
- Task 7.2 checks the two numbers a block size is chosen by (utilisation and the shared prefix
  tokens, chapter 01's formula and chapter 06's whole-block rule), then checks the chosen
  block size against the stated workload's requirements.
- Task 7.4 runs the ablation the learner predicted (on the virtual clock, so the answer is
  fixed) and compares the prediction, direction by direction.
"""

from __future__ import annotations

from functools import lru_cache

from minipaged import planner
from minipaged.accounting import allocated_slots
from minipaged.checks import CheckFailed, check, expect_close, expect_equal

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


# ---------------------------------------------------------------------------
# Task 7.1: the number of KV blocks
# ---------------------------------------------------------------------------

GiB = planner.GiB
PLAN_CASES = [
    # model, GPU bytes, utilisation, weights, activations, non-torch, KV dtype, block size
    ("Llama-3-8B", 80 * GiB, 0.9, 16 * GiB, 1 * GiB, GiB // 2, "fp16", 16),
    ("Llama-3-8B", 80 * GiB, 0.9, 16 * GiB, 1 * GiB, GiB // 2, "fp8", 16),
    ("Llama-2-7B", 24 * GiB, 0.9, 13 * GiB, 2 * GiB, GiB // 3, "fp16", 32),
    ("Llama-2-70B", 80 * GiB, 0.95, 40 * GiB, 3 * GiB, GiB, "bf16", 16),
    ("OPT-13B", 40 * GiB, 0.5, 24 * GiB, 1 * GiB, GiB // 2, "fp16", 16),  # the weights alone take more
    ("Falcon-7B", 24 * GiB, 0.85, 14 * GiB, 5 * GiB // 4, GiB // 4, "fp16", 128),
]


@check("ch07.kv_blocks", hint=HINTS["7.1"][0])
def check_kv_blocks(kv_blocks):
    for model, gpu, util, weights, act, non_torch, kv_dtype, B in PLAN_CASES:
        want = planner.plan(model, gpu, util, max_model_len=1, kv_dtype=kv_dtype, block_size=B, weight_bytes=weights,
                            activation_bytes=act, non_torch_bytes=non_torch).num_blocks
        got = kv_blocks(model, gpu, util, weights, act, non_torch, kv_dtype, B)
        what = (f"kv_blocks({model!r}, {gpu / GiB:g} GiB, {util}, weights {weights / GiB:g} GiB, activations "
                f"{act / GiB:g} GiB, non-torch {non_torch / GiB:.2f} GiB, {kv_dtype!r}, {B})")
        if want == 0 and got != 0:
            raise CheckFailed(f"{what} returned {got!r}, expected 0: the weights, activations and non-torch memory "
                              "already take more than the requested fraction, so no block fits")
        expect_equal(got, want, what)
    return f"{len(PLAN_CASES)} plans agree with vLLM's start-up arithmetic (planner.plan)"


# ---------------------------------------------------------------------------
# Task 7.2: choose a block size
# ---------------------------------------------------------------------------

# The stated workload: every prompt starts with a 200-token system prompt.
SYSTEM_PROMPT = 200
# Final lengths (system prompt + user turn + answer) of a sample of its requests.
WORKLOAD_LENGTHS = [SYSTEM_PROMPT + u + a for u, a in ((12, 40), (25, 61), (7, 90), (40, 33), (18, 75), (30, 58),
                                                       (9, 120), (22, 47), (15, 66), (35, 81))]  # fmt: skip
CANDIDATES = (8, 16, 32, 64, 128)
MIN_KERNEL_BLOCK = 16  # the requirement: the kernel's block-table reads stay at most one per 16 tokens
MIN_UTILISATION = 0.9
MIN_SHARED = 0.9  # of the system prompt's tokens


def _ref_utilisation(lengths, B):
    return sum(lengths) / sum(allocated_slots(n, B) for n in lengths)


def _ref_shared(prefix_len, prompt_len, B):
    return min(prefix_len // B, (prompt_len - 1) // B) * B


def requirements(block_size: int) -> list[str]:
    """The stated workload's requirements that ``block_size`` misses (empty: it meets all three)."""
    missed = []
    if block_size < MIN_KERNEL_BLOCK:
        missed.append(f"B={block_size} is below {MIN_KERNEL_BLOCK}: one block-table read per {block_size} tokens")
    u = _ref_utilisation(WORKLOAD_LENGTHS, block_size)
    if u < MIN_UTILISATION:
        missed.append(f"B={block_size} keeps utilisation at {u:.3f}, below {MIN_UTILISATION}")
    shared = _ref_shared(SYSTEM_PROMPT, SYSTEM_PROMPT + 1, block_size) / SYSTEM_PROMPT
    if shared < MIN_SHARED:
        missed.append(f"B={block_size} shares {shared:.0%} of the {SYSTEM_PROMPT}-token system prompt, "
                      f"below {MIN_SHARED:.0%}")
    return missed


@check("ch07.block_size_measures", hint=HINTS["7.2"][0])
def check_block_size_measures(utilisation, shared_prefix_tokens):
    cases = [([17], 16), ([16, 32, 48], 16), ([1, 2, 3], 4), (WORKLOAD_LENGTHS, 32), (WORKLOAD_LENGTHS, 128)]
    for lengths, B in cases:
        expect_close(utilisation(list(lengths), B), _ref_utilisation(lengths, B),
                     f"utilisation({list(lengths)[:4]}{'...' if len(lengths) > 4 else ''}, {B})")
    for prefix, prompt, B in ((200, 230, 16), (200, 230, 64), (80, 100, 128), (64, 64, 16), (64, 65, 16), (0, 9, 4)):
        got = shared_prefix_tokens(prefix, prompt, B)
        want = _ref_shared(prefix, prompt, B)
        if got != want and got == prefix:
            raise CheckFailed(f"shared_prefix_tokens({prefix}, {prompt}, {B}) returned {got}: only whole blocks "
                              f"are shared, expected {want}")
        expect_equal(got, want, f"shared_prefix_tokens({prefix}, {prompt}, {B})")
    return "utilisation and whole-block sharing agree with chapters 01 and 06"


@check("ch07.block_size_choice", hint=HINTS["7.2"][2])
def check_block_size_choice(choose_block_size):
    block_size = choose_block_size()
    if block_size not in CANDIDATES:
        raise CheckFailed(f"choose one of {CANDIDATES}, got {block_size!r}")
    missed = requirements(block_size)
    if missed:
        raise CheckFailed("; ".join(missed))
    passing = [B for B in CANDIDATES if not requirements(B)]
    return f"B={block_size} meets all three requirements (so do {passing}): now defend it in words"


# ---------------------------------------------------------------------------
# Task 7.4: predict an ablation
# ---------------------------------------------------------------------------

DIRECTIONS = ("more", "fewer", "same")
PREDICTED = ("preemptions", "mean_running", "ttft_p99")
WATERMARK = 0.3


@lru_cache(maxsize=1)
def watermark_ablation() -> dict[str, str]:
    """Each predicted measure's direction from the baseline to a 30% watermark (ShareGPT-like, virtual clock)."""
    from minipaged import tradeoffs  # chapter 07, reached by name: its import builds nothing heavy

    workload, prompts = tradeoffs.regime_workload("sharegpt_like")
    model = tradeoffs.sweep_model()
    base = tradeoffs.run_engine(model, tradeoffs.BASE_CONFIG, workload, prompts)
    config = tradeoffs.ablation_config(next(a for a in tradeoffs.ABLATIONS if a.name == "watermark 30%"), workload)
    ablated = tradeoffs.run_engine(model, config, workload, prompts)
    return {k: "same" if ablated[k] == base[k] else ("more" if ablated[k] > base[k] else "fewer") for k in PREDICTED}


@check("ch07.watermark_prediction", hint=HINTS["7.4"][0], timeout=600)
def check_watermark_prediction(predict):
    prediction = predict()
    if not isinstance(prediction, dict) or set(prediction) != set(PREDICTED):
        raise CheckFailed(f"prediction must be a dict with the keys {PREDICTED}, got {prediction!r}")
    bad = {k: v for k, v in prediction.items() if v not in DIRECTIONS}
    if bad:
        raise CheckFailed(f"each prediction is one of {DIRECTIONS}, got {bad}")
    actual = watermark_ablation()
    wrong = [f"{k}: you predicted {prediction[k]!r}, the run gave {actual[k]!r}" for k in PREDICTED
             if prediction[k] != actual[k]]
    if wrong:
        raise CheckFailed("; ".join(wrong) + ": what does holding 30% of the blocks back do to admission?")
    return f"all {len(PREDICTED)} directions right: {actual}"
