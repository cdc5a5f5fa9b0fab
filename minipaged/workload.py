"""Workloads (who arrives when, with how long a prompt and answer) and the clocks that time them.

**Arrivals** are a Poisson process: independent users, so the gaps between
requests are exponential with mean ``1 / rate``. **Lengths** come from a
truncated log-normal, the usual shape of real prompt and answer lengths (most
short, a few very long). Two presets state their parameters:

========  ================================  ================================
preset    prompt tokens                     output tokens
========  ================================  ================================
chat      median 48, sigma 0.6, in [4,192]  median 32, sigma 0.6, in [2,128]
longtail  median 32, sigma 1.2, in [4,384]  median 24, sigma 1.2, in [2,256]
========  ================================  ================================

(The numbers are scaled to the course's tiny model; real chat traffic has
prompts of hundreds to thousands of tokens. Only the shape matters here.)

A workload is a plain list of :class:`TraceRequest`, so a fixed trace can be
saved to JSON and replayed exactly.

**Time.** Two clocks, same interface (``now()``, ``step(...)``, ``wait_until(t)``):

* :class:`VirtualClock` charges each engine step a modelled cost and jumps
  over idle gaps. Latencies are then a deterministic function of the
  schedule, so notebooks can print them and tests can compare them. The cost
  model is a rough picture of a 7B model on a data-centre GPU: a fixed cost
  per step (reading the weights once), plus a cost per computed token
  (prefill is compute), plus a cost per cached token attended to (reading
  the KV cache), plus a cost per token of K/V swapped between GPU and CPU
  memory (about 0.5 MB per token over a host link of about 25 GB/s).
* :class:`WallClock` is real time (``time.perf_counter``); the benchmark
  uses it, and idle gaps are really waited out.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class TraceRequest:
    arrival_time: float  # seconds from the start of the run
    prompt_len: int
    output_len: int  # becomes SamplingParams.max_tokens


@dataclass(frozen=True)
class LengthDist:
    """A log-normal length distribution truncated to ``[low, high]`` (clipped, then rounded)."""

    median: float
    sigma: float
    low: int
    high: int

    def sample(self, n: int, generator: torch.Generator) -> list[int]:
        z = torch.randn(n, generator=generator, dtype=torch.float64)
        lengths = (math.log(self.median) + self.sigma * z).exp().round().clamp(self.low, self.high)
        return [int(x) for x in lengths]


PRESETS = {
    "chat": (LengthDist(48, 0.6, 4, 192), LengthDist(32, 0.6, 2, 128)),
    "longtail": (LengthDist(32, 1.2, 4, 384), LengthDist(24, 1.2, 2, 256)),
}


def poisson_arrivals(n: int, rate: float, generator: torch.Generator) -> list[float]:
    """``n`` arrival times of a Poisson process with ``rate`` requests per second, starting at 0."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests per second, got {rate!r}")
    gaps = torch.empty(n, dtype=torch.float64).exponential_(rate, generator=generator)
    gaps[0] = 0.0  # the first request opens the run
    return [float(t) for t in gaps.cumsum(0)]


def make_workload(n: int, rate: float, preset: str = "chat", seed: int = 0) -> list[TraceRequest]:
    """A seeded Poisson workload; ``rate=math.inf`` puts every arrival at t = 0 (the "offline" batch)."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    gen = torch.Generator().manual_seed(seed)
    prompt_dist, output_dist = PRESETS[preset]
    arrivals = [0.0] * n if rate == math.inf else poisson_arrivals(n, rate, gen)
    prompts, outputs = prompt_dist.sample(n, gen), output_dist.sample(n, gen)
    return [TraceRequest(round(t, 6), p, o) for t, p, o in zip(arrivals, prompts, outputs)]


def prompt_token_ids(index: int, length: int, vocab_size: int, seed: int = 0) -> list[int]:
    """The prompt of request ``index``: seeded random ids, the same on every replay."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
    return torch.randint(0, vocab_size, (length,), generator=gen).tolist()


def save_trace(trace: list[TraceRequest], path) -> None:
    Path(path).write_text(json.dumps([asdict(r) for r in trace], indent=1))


def load_trace(path) -> list[TraceRequest]:
    return [TraceRequest(**r) for r in json.loads(Path(path).read_text())]


@dataclass(frozen=True)
class StepCost:
    """Modelled seconds for one forward pass (see the module docstring)."""

    per_step: float = 0.010
    per_token: float = 0.0001
    per_context_token: float = 0.000001
    per_swapped_token: float = 0.00002

    def __call__(self, num_batched_tokens: int, num_context_tokens: int, num_swapped_tokens: int = 0) -> float:
        return (
            self.per_step
            + self.per_token * num_batched_tokens
            + self.per_context_token * num_context_tokens
            + self.per_swapped_token * num_swapped_tokens
        )


class VirtualClock:
    """Deterministic time: each step costs ``cost(tokens, context)``; idle gaps are skipped over."""

    def __init__(self, cost: StepCost = StepCost()):
        self.cost = cost
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def step(self, num_batched_tokens: int, num_context_tokens: int, num_swapped_tokens: int = 0) -> None:
        self.t += self.cost(num_batched_tokens, num_context_tokens, num_swapped_tokens)

    def wait_until(self, t: float) -> None:
        self.t = max(self.t, t)


class WallClock:
    """Real seconds since the clock was made; a step costs whatever the forward pass really took."""

    def __init__(self):
        self.start = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.start

    def step(self, num_batched_tokens: int, num_context_tokens: int, num_swapped_tokens: int = 0) -> None:
        pass  # the time has already passed

    def wait_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            time.sleep(delay)
