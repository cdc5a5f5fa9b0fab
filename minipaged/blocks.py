"""The paging core: a fixed pool of KV blocks, reference counts, and one block table per sequence.

The KV tensors themselves live in :mod:`minipaged.cache`; this module is pure
bookkeeping over block ids, so allocation never touches device memory.

Every state change is published as a :class:`~minipaged.events.BlockEvent`. Widgets and logs
subscribe to the allocator instead of polling its internals; :mod:`minipaged.events` says when
an event reaches them (once the operation that caused it is over).
"""

from __future__ import annotations

from collections import Counter, deque
from contextlib import nullcontext

import torch

from minipaged.block_math import ceil_div
from minipaged.events import EventBus
from minipaged.step_state import StepState
from minipaged.validation import check_fits_memory, check_instance, check_int

BOOKKEEPING_BYTES_PER_BLOCK = 64  # an upper bound of the allocator's Python bookkeeping per block


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than a request needs. A scheduler catches this to preempt or wait."""


class BlockError(ValueError):
    """A block id names a block that is not allocated (a double free, or an incref of a free block).

    A subclass of ``ValueError``: the id is in range, but its value is wrong for the
    pool's state, so code that catches bad values catches it too. An id outside the
    pool is an ``IndexError`` instead, like a position outside a sequence.
    """


class AllocatorBase(EventBus, StepState):
    """What every block allocator carries and no chapter builds: the pool's size, checked, and its events.

    :class:`BlockAllocator` (and exercise 02's allocator) subclass it and own the free blocks and
    the reference counts; a subclass provides :attr:`num_free`, from which :attr:`num_used` and
    :meth:`can_allocate` follow. The events (:meth:`subscribe`, :meth:`emit`, :meth:`hold_events`)
    are :class:`~minipaged.events.EventBus`'s. A failed engine step puts back the free queue and the
    refcounts (:class:`~minipaged.step_state.StepState`), under the names a subclass keeps them in.

    Args:
        num_blocks: blocks in the pool.
        block_size: token slots per block.
    """

    _step_containers = ("free_block_ids", "_refcounts")

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__()
        # Python ints in a deque plus a refcount list: ~50 bytes a block. Refuse a pool that could never fit.
        self.num_blocks, self.block_size = check_allocator_args(num_blocks, block_size, BOOKKEEPING_BYTES_PER_BLOCK)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether ``num_blocks`` blocks are free right now."""
        return check_int(num_blocks, "num_blocks") <= self.num_free


class BlockAllocator(AllocatorBase):
    """A pool of ``num_blocks`` blocks of ``block_size`` token slots, with reference counts.

    Free blocks wait in a deque: allocate pops from the left, a freed block
    joins on the right, so both are O(1) and no search ever happens.
    Reference counts exist from the start because a forked sequence shares
    its parent's blocks (chapter 06).

    This class owns the refcounts and the checks; the events are :class:`AllocatorBase`'s.
    Which free block comes next is two small hooks, :meth:`_take_free_block` and
    :meth:`_put_free_block` (and :attr:`num_free`): chapter 06's prefix cache overrides only those.

    Args:
        num_blocks: blocks in the pool.
        block_size: token slots per block.
    """

    _step_containers = ("_ever_allocated",)

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self.free_block_ids: deque[int] = deque(range(self.num_blocks))
        self._refcounts = [0] * self.num_blocks
        self._ever_allocated = bytearray(self.num_blocks)  # tells a double free from an id never handed out

    @property
    def num_free(self) -> int:
        return len(self.free_block_ids)

    def allocate(self, seq_id=None) -> int:
        """Take one free block for ``seq_id`` (refcount 1), or raise OutOfBlocks."""
        ### BEGIN SOLUTION (Exercise 02, Task 2.1)
        if not self.num_free:
            raise OutOfBlocks(f"no free block: all {self.num_blocks} blocks are in use")
        with self.hold_events():  # a subclass's events of taking the block (an eviction) come after it is held
            block_id = self._take_free_block(seq_id)
            self._refcounts[block_id] = 1
            self._ever_allocated[block_id] = 1
            self.emit("allocate", block_id, seq_id)
        return block_id
        ### END SOLUTION

    def _take_free_block(self, seq_id) -> int:
        """Pop the next free block (one is free: :meth:`allocate` checked). Chapter 06 overrides it.

        Args:
            seq_id: the sequence that takes it, for the events a subclass emits.
        """
        return self.free_block_ids.popleft()

    def _put_free_block(self, block_id: int) -> dict:
        """Queue a block whose refcount reached 0; returns extra info for its "free" event. Chapter 06 overrides it.

        Args:
            block_id: the block, just freed.
        """
        self.free_block_ids.append(block_id)
        return {}

    def allocate_many(self, num_blocks: int, seq_id=None) -> list[int]:
        """Take ``num_blocks`` free blocks for ``seq_id``, all or none (OutOfBlocks takes nothing)."""
        ### BEGIN SOLUTION (Exercise 02, Task 2.1)
        # Check first, so a request that cannot be met takes nothing (no half-grown sequence).
        n = check_int(num_blocks, "num_blocks")
        if n > self.num_free:
            raise OutOfBlocks(f"need {n} blocks but only {self.num_free} of {self.num_blocks} are free")
        with self.hold_events():
            return [self.allocate(seq_id) for _ in range(n)]
        ### END SOLUTION

    def _check_block_id(self, block_id, action: str) -> int:
        return check_block_id(block_id, action, self.num_blocks)

    def _check_allocated(self, block_id, action: str) -> int:
        """``block_id``, checked: an IndexError outside the pool, a BlockError naming ``action`` if it is free."""
        ### BEGIN SOLUTION (Exercise 02, Task 2.1)
        block_id = self._check_block_id(block_id, action)
        if self._refcounts[block_id] == 0:
            never = not self._ever_allocated[block_id]
            what = "never allocated" if never else "double free" if action == "free" else "not allocated"
            raise BlockError(f"cannot {action} block {block_id}: it is free ({what})")
        return block_id
        ### END SOLUTION

    def incref(self, block_id: int, seq_id=None) -> None:
        """One more holder of ``block_id`` (a forked sequence sharing it)."""
        ### BEGIN SOLUTION (Exercise 02, Task 2.1)
        block_id = self._check_allocated(block_id, "incref")
        self._refcounts[block_id] += 1
        self.emit("incref", block_id, seq_id, refcount=self._refcounts[block_id])
        ### END SOLUTION

    def free(self, block_id: int, seq_id=None) -> None:
        """Drop one reference; the block returns to the pool when nobody holds it."""
        ### BEGIN SOLUTION (Exercise 02, Task 2.1)
        block_id = self._check_allocated(block_id, "free")
        self._refcounts[block_id] -= 1
        if self._refcounts[block_id] == 0:
            self.emit("free", block_id, seq_id, **self._put_free_block(block_id))
        else:
            self.emit("decref", block_id, seq_id, refcount=self._refcounts[block_id])
        ### END SOLUTION

    def free_sequence(self, block_ids: list[int], seq_id=None) -> None:
        """Drop one reference on each of a sequence's blocks, in table order.

        Args:
            block_ids: the sequence's blocks, logical block 0 first.
            seq_id: the sequence, for the events.

        Chapter 06's prefix cache overrides the order (tail first); here the order is not
        observable beyond the free queue.

        Raises (before any block is freed, so an error frees nothing):
            TypeError: ``block_ids`` is not a list or tuple of ints.
            IndexError: an id outside the pool.
            BlockError: an id that is free, or that appears more often than it has references.
        """
        ### BEGIN SOLUTION (Exercise 02, Task 2.1)
        block_ids = self._check_free_sequence(block_ids)
        with self.hold_events():
            for block_id in block_ids:
                self.free(block_id, seq_id)
        ### END SOLUTION

    def _check_free_sequence(self, block_ids) -> list[int]:
        """``block_ids`` as ints, once every one is known to be freeable as often as it appears."""
        ### BEGIN SOLUTION (Exercise 02, Task 2.1)
        check_instance(block_ids, "block_ids", (list, tuple), "a list of block ids")
        ids = [self._check_allocated(b, "free") for b in block_ids]
        for block_id, times in Counter(ids).items():
            if times > self._refcounts[block_id]:
                raise BlockError(f"cannot free block {block_id} {times} times: it has {self._refcounts[block_id]} "
                                 "reference(s) (block_ids holds it more than once)")
        return ids
        ### END SOLUTION

    def refcount(self, block_id: int) -> int:
        """How many sequences hold ``block_id`` (0: it is free)."""
        ### BEGIN SOLUTION (Exercise 02, Task 2.1)
        return self._refcounts[self._check_block_id(block_id, "read the refcount of")]
        ### END SOLUTION

    @property
    def refcounts(self) -> list[int]:
        return list(self._refcounts)

    def __repr__(self) -> str:
        return f"BlockAllocator(num_blocks={self.num_blocks}, block_size={self.block_size}, free={self.num_free})"


class BlockTable(StepState):
    """One sequence's map from logical block i (tokens i*B .. i*B+B-1) to a physical block id.

    Copy-on-write lives here, in :meth:`append_tokens`, next to :meth:`fork`: the table is
    what shares blocks (fork increfs them) and the table is what writes into its last
    block, so it alone knows when a write would land in a block someone else holds. Putting
    it anywhere else would leave chapter 02's ``fork`` able to corrupt its parent. The
    table records each copy in :attr:`pending_copies` and never touches K/V itself: the
    block manager stays bookkeeping only, and whoever runs the forward pass copies the K/V
    (:meth:`minipaged.cache.PagedKVCache.copy_blocks`) before the new tokens are written.

    Args:
        allocator: the :class:`AllocatorBase` (a :class:`BlockAllocator`, say) whose pool the table's blocks
            come from.
        seq_id: the sequence, for the events.
    """

    # What a failed engine step puts back (a table of the learner's own keeps these names: see minipaged.rollback).
    _step_containers = ("blocks", "pending_copies")

    def __init__(self, allocator: AllocatorBase, seq_id=None):
        if not isinstance(allocator, AllocatorBase):
            raise TypeError(f"allocator must be an AllocatorBase, got {type(allocator).__name__} {allocator!r:.60}")
        self.allocator = allocator
        self.seq_id = seq_id
        self.blocks: list[int] = []
        self.num_tokens = 0
        # (src, dst) block copies that copy-on-write asked for and nobody has carried out yet
        self.pending_copies: list[tuple[int, int]] = []
        self.released = False

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    def _shares_last_block(self, num_tokens: int) -> bool:
        """Whether appending ``num_tokens`` writes into a partly filled last block that another table holds too.

        Then the append first gives this table its own copy (:meth:`_copy_on_write`, chapter 06). An unshared
        block is written in place, and a full one is never written again: the next token starts a new block.
        """
        return (num_tokens > 0 and self.num_tokens % self.block_size != 0
                and self.allocator.refcount(self.blocks[-1]) > 1)

    def num_new_blocks(self, num_tokens: int) -> int:
        """New blocks that appending ``num_tokens`` tokens would take.

        One per block boundary crossed, plus one when the write lands in a shared,
        partly filled last block (copy-on-write gives this table its own copy).
        Not chapter 01's :func:`~minipaged.block_math.blocks_needed` (``ceil(n / B)``).

        Args:
            num_tokens: the tokens the append would add.
        """
        return self._num_new_blocks(check_int(num_tokens, "num_tokens"))

    def _num_new_blocks(self, n: int) -> int:  # n checked: called for every sequence at every step
        ### BEGIN SOLUTION (Exercise 02, Task 2.2)
        return max(0, ceil_div(self.num_tokens + n, self.block_size) - len(self.blocks)) + self._shares_last_block(n)
        ### END SOLUTION

    def append_tokens(self, num_tokens: int) -> torch.Tensor:
        """Make room for ``num_tokens`` more tokens; return their slots (int64) for the cache write.

        All or nothing: if the pool is short, OutOfBlocks is raised and the table is
        unchanged. A write into a shared last block first gets a copy of it (chapter 06).
        """
        ### BEGIN SOLUTION (Exercise 02, Task 2.2)
        n = check_int(num_tokens, "num_tokens")
        need = self._num_new_blocks(n)
        if need > self.allocator.num_free:
            raise OutOfBlocks(f"appending {n} tokens needs {need} blocks but only "
                              f"{self.allocator.num_free} of {self.allocator.num_blocks} are free")
        with self.allocator.hold_events() if need else nullcontext():  # new blocks are heard of once held
            if need and self._shares_last_block(n):
                self._copy_on_write()
            if need:
                self.blocks += _taken(self.allocator.allocate_many(k := self._num_new_blocks(n), self.seq_id), k)
            start = self.num_tokens
            self.num_tokens += n
            self.released = False
        return self._slots(range(start, start + n))
        ### END SOLUTION

    def _copy_on_write(self) -> None:
        """Swap the shared last block for a fresh one and record the copy ``(old, new)``.

        :meth:`append_tokens` calls it when :meth:`_shares_last_block` says so, once it knows the pool has
        room, before it takes the new tokens' blocks. The old block keeps its other holders (this table drops
        one reference); the K/V copy itself is the caller's (see :attr:`pending_copies`). Emits
        ``"cow"`` (block id: the new block; info ``src``, ``dst`` and ``num_slots``, the tokens the copy
        carries) with the allocator's events, all heard once the table holds its own block.
        """
        ### BEGIN SOLUTION (Exercise 06, Task 6.5)
        with self.allocator.hold_events():
            src, dst = self.blocks[-1], self.allocator.allocate(self.seq_id)
            self.blocks[-1] = dst
            self.allocator.free(src, self.seq_id)  # refcount was > 1: the other holders keep it
            self.pending_copies.append((src, dst))
            self.allocator.emit("cow", dst, self.seq_id, src=src, dst=dst, num_slots=self.num_tokens % self.block_size)
        ### END SOLUTION

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) block copies recorded since the last call, oldest first; clears them."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def _slots(self, positions: range) -> torch.Tensor:
        """The slots (int64) of the tokens at ``positions``, each in the block the table maps it to."""
        ### BEGIN SOLUTION (Exercise 02, Task 2.2)
        # A Python loop plus one tensor: decode appends one token, where a chain of tensor ops costs more.
        B, blocks = self.block_size, self.blocks
        return torch.tensor([blocks[p // B] * B + p % B for p in positions], dtype=torch.int64)
        ### END SOLUTION

    def slot(self, position: int) -> int:
        """The slot of the token at ``position`` (0-based) in this sequence."""
        position = check_int(position, "position", minimum=None)
        if not 0 <= position < self.num_tokens:
            raise IndexError(f"position {position} is outside this sequence's {self.num_tokens} tokens")
        return int(self._slots(range(position, position + 1))[0])

    def slots(self) -> torch.Tensor:
        """Slots of every token, in order: where a contiguous read gathers from."""
        return self._slots(range(self.num_tokens))

    @property
    def tail_waste(self) -> int:
        """Reserved but unused slots in the last block: tail waste, paging's only internal fragmentation."""
        return len(self.blocks) * self.block_size - self.num_tokens

    def release(self) -> None:
        """Give every block back (a decref each); the table becomes empty and reusable.

        Pending copies are dropped too: their destination blocks went back with the rest.
        """
        ### BEGIN SOLUTION (Exercise 02, Task 2.2)
        with self.allocator.hold_events():  # subscribers hear of the frees once the table is empty
            blocks, self.blocks = self.blocks, []
            self.num_tokens = 0
            self.pending_copies = []
            self.released = True
            self.allocator.free_sequence(blocks, self.seq_id)
        ### END SOLUTION

    def fork(self, seq_id=None) -> BlockTable:
        """A new table that shares all of this one's blocks (each gets one more reference).

        Neither table copies anything now: the first one to write into the shared, partly
        filled last block gets its own copy then (see :meth:`append_tokens`).

        Args:
            seq_id: the child's sequence id.

        Raises (before any reference is taken):
            ValueError: this table was released (it holds nothing to share any more).
            BlockError: one of its blocks was freed behind its back (through the allocator).
        """
        if self.released:
            raise ValueError(f"cannot fork the block table of sequence {self.seq_id!r}: it was released")
        for block_id in self.blocks:  # all checked before any incref: a block freed behind the table's back leaks none
            if self.allocator.refcount(block_id) == 0:
                raise BlockError(f"cannot fork sequence {self.seq_id!r}'s table: its block {block_id} is free")
        child = type(self)(self.allocator, seq_id)  # a subclass (a learner's table) forks into its own kind
        with self.allocator.hold_events():  # subscribers hear of the increfs once the child holds the blocks
            for block_id in self.blocks:
                self.allocator.incref(block_id, seq_id)
            child.blocks = list(self.blocks)
            child.num_tokens = self.num_tokens
            self.allocator.emit("fork", None, seq_id, parent=self.seq_id, num_blocks=len(self.blocks))
        return child

    def __repr__(self) -> str:
        return f"BlockTable(seq_id={self.seq_id!r}, num_tokens={self.num_tokens}, blocks={self.blocks})"


def _taken(block_ids, num_blocks: int) -> list[int]:
    """``block_ids``, what the allocator's ``allocate_many(num_blocks)`` returned, if it is that many ids."""
    if not isinstance(block_ids, list) or len(block_ids) != num_blocks or not all(type(b) is int for b in block_ids):
        raise TypeError(f"allocator.allocate_many({num_blocks}) returned {block_ids!r:.60}: expected a list of "
                        f"{num_blocks} block ids (ints)")  # fmt: skip
    return block_ids


def block_tables_tensor(tables: list[BlockTable]) -> torch.Tensor:
    """Stack tables into the kernel's ``int32 [num_seqs, max_blocks_per_seq]``, padded with 0.

    Args:
        tables: the sequences' tables; ``max_blocks_per_seq`` is the longest one's length.
    """
    width = max((t.num_blocks for t in tables), default=0)
    # One tensor from padded lists: the engine calls this every step, and a small tensor
    # op per row cost more than the rows' contents.
    rows = [table.blocks + [0] * (width - len(table.blocks)) for table in tables]
    return torch.tensor(rows, dtype=torch.int32).view(len(tables), width)


def check_block_id(block_id, action: str, num_blocks: int) -> int:
    """``block_id`` as an int in ``[0, num_blocks)``, or an error that says which ``action`` it was for.

    Args:
        block_id: the block id.
        action: what the caller was about to do, for the message (``"free"``, ``"read the refcount of"``).
        num_blocks: the pool's size.

    Raises:
        TypeError: ``block_id`` is not an int.
        IndexError: it lies outside the pool.
    """
    block_id = check_int(block_id, "block_id", minimum=None)
    if not 0 <= block_id < num_blocks:
        raise IndexError(f"cannot {action} block {block_id}: block_id runs from 0 to {num_blocks - 1}")
    return block_id


def check_allocator_args(num_blocks, block_size, bytes_per_block: int) -> tuple[int, int]:
    """A block allocator's pool size as ints ``(num_blocks, block_size)``, checked, and its bookkeeping fits memory.

    Args:
        num_blocks, block_size: the pool, each an int >= 1.
        bytes_per_block: an upper bound of the allocator's bookkeeping per block, in bytes.
    """
    num_blocks = check_int(num_blocks, "num_blocks", minimum=1)
    block_size = check_int(block_size, "block_size", minimum=1)
    check_fits_memory(num_blocks * bytes_per_block, f"BlockAllocator(num_blocks={num_blocks})")
    return num_blocks, block_size
