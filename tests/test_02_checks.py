"""Exercise 02's checks by mutation: the reference PASSes, every known wrong answer FAILs."""

from collections import deque

import pytest

from minipaged.block_manager import BlockAllocator, BlockError, BlockTable, OutOfBlocks
from minipaged.checks import FAIL, PASS, ch02

pytestmark = pytest.mark.ch02


class Pool:
    """The reference answer to Tasks 2.1 and 2.2; subclasses below are the known wrong ones."""

    def __init__(self, num_blocks, block_size):
        self.block_size = block_size
        self.free_block_ids = deque(range(num_blocks))
        self.refcounts = [0] * num_blocks

    def allocate(self, num_blocks):
        if num_blocks > len(self.free_block_ids):
            raise OutOfBlocks("short")
        taken = [self.free_block_ids.popleft() for _ in range(num_blocks)]
        for b in taken:
            self.refcounts[b] = 1
        return taken

    def free(self, block_ids):
        for b in block_ids:
            if not 0 <= b < len(self.refcounts):
                raise IndexError(b)
        for b in set(block_ids):
            if block_ids.count(b) > self.refcounts[b]:
                raise BlockError(b)
        self._drop(block_ids)

    def _drop(self, block_ids):
        for b in block_ids:
            self.refcounts[b] -= 1
            if self.refcounts[b] == 0:
                self.free_block_ids.append(b)


class OneByOne(Pool):  # allocates until the pool runs dry, then raises: not all or nothing
    def allocate(self, num_blocks):
        taken = []
        for _ in range(num_blocks):
            if not self.free_block_ids:
                raise OutOfBlocks("short")
            taken.append(self.free_block_ids.popleft())
            self.refcounts[taken[-1]] = 1
        return taken


class FromTheRight(Pool):
    def allocate(self, num_blocks):
        if num_blocks > len(self.free_block_ids):
            raise OutOfBlocks("short")
        taken = [self.free_block_ids.pop() for _ in range(num_blocks)]
        for b in taken:
            self.refcounts[b] = 1
        return taken


class NoRefcount(Pool):
    def allocate(self, num_blocks):
        return [self.free_block_ids.popleft() for _ in range(min(num_blocks, len(self.free_block_ids)))]


class EachIdAlone(Pool):  # validates each id against the count before the list's earlier drops
    def free(self, block_ids):
        for b in block_ids:
            if not 0 <= b < len(self.refcounts):
                raise IndexError(b)
            if self.refcounts[b] == 0:
                raise BlockError(b)
        self._drop(block_ids)


class ValidatesWhileDropping(Pool):
    def free(self, block_ids):
        for b in block_ids:
            if not 0 <= b < len(self.refcounts):
                raise IndexError(b)
            if self.refcounts[b] == 0:
                raise BlockError(b)
            self._drop([b])


class ReturnsSharedBlocks(Pool):
    def _drop(self, block_ids):
        for b in block_ids:
            self.refcounts[b] = max(self.refcounts[b] - 1, 0)
            if b not in self.free_block_ids:
                self.free_block_ids.append(b)


def slots(blocks, start, n, b):
    if start + n > len(blocks) * b:
        raise IndexError("past the table")
    return [blocks[p // b] * b + p % b for p in range(start, start + n)]


def contiguous_from_first(blocks, start, n, b):
    first = slots(blocks, start, 1, b)[0] if n else 0
    return list(range(first, first + n))


SLOT_MUTANTS = {
    "runs on past the block": contiguous_from_first,
    "ignores start": lambda blocks, start, n, b: slots(blocks, 0, n, b),
    "chunk-relative blocks": lambda blocks, start, n, b: [blocks[i // b] * b + (start + i) % b for i in range(n)],
    "no IndexError": lambda blocks, start, n, b: [blocks[min(p // b, len(blocks) - 1)] * b + p % b
                                                  for p in range(start, start + n)] if blocks else [],
    "chapter's BlockTable._slots": BlockTable._slots,
}


@pytest.mark.parametrize(
    "check, mutants",
    [(ch02.check_allocate_many, [OneByOne, FromTheRight, NoRefcount, BlockAllocator]),
     (ch02.check_free_many, [EachIdAlone, ValidatesWhileDropping, ReturnsSharedBlocks, BlockAllocator])],
    ids=["allocate_many", "free_many"],
)
def test_allocator_reference_passes_and_mutants_fail(check, mutants, capsys):
    assert check(Pool).status == PASS
    for mutant in mutants:
        assert check(mutant).status == FAIL, mutant.__name__
    assert "Traceback" not in capsys.readouterr().out


def test_chunk_slots_reference_passes_and_mutants_fail():
    assert ch02.check_chunk_slots(slots).status == PASS
    for name, mutant in SLOT_MUTANTS.items():
        assert ch02.check_chunk_slots(mutant).status == FAIL, name


def test_slots_that_run_past_a_block_are_named():
    assert "run on past the end of block" in ch02.check_chunk_slots(contiguous_from_first).message


def test_a_non_atomic_free_is_named():
    assert "validate the whole list first" in ch02.check_free_many(ValidatesWhileDropping).message
