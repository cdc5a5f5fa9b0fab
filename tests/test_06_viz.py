"""The block map's chapter 06 layer: cached blocks, and hit / cow / evict marks, pure and in the live view."""

import xml.etree.ElementTree as ET

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.blocks import BlockAllocator
from minipaged.viz.blockmap import MARKS, BlockMapView, PoolSnapshot, render_block_map, render_pool
from minipaged.viz.svg import CACHED_COLOR, MARK_COLORS

pytestmark = pytest.mark.ch06

NS = "{http://www.w3.org/2000/svg}"


def cells(svg: str) -> dict[int, ET.Element]:
    root = ET.fromstring(svg)
    return {int(g.get("data-block")): g for g in root.iter(f"{NS}g") if "cell" in (g.get("class") or "").split()}


def shared_prefix():
    """Two sequences share blocks 0 and 1; block 2 is free but keeps a key; block 3 is a's own tail."""
    alloc = BlockAllocator(6, 4)
    a = alloc.allocate_many(2, "a") + [alloc.allocate("a")]
    for b in a[:2]:
        alloc.incref(b, "b")
    spare = alloc.allocate("x")
    alloc.free(spare, "x")
    tables = {"a": a, "b": a[:2]}
    return alloc, tables, spare


def test_cached_free_block_is_drawn_as_cached_and_plain_free_as_free():
    alloc, tables, spare = shared_prefix()
    snap = PoolSnapshot.from_allocator(alloc, tables, cached={0, 1, spare})
    got = cells(render_pool(snap))
    assert got[spare].get("data-state") == "cached" and got[spare].get("data-cached") == "1"
    assert got[spare].find(f"{NS}rect").get("stroke") == CACHED_COLOR
    assert got[4].get("data-state") == "free" and got[4].get("data-cached") is None
    assert got[0].get("data-state") == "shared" and got[0].get("data-refcount") == "2"
    assert got[0].get("data-cached") == "1"
    assert snap.num_cached_free == 1
    # A block with a key that a sequence holds carries the key sign; one without does not.
    assert any(t.get("class") == "key" for t in got[0].iter(f"{NS}text"))
    assert not any(t.get("class") == "key" for t in got[2].iter(f"{NS}text"))


def test_marks_put_a_letter_on_the_cell_and_count_in_the_caption():
    alloc, tables, spare = shared_prefix()
    marks = {0: "hit", 1: "hit", 2: "cow", spare: "evict"}
    snap = PoolSnapshot.from_allocator(alloc, tables, cached={0, 1}, marks=marks)
    svg = render_block_map(snap)
    got = cells(svg)
    for b, kind in marks.items():
        assert got[b].get("data-mark") == kind and f"mark-{kind}" in got[b].get("class")
        letters = [t.text for t in got[b].iter(f"{NS}text") if t.get("class") == "mark-letter"]
        assert letters == [MARKS[kind]]
        assert [c.get("fill") for c in got[b].iter(f"{NS}circle")] == [MARK_COLORS[kind]]
    assert got[4].get("data-mark") is None
    caption = ET.fromstring(svg).find(f"{NS}text").text
    assert "2 hit" in caption and "1 cow" in caption and "1 evict" in caption and "2 shared" in caption


def test_captions_count_shared_blocks_once():
    alloc, tables, spare = shared_prefix()
    snap = PoolSnapshot.from_allocator(alloc, tables, cached={0, 1, spare}, marks={0: "hit"})
    for svg in (render_pool(snap), render_block_map(snap)):
        caption = ET.fromstring(svg).find(f"{NS}text").text
        assert caption.count("shared") == 1 and "2 shared" in caption, caption


def test_without_prefix_state_the_picture_is_the_chapter_02_one():
    alloc, tables, _ = shared_prefix()
    plain = render_block_map(PoolSnapshot.from_allocator(alloc, tables))
    assert "cached" not in plain and "mark" not in plain and "hit" not in plain


@pytest.mark.parametrize(
    "kwargs, match",
    [({"cached": {9}}, "outside"), ({"marks": {9: "hit"}}, "outside"), ({"marks": {0: "copy"}}, "marks are")],
)
def test_snapshot_rejects_bad_cached_or_marks(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PoolSnapshot(num_blocks=4, block_size=2, refcounts=(0, 0, 0, 0), **kwargs)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_every_cell_state_follows_refcount_and_key(data):
    n = data.draw(st.integers(1, 12))
    refs = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    cached = data.draw(st.sets(st.integers(0, n - 1)))
    marks = data.draw(st.dictionaries(st.integers(0, n - 1), st.sampled_from(sorted(MARKS))))
    snap = PoolSnapshot(num_blocks=n, block_size=4, refcounts=tuple(refs), cached=cached, marks=marks)
    got = cells(render_pool(snap))
    assert sorted(got) == list(range(n))
    for b, g in got.items():
        expected = "cached" if refs[b] == 0 and b in cached else "free" if refs[b] == 0 else None
        if expected:
            assert g.get("data-state") == expected
        else:
            assert g.get("data-state") in ("used", "shared")
        assert g.get("data-mark") == marks.get(b)


class PrefixSim:
    """A toy simulation whose steps publish hit, cow and evict events, as the engine's prefix cache does."""

    def __init__(self):
        self.allocator = BlockAllocator(8, 4)
        self.tables = {}
        self.script = [("hit", 0), ("cow", 3), ("evict", 5)]

    def step(self):
        if not self.script:
            return False
        kind, block = self.script.pop(0)
        self.allocator.emit(kind, block, "s")
        return True


def test_view_marks_only_the_last_steps_events():
    view = BlockMapView(lambda: PrefixSim())
    try:
        seen = []
        for _ in range(3):
            view.step()
            marks = cells(view.panels["map"].value).items()
            seen.append({b: g.get("data-mark") for b, g in marks if g.get("data-mark")})
        assert seen == [{0: "hit"}, {3: "cow"}, {5: "evict"}]
        assert [k for _, k in view.events] == ["cow", "evict"]  # hits are too frequent for timeline markers
        assert 'data-mark="evict"' in view._static_html()
        view.reset()
        assert view.marks == {} and "data-mark" not in view.panels["map"].value
    finally:
        view.close()
