"""Exercise 07's references, public cases and hidden cases (the instructor's side of ``minipaged.checks.ch07``)."""

from __future__ import annotations

from functools import lru_cache

from minipaged import planner
from minipaged.accounting import allocated_slots
from minipaged.checks.ch07 import (
    CANDIDATES,
    MIN_KERNEL_BLOCK,
    MIN_SHARED,
    MIN_UTILISATION,
    PREDICTED,
    SYSTEM_PROMPT,
    WORKLOAD_LENGTHS,
)
from minipaged.checks.instructor import Side

GiB = planner.GiB
PLAN_CASES = [
    # model, GPU bytes, utilisation, weights, activations, non-torch, KV dtype, block size
    ["Llama-3-8B", 80 * GiB, 0.9, 16 * GiB, 1 * GiB, GiB // 2, "fp16", 16],
    ["Llama-3-8B", 80 * GiB, 0.9, 16 * GiB, 1 * GiB, GiB // 2, "fp8", 16],
    ["Llama-2-7B", 24 * GiB, 0.9, 13 * GiB, 2 * GiB, GiB // 3, "fp16", 32],
    ["Llama-2-70B", 80 * GiB, 0.95, 40 * GiB, 3 * GiB, GiB, "bf16", 16],
    ["OPT-13B", 40 * GiB, 0.5, 24 * GiB, 1 * GiB, GiB // 2, "fp16", 16],  # the weights alone take more
    ["Falcon-7B", 24 * GiB, 0.85, 14 * GiB, 5 * GiB // 4, GiB // 4, "fp16", 128],
]


def kv_blocks(model, gpu, util, weights, act, non_torch, kv_dtype, block_size) -> int:
    return planner.plan(model, gpu, util, max_model_len=1, kv_dtype=kv_dtype, block_size=block_size,
                        weight_bytes=weights, activation_bytes=act, non_torch_bytes=non_torch).num_blocks


def _hidden_plans(rng):
    cases = []
    for _ in range(4):
        model = rng.choice(["Llama-3-8B", "Llama-2-7B", "OPT-13B", "Falcon-7B"])
        gpu = rng.choice([24, 40, 48, 80]) * GiB
        weights = rng.randrange(4, 30) * GiB // 2
        cases.append([model, gpu, rng.choice([0.5, 0.8, 0.9, 0.95]), weights, rng.randrange(1, 9) * GiB // 4,
                      rng.randrange(1, 5) * GiB // 4, rng.choice(["fp16", "bf16", "fp8"]), rng.choice([8, 16, 32])])
    return cases


def utilisation(lengths, B) -> float:
    return sum(lengths) / sum(allocated_slots(n, B) for n in lengths)


def shared_prefix_tokens(prefix_len, prompt_len, B) -> int:
    return min(prefix_len // B, (prompt_len - 1) // B) * B


MEASURE_CASES = [{"utilisation": [lengths, B]} for lengths, B in
                 [([17], 16), ([16, 32, 48], 16), ([1, 2, 3], 4), (WORKLOAD_LENGTHS, 32), (WORKLOAD_LENGTHS, 128)]]
MEASURE_CASES += [{"shared": list(c)} for c in
                  ((200, 230, 16), (200, 230, 64), (80, 100, 128), (64, 64, 16), (64, 65, 16), (0, 9, 4))]


def _hidden_measures(rng):
    cases = [{"utilisation": [[rng.randrange(1, 400) for _ in range(rng.randrange(1, 8))], rng.choice([4, 16, 32])]}
             for _ in range(3)]
    for _ in range(4):
        B = rng.choice([4, 8, 16, 64])
        prefix = rng.choice([B * rng.randrange(0, 6), rng.randrange(0, 300)])
        cases.append({"shared": [prefix, prefix + rng.choice([0, 1, rng.randrange(2, 40)]), B]})
    return cases


def requirements(block_size: int) -> list[str]:
    """The stated workload's requirements that ``block_size`` misses (empty: it meets all three)."""
    missed = []
    if block_size < MIN_KERNEL_BLOCK:
        missed.append(f"B={block_size} is below {MIN_KERNEL_BLOCK}: one block-table read per {block_size} tokens")
    u = utilisation(WORKLOAD_LENGTHS, block_size)
    if u < MIN_UTILISATION:
        missed.append(f"B={block_size} keeps utilisation at {u:.3f}, below {MIN_UTILISATION}")
    shared = shared_prefix_tokens(SYSTEM_PROMPT, SYSTEM_PROMPT + 1, block_size) / SYSTEM_PROMPT
    if shared < MIN_SHARED:
        missed.append(f"B={block_size} shares {shared:.0%} of the {SYSTEM_PROMPT}-token system prompt, "
                      f"below {MIN_SHARED:.0%}")
    return missed


def _choice_cases():
    return [{"missed": {str(B): requirements(B) for B in CANDIDATES}}]


def choose_block_size() -> int:
    return next(B for B in CANDIDATES if not requirements(B))


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


def _no_hidden(rng) -> list:
    return []  # a choice and a prediction have no inputs to vary


SIDES = {
    "kv_blocks": Side(lambda: PLAN_CASES, _hidden_plans, lambda: (kv_blocks,)),
    "block_size_measures": Side(lambda: MEASURE_CASES, _hidden_measures, lambda: (utilisation, shared_prefix_tokens)),
    "block_size_choice": Side(_choice_cases, _no_hidden, lambda: (choose_block_size,)),
    "watermark_prediction": Side(lambda: [{}], _no_hidden, lambda: (lambda: dict(watermark_ablation()),)),
}
