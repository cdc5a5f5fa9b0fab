"""The baselines paging is measured against, and the paged pool behind the same interface.

The two contiguous allocators keep each sequence's KV in one range of slots.
They manage an arena of ``num_slots`` token slots with first fit (the lowest
free range that is long enough):

- :class:`MaxReservation` reserves ``max_len`` slots at admission, so a
  sequence never has to move, but every slot past its current length is
  reservation waste.
- :class:`GrowInPlace` reserves exactly what a sequence holds and grows it by
  one slot at a time. When the slot after its end is taken, the sequence
  must relocate to a new range and copy its KV there; when no free range is
  long enough, the growth fails even if enough slots are free in total.
  That gap between "free" and "usable" is external fragmentation.

:class:`PagedPool` puts the paged allocator of :mod:`minipaged.blocks`
behind the same interface, so the trace simulator (:mod:`minipaged.trace`)
replays one trace against all three: ``admit(seq_id, num_tokens)``,
``grow(seq_id)`` and ``release(seq_id)``, plus the counters below. A pool of
``num_blocks`` blocks of ``block_size`` slots compares with an arena of
``num_blocks * block_size`` slots.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from minipaged.blocks import BlockAllocator, BlockTable, OutOfBlocks
from minipaged.validation import check_int

_FREE_RUN = re.compile(b"\x00+")


@dataclass
class Extent:
    start: int
    reserved: int  # slots held, from start
    num_tokens: int  # slots holding KV (the rest of the reservation is reservation waste)


class SlotArena:
    """First-fit ranges over a row of slots; the counters are what the course compares."""

    name = "contiguous"

    def __init__(self, num_slots: int):
        self.capacity = check_int(num_slots, "num_slots", minimum=1)
        # One byte per slot (1 = taken): bytes.find then does the first-fit search at C speed.
        self.taken = bytearray(num_slots)
        self.extents: dict[object, Extent] = {}
        self.failed_admissions = 0
        self.relocations = 0
        self.slots_moved = 0

    def _first_fit(self, size: int) -> int:
        return self.taken.find(bytes(size))

    def _mark(self, start: int, size: int, value: int) -> None:
        self.taken[start : start + size] = bytes([value]) * size

    def _reserve(self, seq_id, num_tokens: int, size: int) -> bool:
        if seq_id in self.extents:
            raise ValueError(f"sequence {seq_id!r} is already admitted")
        start = self._first_fit(size)
        if start < 0:
            self.failed_admissions += 1
            return False
        self._mark(start, size, 1)
        self.extents[seq_id] = Extent(start, size, num_tokens)
        return True

    def release(self, seq_id) -> None:
        e = self.extents.pop(seq_id)
        self._mark(e.start, e.reserved, 0)

    @property
    def num_seqs(self) -> int:
        return len(self.extents)

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.extents.values())

    @property
    def reserved_slots(self) -> int:
        return sum(e.reserved for e in self.extents.values())

    @property
    def free_slots(self) -> int:
        return self.capacity - self.reserved_slots

    @property
    def largest_free_run(self) -> int:
        return max((m.end() - m.start() for m in _FREE_RUN.finditer(self.taken)), default=0)

    def unusable_free(self, size: int) -> float:
        """Share of the free slots lying in runs shorter than ``size``: useless to a request of that size."""
        free = self.free_slots
        short = sum(m.end() - m.start() for m in _FREE_RUN.finditer(self.taken) if m.end() - m.start() < size)
        return short / free if free else 0.0

    @property
    def external_fragmentation(self) -> float:
        """1 - largest free run / free slots: the share of free space that one range cannot use."""
        free = self.free_slots
        return 1 - self.largest_free_run / free if free else 0.0


class MaxReservation(SlotArena):
    """Reserve ``max_len`` slots per sequence up front: no moves, maximal reservation waste."""

    name = "max_reservation"

    def __init__(self, num_slots: int, max_len: int):
        super().__init__(num_slots)
        max_len = check_int(max_len, "max_len", minimum=1)
        if max_len > num_slots:
            raise ValueError(f"max_len must be in 1..{num_slots} (the arena), got {max_len}")
        self.max_len = max_len

    @property
    def external_fragmentation(self) -> float:
        # Every request here has the same size, so "unusable" is exact: free runs shorter than max_len.
        return self.unusable_free(self.max_len)

    def admit(self, seq_id, num_tokens: int) -> bool:
        if check_int(num_tokens, "num_tokens") > self.max_len:
            raise ValueError(f"num_tokens {num_tokens} exceeds max_len {self.max_len}")
        return self._reserve(seq_id, num_tokens, self.max_len)

    def grow(self, seq_id) -> bool:
        e = self.extents[seq_id]
        if e.num_tokens == self.max_len:
            raise ValueError(f"sequence {seq_id!r} already holds max_len={self.max_len} tokens")
        e.num_tokens += 1
        return True


class GrowInPlace(SlotArena):
    """Hold exactly the tokens written; grow into the next slot, or relocate and copy when it is taken."""

    name = "grow_in_place"

    def admit(self, seq_id, num_tokens: int) -> bool:
        num_tokens = check_int(num_tokens, "num_tokens", minimum=1)
        return self._reserve(seq_id, num_tokens, num_tokens)

    def grow(self, seq_id) -> bool:
        e = self.extents[seq_id]
        end = e.start + e.reserved
        if end < self.capacity and not self.taken[end]:
            self.taken[end] = 1
            e.reserved += 1
            e.num_tokens += 1
            return True
        # Like realloc: the old range is free during the search, so the new one may overlap it (a memmove).
        self._mark(e.start, e.reserved, 0)
        start = self._first_fit(e.reserved + 1)
        if start < 0:
            self._mark(e.start, e.reserved, 1)
            return False
        self.relocations += 1
        self.slots_moved += e.num_tokens
        e.start, e.reserved, e.num_tokens = start, e.reserved + 1, e.num_tokens + 1
        self._mark(start, e.reserved, 1)
        return True


class PagedPool:
    """The paged allocator behind the same interface as the contiguous baselines."""

    name = "paged"

    def __init__(self, num_blocks: int, block_size: int):
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.capacity = self.allocator.num_blocks * self.allocator.block_size
        self.tables: dict[object, BlockTable] = {}
        self.failed_admissions = 0
        self.relocations = 0  # blocks never move: these stay 0, kept for a uniform report
        self.slots_moved = 0

    def admit(self, seq_id, num_tokens: int) -> bool:
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} is already admitted")
        table = BlockTable(self.allocator, seq_id)
        if not self.allocator.can_allocate(table.num_new_blocks(num_tokens)):
            self.failed_admissions += 1
            return False
        table.append_tokens(num_tokens)
        self.tables[seq_id] = table
        return True

    def grow(self, seq_id) -> bool:
        try:
            self.tables[seq_id].append_tokens(1)
        except OutOfBlocks:
            return False
        return True

    def release(self, seq_id) -> None:
        self.tables.pop(seq_id).release()

    @property
    def num_seqs(self) -> int:
        return len(self.tables)

    @property
    def num_tokens(self) -> int:
        return sum(t.num_tokens for t in self.tables.values())

    @property
    def reserved_slots(self) -> int:
        return self.allocator.num_used * self.allocator.block_size

    @property
    def external_fragmentation(self) -> float:
        return 0.0  # any free block can serve any request: nothing free is unusable
