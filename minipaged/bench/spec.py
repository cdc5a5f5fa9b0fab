"""``python -m minipaged.bench spec``: speculative decoding (n-gram drafts) against plain decoding.

Two workloads on the course model (:func:`minipaged.checkpoint.load_course_model`), every
request greedy and arriving at once:

* **repetitive**: windows of short Python snippets written out twice (``import`` lists,
  ``self.x = x`` lines): the continuation repeats what the prompt holds, so prompt lookup
  finds it;
* **code**: windows of the standard library's own source (what the model was trained on),
  where repetition is only what real code has.

Each workload runs without and with an ``NgramSpeculator``, on the same requests, and the
script checks that the outputs are equal token for token. It prints the acceptance rate,
the mean acceptance length (tokens a drafting sequence gains per step), the tokens per
engine step, the median time per output token, and the throughput ratio (on / off) on the
virtual clock (the modelled GPU step cost of :mod:`minipaged.clock`, deterministic: a step
costs mostly its fixed part, so fewer steps win) and on the wall clock of this machine (the
fastest of ``--repeats`` alternating runs). A sweep of ``k`` on the virtual clock closes the
report.
"""

from __future__ import annotations

import argparse
import inspect
import random
import time

import torch

from minipaged.checkpoint import load_course_model
from minipaged.cli import positive_int
from minipaged.clock import VirtualClock, WallClock
from minipaged.engine import Engine
from minipaged.latency import summarize
from minipaged.scheduler import EngineConfig
from minipaged.speculative import NgramSpeculator
from minipaged.tokenizer import encode
from minipaged.workload import RequestSpec

REPETITIVE_SNIPPETS = [
    "import os\nimport sys\nimport re\nimport json\n",
    "        self.x = x\n        self.y = y\n        self.width = width\n",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\n",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n",
    "if x is None:\n    x = []\nif y is None:\n    y = []\n",
    "    assert f(1) == 1\n    assert f(2) == 4\n    assert f(3) == 9\n",
]
CODE_MODULES = ["json.encoder", "textwrap", "dataclasses", "argparse", "string", "fractions"]


def repetitive_prompts(num: int, length: int, seed: int = 0) -> list[list[int]]:
    """``num`` prompts of ``length`` bytes, each a window of one snippet written out twice (seeded).

    Args:
        num: how many prompts.
        length: bytes per prompt (at most twice the shortest snippet's length minus its start).
        seed: picks the snippets and the windows.
    """
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        text = rng.choice(REPETITIVE_SNIPPETS) * 3
        start = rng.randrange(len(text) - length)
        prompts.append(encode(text[start:start + length]))
    return prompts


def code_prompts(num: int, length: int, seed: int = 0) -> list[list[int]]:
    """``num`` prompts of ``length`` bytes from the standard library's source, at seeded places.

    Args:
        num: how many prompts.
        length: bytes per prompt.
        seed: picks the modules and the windows.
    """
    rng = random.Random(seed)
    sources = [inspect.getsource(__import__(name, fromlist=["_"])) for name in CODE_MODULES]
    prompts = []
    for _ in range(num):
        source = rng.choice(sources).encode("ascii", "replace").decode()
        start = rng.randrange(len(source) - length)
        prompts.append(encode(source[start:start + length]))
    return prompts


def run(model, prompts: list[list[int]], max_tokens: int, parts: dict, clock) -> tuple[Engine, list]:
    """Every prompt arriving at time 0, greedy, ``max_tokens`` each; returns the engine and the sequences.

    ``parts``: the engine's ``config`` and ``speculator`` (:func:`_config`).
    """
    engine = Engine(model, clock=clock, **parts)
    workload = [RequestSpec(0.0, len(p), max_tokens) for p in prompts]
    return engine, engine.run(workload, progress=False, prompts=prompts)


def describe(engine: Engine, seqs: list) -> dict:
    """The run's throughput plus the speculative-decoding counters."""
    m, steps = engine.speculator.stats, engine.metrics.num_steps
    summary = summarize(seqs)
    summary.update(steps=steps, tokens_per_step=summary["output_tokens"] / steps,
                   acceptance_rate=m.acceptance_rate, mean_acceptance_length=m.mean_acceptance_length,
                   per_pos=[a / m.num_drafts for a in m.num_accepted_tokens_per_pos] if m.num_drafts else [])
    return summary


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m minipaged.bench spec", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=positive_int, default=16, help="requests per workload")
    parser.add_argument("--prompt-len", type=positive_int, default=96, help="prompt bytes (tokens)")
    parser.add_argument("--max-tokens", type=positive_int, default=64, help="output tokens per request")
    parser.add_argument("--k", type=positive_int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup", type=positive_int, nargs=2, default=(2, 4), metavar=("MIN", "MAX"),
                        help="prompt_lookup_min and prompt_lookup_max")
    parser.add_argument("--max-num-seqs", type=positive_int, default=8)
    parser.add_argument("--repeats", type=positive_int, default=2, help="wall-clock runs per system, alternating")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.lookup[0] > args.lookup[1]:
        parser.error(f"--lookup MIN must be at most MAX, got {args.lookup[0]} {args.lookup[1]}")
    return args


def _config(args, k: int | None) -> dict:
    """The engine of both systems (its ``config`` and ``speculator``): plain (``k`` None) or ``k`` n-gram drafts."""
    spec = None if k is None else {"method": "ngram", "num_speculative_tokens": k,
                                   "prompt_lookup_min": args.lookup[0], "prompt_lookup_max": args.lookup[1]}
    return {"config": EngineConfig(num_blocks=256, block_size=16, max_num_seqs=args.max_num_seqs,
                                   max_num_batched_tokens=512),
            "speculator": None if spec is None else NgramSpeculator(spec)}  # fmt: skip


def _compare(model, args, name: str, prompts) -> tuple[tuple[float, float], bool]:
    """Plain against speculative decoding on one workload, printed; the (virtual, wall) throughput ratios and
    whether the outputs are equal token for token."""
    virtual = {}
    for system, k in (("plain", None), ("spec", args.k)):
        engine, seqs = run(model, prompts, args.max_tokens, _config(args, k), VirtualClock())
        virtual[system] = (describe(engine, seqs), [s.output_token_ids for s in seqs])
    equal = virtual["plain"][1] == virtual["spec"][1]
    plain, spec = virtual["plain"][0], virtual["spec"][0]
    wall = {}
    for repeat in range(args.repeats):
        for system, k in (("plain", None), ("spec", args.k)):
            start = time.perf_counter()
            engine, seqs = run(model, prompts, args.max_tokens, _config(args, k), WallClock())
            elapsed = time.perf_counter() - start
            tps = summarize(seqs)["tokens_per_s"]
            print(f"{name} {system} run {repeat + 1}: {engine.metrics.num_steps} steps in {elapsed:.1f} s")
            wall[system] = max(wall.get(system, 0.0), tps)
    ratios = (spec["tokens_per_s"] / plain["tokens_per_s"], wall["spec"] / wall["plain"])
    print(f"\n{name}: outputs equal token for token: {equal}")
    print(f"  acceptance rate {spec['acceptance_rate']:.1%}, mean acceptance length "
          f"{spec['mean_acceptance_length']:.2f} tokens per verification step")
    print("  per-position acceptance: " + ", ".join(f"{p:.0%}" for p in spec["per_pos"]))
    print(f"  engine steps: plain {plain['steps']}, spec {spec['steps']} "
          f"({plain['steps'] / spec['steps']:.2f}x fewer); tokens per step: plain {plain['tokens_per_step']:.2f}, "
          f"spec {spec['tokens_per_step']:.2f}")
    print(f"  throughput ratio (spec / plain): virtual clock {ratios[0]:.2f}x "
          f"({plain['tokens_per_s']:.0f} -> {spec['tokens_per_s']:.0f} tok/s), "
          f"wall clock {ratios[1]:.2f}x ({wall['plain']:.0f} -> {wall['spec']:.0f} tok/s)")
    print(f"  TPOT p50 on the virtual clock: plain {plain['tpot_p50'] * 1e3:.1f} ms, spec "
          f"{spec['tpot_p50'] * 1e3:.1f} ms ({plain['tpot_p50'] / spec['tpot_p50']:.2f}x shorter)\n")
    return ratios, equal


def main(argv: list[str]) -> int:
    args = _parse(argv)
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_course_model(device=device)
    print(f"course model, {args.requests} greedy requests per workload arriving at once, prompt {args.prompt_len} "
          f"bytes, {args.max_tokens} output tokens each, max_num_seqs {args.max_num_seqs}; ngram drafts "
          f"k={args.k}, prompt_lookup_min {args.lookup[0]}, prompt_lookup_max {args.lookup[1]}; device {device}")
    run(model, [[1, 2, 3]] * 2, 4, _config(args, args.k), VirtualClock())  # warm-up: one-off costs of first passes
    workloads = {"repetitive": repetitive_prompts(args.requests, args.prompt_len, args.seed),
                 "code": code_prompts(args.requests, args.prompt_len, args.seed)}  # fmt: skip
    ratios = {}
    for name, prompts in workloads.items():
        ratios[name], equal = _compare(model, args, name, prompts)
        if not equal:
            print("ERROR: speculative decoding changed the greedy output")
            return 1

    print("k sweep on the virtual clock (code workload): k, acceptance rate, mean acceptance length, throughput ratio")
    plain = describe(*run(model, workloads["code"], args.max_tokens, _config(args, None), VirtualClock()))
    for k in (1, 2, 4, 8):
        spec = describe(*run(model, workloads["code"], args.max_tokens, _config(args, k), VirtualClock()))
        print(f"  k={k}: {spec['acceptance_rate']:.1%}, {spec['mean_acceptance_length']:.2f}, "
              f"{spec['tokens_per_s'] / plain['tokens_per_s']:.2f}x")
    print("summary: " + ", ".join(f"{n} {v:.2f}x virtual / {w:.2f}x wall" for n, (v, w) in ratios.items()))
    return 0
