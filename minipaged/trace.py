"""Replay one request trace against paged and contiguous KV allocation over the same pool size.

**The trace** (:func:`make_trace`, seeded): arrivals are a Poisson process
(exponential gaps, ``rate`` requests per step); prompt lengths are uniform on
``[prompt_min, prompt_max]``; output lengths are geometric with mean
``output_mean`` (each step a sequence stops with probability
``1/output_mean``), cut so that prompt + output <= ``max_len``.

**A step** (one decode iteration of a toy server), for each allocator:

1. every running sequence writes one token (``grow``); the ones that reach
   their output length finish and release their memory;
2. a sequence that cannot grow is *preempted*: its memory is released and it
   goes back to the front of the queue, to be re-admitted later with all its
   tokens (recomputation, as vLLM does);
3. new arrivals join the queue; the queue is admitted in order until the
   head does not fit (its prompt, written at once as prefill);
4. a request that has waited more than ``max_wait`` steps is *rejected*.

:class:`TraceSimulator` runs the three allocators in lockstep, one
:class:`PoolStats` each per step. It is steppable (``step()`` for a live view,
with ``allocator`` and ``tables`` of the paged pool exposed) and runnable to
the end (``run()`` returns the history).
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass

from minipaged.block_manager import BlockAllocator, BlockTable, OutOfBlocks
from minipaged.contiguous import GrowInPlace, MaxReservation


@dataclass(frozen=True)
class Request:
    req_id: int
    arrival: int  # step
    prompt_len: int
    output_len: int


def make_trace(
    num_requests: int = 200,
    rate: float = 0.3,
    prompt_min: int = 16,
    prompt_max: int = 128,
    output_mean: float = 96,
    max_len: int = 512,
    seed: int = 0,
) -> list[Request]:
    if not 1 <= prompt_min <= prompt_max < max_len:
        raise ValueError(f"need 1 <= prompt_min <= prompt_max < max_len, got {prompt_min}, {prompt_max}, {max_len}")
    if rate <= 0 or output_mean < 1:
        raise ValueError(f"need rate > 0 and output_mean >= 1, got {rate}, {output_mean}")
    rng = random.Random(seed)
    t, trace = 0.0, []
    for i in range(num_requests):
        prompt = rng.randint(prompt_min, prompt_max)
        # Geometric on 1, 2, ...: the inverse CDF of a uniform draw.
        p = 1 / output_mean
        output = 1 if p >= 1 else 1 + int(math.log(1 - rng.random()) / math.log(1 - p))
        trace.append(Request(i, int(t), prompt, min(output, max_len - prompt)))
        t += rng.expovariate(rate)
    return trace


class PagedPool:
    """The paged allocator behind the same interface as the contiguous baselines."""

    name = "paged"

    def __init__(self, num_slots: int, block_size: int):
        self.allocator = BlockAllocator(num_slots // block_size, block_size)
        self.capacity = self.allocator.num_blocks * block_size
        self.tables: dict[object, BlockTable] = {}
        self.failed_admissions = 0
        self.relocations = 0  # blocks never move: these stay 0, kept for a uniform report
        self.slots_moved = 0

    def admit(self, seq_id, num_tokens: int) -> bool:
        table = BlockTable(self.allocator, seq_id)
        if not self.allocator.can_allocate(table.blocks_needed(num_tokens)):
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


@dataclass(frozen=True)
class PoolStats:
    """One allocator's state after one step. Counters (relocations ... finished) are cumulative."""

    running: int
    waiting: int
    tokens: int  # KV actually held
    reserved: int  # slots taken from the pool
    utilisation: float  # tokens / reserved
    internal_waste: int  # reserved - tokens (paged: the tail of each last block)
    external_fragmentation: float
    relocations: int
    slots_moved: int
    preempted: int
    rejected: int
    finished: int


@dataclass
class _Running:
    request: Request
    generated: int


class Replay:
    """One allocator replaying the trace: its queue, its running sequences and its counters."""

    def __init__(self, pool, trace: list[Request], max_wait: int):
        self.pool, self.max_wait = pool, max_wait
        self.arrivals = deque(sorted(trace, key=lambda r: (r.arrival, r.req_id)))
        self.waiting: deque[tuple[Request, int, int]] = deque()  # (request, tokens generated, queued since)
        self.running: dict[int, _Running] = {}
        self.preempted = self.rejected = self.finished = 0
        self.done_at: int | None = None  # the step that served the last request

    @property
    def done(self) -> bool:
        return not (self.arrivals or self.waiting or self.running)

    def step(self, now: int) -> None:
        preempted = []
        for seq_id, seq in list(self.running.items()):
            if not self.pool.grow(seq_id):
                self.pool.release(seq_id)
                del self.running[seq_id]
                preempted.append((seq.request, seq.generated, now))
                continue
            seq.generated += 1
            if seq.generated == seq.request.output_len:
                self.pool.release(seq_id)
                del self.running[seq_id]
                self.finished += 1
        self.preempted += len(preempted)
        self.waiting.extendleft(reversed(preempted))  # first preempted, first re-admitted
        while self.arrivals and self.arrivals[0].arrival <= now:
            self.waiting.append((self.arrivals.popleft(), 0, now))
        while self.waiting:
            request, generated, _ = self.waiting[0]
            if not self.pool.admit(request.req_id, request.prompt_len + generated):
                break
            self.waiting.popleft()
            self.running[request.req_id] = _Running(request, generated)
        kept = deque(w for w in self.waiting if now - w[2] <= self.max_wait)
        self.rejected += len(self.waiting) - len(kept)
        self.waiting = kept
        if self.done and self.done_at is None:
            self.done_at = now

    def stats(self) -> PoolStats:
        pool = self.pool
        tokens, reserved = pool.num_tokens, pool.reserved_slots
        return PoolStats(
            running=len(self.running),
            waiting=len(self.waiting),
            tokens=tokens,
            reserved=reserved,
            utilisation=round(tokens / reserved, 4) if reserved else 0.0,
            internal_waste=reserved - tokens,
            external_fragmentation=round(pool.external_fragmentation, 4),
            relocations=pool.relocations,
            slots_moved=pool.slots_moved,
            preempted=self.preempted,
            rejected=self.rejected,
            finished=self.finished,
        )


SYSTEMS = ("paged", "max_reservation", "grow_in_place")


class TraceSimulator:
    """The same trace against paged, max-reservation and grow-in-place allocation, step by step.

    ``history[t]`` maps each system name to its :class:`PoolStats` after step t.
    ``allocator`` and ``tables`` are the paged pool's, for the block-map widget.
    """

    def __init__(
        self,
        trace: list[Request],
        num_slots: int = 4096,
        block_size: int = 16,
        max_len: int = 512,
        max_wait: int = 50,
        systems: tuple[str, ...] = SYSTEMS,
    ):
        unknown = set(systems) - set(SYSTEMS)
        if unknown or "paged" not in systems:
            raise ValueError(f"systems must include 'paged' and come from {SYSTEMS}, got {systems}")
        too_long = [r.req_id for r in trace if r.prompt_len + r.output_len > max_len]
        if too_long:
            raise ValueError(f"requests {too_long[:5]} are longer than max_len={max_len}")
        self.trace, self.num_slots, self.block_size = trace, num_slots, block_size
        self.max_len, self.max_wait, self.systems = max_len, max_wait, systems
        self.reset()

    def reset(self) -> None:
        make = {
            "paged": lambda: PagedPool(self.num_slots, self.block_size),
            "max_reservation": lambda: MaxReservation(self.num_slots, self.max_len),
            "grow_in_place": lambda: GrowInPlace(self.num_slots),
        }
        self.replays = {name: Replay(make[name](), self.trace, self.max_wait) for name in self.systems}
        self.now = 0
        self.history: list[dict[str, PoolStats]] = []

    @property
    def allocator(self) -> BlockAllocator:
        return self.replays["paged"].pool.allocator

    @property
    def tables(self) -> dict[object, BlockTable]:
        return self.replays["paged"].pool.tables

    @property
    def done(self) -> bool:
        return all(r.done for r in self.replays.values())

    def step(self) -> bool:
        """Advance every system one step; False once the whole trace has been served."""
        if self.done:
            return False
        for replay in self.replays.values():
            replay.step(self.now)
        self.history.append({name: r.stats() for name, r in self.replays.items()})
        self.now += 1
        return not self.done

    def run(self, max_steps: int = 100_000) -> list[dict[str, PoolStats]]:
        for _ in range(max_steps):
            if not self.step():
                break
        return self.history

    def series(self, system: str, field: str) -> list:
        return [getattr(row[system], field) for row in self.history]

    def summary(self) -> dict[str, dict[str, float]]:
        """Per system: means over busy steps (any tokens held), and the final counters."""
        out = {}
        for name in self.systems:
            rows = [row[name] for row in self.history if row[name].reserved]
            last = self.history[-1][name] if self.history else None
            out[name] = {
                "mean utilisation": round(sum(r.utilisation for r in rows) / len(rows), 3) if rows else 0.0,
                "mean running": round(sum(r.running for r in rows) / len(rows), 1) if rows else 0.0,
                "mean ext. fragmentation": round(sum(r.external_fragmentation for r in rows) / len(rows), 3) if rows else 0.0,
                "finished": last.finished if last else 0,
                "rejected": last.rejected if last else 0,
                "preempted": last.preempted if last else 0,
                "relocations": last.relocations if last else 0,
                "slots moved": last.slots_moved if last else 0,
                "last step": self.replays[name].done_at,
            }
        return out
