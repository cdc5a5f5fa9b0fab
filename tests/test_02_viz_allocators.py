"""Chapter 02's matplotlib figures: they plot the simulator's numbers, each system in its course colour."""

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402

from minipaged.trace import TraceSimulator  # noqa: E402
from minipaged.viz import allocators as va  # noqa: E402
from minipaged.viz import style  # noqa: E402
from minipaged.workload import make_workload  # noqa: E402

pytestmark = pytest.mark.ch02


@pytest.fixture(scope="module")
def sim():
    s = TraceSimulator(make_workload(30, rate=0.3, preset="tiny_geometric", seed=1), num_blocks=64, block_size=16,
                       max_len=512)
    s.run()
    return s


def test_history_plots_each_system_in_its_colour_and_paged_stays_visible(sim):
    fig = va.plot_history(sim, "t")
    running = {line.get_label(): line for line in fig.axes[0].lines}
    assert set(running) == set(sim.systems)
    for name, line in running.items():
        assert to_hex(line.get_color()) == style.color(name).lower()
        np.testing.assert_array_equal(line.get_ydata(), sim.series(name, "running"))
    # grow-in-place is drawn wide and underneath, so paged on top of it is never hidden
    assert running["paged"].get_zorder() > running["grow_in_place"].get_zorder()
    assert running["grow_in_place"].get_linewidth() > running["paged"].get_linewidth()
    assert all(ax.get_ylabel() for ax in fig.axes) and "step" in fig.axes[2].get_xlabel()


def test_block_size_sweep_uses_two_panels_one_unit_each():
    sweep = {1: {"tail waste": 0.0, "table bytes": 800.0}, 16: {"tail waste": 80.0, "table bytes": 50.0}}
    fig = va.plot_block_size_sweep(sweep)
    left, right = fig.axes
    assert "slots" in left.get_ylabel() and "bytes" in right.get_ylabel()
    # each is a total over the running sequences, not a per-sequence figure: the axes say so
    assert all("all running sequences" in ax.get_ylabel() for ax in (left, right))
    np.testing.assert_array_equal(left.lines[0].get_ydata(), [0.0, 80.0])
    np.testing.assert_array_equal(right.lines[0].get_ydata(), [800.0, 50.0])


def test_block_size_sweep_draws_each_law_as_a_straight_line():
    # tail waste ∝ B on linear axes; table bytes ∝ 1/B on log-log axes (a log x axis would bend the first)
    fig = va.plot_block_size_sweep({b: {"tail waste": 5.0 * b, "table bytes": 4096.0 / b} for b in (1, 4, 16, 64)})
    left, right = fig.axes
    assert (left.get_xscale(), left.get_yscale()) == ("linear", "linear")
    assert (right.get_xscale(), right.get_yscale()) == ("log", "log")
    for ax, transform in ((left, lambda v: v), (right, np.log2)):
        x, y = (transform(np.asarray(d, dtype=float)) for d in ax.lines[0].get_data())
        slopes = np.diff(y) / np.diff(x)
        np.testing.assert_allclose(slopes, slopes[0])
