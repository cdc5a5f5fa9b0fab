"""Exercise 02's checks by mutation: the model solution PASSes, each classic mistake FAILs with its message and hint.

The model solution (``MyAllocator``, ``MyBlockTable``) is the solution notebook's; each wrong one
below changes one thing in it. The engine check's reference transcript is computed once per case
here (``verdict`` on a cached ``want``), so each wrong piece costs one engine run.
"""

import json
from collections import Counter, deque
from functools import cache

import pytest
import torch

from minipaged.blocks import AllocatorBase, BlockAllocator, BlockError, BlockTable, OutOfBlocks
from minipaged.checks import FAIL, PASS, TODO, ch02, expected

pytestmark = pytest.mark.ch02


class MyAllocator(AllocatorBase):
    def __init__(self, num_blocks, block_size):
        super().__init__(num_blocks, block_size)
        self.free_block_ids = deque(range(self.num_blocks))
        self._refcounts = [0] * self.num_blocks

    @property
    def num_free(self):
        return len(self.free_block_ids)

    def _take_free_block(self, seq_id):
        return self.free_block_ids.popleft()

    def _put_free_block(self, block_id):
        self.free_block_ids.append(block_id)
        return {}

    def refcount(self, block_id):
        if type(block_id) is not int:
            raise TypeError(f"block_id must be an int, got {type(block_id).__name__}")
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block {block_id} is outside the pool")
        return self._refcounts[block_id]

    def _held(self, block_id):
        if self.refcount(block_id) == 0:
            raise BlockError(f"block {block_id} is free")
        return block_id

    def allocate(self, seq_id=None):
        if not self.num_free:
            raise OutOfBlocks("no free block")
        block_id = self._take_free_block(seq_id)
        self._refcounts[block_id] = 1
        self.emit("allocate", block_id, seq_id)
        return block_id

    def allocate_many(self, num_blocks, seq_id=None):
        if num_blocks > self.num_free:
            raise OutOfBlocks("short")
        with self.hold_events():
            return [self.allocate(seq_id) for _ in range(num_blocks)]

    def incref(self, block_id, seq_id=None):
        self._refcounts[self._held(block_id)] += 1
        self.emit("incref", block_id, seq_id, refcount=self._refcounts[block_id])

    def free(self, block_id, seq_id=None):
        self._refcounts[self._held(block_id)] -= 1
        left = self._refcounts[block_id]
        info = {"refcount": left} if left else self._put_free_block(block_id)
        self.emit("decref" if left else "free", block_id, seq_id, **info)

    def free_sequence(self, block_ids, seq_id=None):
        for block_id, times in Counter(self._held(b) for b in block_ids).items():
            if times > self._refcounts[block_id]:
                raise BlockError(f"block {block_id} freed {times} times")
        with self.hold_events():
            for block_id in block_ids:
                self.free(block_id, seq_id)


class MyBlockTable:
    def __init__(self, allocator, seq_id=None):
        self.allocator, self.seq_id = allocator, seq_id
        self.blocks, self.num_tokens = [], 0

    @property
    def block_size(self):
        return self.allocator.block_size

    @property
    def num_blocks(self):
        return len(self.blocks)

    @property
    def tail_waste(self):
        return len(self.blocks) * self.block_size - self.num_tokens

    def take_pending_copies(self):
        return []

    def num_new_blocks(self, num_tokens):
        return max(0, -(-(self.num_tokens + num_tokens) // self.block_size) - len(self.blocks))

    def append_tokens(self, num_tokens):
        self.blocks += self.allocator.allocate_many(self.num_new_blocks(num_tokens), self.seq_id)
        start = self.num_tokens
        self.num_tokens += num_tokens
        return torch.tensor(self.slots_of(range(start, self.num_tokens)), dtype=torch.int64)

    def slots_of(self, positions):
        B = self.block_size
        return [self.blocks[p // B] * B + p % B for p in positions]

    def release(self):
        blocks, self.blocks, self.num_tokens = self.blocks, [], 0
        self.allocator.free_sequence(blocks, self.seq_id)


# ---- wrong allocators ----------------------------------------------------------------------------------------------


class FreesBeforeChecking(MyAllocator):  # free_sequence frees each id as it meets it: a bad id at the end is too late
    def free_sequence(self, block_ids, seq_id=None):
        for block_id in block_ids:
            self.free(block_id, seq_id)


class TakesSomeBeforeRaising(MyAllocator):  # allocate_many takes blocks until the pool runs dry, then raises
    def allocate_many(self, num_blocks, seq_id=None):
        with self.hold_events():
            return [self.allocate(seq_id) for _ in range(num_blocks)]


class ReturnsHeldBlock(MyAllocator):  # a shared block goes back to the pool while another holder still has it
    def free(self, block_id, seq_id=None):
        self._refcounts[self._held(block_id)] -= 1
        self.emit("free", block_id, seq_id, **self._put_free_block(block_id))


class SharedNotDecremented(MyAllocator):  # freeing a shared block forgets to drop its reference
    def free(self, block_id, seq_id=None):
        if self.refcount(block_id) > 1:
            return
        super().free(block_id, seq_id)


class BypassesTheHooks(MyAllocator):  # right on its own, wrong under chapter 06's subclass: asks the deque itself
    def allocate(self, seq_id=None):
        if not self.free_block_ids:
            raise OutOfBlocks("no free block")
        block_id = self.free_block_ids.popleft()
        self._refcounts[block_id] = 1
        self.emit("allocate", block_id, seq_id)
        return block_id


class Silent(MyAllocator):  # right pool, but publishes nothing: chapter 02's log and block map stay empty
    def emit(self, kind, block_id=None, seq_id=None, **info):
        pass


class HeardHalfway(MyAllocator):  # allocate_many lets each block be heard of before the call is complete
    def allocate_many(self, num_blocks, seq_id=None):
        if num_blocks > self.num_free:
            raise OutOfBlocks("short")
        return [self.allocate(seq_id) for _ in range(num_blocks)]


class NewestFirst(MyAllocator):  # takes free blocks from the right: the block freed last comes back first
    def _take_free_block(self, seq_id):
        return self.free_block_ids.pop()


class SearchesTheFreeQueue(MyAllocator):  # tells a double free by a search of the free queue: O(pool)
    def _held(self, block_id):
        self.refcount(block_id)
        if block_id in self.free_block_ids:
            raise BlockError(f"block {block_id} is free")
        return block_id


class ListPopFront(MyAllocator):  # the free queue is a list: pop(0) moves every element after it
    def __init__(self, num_blocks, block_size):
        super().__init__(num_blocks, block_size)
        self.free_block_ids = list(self.free_block_ids)

    def _take_free_block(self, seq_id):
        return self.free_block_ids.pop(0)


class CountsTheFreeBlocks(MyAllocator):  # num_free walks the free queue every time it is asked
    @property
    def num_free(self):
        return sum(1 for _ in self.free_block_ids)


class ScansForAFreeBlock(MyAllocator):  # looks for a block whose refcount is 0, block by block
    def _take_free_block(self, seq_id):
        for block_id in range(self.num_blocks):
            if self._refcounts[block_id] == 0 and block_id == self.free_block_ids[0]:
                return self.free_block_ids.popleft()
        raise AssertionError("unreachable")


# ---- wrong tables ----------------------------------------------------------------------------------------------


class BlockTooEarly(MyBlockTable):  # a full last block already gets a successor: floor + 1 instead of ceil
    def num_new_blocks(self, num_tokens):
        return max(0, (self.num_tokens + num_tokens) // self.block_size + 1 - len(self.blocks))


class RunsPastTheBlock(MyBlockTable):  # the slots run on from the first one, across the block's end
    def slots_of(self, positions):
        first = super().slots_of(positions[:1])
        return list(range(first[0], first[0] + len(positions))) if first else []


class LeakyRelease(MyBlockTable):  # release empties the table but gives nothing back
    def release(self):
        self.blocks, self.num_tokens = [], 0


class TailFirstRelease(MyBlockTable):  # frees the last block first: chapter 06's order, not this allocator's
    def release(self):
        blocks, self.blocks, self.num_tokens = self.blocks, [], 0
        self.allocator.free_sequence(blocks[::-1], self.seq_id)


class Int32Slots(MyBlockTable):  # slots as int32: they overflow past 2**31 slots
    def append_tokens(self, num_tokens):
        return super().append_tokens(num_tokens).to(torch.int32)


class BlockTooLate(MyBlockTable):  # floor instead of ceil: the last tokens of a partly filled block have none
    def num_new_blocks(self, num_tokens):
        return max(0, (self.num_tokens + num_tokens) // self.block_size - len(self.blocks))


class NextBlockLookup(MyBlockTable):  # looks a position up in the block after its own: runs off the table and raises
    def slots_of(self, positions):
        B, slots = self.block_size, []
        for p in positions:
            slots.append(self.blocks[p // B + 1] * B + p % B)
        return slots


# ---- the checks on them ----------------------------------------------------------------------------------------


@cache
def _want(name):
    return expected(name)


def verdict(check, *answers):
    cases, want = _want(check.name)
    return check.verdict(cases, check.transcript(cases, answers), want, len(cases))


def test_the_model_solution_and_the_package_pass():
    assert verdict(ch02.check_allocator, MyAllocator).status == PASS
    assert verdict(ch02.check_constant_time, MyAllocator).status == PASS
    assert verdict(ch02.check_engine, MyAllocator, MyBlockTable).status == PASS
    assert verdict(ch02.check_engine, MyAllocator, BlockTable).status == PASS  # the package's table on yours
    assert verdict(ch02.check_engine, BlockAllocator, MyBlockTable).status == PASS
    assert verdict(ch02.check_allocator, BlockAllocator).status == PASS  # the package's own pieces (the model answer)
    assert verdict(ch02.check_constant_time, BlockAllocator).status == PASS


ALLOCATOR_MUTANTS = {
    FreesBeforeChecking: ("call 11, free_sequence([1, 2, 7]), raised IndexError as it should, but it had already "
                          "changed the pool", "validate the whole list"),
    TakesSomeBeforeRaising: ("call 4, allocate_many(3), raised OutOfBlocks as it should, but it had already changed",
                             "check num_blocks <= num_free before taking the first block"),
    ReturnsHeldBlock: ("call 14, free(1), put block 1 back in free_block_ids, but it still has 1 holder",
                       "free drops ONE reference"),
    SharedNotDecremented: ("call 14, free(1), left block 1 with refcount 2, expected 1", "exactly one reference"),
    NewestFirst: ("call 1, allocate('A'), returned 5, expected 0", "LEFT of free_block_ids (popleft)"),
    BypassesTheHooks: ("(chapter 06's shape): call 19, allocate_many(4), raised OutOfBlocks",
                       "ask self.num_free (never len(free_block_ids))"),
    Silent: ("call 1, allocate('A'), published the events none; expected allocate(0, 'A') [heard with 5 free]",
             "self.emit(kind, block_id, seq_id"),
    HeardHalfway: ("call 2, allocate_many(3), published the events allocate(1, 'many') [heard with 4 free]",
                   "with self.hold_events()"),
}


@pytest.mark.parametrize("mutant", ALLOCATOR_MUTANTS, ids=lambda m: m.__name__)
def test_a_wrong_allocator_is_named_at_its_first_wrong_call(mutant):
    result = verdict(ch02.check_allocator, mutant)
    message, hint = ALLOCATOR_MUTANTS[mutant]
    assert result.status == FAIL
    assert message in result.message, result.message
    assert hint in result.hint, result.hint


CONSTANT_TIME_MUTANTS = {
    SearchesTheFreeQueue: ("incref(block) took 44 operations on a pool of 32 blocks but 1036",
                           "never search free_block_ids"),
    ListPopFront: ("allocate() on a nearly empty pool took", "never pop(0) a list"),
    CountsTheFreeBlocks: ("allocate() on a nearly empty pool took", "num_free = len(free_block_ids)"),
    ScansForAFreeBlock: ("allocate() on a nearly full pool took", "never search or count the refcounts"),
}


@pytest.mark.parametrize("mutant", CONSTANT_TIME_MUTANTS, ids=lambda m: m.__name__)
def test_an_allocator_whose_cost_grows_with_the_pool_fails(mutant):
    assert verdict(ch02.check_allocator, mutant).status == PASS  # it behaves: only its cost is wrong
    result = verdict(ch02.check_constant_time, mutant)
    message, hint = CONSTANT_TIME_MUTANTS[mutant]
    assert result.status == FAIL
    assert message in result.message and "grows with the pool" in result.message, result.message
    assert hint in result.hint, result.hint


TABLE_MUTANTS = {
    BlockTooEarly: ("num_new_blocks(4) said 2, expected 1: 4 tokens need 1 block(s), so it asks for a new block too "
                    "early", "ceil(num_tokens / block_size)"),
    RunsPastTheBlock: ("the slots run on past the end of block", "contiguous only inside a block"),
    LeakyRelease: ("blocks went missing from yours", "release() must hand every block"),
    TailFirstRelease: ("free_block_ids is [", "free_sequence frees in table order"),
    Int32Slots: ("returned int32 slots", "dtype=torch.int64"),
    BlockTooLate: ("num_new_blocks(2) said 0, expected 1: 2 tokens need 1 block(s), so it asks for a new block too "
                   "late", "ceil(num_tokens / block_size)"),
}


@pytest.mark.parametrize("mutant", TABLE_MUTANTS, ids=lambda m: m.__name__)
def test_a_wrong_table_is_named_at_its_first_wrong_step(mutant):
    result = verdict(ch02.check_engine, MyAllocator, mutant)
    message, hint = TABLE_MUTANTS[mutant]
    assert result.status == FAIL
    assert result.message.startswith("the engine on a pool of") and ": step " in result.message, result.message
    assert message in result.message, result.message
    assert hint in result.hint, result.hint


def test_a_wrong_allocator_in_the_engine_is_named_at_its_step():
    result = verdict(ch02.check_engine, NewestFirst, MyBlockTable)
    assert result.status == FAIL and "free_block_ids is [" in result.message, result.message


def test_a_table_that_raises_shows_its_call():
    result = verdict(ch02.check_engine, MyAllocator, NextBlockLookup)
    assert result.status == FAIL
    assert "step 0: your code raised IndexError" in result.message, result.message
    assert "(in slots_of, line" in result.message and "called with positions=range(0, " in result.message


def test_a_missing_piece_is_named():
    class NoBase:
        pass

    result = verdict(ch02.check_allocator, NoBase)
    assert result.status == FAIL and "AllocatorBase as its base class" in result.message
    result = verdict(ch02.check_engine, MyAllocator, object)
    assert result.status == FAIL and "num_new_blocks (on the table)" in result.message


def test_an_unfinished_allocator_is_not_implemented_yet():
    class Stub(AllocatorBase):
        def __init__(self, num_blocks, block_size):
            super().__init__(num_blocks, block_size)
            raise NotImplementedError("Task 2.1 is not implemented yet")

    for name in ("allocate", "allocate_many", "free", "free_sequence", "incref", "refcount", "num_free",
                 "_take_free_block", "_put_free_block"):  # fmt: skip
        setattr(Stub, name, None)
    assert verdict(ch02.check_allocator, Stub).status == TODO
    assert verdict(ch02.check_engine, Stub, MyBlockTable).status == TODO


def test_hidden_cases_pass_on_the_model_solution():
    import random

    from minipaged.checks.instructor import ch02 as side

    rng = random.Random(5)
    for check, hidden, answers in [(ch02.check_allocator, side._hidden_allocator, (MyAllocator,)),
                                   (ch02.check_engine, side._hidden_engine, (MyAllocator, MyBlockTable))]:  # fmt: skip
        cases = hidden(rng)
        want = check.transcript(cases, (BlockAllocator,) if check is ch02.check_allocator else
                                (BlockAllocator, BlockTable))  # fmt: skip
        assert check.verdict(cases, check.transcript(cases, answers), want, 0).status == PASS
        assert check.verdict(cases, check.transcript(cases, (NewestFirst, MyBlockTable)[: len(answers)]), want,
                             0).status == FAIL  # fmt: skip


def test_a_block_still_held_after_the_run_is_a_leak():
    """An abort after the last step is seen only in the pool after the run: the judge reads it there."""
    cases, want = _want("ch02.engine")
    got = json.loads(json.dumps(want))
    final = got["observations"][0]["final"]
    final["refcounts"][2], final["free"] = 1, [b for b in final["free"] if b != 2]
    result = ch02.check_engine.verdict(cases, got, want, len(cases))
    assert result.status == FAIL and "after the run" in result.message and "blocks [2] are still held" in result.message
    assert "release() must hand every block" in result.hint
