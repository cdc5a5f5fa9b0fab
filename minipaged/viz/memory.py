"""Chapter 01 figures: where KV-cache memory goes, fixed reservation against paging.

Three pure renderers (arguments -> matplotlib Figure, nothing global touched)
and one live explorer that redraws them from ipywidgets controls.
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure

from minipaged import accounting as acc
from minipaged.viz import style
from minipaged.viz.svg import text_on
from minipaged.workload import WorkloadPreset, get_length_preset

# the parts of a KV budget (``accounting.Breakdown.parts``), in the course palette
COLORS = {name: style.color(name) for name in ("effective KV", "tail waste", "reservation waste", "block table",
                                                "unused")}

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@style.styled
def plot_waste_vs_block_size(preset: str | WorkloadPreset, max_len: int = 2048,
                             block_sizes: Sequence[int] = BLOCK_SIZES, num_seqs: int = 2000, seed: int = 0,
                             highlight: int | None = None) -> Figure:
    """Wasted share of the allocated slots, 1 − U, against B; fixed reservation as a dashed line.

    Args:
        preset: the length preset (see ``accounting.sample_lengths``).
        max_len: the fixed reservation; sampled lengths are cut off there.
        block_sizes: the values of B on the x axis.
        num_seqs: how many sequence lengths to sample.
        seed: the seed of the sampled lengths.
        highlight: one block size (the explorer's current choice) to mark with a dotted line.
    """
    preset = get_length_preset(preset)
    lengths = acc.sample_lengths(preset, num_seqs, max_len, seed)
    waste = [100 * (1 - acc.utilisation(lengths, b)) for b in block_sizes]
    fixed = 100 * (1 - acc.fixed_utilisation(lengths, max_len))
    fig = Figure(figsize=(6.4, 3.6), layout="constrained")
    ax = fig.add_subplot()
    ax.plot(block_sizes, waste, **style.line("paged", "paged: tail waste"))
    ax.axhline(fixed, ls="--", color=style.color("fixed"), label=f"fixed {max_len}: {fixed:.1f}%")
    if highlight is not None:
        waste_here = 100 * (1 - acc.utilisation(lengths, highlight))
        ax.axvline(highlight, ls=":", color="grey", label=f"B = {highlight}: {waste_here:.1f}%")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(block_sizes), [str(b) for b in block_sizes])
    ax.set_ylim(0, 100)
    ax.set_xlabel("block size B (tokens)")
    ax.set_ylabel("wasted slots (% of allocated)")
    ax.set_title(f"{preset.name} lengths, {num_seqs} sequences (seed {seed})")
    ax.legend(loc="best")
    return fig


@style.styled
def plot_fixed_vs_paged(lengths: Sequence[int], max_len: int, block_size: int) -> Figure:
    """One row per sequence: slots held under fixed reservation (top) and paging (bottom)."""
    lengths = [int(n) for n in lengths]
    acc.fixed_slots(lengths, max_len)  # validates lengths <= max_len
    fig = Figure(figsize=(7.2, 0.55 * len(lengths) + 1.4), layout="constrained")
    ax = fig.add_subplot()
    h = 0.38
    for i, n in enumerate(lengths):
        y = len(lengths) - 1 - i
        tail = acc.tail_waste(n, block_size)
        ax.barh(y + h / 2, n, h, color=COLORS["effective KV"], label="tokens" if i == 0 else None)
        ax.barh(y + h / 2, max_len - n, h, left=n, color=COLORS["reservation waste"],
                label="reserved, empty (fixed)" if i == 0 else None)
        ax.barh(y - h / 2, n, h, color=COLORS["effective KV"])
        ax.barh(y - h / 2, tail, h, left=n, color=COLORS["tail waste"], label="tail waste (paged)" if i == 0 else None)
        for k in range(1, acc.blocks_needed(n, block_size)):  # block boundaries
            ax.vlines(k * block_size, y - h, y, color="white", lw=0.4)
    ax.set_yticks(range(len(lengths)), [f"n={n}" for n in reversed(lengths)])
    ax.set_xlim(0, max_len)
    ax.set_xlabel("token slots (upper bar: fixed reservation; lower bar: paged, white lines = block edges)")
    fixed, paged = acc.fixed_slots(lengths, max_len), acc.paged_slots(lengths, block_size)
    ax.set_title(f"fixed {max_len}: {fixed} slots   vs   paged B={block_size}: {paged} slots   ({sum(lengths)} used)")
    ax.legend(ncols=3, fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.22))
    return fig


# a bar part narrower than this share of the budget (%) is too thin to see at the figure's width
MIN_VISIBLE_SHARE = 1.0


@style.styled
def plot_capacity_breakdown(report: acc.CapacityReport) -> Figure:
    """Two stacked bars, each the whole budget, split into the parts of ``Breakdown``.

    The legend lists only the parts a bar shows (at least ``MIN_VISIBLE_SHARE`` % of the budget); a part
    that holds bytes but is too thin to see is named, with its size, in a note under the axes instead.
    """
    fig = Figure(figsize=(7.2, 2.6), layout="constrained")
    ax = fig.add_subplot()
    bars = ((1, "fixed", report.fixed), (0, "paged", report.paged))
    visible = {name for _, _, part in bars for name, value in part.parts().items()
               if _share(value, report) >= MIN_VISIBLE_SHARE}
    for y, _, part in bars:
        left = 0.0
        for name, value in part.parts().items():
            share = _share(value, report)
            ax.barh(y, share, left=left, color=COLORS[name], label=name if y == 1 and name in visible else None)
            left += share
    ax.set_yticks([1, 0], [f"fixed {report.max_len}\n{report.fixed.num_seqs} seqs",
                           f"paged B={report.block_size}\n{report.paged.num_seqs} seqs"])
    ax.set_xlim(0, 100)
    ax.set_xlabel(f"% of {report.budget_bytes / 2**30:g} GiB KV budget")
    ax.set_title(f"{report.model.name}, {report.preset.name} lengths (max_len {report.max_len})")
    thin = [f"{name} ({scheme}: {value / 2**20:,.2f} MiB, {_share(value, report):.1f}%)"
            for _, scheme, part in bars for name, value in part.parts().items() if value and name not in visible]
    ax.legend(ncols=5, fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.35),
              title="too thin to see: " + "; ".join(thin) if thin else None, title_fontsize="small")
    return fig


def _share(value: int, report: acc.CapacityReport) -> float:
    return 100 * value / report.budget_bytes if report.budget_bytes else 0.0


@style.styled
def plot_waste_breakdown(breakdown: dict[str, dict[str, float]], title: str = "") -> Figure:
    """One stacked bar per scheme: effective KV, reserved and internal fragmentation, in % of the slots held.

    Args:
        breakdown: what :func:`minipaged.accounting.waste_breakdown` returned.
        title: the axes title.
    """
    names = list(breakdown)
    fig = Figure(figsize=(7.2, 0.55 * len(names) + 1.6), layout="constrained")
    ax = fig.add_subplot()
    seen = set()
    for row, name in enumerate(names):
        y, left = len(names) - 1 - row, 0.0
        for part in acc.WASTE_PARTS:
            share = 100 * breakdown[name][part]
            key = "tail waste" if part == "internal fragmentation" and name.startswith("paged") else part
            label = {"tail waste": "tail waste (paging's internal fragmentation)"}.get(key, key)
            ax.barh(y, share, left=left, color=style.color(key), label=None if key in seen else label)
            seen.add(key)
            if share >= 6:
                ax.text(left + share / 2, y, f"{share:.0f}%", ha="center", va="center", fontsize=9,
                        color=text_on(style.color(key)))
            left += share
    ax.set_yticks(range(len(names)), list(reversed(names)))
    ax.set_xlim(0, 100)
    style.axes(ax, "share of the KV slots held, over the requests' lives (%)", "scheme", title=title or None)
    ax.grid(axis="y", visible=False)
    ax.legend(ncols=2, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    return fig


def memory_explorer(model="Llama-3-8B", budget_bytes: int = 16 * 2**30, dtype=None, seed: int = 0,
                    presets: Sequence[str] = ("chat", "long_tail", "uniform")):
    """Live view: block size, max length and length-preset controls redraw the waste and capacity figures.

    Args:
        model: a ``ModelSpec`` or a name in ``accounting.MODEL_PRESETS``.
        budget_bytes: the KV memory to fill.
        dtype: bytes per number (default: the model's own).
        seed: the seed of the sampled lengths.
        presets: the names in ``workload.LENGTH_PRESETS`` to choose from.
    """
    import ipywidgets as W
    from IPython.display import display

    for name in presets:
        get_length_preset(name)  # fail now, not in a callback
    block = W.SelectionSlider(options=list(BLOCK_SIZES), value=16, description="block size")
    max_len = W.SelectionSlider(options=[512, 1024, 2048, 4096, 8192], value=2048, description="max_len")
    which = W.Dropdown(options=list(presets), description="lengths")
    summary = W.HTML()
    out = W.Output()

    @out.capture(clear_output=True, wait=True)
    def redraw(_change=None):
        report = acc.capacity(model, budget_bytes, block.value, max_len.value, which.value, dtype=dtype, seed=seed)
        display(plot_waste_vs_block_size(which.value, max_len.value, seed=seed, highlight=block.value),
                plot_capacity_breakdown(report))
        # set last, so a changed summary means the new figures have been sent
        summary.value = (f"<b>{report.model.name}</b>: fixed admits {report.fixed.num_seqs}, "
                         f"paged admits {report.paged.num_seqs} sequences"
                         + (f" ({report.gain:.2f}x)" if report.fixed.num_seqs else ""))

    for w in (block, max_len, which):
        w.observe(redraw, names="value")
    redraw()
    box = W.VBox([W.HBox([block, max_len, which]), summary, out])
    for w, name in ((box, "explorer"), (block, "block"), (max_len, "max-len"), (which, "lengths"),
                    (summary, "summary"), (out, "figures")):
        w.add_class(f"minipaged-memory-{name}")  # stable hooks for browser tests
    box.redraw = redraw  # for tests and for calling by hand
    return box
