"""Time for the serving engine: a modelled clock for notebooks and tests, a real one for benchmarks.

Two clocks, same interface (``now()``, ``step(...)``, ``wait_until(t)``):

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

import time
from dataclasses import dataclass

from minipaged.step_state import StepState


@dataclass(frozen=True)
class StepCost:
    """Modelled seconds for one forward pass (see the module docstring)."""

    per_step: float = 0.010
    per_token: float = 0.0001
    per_context_token: float = 0.000001
    per_swapped_token: float = 0.00002

    def __call__(self, num_batched_tokens: int, num_context_tokens: int, num_swapped_tokens: int = 0) -> float:
        """Seconds for one step.

        Args:
            num_batched_tokens: tokens computed in the step, all sequences together.
            num_context_tokens: cached tokens the step's attention reads.
            num_swapped_tokens: tokens whose K/V was copied between GPU and CPU memory.
        """
        return (self.per_step + self.per_token * num_batched_tokens + self.per_context_token * num_context_tokens
                + self.per_swapped_token * num_swapped_tokens)  # fmt: skip


class VirtualClock(StepState):
    """Deterministic time: each step costs ``cost(tokens, context)``; idle gaps are skipped over."""

    def __init__(self, cost: StepCost = StepCost()):
        self.cost = cost
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def step(self, num_batched_tokens: int, num_context_tokens: int, num_swapped_tokens: int = 0) -> None:
        """Advance by the modelled cost of one step (arguments as for :class:`StepCost`)."""
        self.t += self.cost(num_batched_tokens, num_context_tokens, num_swapped_tokens)

    def wait_until(self, t: float) -> None:
        """Jump to time ``t`` (seconds) if it is later than now: idle time costs nothing to simulate."""
        self.t = max(self.t, t)


class WallClock(StepState):
    """Real seconds since the clock was made; a step costs whatever the forward pass really took."""

    def __init__(self):
        self.start = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.start

    def step(self, num_batched_tokens: int, num_context_tokens: int, num_swapped_tokens: int = 0) -> None:
        pass  # the time has already passed

    def wait_until(self, t: float) -> None:
        """Sleep until time ``t`` (seconds since the clock was made)."""
        delay = t - self.now()
        if delay > 0:
            time.sleep(delay)
