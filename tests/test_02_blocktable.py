"""Chapter 02's block-table diagram: every token is drawn where its block table says, and the worked slot is right."""

import xml.etree.ElementTree as ET

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.blocks import BlockAllocator, BlockTable
from minipaged.viz.blockmap import PoolSnapshot
from minipaged.viz.blocktable import render_block_tables, worked_slot

pytestmark = pytest.mark.ch02

NS = "{http://www.w3.org/2000/svg}"


def interleaved(block_size=4, steps=(("A", 6), ("B", 3), ("A", 1), ("B", 1), ("A", 2), ("B", 1))):
    alloc = BlockAllocator(num_blocks=8, block_size=block_size)
    tables = {"A": BlockTable(alloc, "A"), "B": BlockTable(alloc, "B")}
    slots = {"A": [], "B": []}
    for seq, n in steps:
        slots[seq] += tables[seq].append_tokens(n).tolist()
    return PoolSnapshot.from_allocator(alloc, tables), slots


def by_class(root, name):
    return [el for el in root.iter() if name in (el.get("class") or "").split()]


def test_worked_slot_matches_the_slots_the_table_handed_out():
    snap, slots = interleaved()
    for seq, seq_slots in slots.items():
        for p, slot in enumerate(seq_slots):
            w = worked_slot(snap, seq, p)
            assert w["slot"] == slot
            assert (w["logical"], w["offset"]) == divmod(p, 4)
            assert w["block"] == snap.tables[seq][w["logical"]]


def test_worked_slot_rejects_bad_input():
    snap, _ = interleaved()
    with pytest.raises(ValueError, match="seq_id"):
        worked_slot(snap, "C", 0)
    with pytest.raises(IndexError, match="position 9"):
        worked_slot(snap, "A", 9)
    with pytest.raises(TypeError, match="position"):
        worked_slot(snap, "A", 1.0)


def test_diagram_traces_the_highlighted_token_through_its_table():
    snap, slots = interleaved()
    root = ET.fromstring(render_block_tables(snap, highlight=("A", 8), title="t"))
    assert root.get("class") == "minipaged-blocktables" and root.get("data-slot") == str(slots["A"][8]) == "12"
    worked = by_class(root, "worked")
    logical = [el for el in worked if el.get("data-pos") == "8" and el.get("data-seq") == "A"]
    row = [el for el in worked if "table-row" in el.get("class")]
    physical = [el for el in worked if el.get("data-slot") == "12"]
    assert len(logical) == len(row) == len(physical) == 1
    assert row[0].get("data-logical") == "2" and row[0].get("data-block") == "3"
    notes = [t.text for t in by_class(root, "worked-note")]
    assert notes[-1] == "slot = 3 · 4 + 0 = 12"


@settings(max_examples=30, deadline=None)
@given(block_size=st.sampled_from([2, 3, 4]), steps=st.lists(
    st.tuples(st.sampled_from("AB"), st.integers(1, 3)), min_size=1, max_size=6))
def test_every_token_sits_in_the_physical_slot_its_table_names(block_size, steps):
    alloc = BlockAllocator(num_blocks=12, block_size=block_size)
    tables = {"A": BlockTable(alloc, "A"), "B": BlockTable(alloc, "B")}
    slots = {"A": [], "B": []}
    for seq, n in steps:
        slots[seq] += tables[seq].append_tokens(n).tolist()
    root = ET.fromstring(render_block_tables(PoolSnapshot.from_allocator(alloc, tables)))
    labelled = {}
    for g in by_class(root, "slot"):
        text = g.find(f"{NS}text")
        if g.get("data-slot") is not None and text is not None:
            labelled[int(g.get("data-slot"))] = text.text
    expected = {slot: f"{seq}{p}" for seq, ss in slots.items() for p, slot in enumerate(ss)}
    assert labelled == expected
    rows = by_class(root, "table-row")
    assert [(r.get("data-seq"), int(r.get("data-block"))) for r in rows] == [
        (s, b) for s, t in tables.items() for b in t.blocks]
