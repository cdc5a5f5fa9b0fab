"""Exercise 07's references, public cases and hidden cases (the instructor's side of ``minipaged.checks.ch07``)."""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from minipaged import accounting as acc
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

GiB, MiB = planner.GiB, planner.MiB


def _case(model, gpu_memory, max_model_len, **kwargs) -> dict:
    return {"model": model, "gpu_memory": gpu_memory, "max_model_len": max_model_len, "kwargs": kwargs}


def _whole_gpu_weights(model: str, gpu: int, max_model_len: int, block_size: int, act: int, non_torch: int) -> int:
    """The weights that make a start need exactly the whole GPU (the answer is 1.0)."""
    blocks = acc.blocks_needed(max_model_len, block_size) * block_size * acc.kv_bytes_per_token(model, 2)
    return gpu - act - non_torch - blocks


_REPORTED = {k: v for k, v in planner.REPORTED_CASE.items() if k not in ("model", "gpu_memory",
                                                                          "gpu_memory_utilization")}
UTIL_CASES = [
    # vLLM issue #10517's RTX 3090: what setting would have started at 29,000 tokens
    _case("Llama-3-8B", planner.REPORTED_CASE["gpu_memory"], 29_000, **_REPORTED),
    # the same with 5 × 7,919 bytes more of weights: need / GPU bytes lands a byte short of the need
    _case("Llama-3-8B", 24_141 * MiB, 4_000, kv_dtype="fp16", block_size=16, weight_bytes=14 * GiB + 5 * 7_919,
          activation_bytes=GiB, non_torch_bytes=GiB // 2),
    # and with 1,592 × 7,919 bytes: the float just below need / GPU bytes still reaches the need
    _case("Llama-3-8B", 24_141 * MiB, 4_000, kv_dtype="fp16", block_size=16, weight_bytes=14 * GiB + 1_592 * 7_919,
          activation_bytes=GiB, non_torch_bytes=GiB // 2),
    # a second instance: 30 GiB already held by another process; a length that is not whole blocks
    _case("Llama-3-8B", "A100 (80 GiB)", 8_000, kv_dtype="fp8", block_size=32, activation_bytes=3 * GiB // 2,
          non_torch_bytes=GiB // 3, other_bytes=30 * GiB),
    # the weights alone are more than the GPU
    _case("Llama-2-70B", "A100 (80 GiB)", 4_096, kv_dtype="fp16", block_size=16),
    # fits the GPU, but not what the other process leaves free
    _case("Llama-2-7B", "L4 (24 GiB)", 16_384, kv_dtype="fp16", block_size=16, weight_bytes=13 * GiB,
          activation_bytes=GiB, non_torch_bytes=GiB // 4, other_bytes=6 * GiB),
    # exactly the whole GPU
    _case("Falcon-7B", 24 * GiB, 2_000, kv_dtype="fp16", block_size=128, activation_bytes=5 * GiB // 4,
          non_torch_bytes=GiB // 4, weight_bytes=_whole_gpu_weights("Falcon-7B", 24 * GiB, 2_000, 128,
                                                                    5 * GiB // 4, GiB // 4)),
]


def _hidden_utils(rng) -> list:
    cases = []
    for i in range(8):
        model = rng.choice(["Llama-3-8B", "Llama-2-7B", "OPT-13B", "Falcon-7B"])
        gpu = rng.choice([24, 40, 48, 80]) * GiB - rng.randrange(0, 600) * MiB - rng.randrange(1 << 20)
        B, m = rng.choice([8, 16, 32, 128]), rng.randrange(256, 32_768)
        act, non_torch = rng.randrange(1, 9) * GiB // 4 + rng.randrange(MiB), rng.randrange(1, 5) * GiB // 8 + 7
        kw = dict(kv_dtype=rng.choice(["fp16", "bf16", "fp8"]), block_size=B, activation_bytes=act,
                  non_torch_bytes=non_torch, weight_bytes=rng.randrange(4, 40) * GiB // 2 + rng.randrange(1 << 24))
        if i == 6:  # the answer is 1.0
            m = min(m, 4_096)
            kw.update(kv_dtype="fp16", weight_bytes=_whole_gpu_weights(model, gpu, m, B, act, non_torch))
        elif i == 7:  # no setting starts
            kw["weight_bytes"] = gpu - act - rng.randrange(GiB)
        elif rng.random() < 0.4:
            kw["other_bytes"] = rng.randrange(1, gpu // GiB) * GiB // 2
        cases.append(_case(model, gpu, m, **kw))
    return cases


def choose_block_size() -> int:
    return next(B for B in CANDIDATES if not requirements(B))


def utilisation(lengths, B) -> float:
    return sum(lengths) / sum(allocated_slots(n, B) for n in lengths)


def shared_prefix_tokens(prefix_len, prompt_len, B) -> int:
    return min(prefix_len // B, (prompt_len - 1) // B) * B


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


@lru_cache(maxsize=1)
def pool_ablation() -> dict[str, str]:
    """Each predicted measure's direction from the baseline to a pool of half its blocks (ShareGPT-like, virtual
    clock): the chapter's ablations keep the pool; this one changes only the pool."""
    from minipaged import tradeoffs  # chapter 07, reached by name: its import builds nothing heavy

    workload, prompts = tradeoffs.regime_workload("sharegpt_like")
    model = tradeoffs.sweep_model()
    base = tradeoffs.run_engine(model, tradeoffs.BASE_CONFIG, workload, prompts)
    half = replace(tradeoffs.BASE_CONFIG, num_blocks=tradeoffs.BASE_CONFIG.num_blocks // 2)
    ablated = tradeoffs.run_engine(model, half, workload, prompts)
    return {k: "same" if ablated[k] == base[k] else ("more" if ablated[k] > base[k] else "fewer") for k in PREDICTED}


def _no_hidden(rng) -> list:
    return []  # a choice and a prediction have no inputs to vary


SIDES = {
    "min_utilization": Side(lambda: UTIL_CASES, _hidden_utils, lambda: (planner.min_utilization,)),
    "block_size_choice": Side(_choice_cases, _no_hidden, lambda: (choose_block_size,)),
    "pool_prediction": Side(lambda: [{}], _no_hidden, lambda: (lambda: dict(pool_ablation()),)),
}
