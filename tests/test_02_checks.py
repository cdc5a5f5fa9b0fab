"""The chapter 02 exercise checks pass the reference answers and catch the usual mistakes."""

from collections import deque

import pytest

from minipaged.accounting import blocks_needed
from minipaged.block_manager import BlockError, OutOfBlocks
from minipaged.checks import FAIL, PASS, TODO, ch02

pytestmark = pytest.mark.ch02


class Allocator:
    def __init__(self, num_blocks, block_size):
        self.block_size = block_size
        self.free_block_ids = deque(range(num_blocks))
        self.refcounts = [0] * num_blocks

    @property
    def num_free(self):
        return len(self.free_block_ids)

    def incref(self, block_id):
        self.refcounts[block_id] += 1

    def allocate(self):
        if not self.free_block_ids:
            raise OutOfBlocks("pool is full")
        block_id = self.free_block_ids.popleft()
        self.refcounts[block_id] = 1
        return block_id

    def free(self, block_id):
        if not 0 <= block_id < len(self.refcounts):
            raise IndexError(f"block {block_id} is outside the pool")
        if self.refcounts[block_id] == 0:
            raise BlockError(f"block {block_id} is not allocated")
        self.refcounts[block_id] -= 1
        if self.refcounts[block_id] == 0:
            self.free_block_ids.append(block_id)


class Table:
    def __init__(self, allocator):
        self.allocator, self.blocks, self.num_tokens = allocator, [], 0

    def needed(self, n):
        return blocks_needed(self.num_tokens + n, self.allocator.block_size) - len(self.blocks)

    def append_tokens(self, n):
        if self.needed(n) > self.allocator.num_free:
            raise OutOfBlocks("pool is full")
        return self._grab(n)

    def _grab(self, n):
        B = self.allocator.block_size
        self.blocks += [self.allocator.allocate() for _ in range(self.needed(n))]
        slots = [self.blocks[p // B] * B + p % B for p in range(self.num_tokens, self.num_tokens + n)]
        self.num_tokens += n
        return slots


class FreesAtOnce(Allocator):  # ignores the refcount: a shared block is returned while still in use
    def free(self, block_id):
        if self.refcounts[block_id] == 0:
            raise BlockError("double free")
        self.refcounts[block_id] = 0
        self.free_block_ids.append(block_id)


class NoDoubleFreeCheck(Allocator):
    def free(self, block_id):
        self.refcounts[block_id] -= 1
        if self.refcounts[block_id] <= 0:
            self.free_block_ids.append(block_id)


class WrongError(Allocator):
    def allocate(self):
        return self.free_block_ids.popleft() if self.free_block_ids else None


class LifoAllocator(Allocator):
    def allocate(self):
        if not self.free_block_ids:
            raise OutOfBlocks("pool is full")
        block_id = self.free_block_ids.pop()
        self.refcounts[block_id] = 1
        return block_id


class BadIdIsBlockError(Allocator):  # the old rule: an id outside the pool was a BlockError too
    def free(self, block_id):
        if not 0 <= block_id < len(self.refcounts):
            raise BlockError(f"block {block_id} is outside the pool")
        super().free(block_id)


class NotAtomic(Table):
    def append_tokens(self, n):
        return self._grab(n)


class OffByOneBlock(Table):
    def needed(self, n):
        return max(0, (self.num_tokens + n) // self.allocator.block_size + 1 - len(self.blocks))


class Todo(Allocator):
    def allocate(self):
        raise NotImplementedError("Task 2.1 is not implemented yet.")


@pytest.mark.parametrize(
    "check, answer, status",
    [
        (ch02.check_allocate, Allocator, PASS),
        (ch02.check_free, Allocator, PASS),
        (ch02.check_append, Table, PASS),
        (ch02.check_free, FreesAtOnce, FAIL),
        (ch02.check_free, NoDoubleFreeCheck, FAIL),
        (ch02.check_free, BadIdIsBlockError, FAIL),
        (ch02.check_allocate, WrongError, FAIL),
        (ch02.check_allocate, LifoAllocator, FAIL),
        (ch02.check_append, NotAtomic, FAIL),
        (ch02.check_append, OffByOneBlock, FAIL),
        (ch02.check_allocate, Todo, TODO),
    ],
)
def test_check_status(check, answer, status, capsys):
    result = check(answer)
    assert result.status == status, result
    assert capsys.readouterr().out.count("\n") >= 1
