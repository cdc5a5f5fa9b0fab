"""Issue 11, chapter 02: the allocator and the cache write answer bad input with named errors."""

import pytest
import torch

import minipaged.validation
from minipaged.attention import write_kv
from minipaged.blocks import BOOKKEEPING_BYTES_PER_BLOCK, BlockAllocator, BlockError, BlockTable
from minipaged.cache import PagedKVCache

pytestmark = pytest.mark.ch02


def test_write_kv_refuses_two_tokens_for_one_slot():
    k_cache = torch.zeros(4, 4, 2, 8)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(3, 2, 8)
    with pytest.raises(ValueError, match="slot_mapping holds slot 3 more than once"):
        write_kv(key, key, k_cache, v_cache, torch.tensor([3, 5, 3]))
    assert not k_cache.any(), "nothing may be written before the error"
    write_kv(key, key, k_cache, v_cache, torch.tensor([-1, 5, -1]))  # -1 (skip) may repeat
    assert torch.equal(k_cache.view(-1, 2, 8)[5], key[1])


def test_refcount_of_none_names_block_id():
    with pytest.raises(TypeError, match="block_id"):
        BlockAllocator(4, 2).refcount(None)


def test_freeing_a_never_allocated_block_is_not_called_a_double_free():
    alloc = BlockAllocator(4, 2)
    with pytest.raises(BlockError, match="never allocated") as info:
        alloc.free(1)
    assert "double free" not in str(info.value)
    b = alloc.allocate()
    alloc.free(b)
    with pytest.raises(BlockError, match="double free"):
        alloc.free(b)


def test_a_pool_larger_than_the_machine_fails_before_allocating():
    # 10**12 blocks of bookkeeping is ~64 TB: more than any machine, so the answer is the same everywhere.
    with pytest.raises(ValueError, match=r"BlockAllocator\(num_blocks=1000000000000\).*physical memory"):
        BlockAllocator(10**12, 16)
    with pytest.raises(ValueError, match=r"num_blocks=1000000000.*K/V pools"):
        PagedKVCache(2, 10**9, 16, 2, 32)


def test_the_pool_check_compares_with_total_memory(monkeypatch):
    total = 100 * BOOKKEEPING_BYTES_PER_BLOCK
    monkeypatch.setattr(minipaged.validation, "total_memory_bytes", lambda device="cpu": total)
    assert BlockAllocator(100, 16).num_blocks == 100
    with pytest.raises(ValueError, match="num_blocks=101"):
        BlockAllocator(101, 16)
    # K and V of 1 layer, blocks of 2 slots x 1 head x 8 fp32 dims: 128 bytes a block.
    fits = total // 128
    PagedKVCache(1, fits, 2, 1, 8)
    with pytest.raises(ValueError, match="K/V pools"):
        PagedKVCache(1, fits + 1, 2, 1, 8)


def pool_state(alloc):
    return list(alloc.free_block_ids), alloc.refcounts


@pytest.mark.parametrize("block_ids, error, match", [
    ("b-1", IndexError, "block_id runs from 0 to 3"),  # was: block b freed, then IndexError
    ("b b", BlockError, "cannot free block 0 2 times: it has 1 reference"),  # the second free would fail
    ("b 3", BlockError, "cannot free block 3: it is free"),
    ("b x", TypeError, "block_id must be an int"),
    ("tuple", TypeError, None),
])  # fmt: skip
def test_free_sequence_checks_every_block_before_freeing_any(block_ids, error, match):
    alloc = BlockAllocator(4, 2)
    b = alloc.allocate("s")
    ids = {"b-1": [b, -1], "b b": [b, b], "b 3": [b, 3], "b x": [b, "x"], "tuple": {b}}[block_ids]
    before = pool_state(alloc)
    with pytest.raises(error, match=match if match else "block_ids must be a list"):
        alloc.free_sequence(ids, "s")
    assert pool_state(alloc) == before
    alloc.free_sequence([b], "s")
    assert alloc.num_free == 4


def test_fork_after_a_block_was_freed_behind_the_tables_back_leaks_no_reference():
    alloc = BlockAllocator(6, 2)
    table = BlockTable(alloc, "p")
    table.append_tokens(5)  # blocks 0, 1, 2
    alloc.free(table.blocks[1])  # behind the table's back
    before = pool_state(alloc)
    with pytest.raises(BlockError, match=r"cannot fork sequence 'p'\'s table: its block 1 is free"):
        table.fork("c")
    assert pool_state(alloc) == before  # was: block 0's refcount raised to 2 before the error


@pytest.mark.parametrize("allocator", ["x", None, 4])
def test_a_block_table_needs_an_allocator(allocator):
    with pytest.raises(TypeError, match="allocator must be an AllocatorBase"):  # was: AttributeError at first append
        BlockTable(allocator)
