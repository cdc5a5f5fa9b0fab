"""The paging core: a fixed pool of KV blocks, reference counts, and one block table per sequence.

The KV tensors themselves live in :mod:`minipaged.cache`; this module is pure
bookkeeping over block ids, so allocation never touches device memory.

Every state change is published as a :class:`BlockEvent`. Widgets, metrics
and higher layers (the scheduler, prefix sharing) subscribe to the allocator
instead of polling its internals.
"""

from __future__ import annotations

import operator
from collections import deque
from dataclasses import dataclass, field

import torch


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than a request needs. A scheduler catches this to preempt or wait."""


class BlockError(ValueError):
    """A block id is out of range or not allocated (for example a double free)."""


@dataclass(frozen=True)
class BlockEvent:
    # "allocate", "free" (back in the pool), "incref", "decref", "fork", "cow", "preempt", ...
    kind: str
    block_id: int | None = None
    seq_id: object = None
    info: dict = field(default_factory=dict)


def _count(n, name: str) -> int:
    """``n`` as a non-negative int, or a TypeError/ValueError that names the argument."""
    try:
        n = operator.index(n)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(n).__name__}") from None
    if n < 0:
        raise ValueError(f"{name} must be >= 0, got {n}")
    return n


class BlockAllocator:
    """A pool of ``num_blocks`` blocks of ``block_size`` token slots, with reference counts.

    Free blocks wait in a deque: allocate pops from the left, a freed block
    joins on the right, so both are O(1) and no search ever happens.
    Reference counts exist from the start because a forked sequence shares
    its parent's blocks (chapter 06).
    """

    def __init__(self, num_blocks: int, block_size: int):
        num_blocks, block_size = _count(num_blocks, "num_blocks"), _count(block_size, "block_size")
        if num_blocks == 0 or block_size == 0:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self._refcounts = [0] * num_blocks
        self._subscribers: list = []

    @property
    def num_free(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    def can_allocate(self, n: int) -> bool:
        return _count(n, "n") <= len(self.free_block_ids)

    def allocate(self, seq_id=None) -> int:
        if not self.free_block_ids:
            raise OutOfBlocks(f"no free block: all {self.num_blocks} blocks are in use")
        block_id = self.free_block_ids.popleft()
        self._refcounts[block_id] = 1
        self.emit("allocate", block_id, seq_id)
        return block_id

    def allocate_many(self, n: int, seq_id=None) -> list[int]:
        # Check first, so a request that cannot be met takes nothing (no half-grown sequence).
        n = _count(n, "n")
        if n > len(self.free_block_ids):
            raise OutOfBlocks(f"need {n} blocks but only {len(self.free_block_ids)} of {self.num_blocks} are free")
        return [self.allocate(seq_id) for _ in range(n)]

    def _check_allocated(self, block_id, action: str) -> int:
        try:
            block_id = operator.index(block_id)
        except TypeError:
            raise TypeError(f"block_id must be an int, got {type(block_id).__name__}") from None
        if not 0 <= block_id < self.num_blocks:
            raise BlockError(f"cannot {action} block {block_id}: ids run from 0 to {self.num_blocks - 1}")
        if self._refcounts[block_id] == 0:
            what = "double free" if action == "free" else "not allocated"
            raise BlockError(f"cannot {action} block {block_id}: it is free ({what})")
        return block_id

    def incref(self, block_id: int, seq_id=None) -> None:
        """One more holder of ``block_id`` (a forked sequence sharing it)."""
        block_id = self._check_allocated(block_id, "incref")
        self._refcounts[block_id] += 1
        self.emit("incref", block_id, seq_id, refcount=self._refcounts[block_id])

    def free(self, block_id: int, seq_id=None) -> None:
        """Drop one reference; the block returns to the pool when nobody holds it."""
        block_id = self._check_allocated(block_id, "free")
        self._refcounts[block_id] -= 1
        if self._refcounts[block_id] == 0:
            self.free_block_ids.append(block_id)
            self.emit("free", block_id, seq_id)
        else:
            self.emit("decref", block_id, seq_id, refcount=self._refcounts[block_id])

    def refcount(self, block_id: int) -> int:
        block_id = operator.index(block_id)
        if not 0 <= block_id < self.num_blocks:
            raise BlockError(f"block {block_id} is out of range: ids run from 0 to {self.num_blocks - 1}")
        return self._refcounts[block_id]

    @property
    def refcounts(self) -> list[int]:
        return list(self._refcounts)

    def subscribe(self, callback):
        """Call ``callback(event)`` on every event; returns a function that unsubscribes."""
        self._subscribers.append(callback)

        def unsubscribe():
            if callback in self._subscribers:
                self._subscribers.remove(callback)

        return unsubscribe

    def emit(self, kind: str, block_id: int | None = None, seq_id=None, **info) -> None:
        """Publish an event; higher layers use this for their own kinds ("preempt", "cow")."""
        event = BlockEvent(kind, block_id, seq_id, info)
        for callback in list(self._subscribers):  # a callback may unsubscribe itself
            callback(event)

    def __repr__(self) -> str:
        return f"BlockAllocator(num_blocks={self.num_blocks}, block_size={self.block_size}, free={self.num_free})"


class BlockTable:
    """One sequence's map from logical block i (tokens i*B .. i*B+B-1) to a physical block id."""

    def __init__(self, allocator: BlockAllocator, seq_id=None):
        self.allocator = allocator
        self.seq_id = seq_id
        self.blocks: list[int] = []
        self.num_tokens = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    def blocks_needed(self, num_new_tokens: int) -> int:
        """New blocks that appending ``num_new_tokens`` would take: only at a block boundary."""
        total = self.num_tokens + _count(num_new_tokens, "num_new_tokens")
        return max(0, -(-total // self.block_size) - len(self.blocks))

    def append_tokens(self, n: int) -> torch.Tensor:
        """Make room for ``n`` more tokens; return their slots (int64) for the cache write.

        All or nothing: if the pool is short, OutOfBlocks is raised and the
        table is unchanged.
        """
        n = _count(n, "n")
        self.blocks += self.allocator.allocate_many(self.blocks_needed(n), self.seq_id)
        start = self.num_tokens
        self.num_tokens += n
        return self._slots(range(start, start + n))

    def _slots(self, positions: range) -> torch.Tensor:
        # A Python loop plus one tensor: decode appends one token, where a chain of tensor ops costs more.
        B, blocks = self.block_size, self.blocks
        return torch.tensor([blocks[p // B] * B + p % B for p in positions], dtype=torch.int64)

    def slot(self, position: int) -> int:
        position = operator.index(position)
        if not 0 <= position < self.num_tokens:
            raise IndexError(f"position {position} is outside this sequence's {self.num_tokens} tokens")
        return self.blocks[position // self.block_size] * self.block_size + position % self.block_size

    def slots(self) -> torch.Tensor:
        """Slots of every token, in order: where a contiguous read gathers from."""
        return self._slots(range(self.num_tokens))

    @property
    def tail_waste(self) -> int:
        """Reserved but unused slots in the last block: the only internal waste paging leaves."""
        return len(self.blocks) * self.block_size - self.num_tokens

    def as_tensor(self, width: int | None = None) -> torch.Tensor:
        width = len(self.blocks) if width is None else _count(width, "width")
        if width < len(self.blocks):
            raise ValueError(f"width {width} is smaller than this table's {len(self.blocks)} blocks")
        row = torch.zeros(width, dtype=torch.int32)  # padding is never read by the kernel
        row[: len(self.blocks)] = torch.tensor(self.blocks, dtype=torch.int32)
        return row

    def release(self) -> None:
        """Give every block back (a decref each); the table becomes empty and reusable."""
        for block_id in self.blocks:
            self.allocator.free(block_id, self.seq_id)
        self.blocks = []
        self.num_tokens = 0

    def fork(self, seq_id=None) -> BlockTable:
        """A new table that shares all of this one's blocks (each gets one more reference)."""
        child = BlockTable(self.allocator, seq_id)
        for block_id in self.blocks:
            self.allocator.incref(block_id, seq_id)
        child.blocks = list(self.blocks)
        child.num_tokens = self.num_tokens
        self.allocator.emit("fork", None, seq_id, parent=self.seq_id, num_blocks=len(self.blocks))
        return child

    def __repr__(self) -> str:
        return f"BlockTable(seq_id={self.seq_id!r}, num_tokens={self.num_tokens}, blocks={self.blocks})"


def block_tables_tensor(tables: list[BlockTable], width: int | None = None) -> torch.Tensor:
    """Stack tables into the kernel's ``int32 [num_seqs, max_blocks_per_seq]``, padded with 0."""
    longest = max((t.num_blocks for t in tables), default=0)
    width = longest if width is None else _count(width, "width")
    if width < longest:
        raise ValueError(f"width {width} is smaller than the longest table ({longest} blocks)")
    out = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, table in enumerate(tables):
        out[i] = table.as_tensor(width)
    return out
