"""Capacity planning as vLLM does it at start-up: from a GPU's memory to KV blocks, tokens and sequences.

Chapter 07. vLLM sizes its block pool once, when it starts, with this arithmetic
(``Worker.determine_available_memory`` and the KV-cache config after it):

    requested  = total GPU memory × gpu_memory_utilization     a fraction of the WHOLE GPU
    KV budget  = requested − weights − activation peak − non-torch memory
    block      = B × kv_bytes_per_token                        B tokens of K and V in every layer
    num_blocks = floor(KV budget / block)
    KV tokens  = num_blocks × B
    fits       ⟺ max_model_len ≤ KV tokens                     one full-length sequence must fit

The activation peak and the non-torch memory (the CUDA context, NCCL buffers,
CUDA graphs) are what vLLM's profile run measures; here they are inputs.
``kv_bytes_per_token`` is chapter 01's ``2 · L · h_kv · d_h · b``
(:func:`minipaged.accounting.kv_bytes_per_token`), with ``b`` the KV dtype's bytes.

Start-up fails in four ways, each an outcome of :func:`plan` with vLLM's message:

- ``"startup_free_memory"``: less memory is free than ``requested``, e.g. a second
  instance on a GPU where the first already took its fraction (vLLM V1:
  "Free memory on device ... on startup is less than desired GPU memory utilization";
  older versions did not check, and ran out of memory loading weights or allocating blocks);
- ``"oom"``: the weights, the profile run's activations and the non-torch memory do
  not fit in what is free (torch: "CUDA out of memory");
- ``"no_cache_blocks"``: the budget holds no block ("No available memory for the cache blocks");
- ``"max_model_len"``: fewer KV tokens than ``max_model_len`` ("The model's max seq len (X) is larger
  than the maximum number of tokens that can be stored in KV cache (Y)"; vLLM V1 asks the same in
  bytes, ceil(max_model_len / B) blocks against the budget, and words it "To serve at least one
  request with the model's max seq len ... KV cache is needed, which is larger than the available
  KV cache memory").

For an exercise that plans a capacity, :func:`plan` is the reference: its
:class:`Plan` holds every intermediate number (``requested_bytes``,
``kv_budget_bytes``, ``block_bytes``, ``num_blocks``, ``kv_tokens``) for a check
to compare against; :func:`model_weight_bytes` and :func:`num_kv_blocks` are the
two steps a learner writes most often, and :func:`min_utilization` answers the
deployer's question backwards: what ``gpu_memory_utilization`` makes a length fit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from minipaged import accounting as acc
from minipaged.validation import check_int, check_real
from minipaged.workload import RequestSpec, WorkloadPreset, get_length_preset

GiB = 2**30
MiB = 2**20

# Parameters of each model preset, counted from its published configuration
# (embeddings, attention and MLP weights, norms; Falcon-7B ties its output layer to its embeddings).
PARAMETER_COUNTS: dict[str, int] = {
    "OPT-13B": 12_853_473_280,
    "Llama-2-7B": 6_738_415_616,
    "Llama-3-8B": 8_030_261_248,
    "Llama-2-70B": 68_976_648_192,
    "Falcon-7B": 6_921_720_704,
}

# Nominal memory of some GPUs (the driver reports a little less: ask ``torch.cuda.mem_get_info()``).
GPU_PRESETS: dict[str, int] = {
    "L4 (24 GiB)": 24 * GiB,
    "RTX 4090 (24 GiB)": 24 * GiB,
    "A100 (40 GiB)": 40 * GiB,
    "A100 (80 GiB)": 80 * GiB,
    "H100 (80 GiB)": 80 * GiB,
}

# The KV dtypes a deployer chooses between (vLLM's ``kv_cache_dtype``; "auto" is the model's own dtype).
KV_DTYPES = ("auto", "fp16", "bf16", "fp8")

# Round placeholders for what vLLM's profile run measures; measure yours (vLLM logs both at start-up).
# The reported Llama-3.1-8B run of REPORTED_CASE measured 2.07 GiB of activations at 20,000 tokens and
# 0.35 GiB of non-torch memory.
DEFAULT_ACTIVATION_BYTES = 1 * GiB
DEFAULT_NON_TORCH_BYTES = 512 * MiB

OUTCOMES = ("ok", "startup_free_memory", "oom", "no_cache_blocks", "max_model_len")

# vLLM issue #10517: Llama-3.1-8B-Instruct (Llama-3-8B's shape) on an RTX 3090, fp16 KV, block size 16,
# max_model_len 29,000. Its log: total_gpu_memory=23.58GiB, weights 14.9888 GiB, peak_torch_memory=17.98GiB
# (weights + activation peak), non_torch_memory=0.35GiB, gpu_memory_utilization=0.90, "# GPU blocks: 1478".
# The log rounds to 0.01 GiB and one block is 2 MiB, so 23.58 GiB exactly gives 1,480 blocks; 24,141 MiB
# (23.575 GiB, which the log prints as 23.58) gives the logged 1,478 with the other logged numbers.
REPORTED_CASE = dict(
    model="Llama-3-8B",
    gpu_memory=24_141 * MiB,
    gpu_memory_utilization=0.90,
    weight_bytes=round(14.9888 * GiB),
    activation_bytes=round(17.98 * GiB) - round(14.9888 * GiB),
    non_torch_bytes=round(0.35 * GiB),
    kv_dtype="fp16",
    block_size=16,
)


# ----------------------------------------------------------------------------
# the steps
# ----------------------------------------------------------------------------


def _model(model) -> acc.ModelSpec:
    spec = acc.get_model_preset(model) if isinstance(model, str) else model
    if not isinstance(spec, acc.ModelSpec):
        raise TypeError(f"model must be a ModelSpec or a model preset name, got {model!r}")
    return spec


def gpu_bytes(gpu) -> int:
    """Bytes of GPU memory: ``gpu`` itself (an int), or the memory of a name in :data:`GPU_PRESETS`."""
    if isinstance(gpu, str):
        if gpu not in GPU_PRESETS:
            raise ValueError(f"gpu_memory {gpu!r} is not a GPU preset; choose one of {', '.join(GPU_PRESETS)}, "
                             "or give bytes")
        return GPU_PRESETS[gpu]
    return check_int(gpu, "gpu_memory", minimum=1)


def model_weight_bytes(model: acc.ModelSpec | str, dtype=None) -> int:
    """Bytes of a model preset's weights: its parameter count × bytes per parameter.

    Args:
        model: a ``ModelSpec`` or name in ``accounting.MODEL_PRESETS`` whose count is in :data:`PARAMETER_COUNTS`.
        dtype: the weights' dtype, as ``accounting.dtype_bytes`` takes it (default: the model's own).
    """
    spec = _model(model)
    if spec.name not in PARAMETER_COUNTS:
        raise ValueError(f"model {spec.name!r} has no known parameter count: give weight_bytes")
    return PARAMETER_COUNTS[spec.name] * (spec.dtype_bytes if dtype is None else acc.dtype_bytes(dtype))


def num_kv_blocks(kv_budget_bytes: int, block_bytes: int) -> int:
    """floor(budget / block): whole blocks only, and none for a budget at or below zero.

    Args:
        kv_budget_bytes: what is left for the KV cache (negative when the rest already takes more).
        block_bytes: one block: ``block_size × kv_bytes_per_token``.
    """
    budget = check_int(kv_budget_bytes, "kv_budget_bytes", minimum=None)
    return max(budget // check_int(block_bytes, "block_bytes", minimum=1), 0)


def _kv_dtype(kv_dtype, spec: acc.ModelSpec) -> tuple[str, int]:
    """The KV dtype's label and bytes per number; ``None`` and ``"auto"`` are the model's own dtype."""
    if kv_dtype is None or kv_dtype == "auto":
        return f"auto ({spec.dtype_bytes} B)", spec.dtype_bytes
    if not isinstance(kv_dtype, str):
        raise TypeError(f"kv_dtype must be a dtype name such as 'fp8', got {type(kv_dtype).__name__} {kv_dtype!r}")
    try:
        return kv_dtype, acc.dtype_bytes(kv_dtype)
    except ValueError:
        raise ValueError(f"kv_dtype {kv_dtype!r} is unknown; use one of {', '.join(KV_DTYPES)}") from None


# ----------------------------------------------------------------------------
# one instance
# ----------------------------------------------------------------------------


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


@dataclass(frozen=True)
class Plan:
    """One vLLM instance's start-up arithmetic, every intermediate number kept (see the module docstring)."""

    model: acc.ModelSpec
    # inputs
    gpu_bytes: int  # the whole GPU
    gpu_memory_utilization: float  # a fraction of the whole GPU
    other_bytes: int  # held by other processes when this instance starts
    weight_bytes: int
    activation_bytes: int  # the profile run's activation peak
    non_torch_bytes: int  # CUDA context, NCCL, CUDA graphs: memory torch does not allocate
    kv_dtype: str
    kv_dtype_bytes: int
    block_size: int
    max_model_len: int
    # intermediates
    free_bytes: int  # gpu − other, at start-up
    requested_bytes: int  # floor(gpu × gpu_memory_utilization)
    kv_budget_bytes: int  # requested − weights − activations − non-torch; negative when they take more
    kv_bytes_per_token: int  # 2 · L · h_kv · d_h · b
    block_bytes: int  # block_size × kv_bytes_per_token
    num_blocks: int  # floor(budget / block), 0 if the instance does not get that far
    kv_tokens: int  # num_blocks × block_size
    leftover_bytes: int  # budget − num_blocks × block (0 if the budget is negative): less than one block,
    # or the whole budget when start-up stops before sizing the pool
    # the verdict
    outcome: str  # one of OUTCOMES
    error: str | None  # the message vLLM (or torch) stops with; None when it starts

    @property
    def starts(self) -> bool:
        """Whether vLLM gets through start-up with these settings."""
        return self.outcome == "ok"

    def fits(self, max_model_len: int | None = None) -> bool:
        """Whether one sequence of ``max_model_len`` tokens (default: the plan's) fits the pool."""
        m = self.max_model_len if max_model_len is None else check_int(max_model_len, "max_model_len", minimum=1)
        return m <= self.kv_tokens

    @property
    def max_concurrency(self) -> float:
        """KV tokens / max_model_len: how many full-length sequences fit (vLLM logs it as "Maximum concurrency")."""
        return self.kv_tokens / self.max_model_len

    @property
    def blocks_per_sequence(self) -> int:
        """ceil(max_model_len / B): the blocks of one full-length sequence."""
        return acc.blocks_needed(self.max_model_len, self.block_size)

    @property
    def held_bytes(self) -> int:
        """What the instance holds once started: its requested memory less the leftover; 0 if it failed."""
        return self.requested_bytes - self.leftover_bytes if self.starts else 0

    def parts(self) -> dict[str, int]:
        """The whole GPU split into what would hold it, in bytes; they sum to ``gpu_bytes`` unless the weights,
        activations and non-torch memory alone take more (then the budget is negative and nothing is unused)."""
        kv = self.num_blocks * self.block_bytes
        used = self.weight_bytes + self.activation_bytes + self.non_torch_bytes + kv + self.leftover_bytes
        return {"weights": self.weight_bytes, "activations": self.activation_bytes,
                "non-torch memory": self.non_torch_bytes, "KV cache": kv, "unused budget": self.leftover_bytes,
                "not requested": max(self.gpu_bytes - used, 0)}

    def arithmetic(self) -> str:
        """The computation, one step a line, as a notebook prints it."""
        rows = [
            ("GPU memory", _gib(self.gpu_bytes), ""),
            ("x gpu_memory_utilization", f"{self.gpu_memory_utilization:g}", "a fraction of the whole GPU"),
            ("= requested", _gib(self.requested_bytes), f"{self.requested_bytes:,} B"),
            ("- weights", _gib(self.weight_bytes), f"{self.weight_bytes:,} B"),
            ("- activation peak", _gib(self.activation_bytes), "the profile run's"),
            ("- non-torch memory", _gib(self.non_torch_bytes), "CUDA context, NCCL, graphs"),
            ("= KV budget", _gib(self.kv_budget_bytes), f"{self.kv_budget_bytes:,} B"),
            ("/ block", f"{self.block_bytes / MiB:g} MiB",
             f"{self.block_size} tokens x {self.kv_bytes_per_token:,} B ({self.kv_dtype})"),
            ("= KV blocks", f"{self.num_blocks:,}", f"leftover {self.leftover_bytes:,} B"),
            ("x block size", f"{self.block_size}", ""),
            ("= KV tokens", f"{self.kv_tokens:,}",
             f"max_model_len {self.max_model_len:,}: {'fits' if self.fits() else 'does not fit'}"),
        ]
        if self.other_bytes:
            rows.insert(1, ("(held by others)", _gib(self.other_bytes), f"free at start-up {_gib(self.free_bytes)}"))
        return acc.format_table(["step", "value", "note"], rows)

    def summary(self) -> str:
        """One line: the outcome, with the numbers that decide it."""
        if self.starts:
            return (f"starts: {self.num_blocks:,} blocks x {self.block_size} = {self.kv_tokens:,} KV tokens, "
                    f"{self.max_concurrency:.2f}x one {self.max_model_len:,}-token sequence")
        return f"fails ({self.outcome}): {self.error}"

    def __str__(self) -> str:
        head = f"{self.model.name}, {self.kv_dtype} KV, block size {self.block_size}"
        return f"{head}\n{self.arithmetic()}\n{self.summary()}"


def plan(model: acc.ModelSpec | str, gpu_memory: int | str, gpu_memory_utilization: float = 0.9, *,
         max_model_len: int, kv_dtype: str | None = None, block_size: int = 16, weight_bytes: int | None = None,
         activation_bytes: int = DEFAULT_ACTIVATION_BYTES, non_torch_bytes: int = DEFAULT_NON_TORCH_BYTES,
         other_bytes: int = 0) -> Plan:
    """vLLM's start-up arithmetic for one instance: blocks, KV tokens, and whether it starts.

    Args:
        model: a ``ModelSpec`` or a name in ``accounting.MODEL_PRESETS``.
        gpu_memory: the GPU's total memory in bytes, or a name in :data:`GPU_PRESETS`.
        gpu_memory_utilization: vLLM's setting, in (0, 1]: the fraction of the *whole* GPU this
            instance may use, whatever other processes hold.
        max_model_len: the longest sequence (prompt + output) the instance must be able to hold.
        kv_dtype: the KV cache's dtype, one of :data:`KV_DTYPES` ("fp16", "bf16", "fp8"; ``None`` or
            "auto": the model's own).
        block_size: B, tokens per block.
        weight_bytes: the weights' bytes (default: :func:`model_weight_bytes` of the model, its parameter
            count × its dtype's bytes).
        activation_bytes: the activation peak of vLLM's profile run (a forward pass at its largest batch).
        non_torch_bytes: memory torch does not allocate: the CUDA context, NCCL buffers, CUDA graphs.
        other_bytes: memory other processes hold on the GPU when this instance starts.
    """
    spec = _model(model)
    total = gpu_bytes(gpu_memory)
    util = check_real(gpu_memory_utilization, "gpu_memory_utilization")
    if not 0 < util <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
    m = check_int(max_model_len, "max_model_len", minimum=1)
    label, b = _kv_dtype(kv_dtype, spec)
    B = check_int(block_size, "block_size", minimum=1)
    weights = model_weight_bytes(spec) if weight_bytes is None else check_int(weight_bytes, "weight_bytes")
    act = check_int(activation_bytes, "activation_bytes")
    non_torch = check_int(non_torch_bytes, "non_torch_bytes")
    other = check_int(other_bytes, "other_bytes")
    if other > total:
        raise ValueError(f"other_bytes ({other:,}) is more than the GPU's memory ({total:,})")

    free = total - other
    requested = math.floor(total * util)
    budget = requested - weights - act - non_torch
    per_token = acc.kv_bytes_per_token(spec, b)
    block = B * per_token
    blocks = num_kv_blocks(budget, block)

    outcome, error = "ok", None
    if free < requested:
        outcome = "startup_free_memory"
        error = (f"Free memory on device ({free / GiB:.2f}/{total / GiB:.2f} GiB) on startup is less than desired "
                 f"GPU memory utilization ({util:g}, {requested / GiB:.2f} GiB). Decrease GPU memory utilization "
                 "or reduce GPU memory used by other processes.")
    elif weights + act + non_torch > free:
        outcome = "oom"
        error = (f"CUDA out of memory: weights ({_gib(weights)}), the profile run's activations ({_gib(act)}) and "
                 f"non-torch memory ({_gib(non_torch)}) need {_gib(weights + act + non_torch)}, "
                 f"but {_gib(free)} is free.")
    elif blocks == 0:
        outcome = "no_cache_blocks"
        error = ("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
                 "initializing the engine.")
    elif m > blocks * B:
        outcome = "max_model_len"
        error = (f"The model's max seq len ({m}) is larger than the maximum number of tokens that can be stored "
                 f"in KV cache ({blocks * B}). Try increasing `gpu_memory_utilization` or decreasing "
                 "`max_model_len` when initializing the engine.")
    if outcome in ("startup_free_memory", "oom"):
        blocks = 0  # it never gets as far as sizing the pool
    leftover = max(budget - blocks * block, 0)
    return Plan(spec, total, util, other, weights, act, non_torch, label, b, B, m, free, requested, budget, per_token,
                block, blocks, blocks * B, leftover, outcome, error)


def min_utilization(model: acc.ModelSpec | str, gpu_memory: int | str, *, max_model_len: int,
                    **kwargs) -> float | None:
    """The smallest ``gpu_memory_utilization`` at which vLLM starts and holds one ``max_model_len`` sequence.

    :func:`plan` answers forwards (this setting: does it start?); this answers the deployer's question
    backwards (this length: what setting?). "Starts" is :attr:`Plan.starts`: the outcome is ``"ok"``, so
    start-up got through every check of :func:`plan`, the last of which is that one ``max_model_len``
    sequence fits the pool.

    Args:
        model: a ``ModelSpec`` or a name in ``accounting.MODEL_PRESETS``.
        gpu_memory: the GPU's total memory in bytes, or a name in :data:`GPU_PRESETS`.
        max_model_len: the length that must fit.
        **kwargs: the other arguments of :func:`plan` (``kv_dtype``, ``block_size``, ``weight_bytes``,
            ``activation_bytes``, ``non_torch_bytes``, ``other_bytes``), passed on unchanged.

    Returns:
        A float ``u`` in (0, 1], or None. ``u`` is the smallest float at which
        ``plan(model, gpu_memory, u, max_model_len=max_model_len, **kwargs).starts`` is True: it starts at
        ``u`` and does not at ``math.nextafter(u, 0.0)``, the float just below. ``plan`` requests
        ``floor(gpu bytes × u)`` bytes, computed in floats, so the boundary is a float, not a fraction:
        two settings that round to the same request are the same setting, and the answer is unique.
        None when no ``u`` in (0, 1] starts; never a number above 1.0.
    """
    ### BEGIN SOLUTION (Exercise 07, Task 7.1)
    p = plan(model, gpu_memory, 1.0, max_model_len=max_model_len, **kwargs)
    need = p.weight_bytes + p.activation_bytes + p.non_torch_bytes + p.blocks_per_sequence * p.block_bytes
    if need > p.free_bytes:  # more than the whole GPU, or than what other processes leave free
        return None
    util = need / p.gpu_bytes
    while math.floor(p.gpu_bytes * util) < need:  # the float may land a byte short
        util = math.nextafter(util, 2.0)
    while math.floor(p.gpu_bytes * math.nextafter(util, 0.0)) >= need:  # or the float below may reach it too
        util = math.nextafter(util, 0.0)
    return util
    ### END SOLUTION


def reported_case(max_model_len: int = 29_000) -> Plan:
    """The reported vLLM start-up failure of :data:`REPORTED_CASE`: 1,478 blocks × 16 = 23,648 KV tokens.

    Args:
        max_model_len: the length asked for (the report asked 29,000, which does not fit; 20,000 does).
    """
    return plan(**REPORTED_CASE, max_model_len=max_model_len)


def plan_shared_gpu(model: acc.ModelSpec | str, gpu_memory: int | str, utilizations: Sequence[float], *,
                    max_model_len: int, **kwargs) -> list[Plan]:
    """Instances started one after another on one GPU, each with its own ``gpu_memory_utilization``.

    Each started instance holds its requested memory (weights, activations, non-torch memory and the
    blocks it sized to fill the rest), so the next one finds that much less free. A fraction is of the
    whole GPU, so two instances at 0.9 cannot both start, and two at 0.45 can.

    Args:
        model: a ``ModelSpec`` or a name in ``accounting.MODEL_PRESETS``, the same for every instance.
        gpu_memory: the GPU's total memory in bytes, or a name in :data:`GPU_PRESETS`.
        utilizations: one ``gpu_memory_utilization`` per instance, in start order.
        max_model_len: as for :func:`plan`.
        **kwargs: the other arguments of :func:`plan` (``kv_dtype``, ``block_size``, ...), except ``other_bytes``.
    """
    if isinstance(utilizations, (str, bytes)) or not isinstance(utilizations, Sequence) or not utilizations:
        raise TypeError(f"utilizations must be a non-empty sequence of fractions, got {utilizations!r}")
    if "other_bytes" in kwargs:
        raise TypeError("plan_shared_gpu() works out other_bytes itself: do not pass it")
    plans, held = [], 0
    for u in utilizations:
        p = plan(model, gpu_memory, u, max_model_len=max_model_len, other_bytes=held, **kwargs)
        plans.append(p)
        held += p.held_bytes
    return plans


# ----------------------------------------------------------------------------
# how many sequences at once
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Concurrency:
    """How many sequences a plan's pool holds at once, at their final lengths (a snapshot: no growth)."""

    num_blocks: int
    block_size: int
    max_model_len: int
    workload: str  # the length preset's name, or "requests"
    num_seqs: int  # lengths looked at
    worst_case: int  # num_blocks // ceil(max_model_len / B): every sequence at max_model_len
    mean_blocks: float  # the mean of ceil(n / B) over the lengths
    expected: float  # num_blocks / mean_blocks: the long-run average
    admitted: int  # the lengths taken in order until the next one does not fit
    admitted_blocks: int  # the blocks those hold

    def __str__(self) -> str:
        return (f"{self.num_blocks:,} blocks of {self.block_size}: {self.worst_case:,} sequences at max_model_len "
                f"{self.max_model_len:,}; {self.workload} lengths: {self.admitted:,} admitted "
                f"(mean {self.mean_blocks:.2f} blocks each, about {self.expected:,.0f} on average)")


def concurrency(p: Plan, workload: str | WorkloadPreset | Sequence[RequestSpec], seed: int = 0) -> Concurrency:
    """Maximum concurrent sequences of a length distribution in a plan's block pool.

    Each sequence holds ceil(n / B) blocks at its final length n (prompt + output, cut at
    ``max_model_len``, where vLLM stops it). The pool is the one the plan sized, whether or not the
    instance starts (``p.num_blocks`` is 0 when it never gets that far).

    Args:
        p: a :class:`Plan`.
        workload: a length preset (a name in ``workload.LENGTH_PRESETS`` or a ``WorkloadPreset``): enough
            lengths are sampled to overflow the pool; or a list of ``RequestSpec``, taken in order.
        seed: the seed of the sampled lengths (a preset only).
    """
    if not isinstance(p, Plan):
        raise TypeError(f"p must be a Plan, got {type(p).__name__}")
    if isinstance(workload, (str, WorkloadPreset)):
        preset = get_length_preset(workload)
        name = preset.name
        lengths = acc.sample_lengths(preset, p.num_blocks + 1, p.max_model_len, seed)
    elif isinstance(workload, Sequence) and workload and all(isinstance(r, RequestSpec) for r in workload):
        name = "requests"
        lengths = np.minimum([r.num_prompt_tokens + r.num_output_tokens for r in workload], p.max_model_len)
    else:
        raise TypeError(f"workload must be a length preset or a non-empty list of RequestSpec, got {workload!r}")
    blocks = (np.asarray(lengths, dtype=np.int64) + p.block_size - 1) // p.block_size
    admitted = int(np.searchsorted(np.cumsum(blocks), p.num_blocks, side="right"))
    mean = float(blocks.mean())
    return Concurrency(p.num_blocks, p.block_size, p.max_model_len, name, len(blocks),
                       p.num_blocks // p.blocks_per_sequence, mean, p.num_blocks / mean, admitted,
                       int(blocks[:admitted].sum()))
