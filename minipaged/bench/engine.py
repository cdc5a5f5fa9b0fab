"""``python -m minipaged.bench engine``: continuous batching + paging against static batching + reservation.

Both systems get the same KV pool (``--num-blocks`` x ``--block-size`` token
slots), the same model, the same seeded Poisson workload, and real wall-clock
time, measured one after the other in this run. Static batching reserves
``max_model_len`` slots per request (the longest request in the workload,
which flatters it: real systems reserve the model's context length).

The arrival rate defaults to more than either system can serve on a CPU, so
the throughput printed is each system's capacity and the queue shows up in
TTFT. A system that keeps up with the arrivals only shows the arrival rate;
the script says so, and a higher ``--rate`` measures its capacity.
"""

from __future__ import annotations

import argparse

import torch

from minipaged.bench import best_runs
from minipaged.block_math import blocks_needed
from minipaged.cli import fraction, positive_int, positive_rate
from minipaged.clock import WallClock
from minipaged.engine import Engine
from minipaged.latency import format_summary
from minipaged.model import LlamaConfig, LlamaForCausalLM
from minipaged.scheduler import EngineConfig
from minipaged.sequence import SamplingParams
from minipaged.static_batching import static_engine
from minipaged.workload import make_workload


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minipaged.bench engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=positive_int, default=200)
    parser.add_argument("--rate", type=positive_rate, default=400.0, help="Poisson arrivals per second")
    parser.add_argument("--preset", default="tiny_chat", choices=["tiny_chat", "tiny_long_tail"],
                        help="length preset of minipaged.workload, scaled to the tiny model")
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--num-blocks", type=positive_int, default=96)
    parser.add_argument("--max-num-seqs", type=positive_int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=512)
    parser.add_argument("--watermark", type=fraction, default=0.01)
    parser.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    parser.add_argument("--backend", default="torch", choices=["torch", "triton"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=positive_int, default=2,
                        help="runs per system, alternating; the fastest counts")
    return parser


def _config(parser, args, model, workload, max_model_len: int) -> EngineConfig:
    """The engine settings of both systems, refused (a usage error) before anything runs when a request cannot fit."""
    try:  # a pool or budget too small for some request is a usage error, found before anything runs
        config = EngineConfig(num_blocks=args.num_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                              max_num_batched_tokens=args.max_num_batched_tokens, watermark=args.watermark,
                              preemption_mode=args.preemption_mode, backend=args.backend)  # chapter 05: no caching
        probe = Engine(model, config)
        for r in workload:
            params = SamplingParams(max_tokens=r.num_output_tokens, ignore_eos=True)
            probe.add_request([0] * r.num_prompt_tokens, params)
    except ValueError as exc:
        parser.error(f"the engine cannot serve this workload: {exc}")
    if config.num_blocks < blocks_needed(max_model_len, config.block_size):
        parser.error(f"--num-blocks {config.num_blocks} cannot hold one static reservation of "
                     f"max_model_len={max_model_len} tokens: raise --num-blocks")
    return config


def _report(runs: dict, rate: float) -> None:
    """The two systems side by side: the summary table, the ratios, and a note where a system kept up with the load."""
    print(format_summary(runs, unit="ms"))
    paged, static = runs["continuous+paged"], runs["static+reserved"]
    print(f"{'max concurrent seqs':<20}" + "".join(f"{r['max_concurrent']:>18}" for r in runs.values()))
    print(f"{'preemptions':<20}" + "".join(f"{r['preemptions']:>18}" for r in runs.values()))
    print()
    ratio = paged["tokens_per_s"] / static["tokens_per_s"]
    print(f"throughput ratio (continuous+paged / static+reserved): {ratio:.2f}x")
    print(f"p99 TTFT: {paged['ttft_p99'] * 1000:.0f} ms vs {static['ttft_p99'] * 1000:.0f} ms")
    print(f"max concurrent sequences: {paged['max_concurrent']} vs {static['max_concurrent']}")
    for name, r in runs.items():
        if r["requests_per_s"] > 0.9 * rate:
            print(f"note: {name} kept up with the arrivals ({r['requests_per_s']:.0f} of {rate:g} requests/s): "
                  "its throughput is the load, not its capacity; raise --rate to measure capacity")


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    # The tiny model's matmuls are too small to gain from threads, and one thread keeps
    # the two measurements comparable on a busy machine.
    torch.set_num_threads(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = LlamaForCausalLM(LlamaConfig(), seed=args.seed).to(device).eval()
    workload = make_workload(args.requests, args.rate, args.preset, seed=args.seed)
    max_model_len = max(r.num_prompt_tokens + r.num_output_tokens for r in workload)
    config = _config(parser, args, model, workload, max_model_len)
    kv_tokens = args.num_blocks * args.block_size
    print(f"workload: {args.requests} requests, {args.preset}, Poisson {args.rate:g}/s, seed {args.seed}; "
          f"device {device}")
    print(f"KV pool: {args.num_blocks} blocks x {args.block_size} = {kv_tokens} token slots for both systems")

    # Warm-up: the first forward passes pay one-off costs (allocator, kernel selection).
    Engine(model, config).generate([[1, 2, 3]] * 2)

    systems = {
        "continuous+paged": lambda: Engine(model, config, WallClock()),
        "static+reserved": lambda: static_engine(model, config, max_model_len, WallClock()),
    }
    runs = best_runs(systems, lambda engine: engine.run(workload, progress=False), args.repeats)
    static_batch = min(config.max_num_seqs, config.num_blocks // blocks_needed(max_model_len, config.block_size))
    print(f"static batch: {static_batch} reservations of max_model_len={max_model_len} tokens fit the pool\n")
    _report(runs, args.rate)
    return 0
