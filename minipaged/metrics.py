"""What a serving run is judged by: per-request latencies, throughput, and the cache over time.

Per request (times in the engine's clock, see :mod:`minipaged.workload`):

* **TTFT**, time to first token = first token time - arrival. Queueing plus prefill.
* **TPOT**, time per output token after the first = (finish - first token) / (outputs - 1).
* **E2E**, end-to-end latency = finish - arrival.

Each is summarised at p50 / p90 / p99: a server is judged by its slow tail,
not its average. Throughput is output tokens (and requests) per second over
the run, from the first arrival to the last finish.

Per step, :class:`Metrics` keeps a ``history`` of :class:`StepRecord` (queue
lengths, KV blocks in use, tail waste, preemptions). It learns about blocks
and preemptions by subscribing to the allocator's events, not by polling.
The plotting functions are pure: data in, matplotlib figure out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minipaged.sequence import Sequence, SequenceStatus

PERCENTILES = (50, 90, 99)


@dataclass
class StepRecord:
    step: int
    time: float  # clock time at the end of the step
    num_running: int
    num_waiting: int
    num_batched_tokens: int
    num_prefill_tokens: int  # tokens of sequences still in prefill (their chunk is not a single decode token)
    kv_used_blocks: int
    kv_utilisation: float  # blocks in use / blocks in the pool
    tail_waste: int  # reserved but unfilled slots in the last block of each running sequence
    preemptions: int  # in this step
    finished: int  # in this step


@dataclass
class Metrics:
    """Step history plus counters fed by allocator events. ``attach(allocator)`` subscribes."""

    num_blocks: int
    history: list[StepRecord] = field(default_factory=list)
    used_blocks: int = 0
    num_preemptions: int = 0
    max_running: int = 0
    swapped_out_blocks: int = 0  # swap-mode preemption: blocks copied to CPU memory ...
    swapped_in_blocks: int = 0  # ... and back into the pool when the victim is readmitted
    _step_preemptions: int = 0

    def attach(self, allocator):
        """Follow ``allocator``'s events; returns the unsubscribe function."""
        return allocator.subscribe(self.on_event)

    def on_event(self, event) -> None:
        if event.kind == "allocate":
            self.used_blocks += 1
        elif event.kind == "free":
            self.used_blocks -= 1
        elif event.kind == "preempt":
            self.num_preemptions += 1
            self._step_preemptions += 1
            self.swapped_out_blocks += event.info.get("swapped_blocks", 0)
        elif event.kind == "swap_in":
            self.swapped_in_blocks += event.info["swapped_blocks"]

    def record_step(self, time: float, running: list[Sequence], num_waiting: int, num_new_tokens: list[int],
                    num_prefill_tokens: int, num_finished: int) -> StepRecord:
        waste = sum(s.block_table.tail_waste for s in running if s.block_table is not None)
        record = StepRecord(
            step=len(self.history),
            time=time,
            num_running=len(running),
            num_waiting=num_waiting,
            num_batched_tokens=sum(num_new_tokens),
            num_prefill_tokens=num_prefill_tokens,
            kv_used_blocks=self.used_blocks,
            kv_utilisation=self.used_blocks / self.num_blocks,
            tail_waste=waste,
            preemptions=self._step_preemptions,
            finished=num_finished,
        )
        self._step_preemptions = 0
        self.max_running = max(self.max_running, len(running))
        self.history.append(record)
        return record


def percentiles(values: list[float]) -> dict[int, float]:
    """p50/p90/p99 by linear interpolation (NaN when there is nothing to summarise)."""
    if not values:
        return {p: float("nan") for p in PERCENTILES}
    t = torch.tensor(values, dtype=torch.float64)
    return {p: float(torch.quantile(t, p / 100)) for p in PERCENTILES}


def request_latencies(seqs: list[Sequence]) -> dict[str, list[float]]:
    """TTFT, TPOT and E2E of the finished requests (aborted ones have no latency to report)."""
    done = [s for s in seqs if s.status is SequenceStatus.FINISHED]
    return {
        "ttft": [s.first_token_time - s.arrival_time for s in done],
        "tpot": [(s.finish_time - s.first_token_time) / (s.num_output_tokens - 1) for s in done if s.num_output_tokens > 1],
        "e2e": [s.finish_time - s.arrival_time for s in done],
    }


def summarize(seqs: list[Sequence]) -> dict:
    """Throughput and latency percentiles of one run, as plain numbers."""
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
    """A small fixed-width table, one column per run; latencies in ``unit`` ("s" or "ms")."""
    scale = 1000.0 if unit == "ms" else 1.0
    rows = [("throughput (tok/s)", "tokens_per_s", 1.0, ".1f"), ("requests/s", "requests_per_s", 1.0, ".2f")]
    for name in ("ttft", "tpot", "e2e"):
        rows += [(f"{name.upper()} p{p} ({unit})", f"{name}_p{p}", scale, ".3f" if unit == "s" else ".1f") for p in PERCENTILES]
    names = list(summaries)
    width = max(12, *(len(n) + 2 for n in names))
    lines = [f"{'':<20}" + "".join(f"{n:>{width}}" for n in names)]
    for label, key, k, fmt in rows:
        lines.append(f"{label:<20}" + "".join(f"{summaries[n][key] * k:>{width}{fmt}}" for n in names))
    return "\n".join(lines)


def plot_latency_percentiles(summaries: dict[str, dict], unit: str = "s"):
    """Bar chart: TTFT / TPOT / E2E at p50, p90, p99, one bar colour per run."""
    import matplotlib.pyplot as plt

    scale = 1000.0 if unit == "ms" else 1.0
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    width = 0.8 / max(1, len(summaries))
    for ax, metric in zip(axes, ("ttft", "tpot", "e2e")):
        for i, (name, s) in enumerate(summaries.items()):
            xs = [j + i * width for j in range(len(PERCENTILES))]
            ax.bar(xs, [s[f"{metric}_p{p}"] * scale for p in PERCENTILES], width, label=name)
        ax.set_xticks([j + width * (len(summaries) - 1) / 2 for j in range(len(PERCENTILES))])
        ax.set_xticklabels([f"p{p}" for p in PERCENTILES])
        ax.set_title(metric.upper())
        ax.set_ylabel(unit)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_latency_cdf(latencies: dict[str, list[float]], title: str = "TTFT", unit: str = "s"):
    """Empirical CDFs, one line per run: where the curves separate at the top is the tail."""
    import matplotlib.pyplot as plt

    scale = 1000.0 if unit == "ms" else 1.0
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for name, values in latencies.items():
        xs = sorted(v * scale for v in values)
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
    ax.axhline(0.99, color="grey", lw=0.6, ls="--")
    ax.set_xlabel(f"{title} ({unit})")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"{title} distribution")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_timeline(history: list[StepRecord], title: str = ""):
    """Queue lengths and KV-cache use over time, with preemptions marked."""
    import matplotlib.pyplot as plt

    t = [r.time for r in history]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 4.5), sharex=True)
    ax1.plot(t, [r.num_running for r in history], label="running")
    ax1.plot(t, [r.num_waiting for r in history], label="waiting")
    pre = [r for r in history if r.preemptions]
    if pre:
        ax1.scatter([r.time for r in pre], [r.num_running for r in pre], color="red", marker="x", label="preemption", zorder=3)
    ax1.set_ylabel("sequences")
    ax1.legend(fontsize=8, loc="upper right")
    ax1.set_title(title)
    ax2.plot(t, [r.kv_utilisation for r in history], label="blocks in use / pool")
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("KV pool")
    ax2.set_xlabel("time (s)")
    ax2.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig
