"""``python -m minipaged.bench sweep``: block sizes 1 ... 256 end to end, and one-factor ablations of the engine.

Two halves, in one run:

* **Wall clock** (this machine): the torch path's CPU time for one decode step
  per block size, the GPU time of the Triton kernel where a GPU is present,
  swap against recompute for one preempted sequence per block size, and the
  engine's throughput per block size and per ablation. Every number is a ratio
  against a baseline measured in this run (block size 16, or the baseline
  configuration).
* **Virtual clock** (deterministic; chapter 07 prints these): the memory sweep
  of the trace simulator, the Triton launch counts, the prefix-cache hit rate,
  and the engine's block-size sweeps and ablations from
  :func:`minipaged.tradeoffs.virtual_tables`. ``--record PATH`` writes them
  as JSON, with the wall-clock tables under ``"wall"``; a run of one half
  replaces that half in an existing file. The notebook reads
  ``notebooks/results/sweep.json``; a test regenerates rows of it and compares.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from minipaged import tradeoffs as T
from minipaged.accounting import format_table
from minipaged.attention import paged_attention
from minipaged.bench import best_runs
from minipaged.block_math import blocks_needed
from minipaged.cache import PagedKVCache
from minipaged.cli import positive_int
from minipaged.clock import StepCost, WallClock
from minipaged.engine import Engine
from minipaged.model import LlamaConfig, LlamaForCausalLM
from minipaged.scheduler import EngineConfig
from minipaged.sequence import SamplingParams
from minipaged.swap import swap_in, swap_out
from minipaged.testing import make_paged_case

QUICK_BLOCK_SIZES = (1, 16, 256)


def _best(fn, repeats: int) -> float:
    """The fastest of ``repeats`` calls of ``fn``, in seconds."""
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def attention_rows(block_sizes, seq_lens: list[int], repeats: int) -> list[tuple]:
    """Per block size: the torch path's CPU time for one decode step, its ratio to B=16, the launch counts, and
    (on a CUDA device only) the Triton kernel's GPU time."""
    times, gpu = {}, {}
    for B in block_sizes:
        case = make_paged_case(seq_lens, block_size=B, num_heads=8, num_kv_heads=8, head_dim=64, spare_blocks=0,
                               extra_columns=0, fill=0.0)  # fmt: skip
        args = case.decode_args
        times[B] = _best(lambda a=args: paged_attention(*a, backend="torch"), repeats)
        if torch.cuda.is_available():
            from minipaged.kernels import paged_decode_attention

            cuda_args = [a.cuda() for a in args]
            paged_decode_attention(*cuda_args)  # compile
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                paged_decode_attention(*cuda_args)
            end.record()
            torch.cuda.synchronize()
            gpu[B] = start.elapsed_time(end) / repeats / 1000
    rows = []
    for B in block_sizes:
        try:
            launch = T.decode_launch(seq_lens, B, 8)
            counts = (launch.programs, launch.loop_steps, launch.block_table_reads)
        except ImportError:
            counts = ("-", "-", "-")
        gpu_cell = (f"{gpu[B] * 1e6:.0f}",) if gpu else ()  # no column without a GPU
        rows.append((B, f"{times[B] * 1e3:.2f}", f"{times[B] / times[16]:.2f}x" if 16 in times else "-", *counts,
                     *gpu_cell))
    return rows


def swap_recompute_rows(block_sizes, num_tokens: int, repeats: int) -> list[tuple]:
    """Per block size: one victim of ``num_tokens`` tokens swapped out and in, against recomputing its prefill."""
    config = LlamaConfig()
    model = LlamaForCausalLM(config, seed=0).eval()
    prompt = list(range(1, num_tokens + 1))
    rows = []
    for B in block_sizes:
        n_blocks = blocks_needed(num_tokens, B)
        cache = PagedKVCache(config.num_hidden_layers, 2 * n_blocks, B, config.num_key_value_heads, config.head_dim)
        out_ids, in_ids = list(range(n_blocks)), list(range(n_blocks, 2 * n_blocks))

        def swap(cache=cache, out_ids=out_ids, in_ids=in_ids):
            swap_in(cache, in_ids, swap_out(cache, out_ids))

        engine_config = EngineConfig(num_blocks=n_blocks, block_size=B, max_num_batched_tokens=num_tokens,
                                     watermark=0.0)  # fmt: skip
        t_recompute = math.inf
        for _ in range(repeats):  # the prefill step alone: the engine is built outside the timing
            engine = Engine(model, engine_config)
            engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
            start = time.perf_counter()
            engine.step()
            t_recompute = min(t_recompute, time.perf_counter() - start)
        t_swap = _best(swap, repeats)
        rows.append((B, f"{t_swap * 1e3:.2f}", f"{t_recompute * 1e3:.2f}", f"{t_recompute / t_swap:.2f}"))
    return rows


def engine_wall_rows(block_sizes, repeats: int) -> list[tuple]:
    """Per block size: the engine's wall-clock throughput on the ShareGPT-like workload, and its ratio to B=16."""
    model = LlamaForCausalLM(LlamaConfig(), seed=0).eval()
    workload, prompts = T.regime_workload("sharegpt_like", vocab_size=model.config.vocab_size)
    pool = T.ENGINE_SETUPS["sharegpt_like"]["pool_tokens"]
    systems = {B: (lambda B=B: Engine(model, T.block_size_config(B, pool_tokens=pool), WallClock()))
               for B in block_sizes}  # fmt: skip
    runs = best_runs(systems, lambda e: e.run(workload, progress=False, prompts=prompts), repeats, "block size ")
    base = runs.get(16, next(iter(runs.values())))
    return [(B, f"{r['tokens_per_s']:.0f}", f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x",
             f"{r['ttft_p99'] * 1e3:.0f}", f"{r['tpot_p99'] * 1e3:.1f}") for B, r in runs.items()]


def ablation_wall_rows(repeats: int) -> list[tuple]:
    """Per ablation, and the baseline once more: the engine's wall-clock throughput and p99s against the baseline's."""
    model = LlamaForCausalLM(LlamaConfig(), seed=0).eval()
    workload, prompts = T.regime_workload("sharegpt_like", vocab_size=model.config.vocab_size)
    systems = {a.name: (lambda a=a: Engine(model, T.ablation_config(a, workload), WallClock())) for a in T.ABLATIONS}
    systems["baseline again"] = systems["baseline"]  # the noise gauge: the same setting, timed a second time
    runs = best_runs(systems, lambda e: e.run(workload, progress=False, prompts=prompts), repeats, "ablation ")
    base = runs["baseline"]
    return [(name, f"{r['tokens_per_s']:.0f}", f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x",
             f"{r['ttft_p99'] / base['ttft_p99']:.2f}x", f"{r['tpot_p99'] / base['tpot_p99']:.2f}x", r["preemptions"])
            for name, r in runs.items()]


def print_virtual(tables: dict) -> None:
    """The recorded (virtual-clock) tables, as chapter 07 prints them."""
    for regime, rows in tables["memory"].items():
        print(f"\nmemory, {regime} (trace simulator, {T.MEMORY_SETUPS[regime]['pool_tokens']} slots at every B)")
        print(format_table(
            ["B", "U measured", "U formula", "tail waste", "W formula", "KV usage", "token occ.", "running",
             "preempted", "table B/seq"],
            [(r["block_size"], f"{r['utilisation']:.3f}", f"{r['formula_utilisation']:.3f}", f"{r['tail_waste']:.1f}",
              f"{r['formula_tail_waste']:.1f}", f"{r['kv_usage']:.3f}", f"{r['token_occupancy']:.3f}",
              f"{r['mean_running']:.1f}", r["preempted"], r["block_table_bytes"]) for r in rows]))
    if tables["launch"]:
        print("\nTriton decode launch per step (32 ShareGPT-like sequences, 8 KV heads)")
        print(format_table(["B", "tile", "programs", "loop steps", "tokens loaded", "block-table reads"],
                           [(B, r["tile"], r["programs"], r["loop_steps"], r["tokens_loaded"], r["block_table_reads"])
                            for B, r in tables["launch"].items()]))
    print("\nprefix-cache hit rate (50 prompts sharing a few-shot prefix, unique suffix 8-32)")
    print(format_table(["B", *tables["hit_rate"]], [(B, *(f"{100 * tables['hit_rate'][s][B]:.1f}%"
                                                          for s in tables["hit_rate"])) for B in tables["hit_rate"]
                                                    ["1-shot"]]))
    for regime, runs in tables["engine"].items():
        print(f"\nengine, {regime} (virtual clock, {T.ENGINE_SETUPS[regime]['pool_tokens']} slots at every B)")
        print(engine_table(runs))
    print("\nengine, sharegpt_like, preemption by swap (the paper's Figure 19b)")
    print(engine_table(tables["engine_swap"], tables["engine"]["sharegpt_like"]))
    print("\nablations (virtual clock, sharegpt_like, one factor each)")
    print(format_table(T.ABLATION_HEADERS, T.ablation_table(tables["ablations"])))


def engine_table(runs: dict, recompute: dict | None = None) -> str:
    """One row per block size; against ``recompute``'s runs, the normalized-latency ratio swap / recompute."""
    headers = ["B", "tok/s", "vs B=16", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "norm. lat. ms",
               "preempt", "hit rate"]
    if recompute:
        headers.append("swap / recompute")
    base = runs.get("16", next(iter(runs.values())))
    rows = []
    for B, r in runs.items():
        row = [B, f"{r['tokens_per_s']:.0f}", f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x",
               f"{r['ttft_p50'] * 1e3:.0f}", f"{r['ttft_p99'] * 1e3:.0f}", f"{r['tpot_p50'] * 1e3:.1f}",
               f"{r['tpot_p99'] * 1e3:.1f}", f"{r['normalized_latency'] * 1e3:.1f}", r["preemptions"],
               f"{100 * r['hit_rate']:.0f}%"]
        if recompute:
            row.append(f"{r['normalized_latency'] / recompute[B]['normalized_latency']:.3f}")
        rows.append(row)
    return format_table(headers, rows)


def wall_tables(block_sizes, repeats: int, engine_repeats: int, device: str) -> dict:
    """The wall-clock half, printed as it runs: attention, swap against recompute, the engine, the ablations."""
    wall = {}
    seq_lens = [r.num_prompt_tokens + r.num_output_tokens for r in T.regime_trace("sharegpt_like")[:32]]
    wall["attention"] = (
        f"attention, one decode step of {len(seq_lens)} ShareGPT-like sequences ({sum(seq_lens)} context tokens, "
        "8 heads x 64, fp32), wall clock" + ("" if device == "cuda" else "; no GPU in this run, so no GPU time"),
        ["B", "torch CPU ms", "vs B=16", "Triton programs", "loop steps", "block-table reads",
         *(["GPU us"] if device == "cuda" else [])],
        attention_rows(block_sizes, seq_lens, repeats))
    wall["swap"] = ("swap vs recompute of one preempted 256-token sequence (course-size model, CPU), wall clock",
                    ["B", "swap out+in ms", "recompute ms", "recompute / swap"],
                    swap_recompute_rows(block_sizes, 256, repeats))
    wall["engine"] = ("engine per block size, sharegpt_like, wall clock",
                      ["B", "tok/s", "vs B=16", "TTFT p99 ms", "TPOT p99 ms"],
                      engine_wall_rows(block_sizes, engine_repeats))
    wall["ablations"] = ("ablations, sharegpt_like, wall clock (ratios against the baseline of this run)",
                         ["setting", "tok/s", "tok/s vs base", "TTFT p99 vs base", "TPOT p99 vs base", "preempt"],
                         ablation_wall_rows(engine_repeats))
    for title, headers, rows in wall.values():
        print(f"\n{title}\n{format_table(headers, rows)}")
        if title.startswith("attention") and device == "cpu":
            print("GPU time: skipped, no CUDA device (the Triton interpreter's time says nothing about a GPU; "
                  "the program and loop-step counts are the proxy)")
    return wall


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m minipaged.bench sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"block sizes {QUICK_BLOCK_SIZES} only")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timings: the fastest of this many")
    parser.add_argument("--engine-repeats", type=positive_int, default=1, help="wall-clock engine runs per setting")
    parser.add_argument("--no-wall", action="store_true", help="skip the wall-clock half")
    parser.add_argument("--no-virtual", action="store_true", help="skip the virtual-clock half")
    parser.add_argument("--record", metavar="PATH", help="write the virtual-clock tables to PATH as JSON")
    args = parser.parse_args(argv)

    torch.set_grad_enabled(False)
    torch.set_num_threads(1)  # tiny matmuls; one thread keeps the measurements comparable on a busy machine
    block_sizes = QUICK_BLOCK_SIZES if args.quick else T.BLOCK_SIZES
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"block sizes {list(block_sizes)}; device {device}; virtual clock {StepCost()}")

    wall = {} if args.no_wall else wall_tables(block_sizes, args.repeats, args.engine_repeats, device)

    record = {}
    if not args.no_virtual:
        record = T.virtual_tables(T.sweep_model(), block_sizes)
        print_virtual(record)
    if args.record:
        if wall:
            record["wall"] = wall  # this run's wall-clock tables, for the record (never compared)
        path = Path(args.record)
        old = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**old, **record}, indent=1) + "\n")  # the halves that ran replace theirs
        print(f"\nrecorded {', '.join(record)} in {args.record}")
    return 0
