"""Benchmarks: ``python -m minipaged.bench NAME``. Ratios against a same-run baseline, never timed tests.

Their options go through :mod:`minipaged.cli`'s argparse types: a bad value is a usage error, never a traceback.
"""

import time

from minipaged.latency import summarize


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
