"""Checks for chapter 02: a tiny block allocator with reference counts, and a block table's append.

Each check drives the learner's class and the package's own
:class:`~minipaged.block_manager.BlockAllocator` / :class:`~minipaged.block_manager.BlockTable`
through the same operations and compares them step by step, including the
edge cases: the block boundary, refcount above one, double free, a full pool.
"""

from __future__ import annotations

from functools import partial

from minipaged.block_manager import BlockAllocator, BlockError, BlockTable, OutOfBlocks
from minipaged.checks import CheckFailed, check, expect_equal


def _expect_raises(exc_type, fn, what: str) -> None:
    try:
        fn()
    except exc_type:
        return
    except NotImplementedError:
        raise
    except Exception as exc:
        raise CheckFailed(f"{what} raised {type(exc).__name__}: {exc}; expected {exc_type.__name__}") from None
    raise CheckFailed(f"{what} returned normally; expected it to raise {exc_type.__name__}")


def _state(alloc) -> tuple:
    return list(alloc.free_block_ids), list(alloc.refcounts)


@check("ch02.allocate",
       hint="raise OutOfBlocks when free_block_ids is empty; otherwise popleft() an id and set its refcount to 1")
def check_allocate(cls):
    mine, ref = cls(4, 16), BlockAllocator(4, 16)
    for i in range(4):
        got = mine.allocate()
        want = ref.allocate()
        expect_equal(got, want, f"allocation {i + 1} of a fresh 4-block pool")
        expect_equal(mine.refcounts[got], 1, f"the refcount of block {got} just after allocate")
    expect_equal(len(mine.free_block_ids), 0, "len(free_block_ids) once all 4 blocks are allocated")
    before = _state(mine)
    _expect_raises(OutOfBlocks, mine.allocate, "allocate() on a full pool")
    if _state(mine) != before:
        raise CheckFailed("allocate() on a full pool changed free_block_ids or refcounts before raising")
    return "4 allocations in pool order, refcount 1 each, OutOfBlocks on a full pool with the state unchanged"


@check(
    "ch02.free",
    hint="check the id is in range (else IndexError) and its refcount > 0 (else BlockError), then decrement; "
    "only at 0 does the block go back: free_block_ids.append(block_id)",
)
def check_free(cls):
    mine, ref = cls(3, 8), BlockAllocator(3, 8)
    a, b = mine.allocate(), mine.allocate()
    ref.allocate(), ref.allocate()
    mine.incref(a)  # a is shared: two holders
    ref.incref(a)
    mine.free(a)
    ref.free(a)
    expect_equal(mine.refcounts[a], 1, "the refcount of a shared block (refcount 2) after one free")
    if a in mine.free_block_ids:
        raise CheckFailed(f"block {a} went back to free_block_ids while another holder still has it (refcount 1)")
    for block in (a, b):
        mine.free(block)
        ref.free(block)
    expect_equal(list(mine.free_block_ids), list(ref.free_block_ids),
                 "free_block_ids after the last holders free both blocks")
    expect_equal(mine.allocate(), ref.allocate(), "the next allocate() (the pool reuses freed blocks in order)")
    freed = mine.free_block_ids[-1]  # freed above and not reallocated
    bad_frees = [(freed, "a double free", BlockError), (3, "block 3 in a 3-block pool", IndexError),
                 (-1, "block -1", IndexError)]
    for bad, why, error in bad_frees:
        before = _state(mine)
        _expect_raises(error, partial(mine.free, bad), f"free({bad}) ({why})")
        if _state(mine) != before:
            raise CheckFailed(f"free({bad}) ({why}) changed the state before raising")
    return ("shared block kept at refcount 1, freed blocks reused in order, BlockError on a double free, "
            "IndexError on ids outside the pool")


def _slots(result, what: str) -> list[int]:
    try:
        return [int(s) for s in result]
    except TypeError:
        raise CheckFailed(f"{what} returned {result!r}; return the list of slots of the new tokens") from None


@check(
    "ch02.append",
    hint="blocks needed = blocks_needed(self.num_tokens + num_tokens, block_size) - len(blocks); if more than "
    "allocator.num_free, raise OutOfBlocks before changing anything; slot of position p = blocks[p // B] * B + p % B",
)
def check_append(cls):
    mine_alloc, ref_alloc = BlockAllocator(6, 4), BlockAllocator(6, 4)
    mine = {s: cls(mine_alloc) for s in "ab"}
    ref = {s: BlockTable(ref_alloc, s) for s in "ab"}
    # Interleaved so the blocks of one sequence are not adjacent; sizes hit and cross block boundaries;
    # ("a", 8) needs 2 blocks when 1 is free, so a table that grabs blocks one by one is caught.
    script = [("a", 3), ("a", 1), ("b", 1), ("a", 0), ("a", 1), ("b", 7), ("a", 4), ("a", 8), ("b", 1), ("a", 5)]
    for seq, n in script:
        what = f"append_tokens({n}) on sequence {seq} holding {ref[seq].num_tokens} tokens"
        try:
            want = ref[seq].append_tokens(n).tolist()
        except OutOfBlocks:
            want = None
        table = mine[seq]
        if want is None:  # the pool is short: the learner's table must refuse and change nothing
            before = (list(table.blocks), table.num_tokens, mine_alloc.num_free)
            short = f"{what} with {ref_alloc.num_free} free blocks"
            _expect_raises(OutOfBlocks, partial(table.append_tokens, n), short)
            if (list(table.blocks), table.num_tokens, mine_alloc.num_free) != before:
                raise CheckFailed(f"{what} raised OutOfBlocks but changed blocks, num_tokens or the pool first")
            continue
        got = _slots(mine[seq].append_tokens(n), what)
        expect_equal(got, want, what)
        expect_equal(list(mine[seq].blocks), ref[seq].blocks, f"blocks after {what}")
        expect_equal(mine[seq].num_tokens, ref[seq].num_tokens, f"num_tokens after {what}")
    expect_equal(mine_alloc.num_free, ref_alloc.num_free, "free blocks at the end")
    return (f"{len(script)} interleaved appends: same slots and blocks as BlockTable, "
            "OutOfBlocks leaves the table as it was")
