"""Trade-offs: which block size and which engine settings, measured one factor at a time.

Chapter 07 asks what a deployer asks: which settings, and why? Every answer
here is measured on the course's own code, nothing is re-derived:

* **Memory per block size** replays one trace through chapter 02's
  :class:`~minipaged.trace.TraceSimulator` (a pool of the same number of
  token slots for every block size) and sets the measured utilisation and tail
  waste beside chapter 01's formula (:func:`~minipaged.accounting.utilisation`,
  :func:`~minipaged.accounting.tail_waste`) on the trace's lengths.
* **Three measures of memory use** (GLOSSARY): utilisation U (tokens / slots
  allocated to the sequences), KV usage (blocks in use / blocks in the pool,
  vLLM's ``kv_cache_usage_perc``) and token occupancy (tokens / slots in the
  pool). Token occupancy = KV usage x U, so a gauge of blocks overstates what
  the pool holds by 1 / U (:func:`memory_measures`, :func:`vllm_gauge_case`).
* **Attention cost proxy**: the Triton decode kernel's launch grid and loop
  steps, from the kernel's own constants and split heuristic
  (:func:`decode_launch`), the work an interpreter can count where a GPU
  would be timed.
* **Sharing**: the prefix cache's hit rate per block size, by replaying
  prompts through chapter 06's allocator (:func:`prefix_hit_rate`).
* **The engine**, on the virtual clock (deterministic): one run per setting
  (:func:`run_engine`), the block-size sweep (:func:`block_size_sweep`) and the
  one-factor ablations (:data:`ABLATIONS`, :func:`ablation_runs`).

Two length regimes stand in for the vLLM paper's traces (its Figure 18):
``sharegpt_like`` (long prompts, long answers) and ``alpaca_like`` (short
ones), at real scale for the memory sweeps (:data:`REGIMES`) and scaled
down for the engine on the tiny model (:data:`TINY_REGIMES`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from minipaged.accounting import BLOCK_TABLE_ENTRY_BYTES, slot_utilisation, tail_waste, utilisation
from minipaged.block_math import blocks_needed, ceil_div, kv_usage, token_occupancy
from minipaged.blocks import BlockAllocator, BlockTable
from minipaged.clock import StepCost, VirtualClock
from minipaged.engine import Engine
from minipaged.latency import percentiles, request_latencies, summarize
from minipaged.model import LlamaConfig, LlamaForCausalLM
from minipaged.prefix_cache import PrefixCachingAllocator
from minipaged.scheduler import EngineConfig
from minipaged.trace import TraceSimulator
from minipaged.validation import check_int
from minipaged.workload import LogNormal, RequestSpec, WorkloadPreset, make_workload, prompt_token_ids

BLOCK_SIZES = tuple(2**i for i in range(9))  # 1, 2, 4, ..., 256: the vLLM paper's Figure 18 range

# The vLLM paper's traces (its Figure 11): ShareGPT averages 161 prompt and 338 output tokens, Alpaca 19
# and 58. A log-normal's mean is median * exp(sigma**2 / 2); these are constructed, not measured.
SHAREGPT_LIKE = WorkloadPreset("sharegpt_like", LogNormal(100, 1.0, 4, 1024), LogNormal(220, 0.9, 4, 1024))
ALPACA_LIKE = WorkloadPreset("alpaca_like", LogNormal(16, 0.6, 4, 128), LogNormal(45, 0.7, 2, 256))
REGIMES = {p.name: p for p in (SHAREGPT_LIKE, ALPACA_LIKE)}
# The same shapes a quarter as long, for the engine on the tiny model (its runs stay a few seconds).
TINY_REGIMES = {
    p.name: p
    for p in (
        WorkloadPreset("tiny_sharegpt_like", LogNormal(25, 1.0, 2, 128), LogNormal(55, 0.9, 2, 112)),
        WorkloadPreset("tiny_alpaca_like", LogNormal(4, 0.6, 2, 32), LogNormal(11, 0.7, 2, 64)),
    )
}


def _block_size(block_size) -> int:
    return check_int(block_size, "block_size", minimum=1)


# ----------------------------------------------------------------------------
# three measures of memory use
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryMeasures:
    """The pool at one moment, three ways (see GLOSSARY: utilisation, KV usage, token occupancy)."""

    num_tokens: int  # tokens the sequences hold
    used_blocks: int  # blocks the sequences hold
    num_blocks: int  # blocks in the pool
    block_size: int

    @property
    def utilisation(self) -> float:
        """U: tokens / slots allocated to the sequences (chapter 01)."""
        return slot_utilisation(self.num_tokens, self.used_blocks * self.block_size)

    @property
    def kv_usage(self) -> float:
        """Blocks in use / blocks in the pool: what vLLM's ``kv_cache_usage_perc`` reports."""
        return kv_usage(self.used_blocks, self.num_blocks)

    @property
    def token_occupancy(self) -> float:
        """Tokens / token slots in the pool; always ``kv_usage * utilisation``."""
        return token_occupancy(self.num_tokens, self.num_blocks * self.block_size)


def memory_measures(lengths: Sequence[int], block_size: int, num_blocks: int) -> MemoryMeasures:
    """The three measures for sequences of ``lengths`` tokens, each in its own block table, in one pool.

    The tables are real: a :class:`~minipaged.blocks.BlockAllocator` of ``num_blocks`` blocks
    hands out their blocks, and the measures read the allocator and the tables.

    Args:
        lengths: tokens each sequence holds (each >= 1).
        block_size: B, tokens per block.
        num_blocks: blocks in the pool.

    Raises:
        OutOfBlocks: the sequences do not fit the pool.
    """
    allocator = BlockAllocator(check_int(num_blocks, "num_blocks", minimum=1), _block_size(block_size))
    tables = []
    for i, n in enumerate(lengths):
        table = BlockTable(allocator, i)
        table.append_tokens(check_int(n, f"lengths[{i}]", minimum=1))
        tables.append(table)
    return MemoryMeasures(sum(t.num_tokens for t in tables), allocator.num_used, allocator.num_blocks,
                          allocator.block_size)  # fmt: skip


def vllm_gauge_case(max_num_seqs: int = 256, num_blocks: int = 768, prompt_len: int = 17,
                    block_size: int = 16) -> MemoryMeasures:
    """A reported vLLM reading, rebuilt: 17-token prompts at block size 16 read 66.7% KV usage, 36.5% occupancy.

    A saturating stream of short requests keeps ``max_num_seqs`` sequences running (vLLM's default is
    256), each observed at its prompt or one token past it: half at ``prompt_len``, half at
    ``prompt_len + 1`` tokens. Each holds ``ceil(n / B)`` blocks, two for 17 or 18 tokens, so
    the gauge counts 2 x 256 of 768 blocks while the tokens fill barely more than half of them.

    Args:
        max_num_seqs: sequences running at once.
        num_blocks: blocks in the pool.
        prompt_len: tokens of every prompt.
        block_size: B.
    """
    n = check_int(max_num_seqs, "max_num_seqs", minimum=1)
    p = check_int(prompt_len, "prompt_len", minimum=1)
    return memory_measures([p + i % 2 for i in range(n)], block_size, num_blocks)


# ----------------------------------------------------------------------------
# memory per block size: the trace simulator against chapter 01's formula
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryRow:
    """One block size replayed through the trace simulator (means over the steps that hold tokens)."""

    block_size: int
    num_blocks: int
    utilisation: float  # measured: tokens / allocated slots
    formula_utilisation: float  # chapter 01: sum n / sum A_B(n) over the trace's final lengths
    tail_waste: float  # measured: empty slots in last blocks per running sequence
    formula_tail_waste: float  # chapter 01: mean W_B(n) over the trace's final lengths
    kv_usage: float
    token_occupancy: float
    mean_running: float
    preempted: int
    block_table_bytes: int  # int32 block-table row of one max_len sequence (ceil(max_len / B) entries)


def memory_sweep(trace: list[RequestSpec], pool_tokens: int, block_sizes: Sequence[int] = BLOCK_SIZES,
                 max_len: int = 2048, max_wait: int = 10_000) -> list[MemoryRow]:  # fmt: skip
    """Replay ``trace`` through a paged pool of ``pool_tokens`` slots at each block size.

    Args:
        trace: the requests; arrival times in seconds, one toy step per second (``step_time=1.0`` of
            :class:`~minipaged.trace.TraceSimulator`).
        pool_tokens: token slots in the pool; ``pool_tokens // B`` blocks of B slots each.
        block_sizes: the block sizes to replay.
        max_len: the longest sequence (sizes a block-table row).
        max_wait: steps a request may wait before the simulator rejects it.
    """
    pool_tokens = check_int(pool_tokens, "pool_tokens", minimum=1)
    final = [r.num_prompt_tokens + r.num_output_tokens for r in trace]
    rows = []
    for B in block_sizes:
        B = _block_size(B)
        sim = TraceSimulator(trace, num_blocks=max(1, pool_tokens // B), block_size=B, max_len=max_len,
                             max_wait=max_wait, systems=("paged",))  # fmt: skip
        sim.run()
        busy = [row["paged"] for row in sim.history if row["paged"].reserved]
        slots = sim.num_blocks * B
        rows.append(MemoryRow(
            block_size=B,
            num_blocks=sim.num_blocks,
            utilisation=float(np.mean([r.utilisation for r in busy])),
            formula_utilisation=utilisation(final, B),
            tail_waste=float(np.mean([r.unfilled_slots / r.running for r in busy if r.running])),
            formula_tail_waste=float(np.mean([tail_waste(n, B) for n in final])),
            kv_usage=float(np.mean([kv_usage(r.reserved // B, sim.num_blocks) for r in busy])),
            token_occupancy=float(np.mean([token_occupancy(r.tokens, slots) for r in busy])),
            mean_running=float(np.mean([r.running for r in busy])),
            preempted=sim.history[-1]["paged"].preempted,
            block_table_bytes=BLOCK_TABLE_ENTRY_BYTES * blocks_needed(max_len, B),
        ))
    return rows


# ----------------------------------------------------------------------------
# attention cost: what the Triton decode kernel launches
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeLaunch:
    """One decode step of the Triton kernel, counted from its launch grid (no GPU needed)."""

    block_size: int
    tile: int  # tokens per loop step: the kernel's KV_TILE, whatever the block size
    num_splits: int
    programs: int  # num_seqs * num_kv_heads * num_splits
    loop_steps: int  # tile iterations, all programs together
    tokens_loaded: int  # loop_steps * tile: the context plus masked padding
    block_table_reads: int  # distinct block-table entries read: sum ceil(L / B) per KV head


def decode_launch(seq_lens: Sequence[int], block_size: int, num_kv_heads: int, parallelism: int | None = None,
                  num_splits: int | None = None) -> DecodeLaunch:  # fmt: skip
    """The grid and loop steps :func:`minipaged.kernels.paged_decode_attention` runs for these context lengths.

    Each program walks ``[start, end)`` of its sequence in tiles of ``TILE`` tokens, as the kernel's
    loop does; the split count comes from the kernel's own heuristic.

    Args:
        seq_lens: each sequence's context length (>= 1).
        block_size: B.
        num_kv_heads: KV heads (one program per sequence and KV head, per split).
        parallelism: the machine's parallel units for the split heuristic (None: the kernel's CPU stand-in).
        num_splits: force a split count (None: the heuristic's choice).
    """
    from minipaged.kernels import paged_attention as kernel  # chapter 04, reached by name only (needs triton)

    lens = [check_int(n, f"seq_lens[{i}]", minimum=1) for i, n in enumerate(seq_lens)]
    if not lens:
        raise ValueError("seq_lens must not be empty")
    B, heads = _block_size(block_size), check_int(num_kv_heads, "num_kv_heads", minimum=1)
    tile = kernel.KV_TILE
    if num_splits is None:
        units = kernel.CPU_PARALLELISM if parallelism is None else check_int(parallelism, "parallelism", minimum=1)
        num_splits = kernel.choose_num_splits(len(lens), heads, max(lens), units)
    num_splits = check_int(num_splits, "num_splits", minimum=1)
    steps = 0
    for n in lens:
        per_split = ceil_div(ceil_div(n, tile), num_splits)
        for split in range(num_splits):
            start = split * per_split * tile
            end = min(start + per_split * tile, n)
            steps += len(range(start, end, tile))
    return DecodeLaunch(B, tile, num_splits, len(lens) * heads * num_splits, steps * heads, steps * heads * tile,
                        sum(blocks_needed(n, B) for n in lens) * heads)  # fmt: skip


# ----------------------------------------------------------------------------
# sharing: the prefix cache's hit rate per block size
# ----------------------------------------------------------------------------


def shared_prefix_prompts(num_prompts: int, prefix_len: int, suffix_len: tuple[int, int], vocab_size: int = 512,
                          seed: int = 0) -> list[list[int]]:  # fmt: skip
    """Prompts that all start with one shared prefix (a system prompt or few-shot examples), then differ.

    Args:
        num_prompts: how many prompts.
        prefix_len: tokens of the shared prefix.
        suffix_len: (low, high), inclusive: each prompt's own tokens after the prefix.
        vocab_size: ids are drawn from ``0 .. vocab_size - 1``.
        seed: the seed of ``np.random.default_rng``.
    """
    rng = np.random.default_rng(check_int(seed, "seed"))
    prefix = rng.integers(0, vocab_size, size=check_int(prefix_len, "prefix_len")).tolist()
    lo, hi = (check_int(x, "suffix_len", minimum=1) for x in suffix_len)
    return [prefix + rng.integers(0, vocab_size, size=int(rng.integers(lo, hi + 1))).tolist()
            for _ in range(check_int(num_prompts, "num_prompts"))]  # fmt: skip


def prefix_hit_rate(prompts: list[list[int]], block_size: int, num_blocks: int | None = None) -> float:
    """Replay prompts one after another through a prefix-caching pool: the hit rate (hit / queried tokens).

    Each prompt is admitted as the engine admits it (match, share the hit, append the rest), its
    full blocks get their keys, and it is released (its cached blocks stay in the free queue).
    Only whole blocks are shared, so a prefix of P tokens hits ``B * floor(P / B)`` of them.

    Args:
        prompts: the prompts' token ids, in arrival order.
        block_size: B.
        num_blocks: blocks in the pool (None: enough for the longest prompt plus everything cached).
    """
    B = _block_size(block_size)
    if num_blocks is None:
        num_blocks = sum(blocks_needed(len(p), B) for p in prompts) + 1
    allocator = PrefixCachingAllocator(check_int(num_blocks, "num_blocks", minimum=1), B)
    for i, prompt in enumerate(prompts):
        table = BlockTable(allocator, i)
        allocator.share_prefix(table, allocator.match_prefix(prompt))
        table.append_tokens(len(prompt) - table.num_tokens)
        allocator.cache_full_blocks(table, prompt, len(prompt))
        table.release()
    return allocator.stats().hit_rate


# ----------------------------------------------------------------------------
# the engine on the virtual clock
# ----------------------------------------------------------------------------

POOL_TOKENS = 2048  # KV slots of every engine run: num_blocks = POOL_TOKENS // block_size
BASE_CONFIG = EngineConfig(num_blocks=POOL_TOKENS // 16, block_size=16, max_num_seqs=64, max_num_batched_tokens=256,
                           keep_finished=True)  # fmt: skip
# The engine's model. On the virtual clock a step costs what StepCost says, whatever the model, and
# outputs run to max_tokens: the schedule, and so every number, is the same for any model; a
# smaller one gets there faster.
SWEEP_MODEL = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # fmt: skip


# Each regime's engine runs: its tiny preset, a load above what the pool serves without queueing,
# and a pool sized to it (short requests get a smaller pool, so that memory is what limits them).
ENGINE_SETUPS = {
    "sharegpt_like": {"preset": "tiny_sharegpt_like", "num_requests": 48, "rate": 100.0, "prefix_len": 16,
                      "pool_tokens": 2048},
    "alpaca_like": {"preset": "tiny_alpaca_like", "num_requests": 48, "rate": 200.0, "prefix_len": 16,
                    "pool_tokens": 512},
}


def regime_workload(regime: str, vocab_size: int = SWEEP_MODEL.vocab_size) -> tuple[list[RequestSpec], list]:
    """The engine workload of a regime of :data:`ENGINE_SETUPS`: (requests, prompts)."""
    if regime not in ENGINE_SETUPS:
        raise ValueError(f"regime must be one of {sorted(ENGINE_SETUPS)}, got {regime!r}")
    s = ENGINE_SETUPS[regime]
    return engine_workload(TINY_REGIMES[s["preset"]], s["num_requests"], s["rate"], s["prefix_len"], vocab_size)


def sweep_model(config: LlamaConfig = SWEEP_MODEL) -> LlamaForCausalLM:
    """The seeded random model the sweeps run (see :data:`SWEEP_MODEL`)."""
    return LlamaForCausalLM(config, seed=0).eval()


def engine_workload(preset: WorkloadPreset | str, num_requests: int = 64, rate: float = 40.0, prefix_len: int = 0,
                    vocab_size: int = SWEEP_MODEL.vocab_size, seed: int = 0) -> tuple[list[RequestSpec], list]:
    """A seeded Poisson workload and its prompts; with ``prefix_len``, every prompt starts with one shared prefix.

    Args:
        preset: the length preset (a name or a :class:`~minipaged.workload.WorkloadPreset`).
        num_requests: how many requests.
        rate: Poisson arrivals per second of the virtual clock.
        prefix_len: tokens of a system prompt all prompts share (added to each prompt's length).
        vocab_size: ids are drawn from ``0 .. vocab_size - 1``.
        seed: the seed of the lengths, the arrivals and the prompts.
    """
    prefix_len = check_int(prefix_len, "prefix_len")
    workload = make_workload(num_requests, rate, preset, seed)
    prefix = prompt_token_ids(num_requests, prefix_len, vocab_size, seed)  # an index no request has
    prompts = [prefix + prompt_token_ids(i, r.num_prompt_tokens, vocab_size, seed) for i, r in enumerate(workload)]
    workload = [RequestSpec(r.arrival_time, r.num_prompt_tokens + prefix_len, r.num_output_tokens) for r in workload]
    return workload, prompts


def run_engine(model, config: EngineConfig, workload: list[RequestSpec], prompts: list | None = None,
               clock=None, allocator=PrefixCachingAllocator) -> dict:  # fmt: skip
    """Serve a workload once; the run's summary plus the pool's and the scheduler's counters.

    Args:
        model: the model (:func:`sweep_model` for sweeps).
        config: the engine's configuration (``keep_finished=True`` keeps every step for the means).
        workload: the requests.
        prompts: their token ids (None: seeded random ones).
        clock: None for a :class:`~minipaged.clock.VirtualClock`, or a wall clock for the bench.
        allocator: the engine's allocator class (chapter 07 runs with prefix caching on; ``BlockAllocator``: off).

    Returns:
        :func:`~minipaged.latency.summarize`'s numbers plus ``normalized_latency`` (mean E2E / output
        tokens, the vLLM paper's measure), ``ttft_long_p99`` (TTFT p99 of the quarter of requests with
        the longest prompts), ``preemptions``, ``mean_running``, ``max_running``,
        ``kv_usage`` and ``token_occupancy`` (means over the steps), ``hit_rate`` and ``swapped_blocks``.
    """
    engine = Engine(model, replace(config, keep_finished=True), clock or VirtualClock(StepCost()), allocator=allocator)
    seqs = engine.run(workload, progress=False, prompts=prompts)
    summary = summarize(seqs)
    latencies = request_latencies(seqs)
    e2e = latencies["e2e"]
    summary["normalized_latency"] = float(np.mean([t / s.num_output_tokens for t, s in zip(e2e, seqs)]))
    # The tail of admission order: TTFT p99 of the quarter of requests with the longest prompts.
    longest = sorted(range(len(seqs)), key=lambda i: seqs[i].num_prompt_tokens)[-max(1, len(seqs) // 4):]
    summary["ttft_long_p99"] = percentiles([latencies["ttft"][i] for i in longest])[99]
    m, history = engine.metrics, engine.metrics.history
    summary.update(
        preemptions=m.num_preemptions,
        mean_running=float(np.mean([r.num_running for r in history])),
        max_running=m.max_running,
        kv_usage=float(np.mean([r.kv_usage for r in history])),
        token_occupancy=float(np.mean([r.token_occupancy for r in history])),
        hit_rate=m.prefix_cache_hit_rate,
        swapped_blocks=m.swapped_out_blocks + m.swapped_in_blocks,
    )
    return summary


def block_size_config(block_size: int, base: EngineConfig = BASE_CONFIG, pool_tokens: int = POOL_TOKENS,
                      **changes) -> EngineConfig:  # fmt: skip
    """``base`` at another block size, with the pool holding the same ``pool_tokens`` slots."""
    B = _block_size(block_size)
    return replace(base, block_size=B, num_blocks=max(1, check_int(pool_tokens, "pool_tokens") // B), **changes)


def block_size_sweep(model, workload: list[RequestSpec], prompts: list | None = None,
                     block_sizes: Sequence[int] = BLOCK_SIZES, base: EngineConfig = BASE_CONFIG,
                     pool_tokens: int = POOL_TOKENS, **changes) -> dict[int, dict]:  # fmt: skip
    """One engine run per block size, same workload, same pool slots: block size -> :func:`run_engine`'s summary.

    Args:
        model: the model (:func:`sweep_model`).
        workload, prompts: the requests and their token ids (:func:`regime_workload`).
        block_sizes: the block sizes to run.
        base: the configuration every run starts from.
        pool_tokens: KV slots of the pool at every block size.
        changes: EngineConfig fields changed in every run (e.g. ``preemption_mode="swap"``).
    """
    return {B: run_engine(model, block_size_config(B, base, pool_tokens, **changes), workload, prompts)
            for B in block_sizes}


# ----------------------------------------------------------------------------
# one-factor ablations
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Ablation:
    """One changed setting against :data:`BASE_CONFIG`."""

    name: str
    factor: str  # which setting changed (a field of EngineConfig, or "allocator")
    change: str  # what changed, in words
    fields: tuple  # (field, value) pairs replaced in the base config
    allocator: type = PrefixCachingAllocator  # the engine's allocator (the baseline caches prefixes)


def contiguous_block_size(workload: list[RequestSpec]) -> int:
    """A block as long as the longest request: one block per sequence is a max-length contiguous reservation."""
    return max(r.num_prompt_tokens + r.num_output_tokens for r in workload)


ABLATIONS = (
    Ablation("baseline", "-", "B=16, watermark 1%, budget 256, chunked, recompute, prefix caching, FCFS", ()),
    Ablation("watermark 0", "watermark", "no headroom kept at admission", (("watermark", 0.0),)),
    Ablation("watermark 10%", "watermark", "10% of blocks kept free at admission", (("watermark", 0.1),)),
    Ablation("watermark 30%", "watermark", "30% of blocks kept free at admission", (("watermark", 0.3),)),
    Ablation("budget 64", "max_num_batched_tokens", "64 tokens per step", (("max_num_batched_tokens", 64),)),
    Ablation("budget 128", "max_num_batched_tokens", "128 tokens per step", (("max_num_batched_tokens", 128),)),
    Ablation("swap", "preemption_mode", "victims' K/V copied to CPU and back", (("preemption_mode", "swap"),)),
    Ablation("no prefix caching", "allocator", "the shared system prompt is recomputed", (), BlockAllocator),
    Ablation("contiguous", "block_size", "one max-length block per sequence, same slots", (("block_size", None),)),
    Ablation("shortest prompt first", "scheduling_policy", "waiting queue ordered by prompt length",
             (("scheduling_policy", "shortest_prompt_first"),)),
)


def ablation_config(ablation: Ablation, workload: list[RequestSpec], base: EngineConfig = BASE_CONFIG,
                    pool_tokens: int = POOL_TOKENS) -> EngineConfig:  # fmt: skip
    """The base config with one ablation's change; the contiguous one gets a block of the longest request."""
    changes = dict(ablation.fields)
    if "block_size" in changes:
        return block_size_config(contiguous_block_size(workload), base, pool_tokens,
                                 **{k: v for k, v in changes.items() if k != "block_size"})  # fmt: skip
    return replace(base, **changes)


def ablation_runs(model, workload: list[RequestSpec], prompts: list | None = None,
                  ablations: Sequence[Ablation] = ABLATIONS, base: EngineConfig = BASE_CONFIG) -> dict[str, dict]:
    """One engine run per ablation on the same workload: ablation name -> :func:`run_engine`'s summary."""
    return {a.name: run_engine(model, ablation_config(a, workload, base), workload, prompts, allocator=a.allocator)
            for a in ablations}


ABLATION_COLUMNS = (("tok/s", "tokens_per_s", 1.0, ".0f"), ("TTFT p50 ms", "ttft_p50", 1e3, ".0f"),
                    ("TTFT p99 ms", "ttft_p99", 1e3, ".0f"), ("TPOT p50 ms", "tpot_p50", 1e3, ".1f"),
                    ("TPOT p99 ms", "tpot_p99", 1e3, ".1f"), ("long TTFT p99 ms", "ttft_long_p99", 1e3, ".0f"),
                    ("preempt", "preemptions", 1, "d"),
                    ("running", "mean_running", 1.0, ".1f"), ("hit rate", "hit_rate", 100.0, ".0f"))


def ablation_table(runs: dict[str, dict], baseline: str = "baseline") -> list[tuple]:
    """Rows of (name, column values..., throughput and p99 TTFT against the baseline as ratios)."""
    base = runs[baseline]
    rows = []
    for name, r in runs.items():
        cells = [format(r[key] * k if isinstance(k, float) else r[key], fmt) for _, key, k, fmt in ABLATION_COLUMNS]
        rows.append((name, *cells, f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x",
                     f"{r['ttft_p99'] / base['ttft_p99']:.2f}x"))
    return rows


ABLATION_HEADERS = ("setting", *(c[0] for c in ABLATION_COLUMNS), "tok/s vs base", "TTFT p99 vs base")


# ----------------------------------------------------------------------------
# the recorded tables: everything above, on the virtual clock, for both regimes
# ----------------------------------------------------------------------------

# Each regime's memory replay (chapter 02's trace simulator, one toy step per second): real-scale lengths.
MEMORY_SETUPS = {
    "sharegpt_like": {"num_requests": 100, "rate": 0.5, "pool_tokens": 16384, "max_len": 2048},
    "alpaca_like": {"num_requests": 100, "rate": 2.0, "pool_tokens": 2048, "max_len": 512},
}
FEW_SHOT_PREFIXES = {"1-shot": 80, "5-shot": 341}  # shared prefix tokens, the vLLM paper's few-shot prompts


def regime_trace(regime: str) -> list[RequestSpec]:
    """The memory replay's trace of a regime of :data:`MEMORY_SETUPS` (seed 0)."""
    if regime not in MEMORY_SETUPS:
        raise ValueError(f"regime must be one of {sorted(MEMORY_SETUPS)}, got {regime!r}")
    s = MEMORY_SETUPS[regime]
    return make_workload(s["num_requests"], s["rate"], REGIMES[regime], seed=0)


def regime_memory_sweep(regime: str, block_sizes: Sequence[int] = BLOCK_SIZES) -> list[MemoryRow]:
    """:func:`memory_sweep` of a regime's trace with its pool (:data:`MEMORY_SETUPS`)."""
    s = MEMORY_SETUPS[regime]
    return memory_sweep(regime_trace(regime), s["pool_tokens"], block_sizes, s["max_len"])


def regime_block_size_sweep(model, regime: str, block_sizes: Sequence[int] = BLOCK_SIZES, **changes) -> dict:
    """:func:`block_size_sweep` of a regime's engine workload with its pool (:data:`ENGINE_SETUPS`)."""
    workload, prompts = regime_workload(regime)
    pool = ENGINE_SETUPS[regime]["pool_tokens"]
    base = block_size_config(16, BASE_CONFIG, pool)
    return block_size_sweep(model, workload, prompts, block_sizes, base, pool, **changes)


def virtual_tables(model, block_sizes: Sequence[int] = BLOCK_SIZES) -> dict:
    """Every deterministic table of the chapter, as plain JSON-able data (what ``bench sweep --record`` writes).

    Keys: ``memory`` (regime -> rows of :func:`regime_memory_sweep`), ``launch`` (block size ->
    :func:`decode_launch` of the ShareGPT-like trace's lengths, 8 KV heads), ``hit_rate`` (few-shot
    name -> block size -> :func:`prefix_hit_rate`), ``engine`` (regime -> block size -> run),
    ``engine_swap`` (the ShareGPT-like sweep with swap), ``ablations`` (name -> run).
    """
    from dataclasses import asdict

    out = {"block_sizes": list(block_sizes)}
    out["memory"] = {r: [asdict(row) for row in regime_memory_sweep(r, block_sizes)] for r in MEMORY_SETUPS}
    lens = [r.num_prompt_tokens + r.num_output_tokens for r in regime_trace("sharegpt_like")[:32]]
    try:
        out["launch"] = {str(B): asdict(decode_launch(lens, B, 8)) for B in block_sizes}
    except ImportError:  # no triton: the counts need the kernel's constants and heuristic
        out["launch"] = {}
    out["hit_rate"] = {
        shot: {str(B): prefix_hit_rate(shared_prefix_prompts(50, p, (8, 32)), B) for B in block_sizes}
        for shot, p in FEW_SHOT_PREFIXES.items()
    }
    out["engine"] = {r: {str(B): v for B, v in regime_block_size_sweep(model, r, block_sizes).items()}
                     for r in ENGINE_SETUPS}  # fmt: skip
    out["engine_swap"] = {str(B): v for B, v in
                          regime_block_size_sweep(model, "sharegpt_like", block_sizes, preemption_mode="swap").items()}
    workload, prompts = regime_workload("sharegpt_like")
    out["ablations"] = ablation_runs(model, workload, prompts)
    return out
