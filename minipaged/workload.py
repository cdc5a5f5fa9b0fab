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
"""

from __future__ import annotations

import json
import math
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
