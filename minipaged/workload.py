"""Workloads: who arrives when, with how long a prompt and how long an answer.

Chapter 01 sizes the KV cache from these lengths, chapter 02 replays them
through the block allocator, chapter 05 through the engine. Every draw comes
from one kind of generator, ``np.random.default_rng(seed)``, so a seed means
the same workload everywhere.

**Lengths** come from one family of distributions, :class:`LengthDistribution`:
each shape draws raw lengths, which are rounded to whole tokens and clipped
to its ``[low, high]``. The shapes: :class:`LogNormal` (most short, some
long: the usual shape of chat prompts and answers), :class:`Pareto` (a heavy
tail), :class:`Uniform`, :class:`Geometric` (an answer that stops at every
token with the same probability) and :class:`Constant`.

**Presets** (:data:`LENGTH_PRESETS`) pair a prompt-length and an output-length
distribution under one name. The real-scale ones are constructed, not
measured (we have no traffic traces), and state their parameters; the
``tiny_`` ones are scaled down to the course's tiny model (chapters 02 and 05):

==============  ==================================  ==================================
preset          prompt tokens                       output tokens
==============  ==================================  ==================================
chat            log-normal, median 160, sigma 1.0,  log-normal, median 120, sigma 0.8,
                in [1, 4096]                        in [1, 2048]
long_tail       Pareto, scale 48, alpha 1.2,        Pareto, scale 32, alpha 1.2,
                in [1, 8192]                        in [1, 4096]
uniform         uniform on [1, 1024]                uniform on [1, 1024]
tiny_chat       log-normal, median 48, sigma 0.6,   log-normal, median 32, sigma 0.6,
                in [4, 192]                         in [2, 128]
tiny_long_tail  log-normal, median 32, sigma 1.2,   log-normal, median 24, sigma 1.2,
                in [4, 384]                         in [2, 256]
tiny_geometric  uniform on [16, 128]                geometric, mean 96, in [1, 384]
==============  ==================================  ==================================

**Arrivals** are a Poisson process: independent users, so the gaps between
requests are exponential with mean ``1 / rate`` (:func:`poisson_arrivals`).

A workload is a plain list of :class:`RequestSpec` (arrival time in seconds, prompt tokens,
output tokens), so a fixed trace can be kept and replayed exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from minipaged.validation import check_int, check_real

# ----------------------------------------------------------------------------
# lengths: one family of distributions
# ----------------------------------------------------------------------------


MAX_DRAWS = 10**7  # the most lengths or arrivals one call draws: more is a typo, and would end in a MemoryError


def check_num_draws(value, name: str, minimum: int = 0) -> int:
    """``value`` as an int in ``[minimum, MAX_DRAWS]``, checked before anything is drawn; errors name ``name``.

    Args:
        value: how many lengths, arrivals or requests a call would build.
        name: the argument's name, as the caller's signature spells it.
        minimum: the fewest allowed.
    """
    n = check_int(value, name, minimum=minimum)
    if n > MAX_DRAWS:
        raise ValueError(f"{name} = {n:,} is more than the limit of {MAX_DRAWS:,} (workload.MAX_DRAWS) "
                         "samples or requests one call may build")
    return n


def _check_bounds(low, high) -> None:
    check_int(low, "low", minimum=1)
    check_int(high, "high", minimum=1)
    if low > high:
        raise ValueError(f"low ({low}) must be <= high ({high})")


@dataclass(frozen=True)
class LengthDistribution:
    """Token lengths: a shape's raw draws, rounded to whole tokens and clipped to ``[low, high]``.

    Subclasses are frozen dataclasses that have ``low`` and ``high`` and implement ``_draw``.
    """

    def _draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        raise NotImplementedError

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` lengths as int64, each in ``[low, high]``.

        Args:
            n: how many lengths to draw (0 .. :data:`MAX_DRAWS`).
            rng: the generator to draw from, ``np.random.default_rng(seed)``.
        """
        n = check_num_draws(n, "n")
        if not isinstance(rng, np.random.Generator):
            raise TypeError(f"rng must be a numpy Generator (np.random.default_rng(seed)), got {type(rng).__name__}")
        raw = np.asarray(self._draw(rng, n), dtype=np.float64)
        return np.clip(np.rint(raw), self.low, self.high).astype(np.int64)


@dataclass(frozen=True)
class LogNormal(LengthDistribution):
    """Log-normal around ``median`` tokens: ``log(length)`` is normal with spread ``sigma``."""

    median: float
    sigma: float
    low: int
    high: int

    def __post_init__(self):
        check_real(self.median, "median", minimum=0, strict=True)
        check_real(self.sigma, "sigma", minimum=0)
        _check_bounds(self.low, self.high)

    def _draw(self, rng, n):
        return rng.lognormal(mean=math.log(self.median), sigma=self.sigma, size=n)


@dataclass(frozen=True)
class Pareto(LengthDistribution):
    """Pareto: at least ``scale`` tokens, with a tail of index ``alpha`` (smaller is heavier)."""

    scale: float
    alpha: float
    low: int
    high: int

    def __post_init__(self):
        check_real(self.scale, "scale", minimum=0, strict=True)
        check_real(self.alpha, "alpha", minimum=0, strict=True)
        _check_bounds(self.low, self.high)

    def _draw(self, rng, n):
        return self.scale * (1.0 + rng.pareto(self.alpha, size=n))


@dataclass(frozen=True)
class Uniform(LengthDistribution):
    """Every length from ``low`` to ``high`` equally likely."""

    low: int
    high: int

    def __post_init__(self):
        _check_bounds(self.low, self.high)

    def _draw(self, rng, n):
        return rng.integers(self.low, self.high, size=n, endpoint=True)


@dataclass(frozen=True)
class Geometric(LengthDistribution):
    """Lengths 1, 2, ... with mean ``mean``: every token ends the answer with probability ``1 / mean``."""

    mean: float
    low: int
    high: int

    def __post_init__(self):
        check_real(self.mean, "mean", minimum=1)
        _check_bounds(self.low, self.high)

    def _draw(self, rng, n):
        return rng.geometric(1.0 / self.mean, size=n)


@dataclass(frozen=True)
class Constant(LengthDistribution):
    """Always ``value`` tokens."""

    value: int

    def __post_init__(self):
        check_int(self.value, "value", minimum=1)

    @property
    def low(self) -> int:
        return self.value

    @property
    def high(self) -> int:
        return self.value

    def _draw(self, rng, n):
        return np.full(n, self.value)


@dataclass(frozen=True)
class WorkloadPreset:
    """A named pair of length distributions: one for prompts, one for outputs."""

    name: str
    prompt_len: LengthDistribution
    output_len: LengthDistribution

    def __post_init__(self):
        for arg in ("prompt_len", "output_len"):
            if not isinstance(getattr(self, arg), LengthDistribution):
                raise TypeError(f"{arg} must be a LengthDistribution, got {getattr(self, arg)!r}")

    def sequence_lengths(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """Prompt + output of ``n`` requests (int64): the tokens each sequence holds when it finishes.

        Args:
            n: how many sequences.
            rng: the generator; prompts are drawn first, then outputs, as :func:`make_workload` does.
        """
        prompts = self.prompt_len.sample(n, rng)
        return prompts + self.output_len.sample(n, rng)


LENGTH_PRESETS: dict[str, WorkloadPreset] = {
    p.name: p
    for p in [
        WorkloadPreset("chat", LogNormal(160, 1.0, 1, 4096), LogNormal(120, 0.8, 1, 2048)),
        WorkloadPreset("long_tail", Pareto(48, 1.2, 1, 8192), Pareto(32, 1.2, 1, 4096)),
        WorkloadPreset("uniform", Uniform(1, 1024), Uniform(1, 1024)),
        WorkloadPreset("tiny_chat", LogNormal(48, 0.6, 4, 192), LogNormal(32, 0.6, 2, 128)),
        WorkloadPreset("tiny_long_tail", LogNormal(32, 1.2, 4, 384), LogNormal(24, 1.2, 2, 256)),
        WorkloadPreset("tiny_geometric", Uniform(16, 128), Geometric(96, 1, 384)),
    ]
}


def get_length_preset(preset: str | WorkloadPreset) -> WorkloadPreset:
    """``preset`` itself, or the entry of :data:`LENGTH_PRESETS` it names."""
    if isinstance(preset, WorkloadPreset):
        return preset
    if not isinstance(preset, str):
        raise TypeError(f"preset must be a name or a WorkloadPreset, got {type(preset).__name__} {preset!r}")
    if preset not in LENGTH_PRESETS:
        raise ValueError(f"preset must be one of {sorted(LENGTH_PRESETS)}, got {preset!r}")
    return LENGTH_PRESETS[preset]


# ----------------------------------------------------------------------------
# requests: arrivals and lengths
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload, fixed before the run (the engine's runtime state is ``Sequence``)."""

    arrival_time: float  # seconds of the engine clock (virtual or wall) from the start of the run
    num_prompt_tokens: int
    num_output_tokens: int  # exactly that many output tokens: SamplingParams(max_tokens=..., ignore_eos=True)

    def __post_init__(self):
        object.__setattr__(self, "arrival_time", check_real(self.arrival_time, "arrival_time", minimum=0))
        object.__setattr__(self, "num_prompt_tokens", check_int(self.num_prompt_tokens, "num_prompt_tokens", minimum=1))
        object.__setattr__(self, "num_output_tokens", check_int(self.num_output_tokens, "num_output_tokens", minimum=1))


def poisson_arrivals(num_requests: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times (float64, non-decreasing, the first at 0) of a Poisson process.

    Args:
        num_requests: how many arrivals (at most :data:`MAX_DRAWS`).
        rate: requests per second (> 0); ``math.inf`` puts every arrival at 0.
        rng: the generator; it draws ``num_requests`` gaps whatever the rate.
    """
    num_requests = check_num_draws(num_requests, "num_requests")
    rate = check_real(rate, "rate", minimum=0, finite=False, strict=True)
    gaps = rng.exponential(1.0 / rate, size=num_requests)
    if num_requests:
        gaps[0] = 0.0  # the first request opens the run
    return np.cumsum(gaps)


def make_workload(num_requests: int, rate: float, preset: str | WorkloadPreset = "tiny_chat",
                  seed: int = 0) -> list[RequestSpec]:
    """A seeded workload: Poisson arrivals, then prompt lengths, then output lengths, from one generator.

    Args:
        num_requests: how many requests (at most :data:`MAX_DRAWS`).
        rate: requests per second (> 0); ``math.inf`` puts every arrival at 0 (an "offline" batch).
            The lengths do not depend on the rate.
        preset: a name in :data:`LENGTH_PRESETS` or a :class:`WorkloadPreset`.
        seed: the seed of ``np.random.default_rng``.
    """
    preset = get_length_preset(preset)
    rng = np.random.default_rng(check_int(seed, "seed"))
    arrivals = poisson_arrivals(num_requests, rate, rng)
    prompts = preset.prompt_len.sample(num_requests, rng)
    outputs = preset.output_len.sample(num_requests, rng)
    return [RequestSpec(float(t), int(p), int(o)) for t, p, o in zip(arrivals, prompts, outputs)]


def prompt_token_ids(index: int, length: int, vocab_size: int, seed: int = 0) -> list[int]:
    """The prompt of request ``index``: ``length`` seeded random ids in ``[0, vocab_size)``, the same on every replay.

    Args:
        index: the request's position in the workload (each request gets its own stream).
        length: the prompt's length in tokens.
        vocab_size: ids are drawn from ``0 .. vocab_size - 1``.
        seed: the workload's seed.
    """
    index = check_int(index, "index")
    length = check_int(length, "length")
    vocab_size = check_int(vocab_size, "vocab_size", minimum=1)
    rng = np.random.default_rng([check_int(seed, "seed"), index])
    return rng.integers(0, vocab_size, size=length).tolist()
