"""Chapter 02 figures: paging against the contiguous allocators on one trace, and the block-size sweep.

Pure renderers: a :class:`~minipaged.trace.TraceSimulator` that has run (or the
numbers of a sweep) in, a matplotlib ``Figure`` out, in the course style.
"""

from __future__ import annotations

from collections.abc import Mapping

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from minipaged.trace import TraceSimulator
from minipaged.viz import style

# Under the others, wide and pale: where two systems coincide (paged and grow-in-place run the same
# sequences while nothing has to move), the thin line on top stays visible on the wide one.
_UNDERLAY = {"grow_in_place": {"lw": 4.0, "alpha": 0.45, "zorder": 1}}


@style.styled
def plot_history(sim: TraceSimulator, title: str = "") -> Figure:
    """Running sequences, utilisation and grow-in-place's external fragmentation, step by step.

    Args:
        sim: a simulation that has run (``sim.run()``).
        title: the figure's title.
    """
    fig = Figure(figsize=(9, 6.5), layout="constrained")
    axes = fig.subplots(3, 1, sharex=True)
    for name in sim.systems:
        kw = {"color": style.color(name), "lw": 1.3, "zorder": 2, **_UNDERLAY.get(name, {})}
        axes[0].plot(sim.series(name, "running"), label=name, **kw)
        # An empty pool has no utilisation: leave a gap rather than plot a drop to 0.
        util = [r[name].utilisation if r[name].reserved else float("nan") for r in sim.history]
        axes[1].plot(util, label=name, **kw)
    if "grow_in_place" in sim.systems:
        axes[2].plot(sim.series("grow_in_place", "external_fragmentation"), color=style.color("grow_in_place"),
                     lw=1, label="grow_in_place")
    axes[2].axhline(0, color=style.color("paged"), lw=1.3, label="paged (always 0)")
    axes[0].set_ylabel("running\n(sequences)")
    axes[1].set_ylabel("utilisation\n(tokens / held slots)")
    axes[2].set_ylabel("external\nfragmentation (0–1)")
    axes[2].set_xlabel("step (one token per running sequence)")
    axes[0].legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=3)
    axes[2].legend(loc="upper right", ncols=2)
    if title:
        fig.suptitle(title)
    return fig


@style.styled
def plot_block_size_sweep(sweep: Mapping[int, Mapping[str, float]], title: str = "") -> Figure:
    """Two panels against the block size B: tail waste (slots) and block-table size (bytes), each summed
    over the sequences running at a step and averaged over the steps.

    Separate panels, because slots and bytes are different units. Each panel's axes make its law a straight
    line: the tail waste grows in proportion to B, so its axes are linear; the tables shrink as 1/B, so
    theirs are both logarithmic (a slope of −1).

    Args:
        sweep: block size -> ``{"tail waste": slots, "table bytes": bytes, ...}``, each the total over the
            running sequences, averaged over the steps.
        title: the figure's title.
    """
    sizes = sorted(sweep)
    fig = Figure(figsize=(9, 3.4), layout="constrained")
    left, right = fig.subplots(1, 2)
    left.plot(sizes, [sweep[b]["tail waste"] for b in sizes], marker="o", color=style.color("tail waste"))
    left.set_xlim(0, None)
    left.set_ylim(0, None)
    right.plot(sizes, [sweep[b]["table bytes"] for b in sizes], marker="s", color=style.color("block table"))
    right.set_xscale("log", base=2)
    right.set_yscale("log", base=2)
    right.set_xticks(sizes, [str(b) for b in sizes])
    right.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))  # 4,096, not 2^12
    style.axes(left, "block size B (tokens)", "tail waste (slots)\nof all running sequences",
               title="tail waste grows with B (linear axes)")
    style.axes(right, "block size B (tokens)", "block tables (bytes)\nof all running sequences",
               title="block tables shrink as 1/B (log axes)")
    if title:
        fig.suptitle(title)
    return fig
