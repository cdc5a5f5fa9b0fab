"""BlockAllocator and BlockTable: invariants under random operation sequences, and every error path."""

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.block_math import blocks_needed
from minipaged.blocks import (
    BlockAllocator,
    BlockError,
    BlockTable,
    OutOfBlocks,
    block_tables_tensor,
)
from minipaged.events import BlockEvent

pytestmark = pytest.mark.ch02

# An operation is (kind, which table, how many tokens); the table index wraps around the live tables.
ops = st.lists(
    st.tuples(st.sampled_from(["new", "append", "append", "release", "fork"]), st.integers(0, 7), st.integers(0, 20)),
    max_size=40,
)
pools = st.tuples(st.integers(1, 12), st.integers(1, 8))


def snapshot(alloc, tables):
    return (list(alloc.free_block_ids), alloc.refcounts, [(list(t.blocks), t.num_tokens) for t in tables])


def check_invariants(alloc, tables):
    free = list(alloc.free_block_ids)
    assert len(free) == len(set(free)), "a block sits twice in the free list"
    holders = Counter(b for t in tables for b in t.blocks)
    for b in range(alloc.num_blocks):
        # every block is free or referenced, never both; its refcount is the number of tables holding it
        assert (b in set(free)) != (holders[b] > 0), f"block {b}: free={b in free}, holders={holders[b]}"
        assert alloc.refcount(b) == holders[b]
    assert alloc.num_free + alloc.num_used == alloc.num_blocks
    for t in tables:
        assert len(t.blocks) == blocks_needed(t.num_tokens, alloc.block_size)
        assert 0 <= t.tail_waste < alloc.block_size or t.num_tokens == 0


def run_ops(alloc, operations, tables, on_append=None):
    out_of_blocks = 0
    for kind, i, n in operations:
        if kind == "new" or not tables:
            tables.append(BlockTable(alloc, seq_id=len(tables)))
            continue
        table = tables[i % len(tables)]
        if kind == "append":
            before = snapshot(alloc, tables)
            try:
                slots = table.append_tokens(n)
            except OutOfBlocks:
                out_of_blocks += 1
                assert snapshot(alloc, tables) == before, "OutOfBlocks changed the state"
                assert not alloc.can_allocate(table.num_new_blocks(n))
            else:
                if on_append:
                    on_append(table, slots)
        elif kind == "release":
            table.release()
        elif kind == "fork" and table.released:
            with pytest.raises(ValueError, match="released"):
                table.fork(seq_id=len(tables))
        elif kind == "fork":
            tables.append(table.fork(seq_id=len(tables)))
        check_invariants(alloc, tables)
    return out_of_blocks


@settings(max_examples=500, deadline=None)
@given(pools, ops)
def test_invariants_hold_under_random_operations(pool, operations):
    alloc = BlockAllocator(*pool)
    tables = []
    run_ops(alloc, operations, tables)
    for t in tables:
        t.release()
    assert alloc.num_free == alloc.num_blocks, "releasing every table must free the whole pool"
    assert alloc.refcounts == [0] * alloc.num_blocks


@settings(max_examples=500, deadline=None)
@given(pools, ops.map(lambda o: [op for op in o if op[0] != "fork"]))
def test_slots_of_different_sequences_never_collide(pool, operations):
    alloc = BlockAllocator(*pool)
    owner = {}  # slot -> table that was handed it by append_tokens

    def on_append(table, slots):
        assert slots.dtype == torch.int64
        for pos, s in zip(range(table.num_tokens - len(slots), table.num_tokens), slots.tolist()):
            assert s == table.slot(pos)
            assert 0 <= s < alloc.num_blocks * alloc.block_size
            assert owner.get(s, table) is table, f"slot {s} handed to two live sequences"
            owner[s] = table

    def forget(table):
        for s in [s for s, t in owner.items() if t is table]:
            del owner[s]

    tables = []
    for op in operations:
        if op[0] == "release" and tables:
            forget(tables[op[1] % len(tables)])
        run_ops(alloc, [op], tables, on_append)


@settings(max_examples=500, deadline=None)
@given(pools, ops)
def test_events_replay_to_the_same_refcounts(pool, operations):
    """A subscriber that only sees events can rebuild the allocator's state: nobody needs to poll."""
    alloc = BlockAllocator(*pool)
    seen = [0] * alloc.num_blocks
    freed_at_zero = []

    def on_event(e: BlockEvent):
        if e.kind == "allocate":
            seen[e.block_id] = 1
        elif e.kind == "incref":
            seen[e.block_id] += 1
        elif e.kind in ("decref", "free"):
            seen[e.block_id] -= 1
            if e.kind == "free":
                freed_at_zero.append(seen[e.block_id] == 0)

    alloc.subscribe(on_event)
    run_ops(alloc, operations, [])
    assert seen == alloc.refcounts
    assert all(freed_at_zero)


def test_allocate_and_free_reuse_the_pool_in_fifo_order():
    alloc = BlockAllocator(3, 4)
    assert [alloc.allocate() for _ in range(3)] == [0, 1, 2]
    assert alloc.num_free == 0 and not alloc.can_allocate(1)
    alloc.free(1)
    alloc.free(0)
    assert alloc.allocate() == 1  # the first block freed is the first reused
    assert alloc.num_used == 2


def test_out_of_blocks_is_all_or_nothing():
    alloc = BlockAllocator(4, 2)
    alloc.allocate()
    with pytest.raises(OutOfBlocks, match="need 4 blocks but only 3"):
        alloc.allocate_many(4)
    assert alloc.num_free == 3
    alloc.allocate_many(3)
    with pytest.raises(OutOfBlocks, match="all 4 blocks"):
        alloc.allocate()


def test_double_free_is_block_error_and_bad_ids_are_index_errors():
    alloc = BlockAllocator(2, 4)
    b = alloc.allocate()
    alloc.free(b)
    with pytest.raises(BlockError, match="double free"):
        alloc.free(b)
    with pytest.raises(BlockError, match="not allocated"):
        alloc.incref(b)
    with pytest.raises(IndexError, match="block_id runs from 0 to 1"):
        alloc.free(2)
    with pytest.raises(IndexError, match="block_id runs from 0 to 1"):
        alloc.incref(-1)
    with pytest.raises(IndexError, match="block_id runs from 0 to 1"):
        alloc.refcount(5)
    with pytest.raises(TypeError, match="block_id must be an int"):
        alloc.free("0")
    with pytest.raises(TypeError, match="block_id must be an int"):
        alloc.free(True)
    assert alloc.refcounts == [0, 0] and alloc.num_free == 2
    assert issubclass(BlockError, ValueError) and not issubclass(IndexError, BlockError)


def test_constructor_and_count_arguments_are_validated():
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        BlockAllocator(0, 16)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        BlockAllocator(4, -1)
    with pytest.raises(TypeError, match="num_blocks must be an int"):
        BlockAllocator(4.0, 16)
    with pytest.raises(TypeError, match="block_size must be an int"):
        BlockAllocator(4, True)
    alloc = BlockAllocator(4, 4)
    with pytest.raises(ValueError, match="num_blocks must be >= 0"):
        alloc.allocate_many(-1)
    with pytest.raises(TypeError, match="num_blocks must be an int"):
        alloc.can_allocate(1.0)
    table = BlockTable(alloc)
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        table.append_tokens(-1)
    with pytest.raises(TypeError, match="num_tokens must be an int"):
        table.num_new_blocks(2.5)
    with pytest.raises(IndexError, match="outside this sequence's 0 tokens"):
        table.slot(0)
    with pytest.raises(TypeError, match="position must be an int"):
        table.slot(0.0)


def test_refcount_above_one_keeps_the_block_until_the_last_holder_frees_it():
    alloc = BlockAllocator(2, 4)
    events = []
    alloc.subscribe(events.append)
    b = alloc.allocate("a")
    alloc.incref(b, "b")
    assert alloc.refcount(b) == 2
    alloc.free(b, "a")
    assert alloc.refcount(b) == 1 and alloc.num_free == 1
    alloc.free(b, "b")
    assert alloc.num_free == 2
    assert [(e.kind, e.seq_id) for e in events] == [("allocate", "a"), ("incref", "b"), ("decref", "a"), ("free", "b")]


def test_unsubscribe_and_custom_events():
    alloc = BlockAllocator(2, 4)
    events = []
    unsubscribe = alloc.subscribe(events.append)
    alloc.emit("preempt", seq_id=7, reason="pool full")
    unsubscribe()
    alloc.allocate()
    assert events == [BlockEvent("preempt", None, 7, {"reason": "pool full"})]


def test_block_table_allocates_only_at_block_boundaries():
    alloc = BlockAllocator(8, 4)
    table = BlockTable(alloc, "s")
    assert table.num_new_blocks(4) == 1 and table.num_new_blocks(5) == 2
    assert table.append_tokens(3).tolist() == [0, 1, 2]
    assert table.num_new_blocks(1) == 0 and table.num_new_blocks(2) == 1
    assert table.append_tokens(1).tolist() == [3]  # fills block 0 exactly: no new block
    assert table.num_blocks == 1 and table.tail_waste == 0
    other = BlockTable(alloc, "o")
    other.append_tokens(1)  # takes block 1, so the next block of `table` is not adjacent
    assert table.append_tokens(2).tolist() == [8, 9]
    assert table.blocks == [0, 2] and table.tail_waste == 2
    assert table.slot(5) == 2 * 4 + 1
    assert table.slots().tolist() == [0, 1, 2, 3, 8, 9]
    assert table.append_tokens(0).tolist() == []


def test_append_out_of_blocks_leaves_table_unchanged():
    alloc = BlockAllocator(2, 4)
    table = BlockTable(alloc)
    table.append_tokens(5)
    with pytest.raises(OutOfBlocks):
        table.append_tokens(4)  # 9 tokens need 3 blocks
    assert table.num_tokens == 5 and table.blocks == [0, 1] and alloc.num_free == 0
    table.append_tokens(3)  # still fits in the tail of block 1
    assert table.num_tokens == 8


def test_release_and_fork():
    alloc = BlockAllocator(6, 2)
    parent = BlockTable(alloc, "p")
    parent.append_tokens(3)
    child = parent.fork("c")
    assert child.blocks == parent.blocks and child.num_tokens == 3
    assert [alloc.refcount(b) for b in parent.blocks] == [2, 2]
    parent.release()
    assert parent.blocks == [] and parent.num_tokens == 0
    assert alloc.num_used == 2 and [alloc.refcount(b) for b in child.blocks] == [1, 1]
    child.release()
    assert alloc.num_free == 6


def test_block_tables_tensor_pads_with_zero():
    alloc = BlockAllocator(8, 2)
    a, b = BlockTable(alloc), BlockTable(alloc)
    a.append_tokens(1)
    b.append_tokens(5)
    t = block_tables_tensor([a, b])
    assert t.dtype == torch.int32 and t.tolist() == [[0, 0, 0], [1, 2, 3]]
    assert block_tables_tensor([]).shape == (0, 0)


class LifoAllocator(BlockAllocator):
    """Only the free-queue hooks differ: a freed block is handed out next (vLLM's order for keyless blocks)."""

    def _put_free_block(self, block_id):
        self.free_block_ids.appendleft(block_id)
        return {"lifo": True}


def test_a_subclass_changes_only_the_free_order_through_the_two_hooks():
    alloc = LifoAllocator(4, 4)
    events = []
    alloc.subscribe(lambda e: events.append((e.kind, e.block_id, e.info)))
    table = BlockTable(alloc, "s")
    table.append_tokens(9)  # blocks 0, 1, 2
    table.release()  # in table order: 0, then 1, then 2, each to the front
    assert list(alloc.free_block_ids) == [2, 1, 0, 3] and alloc.refcounts == [0] * 4
    assert alloc.allocate("t") == 2  # the last one freed comes back first
    assert events[3:6] == [("free", b, {"lifo": True}) for b in (0, 1, 2)] and events[-1] == ("allocate", 2, {})
    with pytest.raises(BlockError, match="double free"):  # the base class's checks, refcounts and events stay
        alloc.free(0)
    alloc.free(2)
    with pytest.raises(BlockError, match="cannot free block 2: it is free"):
        alloc.free_sequence([2, 1])
    assert list(alloc.free_block_ids) == [2, 1, 0, 3]
