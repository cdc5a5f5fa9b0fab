"""KV-cache memory accounting: how many bytes, how many slots, how much waste.

Chapter 01 builds everything here. The whole module is arithmetic: no tensors
are allocated, so it runs instantly on any machine.

    M = 2 · L · n · h_kv · d_h · b        KV bytes for n tokens
    A_B(n) = B · ceil(n / B)              slots allocated with blocks of B tokens
    W_B(n) = A_B(n) − n                   waste in the last, partly filled block
    U = Σ n_i / Σ A_B(n_i)                slot utilisation of a batch

L layers, h_kv key/value heads, d_h head dimension, b bytes per number; the 2
is one K and one V. A *slot* is the room for one token's K and V in every
layer, so one slot costs ``kv_bytes_per_token`` bytes.

Sequence lengths come from :mod:`minipaged.workload`: a length preset's
prompt plus output, cut off at ``max_len`` (:func:`sample_lengths`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from numbers import Integral

import numpy as np

from minipaged.block_math import blocks_needed, ceil_div
from minipaged.validation import check_int
from minipaged.workload import MAX_DRAWS, WorkloadPreset, check_num_draws, get_length_preset

# ----------------------------------------------------------------------------
# input checking: every error names the argument it is about
# ----------------------------------------------------------------------------


def _lengths(lengths, name: str = "lengths") -> list[int]:
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Iterable):
        raise TypeError(f"{name} must be a sequence of token counts, got {lengths!r}")
    out = [check_int(n, f"{name}[{i}]") for i, n in enumerate(lengths)]
    if not out:
        raise ValueError(f"{name} must not be empty")
    return out


# ----------------------------------------------------------------------------
# dtypes and models
# ----------------------------------------------------------------------------

DTYPE_BYTES = {
    "fp32": 4, "float32": 4, "float": 4,
    "fp16": 2, "float16": 2, "half": 2,
    "bf16": 2, "bfloat16": 2,
    "fp8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1,
}


def dtype_bytes(dtype) -> int:
    """Bytes per number for ``dtype``: an int (bytes), a name like "bf16", or a torch dtype."""
    if isinstance(dtype, str):
        key = dtype.lower().removeprefix("torch.")
        if key not in DTYPE_BYTES:
            raise ValueError(f"dtype {dtype!r} is unknown; use bytes (1, 2, 4), a torch dtype, "
                             f"or one of {sorted(DTYPE_BYTES)}")
        return DTYPE_BYTES[key]
    if isinstance(dtype, Integral) and not isinstance(dtype, bool):
        return check_int(dtype, "dtype", minimum=1)
    itemsize = getattr(dtype, "itemsize", None)  # torch.dtype and numpy dtypes both have it
    if isinstance(itemsize, int) and itemsize > 0:
        return itemsize
    raise TypeError(f"dtype must be bytes per element, a dtype name or a torch dtype, got {dtype!r}")


@dataclass(frozen=True)
class ModelSpec:
    """The numbers of a decoder that decide its KV-cache size (weights don't matter here)."""

    name: str
    num_layers: int
    num_attention_heads: int  # query heads
    num_kv_heads: int  # = query heads for MHA, fewer for GQA, 1 for MQA
    head_dim: int
    dtype_bytes: int = 2  # the dtype the model is usually served in

    def __post_init__(self):
        for arg in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "dtype_bytes"):
            check_int(getattr(self, arg), arg, minimum=1)
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads ({self.num_kv_heads}) must divide num_attention_heads ({self.num_attention_heads})"
            )

    @property
    def attention(self) -> str:
        """"MHA" (one KV head per query head), "MQA" (one KV head) or "GQA" (in between)."""
        if self.num_kv_heads == self.num_attention_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    def kv_bytes_per_token(self, dtype=None) -> int:
        return kv_bytes_per_token(self, dtype)

    def kv_bytes(self, num_tokens: int, dtype=None) -> int:
        return kv_bytes(self, num_tokens, dtype)


# From each model's published configuration (layers, heads, head size).
MODEL_PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec("OPT-13B", num_layers=40, num_attention_heads=40, num_kv_heads=40, head_dim=128),
        ModelSpec("Llama-2-7B", num_layers=32, num_attention_heads=32, num_kv_heads=32, head_dim=128),
        ModelSpec("Llama-3-8B", num_layers=32, num_attention_heads=32, num_kv_heads=8, head_dim=128),
        ModelSpec("Llama-2-70B", num_layers=80, num_attention_heads=64, num_kv_heads=8, head_dim=128),
        ModelSpec("Falcon-7B", num_layers=32, num_attention_heads=71, num_kv_heads=1, head_dim=64),
    ]
}


def get_model_preset(name: str) -> ModelSpec:
    """The model preset called ``name`` (case-insensitive), e.g. ``get_model_preset("llama-3-8b")``."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__} {name!r}")
    for key, spec in MODEL_PRESETS.items():
        if key.lower() == name.lower():
            return spec
    raise ValueError(f"name {name!r} is not a model preset; choose one of {', '.join(MODEL_PRESETS)}")


def _spec(model) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str):
        return get_model_preset(model)
    raise TypeError(f"model must be a ModelSpec or a model preset name, got {model!r}")


def kv_bytes_per_token(model: ModelSpec | str, dtype=None) -> int:
    """Bytes of K and V for one token in every layer: 2 · L · h_kv · d_h · b."""
    spec = _spec(model)
    b = spec.dtype_bytes if dtype is None else dtype_bytes(dtype)
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * b


def kv_bytes(model: ModelSpec | str, num_tokens: int, dtype=None) -> int:
    """M = 2 · L · n · h_kv · d_h · b: the KV cache of ``num_tokens`` tokens, in bytes."""
    return check_int(num_tokens, "num_tokens") * kv_bytes_per_token(model, dtype)


# ----------------------------------------------------------------------------
# slots: fixed reservation against blocks
# ----------------------------------------------------------------------------






def allocated_slots(num_tokens: int, block_size: int) -> int:
    """A_B(n) = B · ceil(n / B): the token slots a sequence of n tokens holds."""
    return block_size * blocks_needed(num_tokens, block_size)


def tail_waste(num_tokens: int, block_size: int) -> int:
    """W_B(n) = A_B(n) − n: empty slots in the last block, always between 0 and B − 1."""
    return allocated_slots(num_tokens, block_size) - num_tokens


def paged_slots(lengths: Sequence[int], block_size: int) -> int:
    """Σ A_B(n_i): slots a batch holds when every sequence gets whole blocks."""
    check_int(block_size, "block_size", minimum=1)
    return sum(allocated_slots(n, block_size) for n in _lengths(lengths))


def fixed_slots(lengths: Sequence[int], max_len: int) -> int:
    """Slots a batch holds when every sequence reserves ``max_len`` up front."""
    m = check_int(max_len, "max_len", minimum=1)
    lengths = _lengths(lengths)
    for i, n in enumerate(lengths):
        if n > m:
            raise ValueError(f"lengths[{i}] = {n} is longer than max_len = {m}")
    return m * len(lengths)


def _ratio(used: int, held: int) -> float:
    if held == 0:
        raise ValueError("lengths are all 0: nothing is allocated, so utilisation is undefined")
    return slot_utilisation(used, held)


def slot_utilisation(num_tokens: int, num_slots: int) -> float:
    """U of a pool at one moment: tokens held / slots allocated to the sequences (0.0 while none is allocated).

    The one place utilisation is computed: :func:`utilisation` from lengths, the trace simulator's
    pools, the engine's memory report and chapter 07's measures all call it.

    Args:
        num_tokens: tokens the sequences hold (above ``num_slots`` only when forks share blocks).
        num_slots: slots allocated to them: blocks held × block size, or a contiguous pool's reserved slots.
    """
    num_tokens = check_int(num_tokens, "num_tokens")
    num_slots = check_int(num_slots, "num_slots")
    return num_tokens / num_slots if num_slots else 0.0






def utilisation(lengths: Sequence[int], block_size: int) -> float:
    """U = Σ n_i / Σ A_B(n_i): the fraction of allocated slots that hold a token."""
    return _ratio(sum(_lengths(lengths)), paged_slots(lengths, block_size))


def fixed_utilisation(lengths: Sequence[int], max_len: int) -> float:
    """Σ n_i / (len · max_len): the same fraction under fixed max-length reservation."""
    return _ratio(sum(_lengths(lengths)), fixed_slots(lengths, max_len))


@dataclass(frozen=True)
class SlotRow:
    scheme: str
    effective: int  # slots holding a token
    allocated: int  # slots held
    utilisation: float

    @property
    def wasted(self) -> int:
        return self.allocated - self.effective


def compare_slots(lengths: Sequence[int], max_len: int, block_sizes: Sequence[int] = (16, 32)) -> list[SlotRow]:
    """One row for fixed reservation, then one per block size."""
    lengths = _lengths(lengths)
    eff = sum(lengths)
    rows = [SlotRow(f"fixed {max_len}", eff, fixed_slots(lengths, max_len), fixed_utilisation(lengths, max_len))]
    for b in block_sizes:
        rows.append(SlotRow(f"paged B={b}", eff, paged_slots(lengths, b), utilisation(lengths, b)))
    return rows


# ----------------------------------------------------------------------------
# plain-text tables (so notebooks print the same thing everywhere)
# ----------------------------------------------------------------------------


def format_table(headers: Sequence[str], rows: Iterable[Sequence]) -> str:
    """Columns right-aligned except the first; every cell is str()-ed as given."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])


def slot_table(rows: Sequence[SlotRow]) -> str:
    return format_table(
        ["scheme", "effective", "allocated", "wasted", "utilisation"],
        [(r.scheme, r.effective, r.allocated, r.wasted, f"{100 * r.utilisation:.2f}%") for r in rows],
    )


def model_presets_table(max_len: int = 4096, dtype=None) -> str:
    """Every model preset: its shape, KV bytes per token and for one ``max_len`` sequence."""
    rows = []
    for s in MODEL_PRESETS.values():
        per_tok = kv_bytes_per_token(s, dtype)
        rows.append((s.name, s.num_layers, s.num_attention_heads, s.num_kv_heads, s.head_dim, s.attention,
                     f"{per_tok / 1024:g}", f"{kv_bytes(s, max_len, dtype) / 2**30:.3f}"))
    return format_table(["model", "layers", "q heads", "kv heads", "head dim", "kind", "KiB/token",
                         f"GiB/{max_len} tok"], rows)


# ----------------------------------------------------------------------------
# sequence lengths, from the workload's length presets
# ----------------------------------------------------------------------------


def sample_lengths(preset: str | WorkloadPreset, num_seqs: int, max_len: int, seed: int = 0) -> np.ndarray:
    """``num_seqs`` finished-sequence lengths (prompt + output, int64), cut off at ``max_len``.

    Args:
        preset: a name in ``workload.LENGTH_PRESETS`` or a ``WorkloadPreset``.
        num_seqs: how many lengths (at most ``workload.MAX_DRAWS``).
        max_len: the longest sequence the server allows; longer ones stop there.
        seed: the seed of ``np.random.default_rng``.
    """
    preset = get_length_preset(preset)
    num_seqs = check_num_draws(num_seqs, "num_seqs")
    m = check_int(max_len, "max_len", minimum=1)
    rng = np.random.default_rng(check_int(seed, "seed"))
    return np.minimum(preset.sequence_lengths(num_seqs, rng), m)


# ----------------------------------------------------------------------------
# capacity: how many sequences fit in a memory budget
# ----------------------------------------------------------------------------

BLOCK_TABLE_ENTRY_BYTES = 4  # int32


@dataclass(frozen=True)
class Breakdown:
    """Where every byte of the budget goes under one scheme. The parts sum to the budget."""

    scheme: str
    num_seqs: int
    effective_kv: int  # K/V of real tokens
    tail_waste: int  # empty slots in last blocks (paged)
    reservation_waste: int  # reserved-but-empty slots (fixed)
    block_table: int  # int32 block-table rows (paged)
    unused: int  # left over: too small for the next sequence

    @property
    def total(self) -> int:
        return self.effective_kv + self.tail_waste + self.reservation_waste + self.block_table + self.unused

    def parts(self) -> dict[str, int]:
        return {"effective KV": self.effective_kv, "tail waste": self.tail_waste,
                "reservation waste": self.reservation_waste, "block table": self.block_table,
                "unused": self.unused}


@dataclass(frozen=True)
class CapacityReport:
    model: ModelSpec
    budget_bytes: int
    block_size: int
    max_len: int
    dtype_bytes: int
    preset: WorkloadPreset
    seed: int
    fixed: Breakdown
    paged: Breakdown
    lengths: np.ndarray = field(repr=False)  # the sampled lengths in admission order, up to the first refused

    @property
    def gain(self) -> float:
        """How many times more sequences paging admits; ``math.nan`` when fixed reservation admits none."""
        return self.paged.num_seqs / self.fixed.num_seqs if self.fixed.num_seqs else math.nan

    def table(self) -> str:
        def cell(v):
            return f"{v / 2**20:,.2f} MiB ({100 * v / self.budget_bytes:.1f}%)"

        rows = [("sequences", self.fixed.num_seqs, self.paged.num_seqs)]
        rows += [(k, cell(self.fixed.parts()[k]), cell(v)) for k, v in self.paged.parts().items()]
        rows.append(("total", cell(self.fixed.total), cell(self.paged.total)))
        return format_table(["", "fixed reservation", f"paged B={self.block_size}"], rows)

    def __str__(self) -> str:
        head = (f"{self.model.name}, {self.budget_bytes / 2**30:g} GiB of KV, {self.dtype_bytes} B/number, "
                f"max_len {self.max_len}, {self.preset.name} lengths, seed {self.seed}")
        if self.fixed.num_seqs:
            verdict = f"paging admits {self.gain:.2f}x the sequences"
        else:  # no ratio to a zero: say what each admits
            verdict = (f"fixed reservation admits no sequence (one takes {self.max_len} slots); "
                       f"paging admits {self.paged.num_seqs}")
        return f"{head}\n{self.table()}\n{verdict}"


def fixed_breakdown(lengths: Sequence[int], budget_bytes: int, max_len: int, slot_bytes: int) -> Breakdown:
    """Where every byte of ``budget_bytes`` goes when each admitted sequence reserves ``max_len`` slots.

    Exercise 01, Task 1.1: the fixed-reservation half of :func:`capacity`'s decision. Sequences are
    admitted in the order of ``lengths``, each while its reservation still fits in what the earlier
    ones left; the first that does not fit stops admission (no later one is tried). A length above
    ``max_len`` counts as ``max_len``: the server stops a sequence there.

    Args:
        lengths: the sequences' lengths in tokens, in arrival order (ints >= 0; may be empty).
        budget_bytes: the KV memory to fill (an int >= 0, up to 2**60 and more: stay in integers).
        max_len: the slots each sequence reserves (>= 1).
        slot_bytes: the bytes of one slot, one token's K and V in every layer (>= 1).

    Returns:
        ``Breakdown("fixed", num_seqs, effective_kv, 0, reservation_waste, 0, unused)``, every part in bytes
        (ints): ``num_seqs`` the admitted prefix's length; ``effective_kv`` the slots its tokens fill;
        ``reservation_waste`` its reserved but empty slots; ``unused`` the rest. The parts sum to
        ``budget_bytes``, and ``unused`` is less than one reservation whenever a sequence was refused.
    """
    ### BEGIN SOLUTION (Exercise 01, Task 1.1)
    reservation = max_len * slot_bytes
    num_seqs = min(len(lengths), budget_bytes // reservation)
    tokens = sum(min(n, max_len) for n in lengths[:num_seqs])
    held = num_seqs * reservation
    return Breakdown("fixed", num_seqs, tokens * slot_bytes, 0, held - tokens * slot_bytes, 0, budget_bytes - held)
    ### END SOLUTION


def paged_breakdown(lengths: Sequence[int], budget_bytes: int, block_size: int, max_len: int,
                    slot_bytes: int) -> Breakdown:
    """Where every byte of ``budget_bytes`` goes when each admitted sequence holds whole blocks and a block-table row.

    Exercise 01, Task 1.2: the paged half of :func:`capacity`'s decision. Sequences are admitted in
    the order of ``lengths`` while what each costs still fits in what the earlier ones left; the
    first that does not fit stops admission (no later, smaller one is tried). A sequence of ``n``
    tokens (``n`` cut at ``max_len``, where the server stops it) costs

    - its ``A_B(n) = B · ceil(n / B)`` slots, ``n`` of them holding tokens and the rest tail waste, and
    - one block-table row: ``ceil(max_len / B)`` int32 entries (``BLOCK_TABLE_ENTRY_BYTES`` each), the row
      a sequence that may grow to ``max_len`` needs, whatever its length now.

    ``ceil_div`` (imported here from :mod:`minipaged.block_math`) is an exact integer ceiling. The arguments
    come checked from :func:`capacity`: the piece need not check them again.

    Args:
        lengths: the sequences' lengths in tokens, in arrival order (ints >= 0; may be empty).
        budget_bytes: the KV memory to fill (an int >= 0, up to 2**60 and more: stay in integers).
        block_size: B, the slots of one block (>= 1).
        max_len: the longest a sequence may grow (>= 1).
        slot_bytes: the bytes of one slot, one token's K and V in every layer (>= 1).

    Returns:
        ``Breakdown("paged", num_seqs, effective_kv, tail_waste, 0, block_table, unused)``, every part in
        bytes (ints): the admitted prefix's tokens, its tail waste (under ``B`` slots per sequence), its
        block-table rows, and the rest. The parts sum to ``budget_bytes``, and ``unused`` is less than
        what the first refused sequence would cost.
    """
    ### BEGIN SOLUTION (Exercise 01, Task 1.2)
    row_bytes = BLOCK_TABLE_ENTRY_BYTES * ceil_div(max_len, block_size)
    num_seqs = tokens = slots = 0
    for n in lengths:
        n = min(n, max_len)
        held = block_size * ceil_div(n, block_size)
        if (slots + held) * slot_bytes + (num_seqs + 1) * row_bytes > budget_bytes:
            break
        num_seqs, tokens, slots = num_seqs + 1, tokens + n, slots + held
    table = num_seqs * row_bytes
    return Breakdown("paged", num_seqs, tokens * slot_bytes, (slots - tokens) * slot_bytes, 0, table,
                     budget_bytes - slots * slot_bytes - table)
    ### END SOLUTION


def capacity(model: ModelSpec | str, budget_bytes: int, block_size: int, max_len: int,
             preset: str | WorkloadPreset, dtype=None, seed: int = 0) -> CapacityReport:
    """How many sequences of a length preset fit in ``budget_bytes`` of KV cache.

    A snapshot: every sequence already holds its sampled length (no growth, no
    preemption). Sequences are admitted in sampled order until the next one
    does not fit. Fixed reservation charges ``max_len`` slots each; paging
    charges whole blocks plus an int32 block-table row of ceil(max_len / B)
    entries each. The budget is KV memory only: weights and activations are
    assumed to be paid already. The decision itself is :func:`fixed_breakdown`
    and :func:`paged_breakdown` on the sampled lengths (exercise 01 builds them).

    Args:
        model: a ``ModelSpec`` or a name in ``MODEL_PRESETS``.
        budget_bytes: the KV memory to fill.
        block_size: B, tokens per block.
        max_len: the reservation per sequence; sampled lengths are cut off there.
        preset: the length preset (see :func:`sample_lengths`).
        dtype: bytes per number (default: the model's own).
        seed: the seed of the sampled lengths.

    A budget below one sequence is legal: that scheme admits 0 (see :attr:`CapacityReport.gain`). A budget
    that holds more than ``workload.MAX_DRAWS`` sequences is a ``ValueError``, raised before sampling.
    """
    spec = _spec(model)
    budget = check_int(budget_bytes, "budget_bytes")
    B = check_int(block_size, "block_size", minimum=1)
    m = check_int(max_len, "max_len", minimum=1)
    preset = get_length_preset(preset)
    b = spec.dtype_bytes if dtype is None else dtype_bytes(dtype)
    slot = kv_bytes_per_token(spec, b)
    row = BLOCK_TABLE_ENTRY_BYTES * blocks_needed(m, B)
    # Neither scheme can admit more sequences than this, so this many samples suffice.
    limit = budget // min(m * slot, B * slot + row)
    if limit + 1 > MAX_DRAWS:  # refused before sampling: the array alone would not fit in memory
        raise ValueError(f"budget_bytes = {budget:,} holds up to {limit:,} sequences, more than the limit of "
                         f"{MAX_DRAWS:,} sampled sequences (workload.MAX_DRAWS): lower budget_bytes")
    lengths = sample_lengths(preset, limit + 1, m, seed)
    order = lengths.tolist()  # plain ints: the breakdowns stay exact at any budget
    fixed = fixed_breakdown(order, budget, m, slot)
    paged = paged_breakdown(order, budget, B, m, slot)
    return CapacityReport(spec, budget, B, m, b, preset, seed, fixed, paged,
                          lengths[: max(paged.num_seqs, fixed.num_seqs) + 1])


# ----------------------------------------------------------------------------
# "paging saves 57% at every batch size": test the claim
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SavingRow:
    preset: str
    batch_size: int
    fixed_bytes: int
    paged_bytes: int
    expected_saving: float  # 1 − E[A_B(n)] / max_len, from a large sample

    @property
    def saving(self) -> float:
        return 1.0 - self.paged_bytes / self.fixed_bytes


def expected_saving(preset: str | WorkloadPreset, block_size: int, max_len: int, num_samples: int = 100_000,
                    seed: int = 12345) -> float:
    """1 − E[A_B(n)] / max_len, estimated from ``num_samples`` draws: the saving a large batch tends to.

    Args:
        preset: the length preset (see :func:`sample_lengths`).
        block_size: B, tokens per block.
        max_len: the reservation per sequence; sampled lengths are cut off there.
        num_samples: how many lengths to average over.
        seed: the seed of the sampled lengths.
    """
    B = check_int(block_size, "block_size", minimum=1)
    lengths = sample_lengths(preset, check_num_draws(num_samples, "num_samples", minimum=1), max_len, seed)
    mean_alloc = float(((lengths + B - 1) // B * B).mean())
    return 1.0 - mean_alloc / max_len


def saving_grid(model: ModelSpec | str, presets: Sequence[str | WorkloadPreset], batch_sizes: Sequence[int],
                block_size: int = 16, max_len: int = 2048, dtype=None, seed: int = 0) -> list[SavingRow]:
    """KV bytes of one batch under fixed reservation vs paging, per length preset and batch size.

    Each batch is ``batch_size`` fresh lengths, drawn with a seed of its own, so that no two batches
    share lengths. The block table is left out here, as in the claim being tested.

    Args:
        model: a ``ModelSpec`` or a name in ``MODEL_PRESETS``.
        presets: the length presets, names or ``WorkloadPreset`` objects.
        batch_sizes: the batch sizes to try, each >= 1.
        block_size: B, tokens per block.
        max_len: the reservation per sequence; sampled lengths are cut off there.
        dtype: bytes per number (default: the model's own).
        seed: the seed of the first batch size's lengths; the k-th batch size (from 0) draws with ``seed + k``.
    """
    B = check_int(block_size, "block_size", minimum=1)
    seed = check_int(seed, "seed")
    slot = kv_bytes_per_token(model, dtype)
    rows = []
    for preset in presets:
        preset = get_length_preset(preset)
        exp = expected_saving(preset, B, max_len)
        for k, bs in enumerate(batch_sizes):
            lengths = sample_lengths(preset, check_int(bs, "batch_size", minimum=1), max_len, seed + k)
            rows.append(SavingRow(preset.name, int(bs), fixed_slots(lengths, max_len) * slot,
                                  paged_slots(lengths, B) * slot, exp))
    return rows


def saving_table(rows: Sequence[SavingRow]) -> str:
    return format_table(
        ["lengths", "batch", "fixed GiB", "paged GiB", "saving", "1 - E[A]/max_len"],
        [(r.preset, r.batch_size, f"{r.fixed_bytes / 2**30:.2f}", f"{r.paged_bytes / 2**30:.2f}",
          f"{100 * r.saving:.1f}%", f"{100 * r.expected_saving:.1f}%") for r in rows],
    )


# ----------------------------------------------------------------------------
# the vLLM paper's waste breakdown (its Figures 2 and 3), over a sequence's life
# ----------------------------------------------------------------------------

WASTE_PARTS = ("effective KV", "reserved", "internal fragmentation")


def waste_breakdown(preset: str | WorkloadPreset, max_len: int, block_size: int = 16, num_seqs: int = 2000,
                    seed: int = 0) -> dict[str, dict[str, float]]:
    """Shares of the KV slots held over the requests' lives, split as in the vLLM paper's Figure 3.

    Every request is followed through its decode steps: after its j-th output token it holds
    ``h = prompt + j`` tokens of a final ``n``. A slot held at that step is

    - *effective KV* if it holds one of the ``h`` tokens;
    - *reserved* if it waits for one of the request's later tokens (``n − h`` of them);
    - *internal fragmentation* if no token of the request will ever fill it.

    Four schemes, the first three contiguous as in the paper's Figure 2:

    - ``fixed max_len``: every request holds ``max_len`` slots (Orca "Max");
    - ``fixed pow2``: it holds the next power of two at or above ``n``, at most ``max_len`` (Orca "Pow2");
    - ``fixed oracle``: it holds exactly ``n`` (Orca "Oracle": the output length known in advance);
    - ``paged B=…``: it holds ``A_B(h)`` slots, growing block by block; its only internal
      fragmentation is the tail waste ``W_B(h)``, and it reserves nothing ahead.

    External fragmentation needs a timeline of allocations and frees; it is not counted here
    (chapter 02 measures it on a trace).

    Args:
        preset: the length preset (prompt and output lengths), as in :func:`sample_lengths`.
        max_len: the longest sequence; a request whose prompt + output passes it stops there.
        block_size: B, tokens per block, for the paged scheme.
        num_seqs: how many requests to sample.
        seed: the seed of ``np.random.default_rng``; prompts are drawn first, then outputs.

    Returns:
        scheme name -> {part name (:data:`WASTE_PARTS`) -> share of the slot-steps}; shares sum to 1.
    """
    preset = get_length_preset(preset)
    m = check_int(max_len, "max_len", minimum=1)
    B = check_int(block_size, "block_size", minimum=1)
    rng = np.random.default_rng(check_int(seed, "seed"))
    n_seqs = check_int(num_seqs, "num_seqs", minimum=1)
    prompts = preset.prompt_len.sample(n_seqs, rng)
    final = np.minimum(prompts + preset.output_len.sample(n_seqs, rng), m)
    prompts = np.minimum(prompts, final)
    totals = {name: dict.fromkeys(WASTE_PARTS, 0) for name in ("fixed max_len", "fixed pow2", "fixed oracle",
                                                                f"paged B={B}")}
    for p, n in zip(prompts.tolist(), final.tolist()):
        # tokens held after each output token (a prompt cut off at max_len gets no output: one step)
        held = np.arange(p + 1 if n > p else n, n + 1)
        tokens, ahead = int(held.sum()), int((n - held).sum())
        for name, capacity in (("fixed max_len", m), ("fixed pow2", min(1 << (n - 1).bit_length(), m)),
                               ("fixed oracle", n)):
            totals[name]["effective KV"] += tokens
            totals[name]["reserved"] += ahead
            totals[name]["internal fragmentation"] += (capacity - n) * len(held)
        paged = totals[f"paged B={B}"]
        paged["effective KV"] += tokens
        paged["internal fragmentation"] += int(((held + B - 1) // B * B - held).sum())
    return {name: {k: v / sum(parts.values()) for k, v in parts.items()} for name, parts in totals.items()}


# ----------------------------------------------------------------------------
# a paged cache's memory, as chapter 02 reports it
# ----------------------------------------------------------------------------


@dataclass
class MemoryReport:
    """What a paged KV cache holds for some sequences: blocks, tokens, tail waste and bytes (see :func:`memory_report`).

    Attributes:
        num_seqs: the sequences reported on.
        block_size: token slots per block.
        total_blocks, used_blocks, free_blocks: the pool's blocks (used: held by any sequence).
        effective_tokens: tokens the sequences actually hold.
        tail_waste: reserved but unused slots in the sequences' last blocks.
        bytes_per_block: K and V of one block, all layers.
        block_table_bytes: the padded int32 ``[num_seqs, max_blocks]`` tensor the kernel reads.
    """

    num_seqs: int
    block_size: int
    total_blocks: int
    used_blocks: int
    free_blocks: int
    effective_tokens: int
    tail_waste: int
    bytes_per_block: int
    block_table_bytes: int

    @property
    def utilisation(self) -> float:
        """Effective tokens over allocated slots (:func:`slot_utilisation`). Above 1 only when forks share blocks."""
        return slot_utilisation(self.effective_tokens, self.used_blocks * self.block_size)

    @property
    def kv_bytes_used(self) -> int:
        return self.used_blocks * self.bytes_per_block

    def __str__(self) -> str:
        return "\n".join(
            [
                f"sequences          {self.num_seqs}",
                f"blocks used/total  {self.used_blocks}/{self.total_blocks} "
                f"({self.free_blocks} free, block_size {self.block_size})",
                f"effective tokens   {self.effective_tokens}",
                f"tail waste         {self.tail_waste} slots",
                f"utilisation        {self.utilisation:.2%}",
                f"bytes per block    {self.bytes_per_block:,}",
                f"KV bytes used      {self.kv_bytes_used:,} ({_binary(self.kv_bytes_used)})",
                f"block-table bytes  {self.block_table_bytes:,}",
            ]
        )


def _binary(n: int) -> str:
    """``n`` bytes in the largest binary unit it reaches (``"1.50 MiB"``)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def memory_report(cache, tables) -> MemoryReport:
    """The :class:`MemoryReport` of ``cache``'s pool with the sequences whose block tables are ``tables``.

    Args:
        cache: a :class:`~minipaged.cache.PagedKVCache` (its pool, allocator and block bytes).
        tables: the sequences' :class:`~minipaged.blocks.BlockTable` s, from this cache's allocator.
    """
    width = max((t.num_blocks for t in tables), default=0)
    return MemoryReport(
        num_seqs=len(tables),
        block_size=cache.block_size,
        total_blocks=cache.num_blocks,
        used_blocks=cache.allocator.num_used,
        free_blocks=cache.allocator.num_free,
        effective_tokens=sum(t.num_tokens for t in tables),
        tail_waste=sum(t.tail_waste for t in tables),
        bytes_per_block=cache.bytes_per_block,
        block_table_bytes=len(tables) * width * 4,
    )
