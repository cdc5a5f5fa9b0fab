"""Chapter 02 pictures: the block-map, pool and timeline renderers, and the BlockMapView widget.

The renderers are pure functions of a PoolSnapshot, so the SVG is parsed with
xml.etree and its cells, labels, fills and colours are compared with the state
they claim to show. The widget is driven from Python (no browser): Step, Play,
Reset and allocator events must all change what it shows.
"""

import itertools
import math
import xml.etree.ElementTree as ET

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.blocks import BlockAllocator, BlockTable
from minipaged.viz.blockmap import (
    LINK_OPACITY,
    LINK_WIDTH,
    MARKS,
    BlockMapView,
    PoolSnapshot,
    render_block_map,
    render_pool,
)
from minipaged.viz.svg import (
    CACHED_COLOR,
    FREE_COLOR,
    PALETTE,
    SHARED_COLOR,
    TEXT_COLOR,
    USED_COLOR,
    seq_color,
    text_on,
)
from minipaged.viz.timeline import counter_events, default_series, history_series, render_timeline

pytestmark = pytest.mark.ch02

NS = "{http://www.w3.org/2000/svg}"


def parse(svg: str) -> ET.Element:
    return ET.fromstring(svg)


def cls(el) -> list[str]:
    return el.get("class", "").split()


def find_class(root, name, tag="*"):
    return [el for el in root.iter() if name in cls(el) and (tag == "*" or el.tag == NS + tag)]


def cells(root) -> dict[int, ET.Element]:
    return {int(g.get("data-block")): g for g in find_class(root, "cell", "g")}


def child_with_class(el, name):
    found = [c for c in el if name in cls(c)]
    return found[0] if found else None


def example():
    """seq 0: 9 tokens in 3 blocks; seq 1: 3 tokens in 1 block; seq 2 forks seq 0 (shares 3 blocks)."""
    alloc = BlockAllocator(12, 4)
    tables = {0: BlockTable(alloc, 0), 1: BlockTable(alloc, 1)}
    tables[0].append_tokens(9)
    tables[1].append_tokens(3)
    tables[2] = tables[0].fork(2)
    return alloc, tables


# ---------------------------------------------------------------------------
# PoolSnapshot
# ---------------------------------------------------------------------------


def test_snapshot_copies_allocator_and_tables():
    alloc, tables = example()
    snap = PoolSnapshot.from_allocator(alloc, tables, step=5)
    assert snap.num_blocks == 12 and snap.block_size == 4 and snap.step == 5
    assert snap.refcounts == tuple(alloc.refcounts)
    assert snap.tables == {s: tuple(t.blocks) for s, t in tables.items()}
    assert snap.num_tokens == {0: 9, 1: 3, 2: 9}
    assert snap.tail_waste == sum(t.tail_waste for t in tables.values())
    assert snap.num_used == alloc.num_used
    # a frozen copy: later changes to the allocator do not leak into it
    tables[1].append_tokens(4)
    assert snap.tables[1] == (tables[1].blocks[0],)


def test_snapshot_accepts_an_iterable_of_tables_and_plain_lists():
    alloc, tables = example()
    a = PoolSnapshot.from_allocator(alloc, list(tables.values()))
    b = PoolSnapshot.from_allocator(alloc, {s: list(t.blocks) for s, t in tables.items()})
    assert a.tables == b.tables
    assert b.num_tokens[1] == len(tables[1].blocks) * 4  # no num_tokens: assumed full


def test_snapshot_rejects_inconsistent_state():
    with pytest.raises(ValueError, match="refcounts"):
        PoolSnapshot(4, 2, (0, 0, 0))
    with pytest.raises(ValueError, match="block 9"):
        PoolSnapshot(4, 2, (1, 0, 0, 0), {0: [9]}, {0: 1})
    with pytest.raises(ValueError, match="block_size"):
        PoolSnapshot(4, 0, (0, 0, 0, 0))


def test_fills_are_per_block_tokens_and_tail_is_partial():
    alloc, tables = example()
    snap = PoolSnapshot.from_allocator(alloc, tables)
    b0, b1, b2 = tables[0].blocks
    assert [snap.fills[b] for b in (b0, b1, b2)] == [4, 4, 1]
    assert snap.fills[tables[1].blocks[0]] == 3
    assert snap.owners[b0] == [0, 2]


# ---------------------------------------------------------------------------
# render_pool
# ---------------------------------------------------------------------------


def test_pool_has_one_cell_per_block_with_its_id_and_state():
    alloc, tables = example()
    snap = PoolSnapshot.from_allocator(alloc, tables, step=7)
    root = parse(render_pool(snap))
    assert root.tag == NS + "svg" and "minipaged-pool" in cls(root)
    assert root.get("data-step") == "7"
    by_id = cells(root)
    assert sorted(by_id) == list(range(12))
    for b, g in by_id.items():
        label = child_with_class(g, "block-id")
        assert label.text == str(b)
        ref = alloc.refcount(b)
        assert g.get("data-refcount") == str(ref)
        expected = "free" if ref == 0 else "shared" if ref > 1 else "used"
        assert g.get("data-state") == expected
        assert f"cell-{expected}" in cls(g)


def test_pool_fill_bar_height_is_the_fraction_of_slots_used():
    alloc, tables = example()
    snap = PoolSnapshot.from_allocator(alloc, tables)
    by_id = cells(parse(render_pool(snap)))
    for b, g in by_id.items():
        bg, bar = child_with_class(g, "bg"), child_with_class(g, "fill")
        if snap.fills[b] == 0:
            assert bar is None
            continue
        frac = float(bar.get("height")) / float(bg.get("height"))
        assert frac == pytest.approx(snap.fills[b] / snap.block_size, abs=0.01)
        # the bar sits at the bottom of the cell
        assert float(bar.get("y")) + float(bar.get("height")) == pytest.approx(
            float(bg.get("y")) + float(bg.get("height")), abs=0.01
        )
    tail = tables[1].blocks[0]
    assert by_id[tail].get("data-fill") == "3"


def test_refcount_labels_only_on_shared_cells_unless_always():
    alloc, tables = example()
    snap = PoolSnapshot.from_allocator(alloc, tables)
    root = parse(render_pool(snap))
    labelled = {int(g.get("data-block")): child_with_class(g, "refcount") for g in find_class(root, "cell", "g")}
    for b, label in labelled.items():
        if alloc.refcount(b) > 1:
            assert label is not None and label.text == f"×{alloc.refcount(b)}"
        else:
            assert label is None
    root = parse(render_pool(snap, show_refcount="always"))
    texts = [child_with_class(g, "refcount").text for g in find_class(root, "cell", "g")]
    assert texts == [f"×{r}" for r in alloc.refcounts]
    assert not find_class(parse(render_pool(snap, show_refcount="never")), "refcount")
    with pytest.raises(ValueError, match="show_refcount"):
        render_pool(snap, show_refcount="sometimes")


def test_used_cells_take_their_sequence_colour_and_shared_cells_the_shared_colour():
    alloc, tables = example()
    snap = PoolSnapshot.from_allocator(alloc, tables)
    by_id = cells(parse(render_pool(snap)))
    only_1 = tables[1].blocks[0]
    assert child_with_class(by_id[only_1], "fill").get("fill") == seq_color(1)
    for b in tables[0].blocks:
        assert child_with_class(by_id[b], "fill").get("fill") == SHARED_COLOR
        assert by_id[b].get("data-seqs") == "0 2"


# ---------------------------------------------------------------------------
# render_block_map
# ---------------------------------------------------------------------------


def test_block_map_links_every_logical_block_to_its_physical_cell():
    alloc, tables = example()
    snap = PoolSnapshot.from_allocator(alloc, tables, step=3)
    root = parse(render_block_map(snap))
    assert "minipaged-blockmap" in cls(root) and root.get("data-step") == "3"
    assert root.get("data-used") == str(alloc.num_used)
    assert sorted(cells(root)) == list(range(12))

    lblocks = find_class(root, "lblock", "g")
    links = find_class(root, "link", "path")
    expected = [(str(s), i, b) for s, t in tables.items() for i, b in enumerate(t.blocks)]
    assert [(g.get("data-seq"), int(g.get("data-logical")), int(g.get("data-block"))) for g in lblocks] == expected
    assert [(p.get("data-seq"), int(p.get("data-logical")), int(p.get("data-block"))) for p in links] == expected
    for p in links:
        assert p.get("stroke") == seq_color(int(p.get("data-seq")))


def test_block_map_rows_are_labelled_and_coloured_per_sequence():
    alloc, tables = example()
    root = parse(render_block_map(PoolSnapshot.from_allocator(alloc, tables)))
    rows = find_class(root, "seq", "g")
    assert [g.get("data-seq") for g in rows] == ["0", "1", "2"]
    for g in rows:
        color = seq_color(int(g.get("data-seq")))
        assert g.get("data-color") == color
        label = child_with_class(g, "label")
        assert label.text == f"seq {g.get('data-seq')}"
        assert child_with_class(g, "swatch").get("fill") == color
        for lb in find_class(g, "lblock", "g"):
            box = next(r for r in lb if r.tag == NS + "rect")
            assert box.get("stroke") == color
            # the block-table entry is written in the logical block: the physical block it maps to
            assert child_with_class(lb, "entry").text == lb.get("data-block")


def _contrast(a: str, b: str) -> float:
    def lum(h):
        c = [int(h[i : i + 2], 16) / 255 for i in (1, 3, 5)]
        c = [x / 12.92 if x <= 0.03928 else ((x + 0.055) / 1.055) ** 2.4 for x in c]
        return 0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2]

    hi, lo = sorted((lum(a), lum(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def test_labels_on_a_coloured_fill_keep_a_readable_contrast():
    # White on yellow was hard to read: every palette colour gets the text colour with the better contrast.
    for color in PALETTE:
        chosen = _contrast(text_on(color), color)
        assert chosen == max(_contrast("#ffffff", color), _contrast(TEXT_COLOR, color))
        assert chosen >= 4.0, color
    assert text_on("#E69F00") == TEXT_COLOR  # the palette's orange takes dark text


def test_block_map_has_a_legend_that_explains_rows_and_fill():
    alloc, tables = example()
    root = parse(render_block_map(PoolSnapshot.from_allocator(alloc, tables)))
    notes = " ".join(t.text for t in find_class(root, "note"))
    assert "block table" in notes and "physical block" in notes and "slots that hold tokens" in notes
    assert not find_class(root, "link-end")  # no unexplained dots


def legend_items(root) -> list[str]:
    return [t.text for t in find_class(root, "legend-item")]


def test_legend_lists_only_the_cell_states_and_marks_the_picture_holds():
    alloc = BlockAllocator(6, 4)
    tables = {0: BlockTable(alloc, 0), 1: BlockTable(alloc, 1)}
    tables[0].append_tokens(5)
    tables[1].append_tokens(2)
    plain = PoolSnapshot.from_allocator(alloc, tables)  # chapter 02's case: nothing shared, nothing cached
    for render in (render_block_map, render_pool):
        assert legend_items(parse(render(plain))) == ["free", "used (colour = sequence)"]
    tables[2] = tables[0].fork(2)
    shared = PoolSnapshot.from_allocator(alloc, tables)
    assert legend_items(parse(render_block_map(shared))) == [
        "free", "used (colour = sequence)", "shared (refcount > 1)"]
    hit = PoolSnapshot.from_allocator(alloc, tables, cached=[5], marks={tables[1].blocks[0]: "hit"})
    assert legend_items(parse(render_pool(hit))) == [
        "free", "used (colour = sequence)", "shared (refcount > 1)", "cached, free (# = has a key)", "hit"]
    assert set(MARKS) - {"hit"} and not set(legend_items(parse(render_pool(hit)))) & (set(MARKS) - {"hit"})
    full = PoolSnapshot(2, 4, (1, 1), {0: [0], 1: [1]}, {0: 4, 1: 4})  # no free block: no "free" swatch
    assert legend_items(parse(render_pool(full))) == ["used (colour = sequence)"]


def _linear_rgb(hex_color: str) -> list[float]:
    c = [int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    return [x / 12.92 if x <= 0.04045 else ((x + 0.055) / 1.055) ** 2.4 for x in c]


# Machado, Oliveira and Fernandes (2009), severity 1.0, applied to linear RGB: what a protanope and a
# deuteranope see.
PROTAN = ((0.152286, 1.052583, -0.204868), (0.114503, 0.786281, 0.099216), (-0.003882, -0.048116, 1.051998))
DEUTAN = ((0.367322, 0.860646, -0.227968), (0.280085, 0.672501, 0.047413), (-0.011820, 0.042940, 0.968881))


def _lab(hex_color: str, vision=None) -> tuple[float, float, float]:
    """CIELAB (D65) of ``hex_color`` as seen with normal vision (``None``) or through a ``vision`` matrix."""
    rgb = _linear_rgb(hex_color)
    if vision is not None:
        rgb = [min(1.0, max(0.0, sum(m * c for m, c in zip(row, rgb, strict=True)))) for row in vision]
    r, g, b = rgb
    xyz = ((0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047, 0.2126 * r + 0.7152 * g + 0.0722 * b,
           (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883)
    fx, fy, fz = (t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116 for t in xyz)
    return 116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)


def delta_e(a: str, b: str, vision=None) -> float:
    """CIE76 colour difference: about 2 is just noticeable, above 20 two colours read as different ones."""
    return math.dist(_lab(a, vision), _lab(b, vision))


def test_delta_e_tells_near_blues_apart_from_distinct_colours():
    assert delta_e("#1f77b4", "#4e79a7") < 12  # the two blues seqs 8 and 12 once had
    assert delta_e("#0072B2", "#E69F00") > 60
    assert delta_e("#d62728", "#2ca02c") > 60 and delta_e("#d62728", "#2ca02c", DEUTAN) < 12  # red and green


def test_sequence_colours_are_told_apart_also_by_colour_blind_readers():
    for a, b in itertools.combinations(PALETTE, 2):
        assert delta_e(a, b) >= 20, (a, b)  # no two the same hue and lightness
        assert min(delta_e(a, b, PROTAN), delta_e(a, b, DEUTAN)) >= 12, (a, b)
    for i, a in enumerate(PALETTE):  # neighbouring ids, as sequences arrive, differ the most
        b = PALETTE[(i + 1) % len(PALETTE)]
        assert min(delta_e(a, b, vision) for vision in (None, PROTAN, DEUTAN)) >= 40, (a, b)
    for color in PALETTE:  # never mistaken for a cell state
        for state in (SHARED_COLOR, CACHED_COLOR, FREE_COLOR, USED_COLOR):
            assert delta_e(color, state) >= 15, (color, state)
        # shared and cached cells also carry a border of their own (bold, dashed); free and used cells only colour
        for state in (FREE_COLOR, USED_COLOR):
            assert min(delta_e(color, state, PROTAN), delta_e(color, state, DEUTAN)) >= 12, (color, state)


def test_static_link_lines_are_visible_in_every_sequence_colour():
    alloc, tables = example()
    links = find_class(parse(render_block_map(PoolSnapshot.from_allocator(alloc, tables))), "link", "path")
    assert links and {(p.get("stroke-width"), p.get("stroke-opacity")) for p in links} == {
        (str(LINK_WIDTH), str(LINK_OPACITY))}
    assert LINK_WIDTH >= 1.5
    for color in PALETTE:  # the line as drawn, blended with the white page, against the page
        seen = "#" + "".join(f"{round(LINK_OPACITY * int(color[i : i + 2], 16) + (1 - LINK_OPACITY) * 255):02x}"
                             for i in (1, 3, 5))
        assert _contrast(seen, "#ffffff") >= 1.8, color


def test_block_map_draws_its_links_beneath_every_block_so_no_line_covers_an_id():
    # SVG paints in document order: the links come first, and the blocks they cross are opaque
    alloc, tables = example()
    root = parse(render_block_map(PoolSnapshot.from_allocator(alloc, tables)))
    order = list(root.iter())
    first_link = order.index(find_class(root, "links", "g")[0])
    blocks = find_class(root, "lblock", "g") + find_class(root, "cell", "g")
    assert blocks and all(order.index(g) > first_link for g in blocks)
    for g in blocks:
        box = next(r for r in g if r.tag == NS + "rect")
        assert box.get("fill").startswith("#") and box.get("fill-opacity") is None and box.get("opacity") is None


@pytest.mark.parametrize("lengths", [[], [3], [9, 3]])
def test_block_map_column_titles_never_overlap(lengths):
    # the pool's title starts past the end of the tables' title, however short the tables are (or none)
    alloc = BlockAllocator(32, 8)
    tables = {}
    for i, n in enumerate(lengths):
        tables[i] = BlockTable(alloc, i)
        tables[i].append_tokens(n)
    texts = list(parse(render_block_map(PoolSnapshot.from_allocator(alloc, tables))).iter(NS + "text"))
    left, right = (next(t for t in texts if (t.text or "").startswith(head)) for head in ("block tables", "physical"))
    assert float(right.get("x")) >= float(left.get("x")) + 0.62 * float(left.get("font-size")) * len(left.text)


def test_block_map_logical_tail_block_is_partly_filled():
    alloc, tables = example()
    root = parse(render_block_map(PoolSnapshot.from_allocator(alloc, tables)))
    for lb in find_class(root, "lblock", "g"):
        seq, i = int(lb.get("data-seq")), int(lb.get("data-logical"))
        expected = max(0, min(4, tables[seq].num_tokens - 4 * i))
        assert lb.get("data-fill") == str(expected)
        box, bar = next(r for r in lb if r.tag == NS + "rect"), child_with_class(lb, "fill")
        assert float(bar.get("width")) / float(box.get("width")) == pytest.approx(expected / 4, abs=0.01)


def test_block_map_is_deterministic_and_changes_with_state():
    alloc, tables = example()
    first = render_block_map(PoolSnapshot.from_allocator(alloc, tables, step=1))
    assert first == render_block_map(PoolSnapshot.from_allocator(alloc, tables, step=1))
    tables[1].append_tokens(2)  # crosses a block boundary: one more block
    second = render_block_map(PoolSnapshot.from_allocator(alloc, tables, step=2))
    assert second != first
    assert parse(second).get("data-used") == str(int(parse(first).get("data-used")) + 1)


def test_block_map_summarises_rows_past_max_rows_and_escapes_ids():
    alloc = BlockAllocator(8, 2)
    tables = {f"<r{i}>": BlockTable(alloc, f"<r{i}>") for i in range(5)}
    for t in tables.values():
        t.append_tokens(1)
    svg = render_block_map(PoolSnapshot.from_allocator(alloc, tables), max_rows=3)
    root = parse(svg)  # would fail on an unescaped "<"
    assert [g.get("data-seq") for g in find_class(root, "seq", "g")] == ["<r0>", "<r1>", "<r2>"]
    assert find_class(root, "more")[0].text == "… and 2 more sequences"


def test_empty_pool_renders():
    snap = PoolSnapshot(4, 2, (0, 0, 0, 0))
    root = parse(render_block_map(snap))
    assert len(cells(root)) == 4 and not find_class(root, "link")


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 24),
    st.integers(1, 6),
    st.lists(st.integers(0, 13), max_size=8),
)
def test_block_map_matches_any_allocator_state(num_blocks, block_size, lengths):
    alloc = BlockAllocator(num_blocks, block_size)
    tables = {}
    for i, n in enumerate(lengths):
        t = BlockTable(alloc, i)
        try:
            t.append_tokens(n)
        except Exception:  # the pool ran out: the table stays empty
            pass
        tables[i] = t
    snap = PoolSnapshot.from_allocator(alloc, tables)
    root = parse(render_block_map(snap))
    by_id = cells(root)
    assert len(by_id) == num_blocks
    used = [b for b, g in by_id.items() if g.get("data-state") != "free"]
    assert sorted(used) == sorted(b for t in tables.values() for b in t.blocks)
    assert len(find_class(root, "link")) == sum(len(t.blocks) for t in tables.values())
    for b, g in by_id.items():
        assert int(g.get("data-fill")) == sum(
            max(0, min(block_size, t.num_tokens - block_size * t.blocks.index(b)))
            for t in tables.values() if b in t.blocks
        )


def test_seq_colours_are_stable_and_from_the_palette():
    assert seq_color(0) == PALETTE[0] and seq_color(len(PALETTE) + 1) == PALETTE[1]
    assert seq_color("req-7") == seq_color("req-7") and seq_color("req-7") in PALETTE


# ---------------------------------------------------------------------------
# render_timeline
# ---------------------------------------------------------------------------


def test_history_shapes_become_the_same_series():
    records = [{"paged": {"utilisation": 0.5}, "contiguous": {"utilisation": 0.25}, "note": "x"},
               {"paged": {"utilisation": 1.0}, "contiguous": {"utilisation": 0.5}, "note": "y"}]
    columns = {"paged": {"utilisation": [0.5, 1.0]}, "contiguous": {"utilisation": [0.25, 0.5]}}
    expected = {"paged.utilisation": [0.5, 1.0], "contiguous.utilisation": [0.25, 0.5]}
    assert history_series(records) == expected
    assert history_series(columns) == expected
    assert history_series(None) == {}


def test_timeline_polylines_follow_the_values():
    hist = {"paged.utilisation": [0.0, 0.5, 1.0], "contiguous.utilisation": [0.0, 0.25, 0.5]}
    root = parse(render_timeline(hist, width=400, height=200))
    assert "minipaged-timeline" in cls(root) and root.get("data-points") == "3"
    lines = {p.get("data-series"): p for p in find_class(root, "series", "polyline")}
    assert set(lines) == set(hist)
    pts = [tuple(map(float, xy.split(","))) for xy in lines["paged.utilisation"].get("points").split()]
    xs, ys = zip(*pts)
    assert xs[0] < xs[1] < xs[2] and ys[0] > ys[1] > ys[2]  # rising value: SVG y goes up
    assert ys[0] - ys[1] == pytest.approx(ys[1] - ys[2])
    cont = [tuple(map(float, xy.split(","))) for xy in lines["contiguous.utilisation"].get("points").split()]
    assert cont[2][1] == pytest.approx(pts[1][1])  # 0.5 is drawn at the same height in both
    # same metric, same colour; different system, different dash
    assert lines["paged.utilisation"].get("stroke") == lines["contiguous.utilisation"].get("stroke")
    assert lines["paged.utilisation"].get("stroke-dasharray") != lines["contiguous.utilisation"].get("stroke-dasharray")


def test_timeline_series_selection_and_event_markers():
    hist = [{"utilisation": 0.1, "tail_waste": 0.3, "rejected": 4.0} for _ in range(5)]
    root = parse(render_timeline(hist, series=["utilisation", "tail_waste"], events=[(2, "preempt"), (4, "cow")]))
    assert [p.get("data-series") for p in find_class(root, "series")] == ["utilisation", "tail_waste"]
    marks = find_class(root, "event", "line")
    assert [(m.get("data-kind"), m.get("data-step")) for m in marks] == [("preempt", "2"), ("cow", "4")]
    assert marks[0].get("stroke") != marks[1].get("stroke")  # preemptions stand out
    assert float(marks[0].get("x1")) < float(marks[1].get("x1"))


def test_timeline_without_history():
    root = parse(render_timeline([]))
    assert root.get("data-points") == "0" and not find_class(root, "series")


# ---------------------------------------------------------------------------
# BlockMapView, driven from Python
# ---------------------------------------------------------------------------


class ToySim:
    """A tiny steppable simulation: sequence i joins at step i, grows 3 tokens a step, leaves after 4 steps."""

    def __init__(self, steps=6, num_blocks=16, block_size=4):
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.tables = {}
        self.t = 0
        self.steps = steps
        self.history = []

    def step(self):
        if self.t >= self.steps:
            return False
        self.tables[self.t] = BlockTable(self.allocator, self.t)
        for seq_id, table in list(self.tables.items()):
            if self.t - seq_id >= 4:
                table.release()
                del self.tables[seq_id]
            else:
                table.append_tokens(3)
        if self.t == 3:
            self.allocator.emit("preempt", None, 0)
        self.t += 1
        used = self.allocator.num_used
        self.history.append({"utilisation": sum(t.num_tokens for t in self.tables.values()) / max(used * 4, 1)})
        return self.t < self.steps


def svg_root(html_widget):
    return parse(html_widget.value)


def test_view_steps_and_redraws():
    view = BlockMapView(lambda: ToySim(steps=6))
    before = svg_root(view.panels["map"])
    assert before.get("data-step") == "0" and before.get("data-used") == "0"
    view.step_button.click()
    after = svg_root(view.panels["map"])
    assert after.get("data-step") == "1" and int(after.get("data-used")) == 1
    assert len(find_class(after, "lblock")) == 1
    assert svg_root(view.panels["timeline"]).get("data-points") == "1"
    for _ in range(10):
        view.step_button.click()
    assert view.finished and view.steps == 6 and view.step_button.disabled
    assert not view.step()  # no more steps once finished
    assert [k for _, k in view.events] == ["preempt"]
    assert find_class(svg_root(view.panels["timeline"]), "event")[0].get("data-kind") == "preempt"


def test_view_play_value_steps_and_speed_drives_interval():
    view = BlockMapView(ToySim(steps=3))
    view.speed.value = 100
    assert view.play.interval == 100
    view.play.value = 1  # what the front end's timer does
    view.play.value = 2
    assert view.steps == 2 and svg_root(view.panels["map"]).get("data-step") == "2"
    view.play.playing = True
    view.play.value = 3
    assert view.finished and view.play.playing is False


def test_view_reset_builds_a_fresh_simulation():
    view = BlockMapView(lambda: ToySim(steps=4))
    old = view.sim
    view.step()
    view.step()
    view.reset_button.click()
    assert view.sim is not old and view.steps == 0 and not view.finished
    assert svg_root(view.panels["map"]).get("data-used") == "0"
    old.step()  # the old simulation no longer drives the picture
    assert svg_root(view.panels["map"]).get("data-used") == "0"
    view.step()
    assert svg_root(view.panels["map"]).get("data-step") == "1"


def test_view_follows_allocator_events_from_outside():
    sim = ToySim()
    view = BlockMapView(sim)
    sim.tables["x"] = BlockTable(sim.allocator, "x")
    sim.tables["x"].append_tokens(9)  # three allocate events, no Step click
    root = svg_root(view.panels["map"])
    assert root.get("data-used") == "3" and [g.get("data-seq") for g in find_class(root, "seq")] == ["x"]
    view.close()
    sim.tables["x"].release()
    assert svg_root(view.panels["map"]).get("data-used") == "3"  # unsubscribed


def test_view_without_reset_or_factory_says_so():
    class NoReset(ToySim):
        pass

    view = BlockMapView(NoReset())
    with pytest.raises(RuntimeError, match="reset"):
        view.reset()
    with pytest.raises(TypeError, match="source"):
        BlockMapView(42)


def test_view_static_rendering_and_display_fallback():
    view = BlockMapView(lambda: ToySim())
    view.step()
    html = view.static().data
    assert 'class="minipaged-blockmap"' in html and 'data-step="1"' in html
    bundle = view._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["text/html"] == html


def test_a_failing_step_leaves_the_view_where_it_was():
    class Broken(ToySim):
        def step(self):
            raise ZeroDivisionError("boom")

    view = BlockMapView(Broken())
    with pytest.raises(ZeroDivisionError):
        view.step()
    assert view.steps == 0 and not view.finished and not view._in_step
    view.step_button.click()  # in a notebook the traceback lands in view.out (Output.capture)
    assert view.steps == 0


# ---------------------------------------------------------------------------
# With the chapter's trace simulator
# ---------------------------------------------------------------------------


def small_trace_sim():
    from minipaged.trace import TraceSimulator
    from minipaged.workload import Geometric, Uniform, WorkloadPreset, make_workload

    short = WorkloadPreset("short", Uniform(8, 48), Geometric(24, 1, 80))
    trace = make_workload(40, 0.5, short, seed=0)
    return TraceSimulator(trace, num_blocks=32, block_size=16, max_len=128)


def test_default_series_and_preemption_markers_from_a_trace_history():
    sim = small_trace_sim()
    history = sim.run()
    names = default_series(history)
    assert names[:3] == ["paged.utilisation", "max_reservation.utilisation", "grow_in_place.utilisation"]
    assert "grow_in_place.external_fragmentation" in names  # the only system that fragments externally
    assert "paged.external_fragmentation" not in names
    marks = counter_events(history, "paged.preempted", "preempt")
    preempted = sim.series("paged", "preempted")
    assert len(marks) == sum(1 for a, b in zip([0] + preempted, preempted) if b > a) > 0
    assert all(preempted[i] > (preempted[i - 1] if i else 0) for i, _ in marks)
    root = parse(render_timeline(history, series=names, events=marks))
    assert int(root.get("data-points")) == len(history)
    assert len(find_class(root, "event")) == len(marks)


def test_view_over_the_trace_simulator_matches_its_paged_pool():
    view = BlockMapView(small_trace_sim)
    for _ in range(12):
        view.step()
    sim = view.sim
    root = svg_root(view.panels["map"])
    assert root.get("data-step") == "12" and int(root.get("data-used")) == sim.allocator.num_used > 0
    rows = [g.get("data-seq") for g in find_class(root, "seq", "g")]
    assert rows == [str(s) for s in sim.tables][: len(rows)]
    by_id = cells(root)
    for seq_id, table in sim.tables.items():
        for b in table.blocks:
            assert by_id[b].get("data-state") == "used" and by_id[b].get("data-seqs") == str(seq_id)
    timeline = svg_root(view.panels["timeline"])
    assert int(timeline.get("data-points")) == len(sim.history) == 12
    view.reset()
    assert view.sim is not sim and svg_root(view.panels["map"]).get("data-used") == "0"
