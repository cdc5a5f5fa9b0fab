"""What a serving run is judged by: per-request latencies and throughput.

Per request (times in the engine's clock, see :mod:`minipaged.clock`):

* **TTFT**, time to first token = first token time - arrival. Queueing plus prefill.
* **TPOT**, time per output token after the first = (finish - first token) / (outputs - 1).
* **E2E**, end-to-end latency = finish - arrival.

Each is summarised at p50 / p90 / p99: a server is judged by its slow tail,
not its average. Throughput is output tokens (and requests) per second over
the run, from the first arrival to the last finish. What the engine records
step by step is :mod:`minipaged.metrics`'s.
"""

from __future__ import annotations

from minipaged.sequence import Sequence, SequenceStatus

PERCENTILES = (50, 90, 99)


def percentiles(values: list[float]) -> dict[int, float]:
    """p50/p90/p99 by linear interpolation between order statistics (NaN when there is nothing to summarise).

    Plain Python floats, not ``torch.quantile``: its vectorised interpolation rounds differently on
    AVX-512, AVX2 and scalar CPUs, and these numbers are printed in checked notebook cells.
    """
    if not values:
        return {p: float("nan") for p in PERCENTILES}
    ordered = sorted(float(v) for v in values)
    result = {}
    for p in PERCENTILES:
        rank = p / 100 * (len(ordered) - 1)
        lo = int(rank)
        hi = min(lo + 1, len(ordered) - 1)
        result[p] = ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)
    return result


def request_latencies(seqs: list[Sequence]) -> dict[str, list[float]]:
    """TTFT, TPOT and E2E of the finished requests (aborted ones have no latency to report)."""
    done = [s for s in seqs if s.status is SequenceStatus.FINISHED]
    return {
        "ttft": [s.first_token_time - s.arrival_time for s in done],
        "tpot": [
            (s.finish_time - s.first_token_time) / (s.num_output_tokens - 1) for s in done if s.num_output_tokens > 1
        ],
        "e2e": [s.finish_time - s.arrival_time for s in done],
    }


def summarize(seqs: list[Sequence]) -> dict:
    """Throughput and latency percentiles of one run, as plain numbers.

    Args:
        seqs: the run's sequences (finished ones count; the run starts at the earliest arrival).
    """
    done = [s for s in seqs if s.status is SequenceStatus.FINISHED]
    if not done:
        raise ValueError("no finished requests to summarise")
    span = max(s.finish_time for s in done) - min(s.arrival_time for s in seqs)
    output_tokens = sum(s.num_output_tokens for s in done)
    summary = {
        "requests": len(done),
        "duration_s": span,
        "output_tokens": output_tokens,
        "tokens_per_s": output_tokens / span,
        "requests_per_s": len(done) / span,
    }
    for name, values in request_latencies(seqs).items():
        for p, v in percentiles(values).items():
            summary[f"{name}_p{p}"] = v
    return summary


def format_summary(summaries: dict[str, dict], unit: str = "s") -> str:
    """A small fixed-width table, one column per run.

    Args:
        summaries: run name -> what :func:`summarize` returned.
        unit: latencies in seconds (``"s"``) or milliseconds (``"ms"``).
    """
    if not isinstance(summaries, dict):
        raise TypeError(f"summaries must be a dict of run name -> summary, got {type(summaries).__name__}")
    if not summaries:
        raise ValueError("summaries must hold at least one run (run name -> what summarize returned)")
    if unit not in ("s", "ms"):
        raise ValueError(f"unit must be 's' or 'ms', got {unit!r}")
    scale = 1000.0 if unit == "ms" else 1.0
    rows = [("throughput (tok/s)", "tokens_per_s", 1.0, ".1f"), ("requests/s", "requests_per_s", 1.0, ".2f")]
    for name in ("ttft", "tpot", "e2e"):
        fmt = ".3f" if unit == "s" else ".1f"
        rows += [(f"{name.upper()} p{p} ({unit})", f"{name}_p{p}", scale, fmt) for p in PERCENTILES]
    names = list(summaries)
    width = max(12, *(len(n) + 2 for n in names))
    lines = [f"{'':<20}" + "".join(f"{n:>{width}}" for n in names)]
    for label, key, k, fmt in rows:
        lines.append(f"{label:<20}" + "".join(f"{summaries[n][key] * k:>{width}{fmt}}" for n in names))
    return "\n".join(lines)

