"""Chapter 05 serving figures: log axes where asked, one shared time axis for the timelines."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from minipaged.latency import PERCENTILES
from minipaged.metrics import StepRecord  # noqa: E402
from minipaged.viz import serving  # noqa: E402

pytestmark = pytest.mark.ch05


def summary(scale):
    return {f"{m}_p{p}": scale * (1 + i) for m in ("ttft", "tpot", "e2e") for i, p in enumerate(PERCENTILES)}


def record(step, time, running, waiting, preemptions=0):
    return StepRecord(step, time, running, waiting, 4, 0, running, running / 8, running / 16, 0, preemptions, 0)


def test_percentile_bars_log_only_where_asked():
    fig = serving.plot_latency_percentiles({"paged": summary(0.02), "static": summary(3.0)}, unit="ms", log=("ttft",))
    scales = [ax.get_yscale() for ax in fig.axes]
    assert scales == ["log", "linear", "linear"]
    heights = sorted(bar.get_height() for bar in fig.axes[0].patches)
    assert heights[0] == pytest.approx(20.0) and heights[-1] == pytest.approx(9000.0)
    plt.close(fig)


def test_percentile_bars_reject_unknown_metric():
    with pytest.raises(ValueError, match="log"):
        serving.plot_latency_percentiles({"paged": summary(1.0)}, log=("ttfb",))


def test_cdf_log_axis():
    fig = serving.plot_latency_cdf({"a": [0.01, 0.02], "b": [1.0, 3.0]}, unit="ms", log=True)
    assert fig.axes[0].get_xscale() == "log"
    plt.close(fig)


def test_timelines_share_one_time_axis():
    short = [record(i, 0.1 * i, 2, 0) for i in range(5)]
    long = [record(i, 0.5 * i, 4, i, preemptions=int(i == 3)) for i in range(10)]
    fig = serving.plot_timelines({"paged": short, "static": long})
    axes = fig.axes
    assert len(axes) == 4
    assert all(ax.get_xlim() == axes[0].get_xlim() for ax in axes)
    assert axes[0].get_xlim()[1] >= 4.5  # the longer run sets the axis for both columns
    assert axes[0].get_ylim() == axes[1].get_ylim()  # a row shares its y axis
    assert [ax.get_title() for ax in axes[:2]] == ["paged", "static"]
    assert len(axes[1].collections) == 1  # the one preemption, marked in the run that had it
    legends = [ax.get_legend() for ax in axes]
    assert legends[0] is None and legends[2] is None  # legends sit right of the last column
    assert [t.get_text() for t in legends[1].get_texts()] == ["running", "waiting", "preemption"]
    plt.close(fig)


def test_timelines_need_a_run():
    with pytest.raises(ValueError, match="histories"):
        serving.plot_timelines({})
