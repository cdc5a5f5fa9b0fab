"""Issue 11 item 3: event subscribers cannot corrupt the allocator.

Events arrive only once the operation that caused them is complete; a subscriber that
raises is isolated (recorded, warned, the others still served); a KeyboardInterrupt is
re-raised after every subscriber had the event; a subscriber may call back in.
"""

import warnings
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.blocks import BlockAllocator, BlockTable
from minipaged.events import SUBSCRIBER_ERRORS_KEPT

pytestmark = pytest.mark.ch02


def check_pool(alloc: BlockAllocator, tables: list[BlockTable]) -> None:
    """Free list without duplicates; each refcount = the tables holding the block; no table holds a free block."""
    free = list(alloc.free_block_ids)
    assert len(free) == len(set(free))
    holders = Counter(b for t in tables for b in t.blocks)
    assert alloc.refcounts == [holders[b] for b in range(alloc.num_blocks)]
    assert set(free) == {b for b in range(alloc.num_blocks) if holders[b] == 0}
    for t in tables:
        assert t.num_blocks == -(-t.num_tokens // alloc.block_size)


class Boom(Exception):
    pass


def workout(alloc: BlockAllocator) -> list[BlockTable]:
    """allocate, free, append (many blocks), fork, copy-on-write, release: every emit site of chapters 02 and 06."""
    single = alloc.allocate("x")
    alloc.incref(single)
    alloc.free(single)
    alloc.free(single)
    parent = BlockTable(alloc, "p")
    parent.append_tokens(6)  # two blocks of 4
    child = parent.fork("c")
    child.append_tokens(1)  # copy-on-write of the shared, partly filled last block
    gone = BlockTable(alloc, "g")
    gone.append_tokens(5)
    gone.release()
    return [parent, child, gone]


def test_events_arrive_after_the_operation_is_complete():
    alloc = BlockAllocator(8, 4)
    tables, seen, problems = [], [], []

    def on_event(event):  # (an assert here would be isolated as a subscriber error: record instead)
        seen.append(event.kind)
        holders = Counter(b for t in tables for b in t.blocks)  # a fork's child is not known yet: at least these
        free = list(alloc.free_block_ids)
        if len(free) != len(set(free)) or any(alloc.refcount(b) < n for b, n in holders.items()):
            problems.append((event.kind, "pool"))
        if any(t.num_blocks != -(-t.num_tokens // 4) for t in tables):
            problems.append((event.kind, "table"))

    alloc.subscribe(on_event)
    parent = BlockTable(alloc, "p")
    tables.append(parent)
    parent.append_tokens(6)
    child = parent.fork("c")
    tables.append(child)
    child.append_tokens(1)
    parent.release()
    child.release()
    assert seen == ["allocate", "allocate", "incref", "incref", "fork", "allocate", "decref", "cow",
                    "decref", "free", "free", "free"]  # fmt: skip
    assert problems == [] and alloc.num_subscriber_errors == 0
    assert alloc.num_free == 8


@pytest.mark.parametrize("error", [Boom("subscriber"), KeyError("late"), ZeroDivisionError()])
def test_a_raising_subscriber_is_isolated_and_reported(error):
    alloc = BlockAllocator(8, 4)
    good, calls = [], []

    def bad(event):
        calls.append(event.kind)
        raise error

    alloc.subscribe(bad)
    alloc.subscribe(good.append)
    with pytest.warns(RuntimeWarning, match="subscriber .* raised"):
        tables = workout(alloc)
    check_pool(alloc, tables)
    assert [e.kind for e in good] == calls  # the other subscriber got every event
    assert alloc.num_subscriber_errors == len(calls) > 10
    assert len(alloc.subscriber_errors) == SUBSCRIBER_ERRORS_KEPT  # bounded, the latest kept
    event, callback, exc = alloc.subscriber_errors[-1]
    assert callback is bad and exc is error and event.kind == calls[-1]


def test_a_keyboard_interrupt_in_a_subscriber_propagates_with_the_state_consistent():
    alloc = BlockAllocator(8, 4)
    good = []
    armed = {"on": False}

    def interrupt(event):
        if armed["on"]:
            raise KeyboardInterrupt

    alloc.subscribe(interrupt)
    alloc.subscribe(good.append)
    table = BlockTable(alloc, "t")
    armed["on"] = True
    with pytest.raises(KeyboardInterrupt):
        table.append_tokens(9)  # three blocks: all taken, all in the table, all three events delivered
    assert table.blocks == [0, 1, 2] and table.num_tokens == 9 and [e.kind for e in good] == ["allocate"] * 3
    armed["on"] = False
    child = table.fork("c")
    armed["on"] = True
    with pytest.raises(KeyboardInterrupt):
        child.append_tokens(1)  # copy-on-write: the child has its own last block before anyone hears of it
    check_pool(alloc, [table, child])
    assert child.blocks[-1] != table.blocks[-1] and child.pending_copies == [(table.blocks[-1], child.blocks[-1])]
    with pytest.raises(KeyboardInterrupt):
        table.release()
    check_pool(alloc, [table, child])
    assert table.blocks == [] and [e.kind for e in good[-3:]] == ["decref", "decref", "free"]


def test_a_subscriber_may_release_another_table_from_inside_an_event():
    """Re-entrancy: the subscriber changes the pool while an append is being reported."""
    alloc = BlockAllocator(6, 4)
    victim = BlockTable(alloc, "v")
    victim.append_tokens(8)

    def release_victim(event):
        if event.kind == "allocate" and event.seq_id == "grower" and victim.blocks:
            victim.release()

    alloc.subscribe(release_victim)
    grower = BlockTable(alloc, "grower")
    grower.append_tokens(12)
    check_pool(alloc, [victim, grower])
    assert victim.blocks == [] and alloc.num_free == 3


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["append", "fork", "release"]), st.integers(0, 7), st.integers(1, 6)),
                max_size=40),
       st.integers(0, 3))  # fmt: skip
def test_whatever_the_subscribers_raise_the_pool_stays_consistent(ops, raise_every):
    alloc = BlockAllocator(10, 4)
    count = {"n": 0}

    def flaky(event):
        count["n"] += 1
        if raise_every and count["n"] % raise_every == 0:
            raise Boom(event.kind)

    alloc.subscribe(flaky)
    tables = [BlockTable(alloc, 0)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for op, which, n in ops:
            table = tables[which % len(tables)]
            if op == "append" and table.num_new_blocks(n) <= alloc.num_free:
                table.append_tokens(n)
            elif op == "fork" and not table.released:
                tables.append(table.fork(len(tables)))
            elif op == "release":
                table.release()
            check_pool(alloc, tables)
    assert alloc.num_subscriber_errors == (count["n"] // raise_every if raise_every else 0)
