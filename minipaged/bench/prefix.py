"""``python -m minipaged.bench prefix``: the prefix cache on against off, on few-shot-like workloads.

Two workloads in one run, as in the vLLM paper's shared-prefix experiment: every
prompt is one shared few-shot prefix (80 tokens for "1-shot", 341 for "5-shot")
plus a unique suffix of 8-32 tokens; outputs are 16-64 tokens (uniform); arrivals
are Poisson at a rate above what the uncached engine can serve, so throughput is
each system's capacity and the queue shows up in TTFT.

Each workload runs on the same model and the same KV pool with
the prefix cache off and on (the engine's ``allocator``). Caching saves twice: a hit skips the
prefix's prefill, and the requests share the prefix's blocks, so more of them fit
the pool at once. The script prints the throughput ratio (on / off), the TTFT
p50 and p99 ratios (off / on: how many times shorter) and the hit rate.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from minipaged.bench import best_runs
from minipaged.blocks import BlockAllocator
from minipaged.cli import positive_int, positive_rate
from minipaged.clock import VirtualClock, WallClock
from minipaged.engine import Engine
from minipaged.latency import format_summary
from minipaged.model import LlamaConfig, LlamaForCausalLM
from minipaged.prefix_cache import PrefixCachingAllocator
from minipaged.scheduler import EngineConfig
from minipaged.workload import RequestSpec, poisson_arrivals

SHOTS = {"1-shot": 80, "5-shot": 341}  # shared prefix lengths in tokens, the vLLM paper's few-shot prompts


def shared_prefix_workload(num_requests: int, rate: float, prefix_len: int, suffix_len: tuple[int, int],
                           output_len: tuple[int, int], vocab_size: int,
                           seed: int = 0) -> tuple[list[RequestSpec], list[list[int]]]:  # fmt: skip
    """A seeded workload whose prompts all start with one shared prefix.

    Args:
        num_requests: how many requests.
        rate: Poisson arrivals per second.
        prefix_len: tokens of the shared prefix.
        suffix_len: (low, high), inclusive: each prompt's unique suffix length, uniform.
        output_len: (low, high), inclusive: each request's ``max_tokens``, uniform.
        vocab_size: token ids are drawn from ``0 .. vocab_size - 1``.
        seed: the seed of ``np.random.default_rng``.

    Returns:
        The request specs and each request's prompt token ids.
    """
    rng = np.random.default_rng(seed)
    arrivals = poisson_arrivals(num_requests, rate, rng)
    prefix = rng.integers(0, vocab_size, size=prefix_len).tolist()
    suffixes = rng.integers(suffix_len[0], suffix_len[1] + 1, size=num_requests)
    outputs = rng.integers(output_len[0], output_len[1] + 1, size=num_requests)
    prompts = [prefix + rng.integers(0, vocab_size, size=int(s)).tolist() for s in suffixes]
    workload = [RequestSpec(float(t), len(p), int(o)) for t, p, o in zip(arrivals, prompts, outputs)]
    return workload, prompts


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m minipaged.bench prefix", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=positive_int, default=200, help="requests per workload")
    parser.add_argument("--rate", type=positive_rate, default=400.0, help="Poisson arrivals per second")
    parser.add_argument("--suffix-len", type=positive_int, nargs=2, default=(8, 32), metavar=("LOW", "HIGH"))
    parser.add_argument("--output-len", type=positive_int, nargs=2, default=(16, 64), metavar=("LOW", "HIGH"))
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--num-blocks", type=positive_int, default=128)
    parser.add_argument("--max-num-seqs", type=positive_int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=512)
    parser.add_argument("--clock", default="wall", choices=["wall", "virtual"],
                        help="real seconds, or the modelled GPU step cost of minipaged.clock")
    parser.add_argument("--backend", default="torch", choices=["torch", "triton"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=positive_int, default=1,
                        help="runs per system, alternating; the fastest counts")
    args = parser.parse_args(argv)
    for option, (low, high) in (("--suffix-len", args.suffix_len), ("--output-len", args.output_len)):
        if low > high:
            parser.error(f"{option} LOW must be at most HIGH, got {low} {high}")
    return args


def _config(args) -> EngineConfig:
    """The engine of both systems (prefix caching is the allocator: see :func:`_compare`)."""
    return EngineConfig(num_blocks=args.num_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, backend=args.backend)  # fmt: skip


def _compare(model, args, shot: str, prefix_len: int) -> float:
    """Prefix caching off against on for one shared prefix, printed; the throughput ratio on / off."""
    workload, prompts = shared_prefix_workload(args.requests, args.rate, prefix_len, args.suffix_len,
                                               args.output_len, model.config.vocab_size, args.seed)  # fmt: skip
    systems = {
        name: (lambda caching=caching: Engine(model, _config(args), WallClock() if args.clock == "wall" else
                                              VirtualClock(), allocator=PrefixCachingAllocator if caching else
                                              BlockAllocator))  # fmt: skip
        for name, caching in (("cache off", False), ("cache on", True))
    }
    runs = best_runs(systems, lambda engine, w=workload, p=prompts: engine.run(w, progress=False, prompts=p),
                     args.repeats, label=f"{shot} ")
    hit_rate = runs["cache on"]["hit_rate"]
    print(f"\n{shot}: shared prefix of {prefix_len} tokens")
    print(format_summary(runs, unit="ms"))
    for key, label in (("max_concurrent", "max concurrent seqs"), ("preemptions", "preemptions")):
        print(f"{label:<20}" + "".join(f"{r[key]:>12}" for r in runs.values()))
    off, on = runs["cache off"], runs["cache on"]
    ratio = on["tokens_per_s"] / off["tokens_per_s"]
    print(f"throughput ratio (on / off): {ratio:.2f}x")
    print(f"TTFT ratio (off / on): p50 {off['ttft_p50'] / on['ttft_p50']:.2f}x, "
          f"p99 {off['ttft_p99'] / on['ttft_p99']:.2f}x")
    print(f"prefix cache hit rate: {hit_rate:.1%} of prompt tokens\n")
    if off["requests_per_s"] > 0.9 * args.rate:
        print(f"note: the uncached engine kept up with the arrivals ({off['requests_per_s']:.0f} of "
              f"{args.rate:g} requests/s): its throughput is the load; raise --rate to measure capacity\n")
    return ratio


def main(argv: list[str]) -> int:
    args = _parse(argv)
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)  # tiny matmuls; one thread keeps the two measurements comparable
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = LlamaForCausalLM(LlamaConfig(), seed=args.seed).to(device).eval()
    print(f"workloads: {args.requests} requests each, shared prefix {SHOTS} tokens, unique suffix "
          f"{args.suffix_len[0]}-{args.suffix_len[1]}, output {args.output_len[0]}-{args.output_len[1]} (uniform), "
          f"Poisson {args.rate:g}/s, seed {args.seed}")
    print(f"KV pool: {args.num_blocks} blocks x {args.block_size} = {args.num_blocks * args.block_size} token slots, "
          f"max_num_seqs {args.max_num_seqs}, budget {args.max_num_batched_tokens}; "
          f"{args.clock} clock, device {device}")

    Engine(model, _config(args)).generate([[1, 2, 3]] * 2)  # warm-up: one-off costs of the first passes
    ratios = {shot: _compare(model, args, shot, prefix_len) for shot, prefix_len in SHOTS.items()}
    goals = {"1-shot": 1.6, "5-shot": 3.0}
    print("goals: " + ", ".join(f"{shot} {ratios[shot]:.2f}x (goal >= {goal:g}x)" for shot, goal in goals.items()))
    return 0
