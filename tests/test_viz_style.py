"""The course figure style: each system keeps one colour, renderers use it, the global style stays alone."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402

from minipaged.viz import memory as vm  # noqa: E402
from minipaged.viz import serving, style  # noqa: E402

pytestmark = pytest.mark.package


def test_code_names_and_glossary_names_share_a_colour():
    assert style.color("grow_in_place") == style.color("grow-in-place") == style.color("contiguous")
    assert style.color("max_reservation") == style.color("fixed") == style.color("static")
    assert len({style.color(n) for n in ("paged", "fixed", "grow-in-place", "cache on")}) == 4


def test_run_labels_find_their_system():
    assert style.color_of("continuous+paged") == style.color("paged")
    assert style.color_of("static+reserved") == style.color("static")
    assert style.color_of("paged, cache on") == style.color("cache on")  # the longer name wins
    assert style.color_of("run A", 1) == style.CYCLE[1]


def test_bad_names_are_refused():
    with pytest.raises(ValueError, match="'pagd'"):
        style.color("pagd")
    with pytest.raises(TypeError, match="name"):
        style.color(3)
    with pytest.raises(ValueError, match="xlabel"):
        style.axes(style.figure()[1], "", "y (s)")


def test_line_gives_each_system_its_own_marker():
    paged, grow = style.line("paged"), style.line("grow_in_place", label="grow")
    assert paged["color"] != grow["color"] and paged["marker"] != grow["marker"]
    assert grow["label"] == "grow"


def test_renderers_use_the_palette_without_changing_the_global_style():
    before = matplotlib.rcParams["font.size"]
    fig = vm.plot_waste_vs_block_size("chat", 1024, block_sizes=(4, 16), num_seqs=50)
    assert matplotlib.rcParams["font.size"] == before
    paged, fixed = fig.axes[0].lines[:2]
    assert to_hex(paged.get_color()) == style.color("paged").lower()
    assert to_hex(fixed.get_color()) == style.color("fixed").lower()
    assert fig.axes[0].xaxis.label.get_fontsize() == style.FONT_SIZE


def test_serving_bars_take_the_system_colour():
    summary = {f"{m}_p{p}": 0.1 for m in ("ttft", "tpot", "e2e") for p in (50, 90, 99)}
    fig = serving.plot_latency_percentiles({"continuous+paged": summary, "static+reserved": summary})
    colours = {to_hex(p.get_facecolor()) for p in fig.axes[0].patches}
    assert colours == {style.color("paged").lower(), style.color("static").lower()}
    assert all("(s)" in ax.get_ylabel() for ax in fig.axes)


def test_apply_sets_the_session_default():
    with matplotlib.rc_context():
        style.apply()
        assert matplotlib.rcParams["font.size"] == style.FONT_SIZE
        assert not matplotlib.rcParams["axes.spines.top"]
