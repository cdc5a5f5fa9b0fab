"""Plots of a serving run (chapter 05): latency percentiles and distributions, queues and memory over time.

Pure functions: the numbers of :mod:`minipaged.metrics` in, a matplotlib figure out.
"""

from __future__ import annotations

from minipaged.metrics import PERCENTILES, StepRecord
from minipaged.viz import style


@style.styled
def plot_latency_percentiles(summaries: dict[str, dict], unit: str = "s"):
    """Bar chart: TTFT / TPOT / E2E at p50, p90, p99, one bar colour per run.

    Args:
        summaries: run name -> what :func:`minipaged.metrics.summarize` returned.
        unit: latencies in seconds (``"s"``) or milliseconds (``"ms"``).
    """
    import matplotlib.pyplot as plt

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
        ax.set_title(metric.upper())
        ax.set_ylabel(f"{metric.upper()} ({unit})")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


@style.styled
def plot_latency_cdf(latencies: dict[str, list[float]], title: str = "TTFT", unit: str = "s"):
    """Empirical CDFs, one line per run: where the curves separate at the top is the tail.

    Args:
        latencies: run name -> latencies in seconds (one list of :func:`minipaged.metrics.request_latencies`).
        title: what the latencies are, for the axis label and title.
        unit: plot in seconds (``"s"``) or milliseconds (``"ms"``).
    """
    import matplotlib.pyplot as plt

    scale = 1000.0 if unit == "ms" else 1.0
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for k, (name, values) in enumerate(latencies.items()):
        xs = sorted(v * scale for v in values)
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name,
                color=style.color_of(name, k))
    ax.axhline(0.99, color="grey", lw=0.6, ls="--")
    ax.set_xlabel(f"{title} ({unit})")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"{title} distribution")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


@style.styled
def plot_timeline(history: list[StepRecord], title: str = ""):
    """Queue lengths and the cache's memory use over time, with preemptions marked.

    The lower panel shows two fractions of the pool: KV usage (blocks in use)
    and token occupancy (tokens held); the gap between them is tail waste.

    Args:
        history: ``engine.metrics.history``.
        title: the figure's title.
    """
    import matplotlib.pyplot as plt

    t = [r.time for r in history]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 4.5), sharex=True)
    ax1.plot(t, [r.num_running for r in history], label="running")
    ax1.plot(t, [r.num_waiting for r in history], label="waiting")
    pre = [r for r in history if r.preemptions]
    if pre:
        ax1.scatter([r.time for r in pre], [r.num_running for r in pre], color=style.color("preemption"), marker="x",
                    label="preemption", zorder=3)
    ax1.set_ylabel("sequences")
    ax1.legend(fontsize=8, loc="upper right")
    ax1.set_title(title)
    ax2.plot(t, [r.kv_usage for r in history], label="KV usage (blocks in use / pool)")
    ax2.plot(t, [r.token_occupancy for r in history], label="token occupancy (tokens / pool slots)")
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("fraction of pool")
    ax2.set_xlabel("time (s)")
    ax2.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig
