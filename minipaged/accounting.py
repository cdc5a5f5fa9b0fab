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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from numbers import Integral
from typing import Iterable, Sequence

import numpy as np

# ----------------------------------------------------------------------------
# input checking: every error names the argument it is about
# ----------------------------------------------------------------------------


def _int(name: str, value, minimum: int) -> int:
    """``value`` as a Python int >= minimum, or a ValueError that names ``name``."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _lengths(lengths, name: str = "lengths") -> list[int]:
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Iterable):
        raise ValueError(f"{name} must be a sequence of token counts, got {lengths!r}")
    out = [_int(f"{name}[{i}]", n, 0) for i, n in enumerate(lengths)]
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
            raise ValueError(f"dtype {dtype!r} is unknown; use bytes (1, 2, 4), a torch dtype, or one of {sorted(DTYPE_BYTES)}")
        return DTYPE_BYTES[key]
    if isinstance(dtype, Integral) and not isinstance(dtype, bool):
        return _int("dtype", dtype, 1)
    itemsize = getattr(dtype, "itemsize", None)  # torch.dtype and numpy dtypes both have it
    if isinstance(itemsize, int) and itemsize > 0:
        return itemsize
    raise ValueError(f"dtype must be bytes per element, a dtype name or a torch dtype, got {dtype!r}")


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
            _int(arg, getattr(self, arg), 1)
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

    def kv_bytes(self, n_tokens: int, dtype=None) -> int:
        return kv_bytes(self, n_tokens, dtype)


# From each model's published configuration (layers, heads, head size).
PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec("OPT-13B", num_layers=40, num_attention_heads=40, num_kv_heads=40, head_dim=128),
        ModelSpec("Llama-2-7B", num_layers=32, num_attention_heads=32, num_kv_heads=32, head_dim=128),
        ModelSpec("Llama-3-8B", num_layers=32, num_attention_heads=32, num_kv_heads=8, head_dim=128),
        ModelSpec("Llama-2-70B", num_layers=80, num_attention_heads=64, num_kv_heads=8, head_dim=128),
        ModelSpec("Falcon-7B", num_layers=32, num_attention_heads=71, num_kv_heads=1, head_dim=64),
    ]
}


def get_preset(name: str) -> ModelSpec:
    """The preset called ``name`` (case-insensitive), e.g. ``get_preset("llama-3-8b")``."""
    for key, spec in PRESETS.items():
        if isinstance(name, str) and key.lower() == name.lower():
            return spec
    raise ValueError(f"name {name!r} is not a preset; choose one of {', '.join(PRESETS)}")


def _spec(model) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str):
        return get_preset(model)
    raise ValueError(f"model must be a ModelSpec or a preset name, got {model!r}")


def kv_bytes_per_token(model: ModelSpec | str, dtype=None) -> int:
    """Bytes of K and V for one token in every layer: 2 · L · h_kv · d_h · b."""
    spec = _spec(model)
    b = spec.dtype_bytes if dtype is None else dtype_bytes(dtype)
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * b


def kv_bytes(model: ModelSpec | str, n_tokens: int, dtype=None) -> int:
    """M = 2 · L · n · h_kv · d_h · b: the KV cache of ``n_tokens`` tokens, in bytes."""
    return _int("n_tokens", n_tokens, 0) * kv_bytes_per_token(model, dtype)


# ----------------------------------------------------------------------------
# slots: fixed reservation against blocks
# ----------------------------------------------------------------------------


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for ints, exact at any size (``math.ceil(a / b)`` rounds through a float)."""
    return -(-a // b)


def blocks_needed(n_tokens: int, block_size: int) -> int:
    """ceil(n / B): a partly filled last block is still a whole block. 0 tokens need 0 blocks."""
    n = _int("n_tokens", n_tokens, 0)
    b = _int("block_size", block_size, 1)
    return ceil_div(n, b)


def allocated_slots(n_tokens: int, block_size: int) -> int:
    """A_B(n) = B · ceil(n / B): the token slots a sequence of n tokens holds."""
    return block_size * blocks_needed(n_tokens, block_size)


def tail_waste(n_tokens: int, block_size: int) -> int:
    """W_B(n) = A_B(n) − n: empty slots in the last block, always between 0 and B − 1."""
    return allocated_slots(n_tokens, block_size) - n_tokens


def paged_slots(lengths: Sequence[int], block_size: int) -> int:
    """Σ A_B(n_i): slots a batch holds when every sequence gets whole blocks."""
    _int("block_size", block_size, 1)
    return sum(allocated_slots(n, block_size) for n in _lengths(lengths))


def fixed_slots(lengths: Sequence[int], max_len: int) -> int:
    """Slots a batch holds when every sequence reserves ``max_len`` up front."""
    m = _int("max_len", max_len, 1)
    lengths = _lengths(lengths)
    for i, n in enumerate(lengths):
        if n > m:
            raise ValueError(f"lengths[{i}] = {n} is longer than max_len = {m}")
    return m * len(lengths)


def _ratio(used: int, held: int) -> float:
    if held == 0:
        raise ValueError("lengths are all 0: nothing is allocated, so utilisation is undefined")
    return used / held


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


def presets_table(max_len: int = 4096, dtype=None) -> str:
    """Every preset: its shape, KV bytes per token and for one ``max_len`` sequence."""
    rows = []
    for s in PRESETS.values():
        per_tok = kv_bytes_per_token(s, dtype)
        rows.append((s.name, s.num_layers, s.num_attention_heads, s.num_kv_heads, s.head_dim, s.attention,
                     f"{per_tok / 1024:g}", f"{kv_bytes(s, max_len, dtype) / 2**30:.3f}"))
    return format_table(["model", "layers", "q heads", "kv heads", "head dim", "kind", "KiB/token",
                         f"GiB/{max_len} tok"], rows)


# ----------------------------------------------------------------------------
# length distributions (constructed, not measured traffic)
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class LengthDistribution:
    """Sequence lengths in tokens, clipped to [1, max_len]. ``sample(n, seed)`` is deterministic."""

    max_len: int = 2048

    def __post_init__(self):
        _int("max_len", self.max_len, 1)

    @property
    def name(self) -> str:
        return type(self).__name__

    def _draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        raise NotImplementedError

    def sample(self, n: int, seed: int) -> np.ndarray:
        """``n`` lengths as int64, from ``numpy.random.default_rng(seed)``."""
        n = _int("n", n, 0)
        seed = _int("seed", seed, 0)
        raw = self._draw(np.random.default_rng(seed), n)
        return np.clip(np.ceil(raw), 1, self.max_len).astype(np.int64)

    def with_max_len(self, max_len: int) -> "LengthDistribution":
        return replace(self, max_len=max_len)


@dataclass(frozen=True)
class ChatLengths(LengthDistribution):
    """Chat-like: log-normal around ``median`` tokens (most short, some long)."""

    median: float = 300.0
    sigma: float = 0.9

    def __post_init__(self):
        super().__post_init__()
        if not (self.median > 0 and self.sigma >= 0):
            raise ValueError(f"median must be > 0 and sigma >= 0, got median={self.median}, sigma={self.sigma}")

    @property
    def name(self) -> str:
        return "chat"

    def _draw(self, rng, n):
        return rng.lognormal(mean=math.log(self.median), sigma=self.sigma, size=n)


@dataclass(frozen=True)
class LongTailLengths(LengthDistribution):
    """Long-tailed: Pareto with minimum ``scale`` tokens and tail index ``alpha`` (smaller = heavier)."""

    scale: float = 64.0
    alpha: float = 1.2

    def __post_init__(self):
        super().__post_init__()
        if not (self.scale > 0 and self.alpha > 0):
            raise ValueError(f"scale and alpha must be > 0, got scale={self.scale}, alpha={self.alpha}")

    @property
    def name(self) -> str:
        return "long-tail"

    def _draw(self, rng, n):
        return self.scale * (1.0 + rng.pareto(self.alpha, size=n))


@dataclass(frozen=True)
class UniformLengths(LengthDistribution):
    """Every length from ``low`` to ``max_len`` equally likely."""

    low: int = 1

    def __post_init__(self):
        super().__post_init__()
        _int("low", self.low, 1)
        if self.low > self.max_len:
            raise ValueError(f"low ({self.low}) must be <= max_len ({self.max_len})")

    @property
    def name(self) -> str:
        return "uniform"

    def _draw(self, rng, n):
        return rng.integers(self.low, self.max_len, size=n, endpoint=True)


def default_distributions(max_len: int = 2048) -> dict[str, LengthDistribution]:
    """The three constructed distributions the course uses, keyed by ``name``."""
    dists = [ChatLengths(max_len=max_len), LongTailLengths(max_len=max_len), UniformLengths(max_len=max_len)]
    return {d.name: d for d in dists}


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
    distribution: LengthDistribution
    seed: int
    fixed: Breakdown
    paged: Breakdown
    lengths: np.ndarray = field(repr=False)  # the sampled lengths, in admission order

    @property
    def gain(self) -> float:
        """How many times more sequences paging admits."""
        return self.paged.num_seqs / self.fixed.num_seqs if self.fixed.num_seqs else math.inf

    def table(self) -> str:
        def cell(v):
            return f"{v / 2**20:,.2f} MiB ({100 * v / self.budget_bytes:.1f}%)"

        rows = [("sequences", self.fixed.num_seqs, self.paged.num_seqs)]
        rows += [(k, cell(self.fixed.parts()[k]), cell(v)) for k, v in self.paged.parts().items()]
        rows.append(("total", cell(self.fixed.total), cell(self.paged.total)))
        return format_table(["", "fixed reservation", f"paged B={self.block_size}"], rows)

    def __str__(self) -> str:
        head = (f"{self.model.name}, {self.budget_bytes / 2**30:g} GiB of KV, {self.dtype_bytes} B/number, "
                f"max_len {self.max_len}, lengths {self.distribution!r} seed {self.seed}")
        return f"{head}\n{self.table()}\npaging admits {self.gain:.2f}x the sequences"


def capacity(model: ModelSpec | str, budget_bytes: int, block_size: int, max_len: int,
             distribution: LengthDistribution, dtype=None, seed: int = 0) -> CapacityReport:
    """How many sequences of a length distribution fit in ``budget_bytes`` of KV cache.

    A snapshot: every sequence already holds its sampled length (no growth, no
    preemption). Sequences are admitted in sampled order until the next one
    does not fit. Fixed reservation charges ``max_len`` slots each; paging
    charges whole blocks plus an int32 block-table row of ceil(max_len / B)
    entries each. A distribution with another ``max_len`` is re-clipped to
    this one. The budget is KV memory only: weights and activations are
    assumed to be paid already.
    """
    spec = _spec(model)
    budget = _int("budget_bytes", budget_bytes, 0)
    B = _int("block_size", block_size, 1)
    m = _int("max_len", max_len, 1)
    b = spec.dtype_bytes if dtype is None else dtype_bytes(dtype)
    if not isinstance(distribution, LengthDistribution):
        raise ValueError(f"distribution must be a LengthDistribution, got {distribution!r}")
    dist = distribution.with_max_len(m) if distribution.max_len != m else distribution
    slot = kv_bytes_per_token(spec, b)
    row = BLOCK_TABLE_ENTRY_BYTES * blocks_needed(m, B)

    # Neither scheme can admit more sequences than this, so this many samples suffice.
    limit = budget // min(m * slot, B * slot + row)
    lengths = dist.sample(limit + 1, seed)

    k = budget // (m * slot)
    eff = int(lengths[:k].sum()) * slot
    fixed = Breakdown("fixed", k, eff, 0, k * m * slot - eff, 0, budget - k * m * slot)

    cost = (-(-lengths // B) * B) * slot + row  # bytes per sequence, paged
    k = int(np.searchsorted(np.cumsum(cost), budget, side="right"))
    used = lengths[:k]
    eff = int(used.sum()) * slot
    held = int((-(-used // B) * B).sum()) * slot
    paged = Breakdown("paged", k, eff, held - eff, 0, k * row, budget - held - k * row)
    return CapacityReport(spec, budget, B, m, b, dist, seed, fixed, paged, lengths[: max(k, fixed.num_seqs)])


# ----------------------------------------------------------------------------
# "paging saves 57% at every batch size": test the claim
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SavingRow:
    distribution: str
    batch_size: int
    fixed_bytes: int
    paged_bytes: int
    expected_saving: float  # 1 − E[A_B(n)] / max_len, from a large sample

    @property
    def saving(self) -> float:
        return 1.0 - self.paged_bytes / self.fixed_bytes


def expected_saving(distribution: LengthDistribution, block_size: int, samples: int = 100_000, seed: int = 12345) -> float:
    """1 − E[A_B(n)] / max_len, estimated from ``samples`` draws: the saving a large batch tends to."""
    lengths = distribution.sample(samples, seed)
    mean_alloc = float((-(-lengths // block_size) * block_size).mean())
    return 1.0 - mean_alloc / distribution.max_len


def saving_grid(model: ModelSpec | str, distributions: Sequence[LengthDistribution], batch_sizes: Sequence[int],
                block_size: int = 16, dtype=None, seed: int = 0) -> list[SavingRow]:
    """KV bytes of one batch under fixed reservation vs paging, per distribution and batch size.

    Each batch is ``batch_size`` fresh lengths (seeded). The block table is
    left out here, as in the claim being tested.
    """
    B = _int("block_size", block_size, 1)
    slot = kv_bytes_per_token(model, dtype)
    rows = []
    for dist in distributions:
        exp = expected_saving(dist, B)
        for bs in batch_sizes:
            lengths = dist.sample(_int("batch_size", bs, 1), seed)
            rows.append(SavingRow(dist.name, int(bs), fixed_slots(lengths, dist.max_len) * slot,
                                  paged_slots(lengths, B) * slot, exp))
    return rows


def saving_table(rows: Sequence[SavingRow]) -> str:
    return format_table(
        ["distribution", "batch", "fixed GiB", "paged GiB", "saving", "1 - E[A]/max_len"],
        [(r.distribution, r.batch_size, f"{r.fixed_bytes / 2**30:.2f}", f"{r.paged_bytes / 2**30:.2f}",
          f"{100 * r.saving:.1f}%", f"{100 * r.expected_saving:.1f}%") for r in rows],
    )
