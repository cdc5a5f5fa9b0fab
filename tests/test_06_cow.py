"""Copy-on-write in BlockTable.append_tokens: exact ids, all or nothing, and the parent's K/V untouched."""

import pytest
import torch

from minipaged.blocks import BlockAllocator, BlockTable, OutOfBlocks
from minipaged.cache import PagedKVCache

pytestmark = pytest.mark.ch06


def test_append_into_a_shared_partial_block_copies_it():
    alloc = BlockAllocator(10, 4)
    events = []
    alloc.subscribe(lambda e: events.append((e.kind, e.block_id, e.info)) if e.kind == "cow" else None)
    parent = BlockTable(alloc, "p")
    parent.append_tokens(6)  # blocks 0 and 1, block 1 half full
    child = parent.fork("c")
    assert alloc.refcounts[:2] == [2, 2]
    slots = child.append_tokens(1)  # lands in block 1, which the parent also holds
    assert child.blocks == [0, 2] and parent.blocks == [0, 1]
    assert alloc.refcounts[:3] == [2, 1, 1]
    assert child.pending_copies == [(1, 2)] and parent.pending_copies == []
    assert slots.tolist() == [2 * 4 + 2]
    assert events == [("cow", 2, {"src": 1, "dst": 2, "num_slots": 2})]
    parent.append_tokens(1)  # the parent is block 1's only holder now: it writes in place
    assert parent.blocks == [0, 1] and parent.pending_copies == [] and len(events) == 1
    assert child.take_pending_copies() == [(1, 2)] and child.pending_copies == []


def test_no_copy_when_the_shared_last_block_is_full():
    alloc = BlockAllocator(10, 4)
    parent = BlockTable(alloc, "p")
    parent.append_tokens(8)
    child = parent.fork("c")
    assert child.num_new_blocks(1) == 1
    child.append_tokens(1)
    assert child.blocks == [0, 1, 2] and child.pending_copies == [] and alloc.refcounts[:3] == [2, 2, 1]


def test_copy_on_write_is_all_or_nothing():
    alloc = BlockAllocator(3, 4)
    parent = BlockTable(alloc, "p")
    parent.append_tokens(6)
    child = parent.fork("c")
    assert child.num_new_blocks(3) == 2  # 9 tokens need a third block, and the copy of block 1
    before = (list(alloc.free_block_ids), alloc.refcounts, child.blocks, child.num_tokens)
    with pytest.raises(OutOfBlocks, match="needs 2 blocks but only 1"):
        child.append_tokens(3)
    assert (list(alloc.free_block_ids), alloc.refcounts, child.blocks, child.num_tokens) == before
    assert child.pending_copies == []
    child.append_tokens(2)  # the copy alone fits
    assert child.blocks == [0, 2] and child.pending_copies == [(1, 2)]


def test_fork_of_a_released_table_is_named():
    alloc = BlockAllocator(4, 4)
    table = BlockTable(alloc, "gone")
    table.append_tokens(5)
    table.release()
    before = (list(alloc.free_block_ids), alloc.refcounts)
    with pytest.raises(ValueError, match="'gone'.*released"):
        table.fork("child")
    assert (list(alloc.free_block_ids), alloc.refcounts) == before
    table.append_tokens(1)  # a released table is reusable, and then forkable again
    assert table.fork("child").blocks == table.blocks


def test_parent_kv_bit_identical_after_the_child_writes():
    torch.manual_seed(0)
    cache = PagedKVCache(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8)
    for pool in (*cache.k_caches, *cache.v_caches):
        pool.fill_(float("nan"))  # poison: any slot read before it is written shows up
    parent = cache.new_table("p")

    def write(table, n):
        slots = table.append_tokens(n)
        for src, dst in table.take_pending_copies():  # the copy runs before the write, as the engine does
            cache.copy_blocks([src], [dst])
        for layer in range(cache.num_layers):
            k, v = torch.randn(n, 2, 8), torch.randn(n, 2, 8)
            cache.write(layer, k, v, slots)

    write(parent, 6)
    before = [tuple(t.clone() for t in cache.gather(layer, parent)) for layer in range(2)]
    child = parent.fork("c")
    write(child, 3)  # copy-on-write into block 1, then block 2
    for layer in range(2):
        k, v = cache.gather(layer, parent)
        assert torch.equal(k, before[layer][0]) and torch.equal(v, before[layer][1]), "the child overwrote its parent"
        ck, cv = cache.gather(layer, child)
        assert not ck.isnan().any() and not cv.isnan().any()
        assert torch.equal(ck[:6], before[layer][0]) and torch.equal(cv[:6], before[layer][1])
