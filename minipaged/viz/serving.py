"""Plots of a serving run (chapter 05): latency percentiles and distributions, queues and memory over time.

Pure functions: the numbers of :mod:`minipaged.metrics` in, a matplotlib figure out.
"""

from __future__ import annotations

from collections.abc import Sequence

from minipaged.latency import PERCENTILES
from minipaged.metrics import StepRecord
from minipaged.viz import style


@style.styled
def plot_latency_percentiles(summaries: dict[str, dict], unit: str = "s", log: Sequence[str] = ()):
    """Bar chart: TTFT / TPOT / E2E at p50, p90, p99, one bar colour per run.

    Args:
        summaries: run name -> what :func:`minipaged.latency.summarize` returned.
        unit: latencies in seconds (``"s"``) or milliseconds (``"ms"``).
        log: the metrics (of ``"ttft"``, ``"tpot"``, ``"e2e"``) drawn on a log axis, for runs whose
            latencies differ by orders of magnitude (a linear axis would hide the short bars).
    """
    import matplotlib.pyplot as plt

    unknown = set(log) - {"ttft", "tpot", "e2e"}
    if unknown:
        raise ValueError(f"log: unknown metrics {sorted(unknown)}; use 'ttft', 'tpot' or 'e2e'")
    scale = 1000.0 if unit == "ms" else 1.0
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    width = 0.8 / max(1, len(summaries))
    for ax, metric in zip(axes, ("ttft", "tpot", "e2e")):
        for i, (name, s) in enumerate(summaries.items()):
            xs = [j + i * width for j in range(len(PERCENTILES))]
            ax.bar(xs, [s[f"{metric}_p{p}"] * scale for p in PERCENTILES], width, label=name,
                   color=style.color_of(name, i))
        ax.set_xticks([j + width * (len(summaries) - 1) / 2 for j in range(len(PERCENTILES))])
        ax.set_xticklabels([f"p{p}" for p in PERCENTILES])
        if metric in log:
            ax.set_yscale("log")
        ax.set_title(metric.upper() + (" (log scale)" if metric in log else ""))
        ax.set_ylabel(f"{metric.upper()} ({unit})")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


@style.styled
def plot_latency_cdf(latencies: dict[str, list[float]], title: str = "TTFT", unit: str = "s", log: bool = False):
    """Empirical CDFs, one line per run: where the curves separate at the top is the tail.

    Args:
        latencies: run name -> latencies in seconds (one list of :func:`minipaged.latency.request_latencies`).
        title: what the latencies are, for the axis label and title.
        unit: plot in seconds (``"s"``) or milliseconds (``"ms"``).
        log: draw the latency axis on a log scale.
    """
    import matplotlib.pyplot as plt

    scale = 1000.0 if unit == "ms" else 1.0
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for k, (name, values) in enumerate(latencies.items()):
        xs = sorted(v * scale for v in values)
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name,
                color=style.color_of(name, k))
    ax.axhline(0.99, color="grey", lw=0.6, ls="--")
    if log:
        ax.set_xscale("log")
    ax.set_xlabel(f"{title} ({unit}{', log scale' if log else ''})")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"{title} distribution")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


@style.styled
def plot_timelines(histories: dict[str, list[StepRecord]]):
    """Queue lengths and the cache's memory use over time, one column per run, on one shared time axis.

    The upper row counts running and waiting sequences, with preemptions marked. The lower row shows
    two fractions of the pool: KV usage (blocks in use) and token occupancy (tokens held); the gap
    between them is tail waste. The lines take neutral colours and those of the kinds of memory, not
    the systems' colours, so they read the same in every column. All panels share the time axis, and
    each row its y axis, so the runs compare at a glance.

    Args:
        histories: run name (the column's title) -> that run's ``engine.metrics.history``.
    """
    import matplotlib.pyplot as plt

    if not histories:
        raise ValueError("histories: need at least one run")
    fig, axes = plt.subplots(2, len(histories), figsize=(4.5 * len(histories) + 2.5, 4.5), sharex=True, sharey="row",
                             squeeze=False)
    for col, (name, history) in enumerate(histories.items()):
        ax1, ax2 = axes[0][col], axes[1][col]
        t = [r.time for r in history]
        ax1.plot(t, [r.num_running for r in history], color="#777777", label="running")
        ax1.plot(t, [r.num_waiting for r in history], color="#000000", ls="--", label="waiting")
        pre = [r for r in history if r.preemptions]
        if pre:
            ax1.scatter([r.time for r in pre], [r.num_running for r in pre], color=style.color("preemption"),
                        marker="x", label="preemption", zorder=3)
        ax1.set_title(name)
        ax2.plot(t, [r.kv_usage for r in history], color=style.color("tail waste"),
                 label="KV usage (blocks in use / pool)")
        ax2.plot(t, [r.token_occupancy for r in history], color=style.color("effective KV"),
                 label="token occupancy (tokens / pool slots)")
        ax2.set_ylim(0, 1.05)
        ax2.set_xlabel("time (s)")
    axes[0][0].set_ylabel("sequences")
    axes[1][0].set_ylabel("fraction of pool")
    for row in axes:  # one legend per row, right of the last column, clear of every run's lines
        entries = {label: handle for ax in row for handle, label in zip(*ax.get_legend_handles_labels())}
        row[-1].legend(entries.values(), entries.keys(), fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    return fig
