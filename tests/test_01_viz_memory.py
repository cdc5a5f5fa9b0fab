"""Chapter 01 renderers, checked without a browser: they return figures holding the right data."""

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from minipaged import accounting as acc  # noqa: E402
from minipaged.viz import memory as vm  # noqa: E402

pytestmark = pytest.mark.ch01

WORKED = [37, 91, 128, 201, 511]


def test_waste_vs_block_size_plots_one_minus_utilisation():
    fig = vm.plot_waste_vs_block_size("chat", 1024, block_sizes=(4, 16, 64), num_seqs=300, seed=5)
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    paged, fixed = ax.lines[0], ax.lines[1]
    lengths = acc.sample_lengths("chat", 300, 1024, seed=5)
    assert list(paged.get_xdata()) == [4, 16, 64]
    expected = [100 * (1 - acc.utilisation(lengths, b)) for b in (4, 16, 64)]
    np.testing.assert_allclose(paged.get_ydata(), expected)
    assert np.all(np.diff(paged.get_ydata()) >= 0)  # bigger blocks waste more here
    np.testing.assert_allclose(fixed.get_ydata()[0], 100 * (1 - acc.fixed_utilisation(lengths, 1024)))
    assert "B" in ax.get_xlabel()


def _bars(ax):
    return [(round(p.get_x(), 6), round(p.get_width(), 6), p.get_facecolor()) for p in ax.patches]


def test_fixed_vs_paged_bars_match_the_worked_example():
    fig = vm.plot_fixed_vs_paged(WORKED, 512, 16)
    ax = fig.axes[0]
    assert len(ax.patches) == 4 * len(WORKED)
    widths = [p.get_width() for p in ax.patches]
    tokens = sum(widths[0::4])
    reserved_empty = sum(widths[1::4])
    tail = sum(widths[3::4])
    assert tokens == sum(WORKED) == 968
    assert tokens + reserved_empty == 2560
    assert tokens + tail == 992
    assert "2560" in ax.get_title() and "992" in ax.get_title()
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"n={n}" for n in reversed(WORKED)]


def test_fixed_vs_paged_rejects_too_long():
    with pytest.raises(ValueError, match="max_len"):
        vm.plot_fixed_vs_paged([600], 512, 16)


def test_capacity_breakdown_bars_sum_to_the_budget():
    report = acc.capacity("Llama-3-8B", 4 * 2**30, 32, 2048, "long_tail", seed=1)
    fig = vm.plot_capacity_breakdown(report)
    ax = fig.axes[0]
    assert len(ax.patches) == 10  # 5 parts x 2 schemes
    fixed, paged = ax.patches[:5], ax.patches[5:]
    for bars, part in ((fixed, report.fixed), (paged, report.paged)):
        assert sum(p.get_width() for p in bars) == pytest.approx(100)
        assert bars[0].get_width() == pytest.approx(100 * part.effective_kv / report.budget_bytes)
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert f"{report.paged.num_seqs} seqs" in labels[1] and f"{report.fixed.num_seqs} seqs" in labels[0]
    legend = ax.get_legend()
    shown = [t.get_text() for t in legend.get_texts()]
    parts = (report.fixed.parts(), report.paged.parts())
    share = {name: max(100 * p[name] / report.budget_bytes for p in parts) for name in vm.COLORS}
    assert shown == [name for name in vm.COLORS if share[name] >= vm.MIN_VISIBLE_SHARE]
    note = legend.get_title().get_text()
    for name in vm.COLORS:
        assert (name in note) == (name not in shown and share[name] > 0), name


def test_capacity_breakdown_legend_lists_only_the_parts_a_bar_shows():
    # chapter 01's case: the block tables (0.15 MiB) and the unused rest (0.4%) are too thin to draw
    report = acc.capacity("Llama-3-8B", 16 * 2**30, 16, 2048, "chat", dtype="bf16", seed=0)
    legend = vm.plot_capacity_breakdown(report).axes[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["effective KV", "tail waste", "reservation waste"]
    assert legend.get_title().get_text() == ("too thin to see: block table (paged: 0.15 MiB, 0.0%); "
                                             "unused (paged: 67.85 MiB, 0.4%)")


def test_explorer_redraws_on_slider_change():
    box = vm.memory_explorer("Llama-3-8B", budget_bytes=2**30)
    controls, summary, out = box.children
    block, max_len, which = controls.children
    before = summary.value
    assert "Llama-3-8B" in before and "paged admits" in before
    block.value = 256
    assert summary.value != before
    r = acc.capacity("Llama-3-8B", 2**30, 256, 2048, "chat")
    assert f"paged admits {r.paged.num_seqs}" in summary.value
    which.value = "uniform"
    max_len.value = 4096
    r = acc.capacity("Llama-3-8B", 2**30, 256, 4096, "uniform")
    assert f"fixed admits {r.fixed.num_seqs}," in summary.value
    assert f"paged admits {r.paged.num_seqs}" in summary.value


def test_waste_plot_highlights_the_chosen_block_size():
    fig = vm.plot_waste_vs_block_size("uniform", 512, block_sizes=(8, 32), num_seqs=100, seed=0, highlight=32)
    ax = fig.axes[0]
    assert len(ax.lines) == 3
    assert list(ax.lines[2].get_xdata()) == [32, 32]
    u = acc.utilisation(acc.sample_lengths("uniform", 100, 512, seed=0), 32)
    assert f"B = 32: {100 * (1 - u):.1f}%" in [t.get_text() for t in ax.get_legend().get_texts()]
    assert len(vm.plot_waste_vs_block_size("uniform", 512, block_sizes=(8, 32), num_seqs=100).axes[0].lines) == 2


def test_explorer_rejects_unknown_presets_up_front():
    with pytest.raises(ValueError, match="preset"):
        vm.memory_explorer(presets=("chat", "nope"))


def test_waste_breakdown_bars_are_the_shares():
    breakdown = acc.waste_breakdown("chat", 1024, 16, num_seqs=100, seed=3)
    fig = vm.plot_waste_breakdown(breakdown)
    ax = fig.axes[0]
    assert len(ax.patches) == len(breakdown) * len(acc.WASTE_PARTS)
    for k, parts in enumerate(breakdown.values()):
        bars = ax.patches[k * 3 : k * 3 + 3]
        np.testing.assert_allclose([b.get_width() for b in bars], [100 * parts[p] for p in acc.WASTE_PARTS])
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "reserved" in labels and "tail waste (paging's internal fragmentation)" in labels
    assert "%" in ax.get_xlabel()
