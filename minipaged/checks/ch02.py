"""Checks for exercise 02: an allocator that takes and returns many blocks at once, and a chunk's slot mapping.

Chapter 02 shows :class:`~minipaged.block_manager.BlockAllocator`, which hands out
and frees one block per call. The exercise's allocator does it for a whole list,
all or nothing, which is where reference counts and repeated ids bite; and its
slot mapping starts at any position, not at the sequence's end.
"""

from __future__ import annotations

from collections import deque
from functools import partial

from minipaged.block_manager import BlockError, OutOfBlocks
from minipaged.checks import CheckFailed, check, expect_equal

HINTS = {
    "2.1": [
        "all or nothing: decide whether the whole request fits before touching the pool",
        "compare num_blocks with len(self.free_block_ids) first; only then take ids from the left of the deque",
        "every id you hand out starts with refcount 1; an empty request returns []",
    ],
    "2.2": [
        "validate the whole list before changing anything; the same id may appear more than once in it",
        "count how many times each id appears (collections.Counter) and compare with its refcount",
        "then decrement once per appearance; a block rejoins free_block_ids (on the right) when its count hits 0",
    ],
    "2.3": [
        "a chunk that starts in the middle of a block crosses a block boundary wherever p % block_size wraps to 0",
        "compute each position's slot on its own: position p lives in logical block p // block_size",
        "raise IndexError when the chunk's last position is beyond len(blocks) * block_size, before computing slots",
    ],
}


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


class _Reference:
    """The exercise's allocator as the checks expect it to behave."""

    def __init__(self, num_blocks: int):
        self.free_block_ids = deque(range(num_blocks))
        self.refcounts = [0] * num_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self.free_block_ids):
            raise OutOfBlocks(f"{num_blocks} blocks asked, {len(self.free_block_ids)} free")
        ids = [self.free_block_ids.popleft() for _ in range(num_blocks)]
        for b in ids:
            self.refcounts[b] = 1
        return ids

    def free(self, block_ids: list[int]) -> None:
        for b in block_ids:
            if not 0 <= b < len(self.refcounts):
                raise IndexError(b)
        for b in set(block_ids):
            if block_ids.count(b) > self.refcounts[b]:
                raise BlockError(b)
        for b in block_ids:
            self.refcounts[b] -= 1
            if self.refcounts[b] == 0:
                self.free_block_ids.append(b)


def _ids(result, what: str) -> list[int]:
    if not isinstance(result, list):
        raise CheckFailed(f"{what} returned {result!r}; return a list of block ids")
    return result


@check("ch02.allocate_many", hint=HINTS["2.1"][0])
def check_allocate_many(cls):
    mine, ref = cls(6, 4), _Reference(6)
    for n in (2, 0, 3):
        what = f"allocate({n}) with {len(ref.free_block_ids)} free blocks"
        expect_equal(_ids(mine.allocate(n), what), ref.allocate(n), what)
        expect_equal(list(mine.refcounts), ref.refcounts, f"refcounts after {what}")
    before = _state(mine)
    _expect_raises(OutOfBlocks, partial(mine.allocate, 2), "allocate(2) with 1 free block")
    if _state(mine) != before:
        raise CheckFailed("allocate(2) with 1 free block changed free_block_ids or refcounts before raising; "
                          "check that the whole request fits first")
    expect_equal(mine.allocate(1), ref.allocate(1), "allocate(1) with 1 free block")
    return "in pool order, refcount 1 each, all or nothing on a short pool"


@check("ch02.free_many", hint=HINTS["2.2"][0])
def check_free_many(cls):
    mine, ref = cls(5, 4), _Reference(5)
    for alloc in (mine, ref):
        alloc.allocate(4)
        alloc.refcounts[1] += 1  # block 1 is shared by two holders
        alloc.refcounts[2] += 1
    steps = [[1], [3, 0], [2, 2]]  # one holder of a shared block; two blocks; both holders of block 2 at once
    for ids in steps:
        mine.free(list(ids))
        ref.free(list(ids))
        expect_equal(_state(mine), _state(ref), f"(free_block_ids, refcounts) after free({ids})")
    bad = [
        ([1, 1], BlockError, "block 1 twice while it has one holder"),
        ([0], BlockError, "block 0, already free"),
        ([1, 5], IndexError, "block 5 in a 5-block pool"),
        ([-1], IndexError, "block -1"),
    ]
    for ids, error, why in bad:
        before = _state(mine)
        _expect_raises(error, partial(mine.free, list(ids)), f"free({ids}) ({why})")
        if _state(mine) != before:
            raise CheckFailed(f"free({ids}) ({why}) changed the pool before raising: validate the whole list first")
    mine.free([1])
    ref.free([1])
    expect_equal(_state(mine), _state(ref), "(free_block_ids, refcounts) after the last holder frees block 1")
    return "shared blocks kept until their last holder, repeated ids counted, nothing changed by a bad list"


# (blocks, start, num_tokens, block_size)
SLOT_CASES = [
    ([7, 2, 9], 0, 4, 4),
    ([7, 2, 9], 2, 5, 4),  # starts mid-block, crosses into the next block
    ([7, 2, 9], 3, 6, 4),  # crosses two boundaries
    ([5, 0], 5, 1, 4),
    ([3, 8, 1], 4, 0, 4),  # an empty chunk
    ([4, 1, 6, 0], 6, 6, 3),
    ([11], 3, 1, 16),
    ([2**40, 3], 1, 2, 2**20),  # large block ids and block size
]


def _chunk(blocks, start, num_tokens, block_size) -> list[int]:
    return [blocks[p // block_size] * block_size + p % block_size for p in range(start, start + num_tokens)]


@check("ch02.chunk_slots", hint=HINTS["2.3"][0])
def check_chunk_slots(fn):
    for blocks, start, n, b in SLOT_CASES:
        what = f"chunk_slots({blocks}, start={start}, num_tokens={n}, block_size={b})"
        got = fn(list(blocks), start, n, b)
        try:
            got = [int(s) for s in got]
        except (TypeError, ValueError):
            raise CheckFailed(f"{what} returned {got!r}; return a list of slots") from None
        want = _chunk(blocks, start, n, b)
        first = blocks[start // b] * b + start % b
        if n and got == list(range(first, first + n)) and got != want:
            raise CheckFailed(
                f"{what} returned {got}, expected {want}: the slots run on past the end of block "
                f"{blocks[start // b]}; the next position lives in the next block of the table"
            )
        expect_equal(got, want, what)
    for blocks, start, n, b in [([7, 2], 6, 3, 4), ([7], 0, 5, 4), ([], 0, 1, 4)]:
        what = f"chunk_slots({blocks}, start={start}, num_tokens={n}, block_size={b}) (past the table's blocks)"
        _expect_raises(IndexError, partial(fn, list(blocks), start, n, b), what)
    return f"{len(SLOT_CASES)} chunks, mid-block starts and boundaries crossed, IndexError past the table"
