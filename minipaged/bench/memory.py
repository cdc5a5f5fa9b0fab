"""``python -m minipaged.bench memory``: how much a long-running engine's memory grows per request.

Without ``keep_finished``, :meth:`Engine.step <minipaged.engine.Engine.step>` hands every finished
request over and forgets it, and the metrics keep a bounded window of step records, so the
process's resident memory (RSS) should stop growing once the engine has warmed up. The script
serves ``--warmup`` requests, then ``--requests`` more, a few arriving before every step (seeded
random prompts, so the prefix cache keeps filling and evicting), and prints the RSS growth over
the measured requests, per request and against the goal (``--goal-mib``, 1 MiB over 10,000
requests). ``--trace`` also lists the Python allocation sites that grew most (``tracemalloc``;
slower).

:func:`measure` is what ``tests/test_05_bounded_memory.py`` runs for 1,000 requests in CI.
"""

from __future__ import annotations

import argparse
import gc
import os
import tracemalloc

import torch

from minipaged.cli import positive_finite, positive_int
from minipaged.engine import Engine
from minipaged.metrics import HISTORY_WINDOW
from minipaged.model import LlamaConfig, LlamaForCausalLM
from minipaged.scheduler import EngineConfig
from minipaged.sequence import SamplingParams
from minipaged.workload import prompt_token_ids

PROMPT_LEN, MAX_TOKENS, ARRIVALS_PER_STEP = 12, 3, 4


def rss_bytes() -> int:
    """This process's resident set size now (Linux: ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def serve(engine: Engine, first: int, num_requests: int) -> None:
    """Serve requests ``first .. first + num_requests - 1``, ``ARRIVALS_PER_STEP`` arriving before each step.

    Args:
        engine: the engine, which forgets each request as it finishes.
        first: the index of the first request (its seeded prompt).
        num_requests: how many to serve, to the end.
    """
    vocab, params = engine.model.config.vocab_size, SamplingParams(max_tokens=MAX_TOKENS)
    pending = iter(range(first, first + num_requests))
    more = True
    while more or engine.has_unfinished():
        for _ in range(ARRIVALS_PER_STEP):
            i = next(pending, None)
            if i is None:
                more = False
                break
            engine.add_request(prompt_token_ids(i, PROMPT_LEN, vocab), params)
        engine.step()


def measure(num_requests: int, warmup: int, window: int = HISTORY_WINDOW, trace: bool = False) -> dict:
    """RSS before and after ``num_requests`` requests on a warmed-up engine (defaults: no ``keep_finished``).

    Args:
        num_requests: the requests measured.
        warmup: requests served first, so caches, pools and the history window are full
            (about ``ARRIVALS_PER_STEP`` requests a step).
        window: the step records the metrics keep (``Metrics.window``).
        trace: also compare ``tracemalloc`` snapshots (slower); the result then has ``top``,
            the ten allocation sites that grew most.

    Returns:
        ``{"requests", "rss_before", "rss_after", "growth", "per_request", "steps"}`` (bytes), plus ``top``.
    """
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(), seed=0).eval()
    engine = Engine(model, EngineConfig())
    engine.metrics.window = window
    serve(engine, 0, warmup)
    if trace:
        tracemalloc.start()
    gc.collect()
    before, snapshot, steps = rss_bytes(), tracemalloc.take_snapshot() if trace else None, engine.metrics.num_steps
    serve(engine, warmup, num_requests)
    gc.collect()
    after = rss_bytes()
    result = {"requests": num_requests, "rss_before": before, "rss_after": after, "growth": after - before,
              "per_request": (after - before) / num_requests, "steps": engine.metrics.num_steps - steps}  # fmt: skip
    if trace:
        result["top"] = [str(s) for s in tracemalloc.take_snapshot().compare_to(snapshot, "lineno")[:10]]
        tracemalloc.stop()
    assert not engine.seqs and not engine.requests  # every request was handed over and forgotten
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minipaged.bench memory", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=positive_int, default=10_000, help="requests measured")
    parser.add_argument("--warmup", type=positive_int, default=ARRIVALS_PER_STEP * (HISTORY_WINDOW + 100),
                        help="requests served before measuring (default: enough to fill the history window)")
    parser.add_argument("--goal-mib", type=positive_finite, default=1.0, help="the RSS growth allowed over --requests")
    parser.add_argument("--trace", action="store_true", help="list the Python allocation sites that grew most")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    r = measure(args.requests, args.warmup, trace=args.trace)
    print(f"{r['requests']:,} requests ({r['steps']:,} steps) after {args.warmup:,} of warm-up: RSS "
          f"{r['rss_before'] / 2**20:.1f} -> {r['rss_after'] / 2**20:.1f} MiB, growth {r['growth'] / 2**10:+,.0f} KiB "
          f"({r['per_request']:+.1f} bytes per request); goal < {args.goal_mib:g} MiB: "
          f"{'met' if r['growth'] < args.goal_mib * 2**20 else 'NOT met'}")  # fmt: skip
    for line in r.get("top", []):
        print("  ", line)
    return 0 if r["growth"] < args.goal_mib * 2**20 else 1
