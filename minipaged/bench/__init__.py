"""Benchmarks: ``python -m minipaged.bench NAME``. Ratios against a same-run baseline, never timed tests.

The argparse ``type`` helpers below turn a bad option into a usage error, never a traceback.
"""

import argparse
import math
import time

from minipaged.latency import summarize


def positive_int(text: str) -> int:
    """An argparse ``type``: an int >= 1, else a usage error that quotes the value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _number(text: str) -> float:
    """``text`` as a float, or a usage error that quotes it."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def positive_rate(text: str) -> float:
    """An argparse ``type``: a number > 0 (``inf`` allowed: every arrival at once), never NaN."""
    value = _number(text)
    if math.isnan(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0 (inf: all at once), got {text}")
    return value


def positive_finite(text: str) -> float:
    """An argparse ``type``: a finite number > 0 (not NaN, not inf)."""
    value = _number(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def fraction(text: str) -> float:
    """An argparse ``type``: a number in [0, 1)."""
    value = _number(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def best_runs(systems: dict, replay, repeats: int, label: str = "") -> dict[str, dict]:
    """Run every system ``repeats`` times, alternating, and keep each one's fastest run.

    Alternating the systems means a burst of load from something else on the machine slows one
    round of all of them, instead of deciding the ratio.

    Args:
        systems: name -> a function that builds a fresh engine for that system.
        replay: engine -> the sequences of one run (for example ``lambda e: e.run(workload)``).
        repeats: rounds (>= 1).
        label: printed before each run's progress line.

    Returns:
        name -> the best run's ``metrics.summarize`` plus ``max_concurrent``, ``preemptions``
        and ``hit_rate`` (the prefix cache's, 0.0 without one).
    """
    runs: dict[str, dict] = {}
    for repeat in range(repeats):
        for name, make in systems.items():
            engine = make()
            start = time.perf_counter()
            summary = summarize(replay(engine))
            elapsed = time.perf_counter() - start
            summary["max_concurrent"] = engine.metrics.max_running
            summary["preemptions"] = engine.metrics.num_preemptions
            summary["hit_rate"] = engine.metrics.prefix_cache_hit_rate
            print(f"{label}{name} run {repeat + 1}: {engine.metrics.num_steps} steps in {elapsed:.1f} s wall-clock")
            if name not in runs or summary["tokens_per_s"] > runs[name]["tokens_per_s"]:
                runs[name] = summary
    return runs
