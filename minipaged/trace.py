"""Replay one workload against paged and contiguous KV allocation over the same pool size.

**The trace** is a workload of :mod:`minipaged.workload` (``make_workload``), whose
``arrival_time`` is in seconds, as everywhere in the package. The toy server takes
``step_time`` seconds per step (default 1.0): request i arrives at step
``floor(arrival_time / step_time)``, so with the default a ``make_workload`` rate of
r requests per second is r requests per step. Chapter 02 uses the
``tiny_geometric`` preset: prompts uniform on 16..128 tokens, outputs
geometric with mean 96 (every token ends the answer with probability 1/96),
at most 384, so no request is longer than 512 tokens.

**A step** (one decode iteration of a toy server), for each allocator:

1. every running sequence writes one token (``grow``); the ones that reach
   their output length finish and release their memory;
2. a sequence that cannot grow is *preempted*: its memory is released and it
   goes back to the front of the queue, to be re-admitted later with all its
   tokens (recomputation, as vLLM does);
3. new arrivals join the queue; the queue is admitted in order until the
   head does not fit (its prompt, written at once as prefill);
4. a request that has waited more than ``max_wait`` steps is *rejected*.

:class:`TraceSimulator` runs the three allocators of
:mod:`minipaged.contiguous` in lockstep, one :class:`PoolStats` each per
step. A sequence's ``seq_id`` is its index in the trace. The simulator is
steppable (``step()`` for a live view, with ``allocator`` and ``tables`` of
the paged pool exposed) and runnable to the end (``run()`` returns the
history).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from minipaged.accounting import slot_utilisation
from minipaged.blocks import BlockAllocator, BlockTable
from minipaged.contiguous import GrowInPlace, MaxReservation, PagedPool
from minipaged.validation import check_int, check_real
from minipaged.workload import RequestSpec


@dataclass(frozen=True)
class PoolStats:
    """One allocator's state after one step. Counters (relocations ... finished) are cumulative."""

    running: int
    waiting: int
    tokens: int  # KV actually held
    reserved: int  # slots taken from the pool
    utilisation: float  # tokens / reserved
    unfilled_slots: int  # reserved - tokens: tail waste (paged), reservation waste (max_reservation), 0 (grow)
    external_fragmentation: float
    relocations: int
    slots_moved: int
    preempted: int
    rejected: int
    finished: int


@dataclass
class _Running:
    request: RequestSpec
    generated: int


class PoolRun:
    """One allocator running the trace: its queue, its running sequences and its counters.

    Args:
        pool: the allocator (one of :mod:`minipaged.contiguous`'s pools).
        trace: the requests; request i arrives at step ``floor(arrival_time / step_time)``.
        max_wait: steps a request may wait in the queue before it is rejected.
        step_time: seconds of the trace's clock per step.
    """

    def __init__(self, pool, trace: list[RequestSpec], max_wait: int, step_time: float):
        self.pool, self.max_wait = pool, max_wait
        # (arrival step, seq_id, request), in arrival order; a tie keeps the trace's order.
        self.arrivals = deque(sorted((math.floor(r.arrival_time / step_time), i, r) for i, r in enumerate(trace)))
        self.waiting: deque[tuple[int, RequestSpec, int, int]] = deque()  # (seq_id, request, generated, since)
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
                preempted.append((seq_id, seq.request, seq.generated, now))
                continue
            seq.generated += 1
            if seq.generated == seq.request.num_output_tokens:
                self.pool.release(seq_id)
                del self.running[seq_id]
                self.finished += 1
        self.preempted += len(preempted)
        self.waiting.extendleft(reversed(preempted))  # first preempted, first re-admitted
        while self.arrivals and self.arrivals[0][0] <= now:
            _, seq_id, request = self.arrivals.popleft()
            self.waiting.append((seq_id, request, 0, now))
        while self.waiting:
            seq_id, request, generated, _ = self.waiting[0]
            if not self.pool.admit(seq_id, request.num_prompt_tokens + generated):
                break
            self.waiting.popleft()
            self.running[seq_id] = _Running(request, generated)
        kept = deque(w for w in self.waiting if now - w[3] <= self.max_wait)
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
            utilisation=round(slot_utilisation(tokens, reserved), 4),
            unfilled_slots=reserved - tokens,
            external_fragmentation=round(pool.external_fragmentation, 4),
            relocations=pool.relocations,
            slots_moved=pool.slots_moved,
            preempted=self.preempted,
            rejected=self.rejected,
            finished=self.finished,
        )


def _mean(rows: list[PoolStats], field: str, digits: int) -> float:
    return round(sum(getattr(r, field) for r in rows) / len(rows), digits) if rows else 0.0


SYSTEMS = ("paged", "max_reservation", "grow_in_place")


class TraceSimulator:
    """The same trace against paged, max-reservation and grow-in-place allocation, step by step.

    ``history[t]`` maps each system name to its :class:`PoolStats` after step t.
    ``allocator`` and ``tables`` are the paged pool's, for the block-map widget.
    """

    def __init__(
        self,
        trace: list[RequestSpec],
        num_blocks: int = 256,
        block_size: int = 16,
        max_len: int = 512,
        max_wait: int = 50,
        systems: tuple[str, ...] = SYSTEMS,
        step_time: float = 1.0,
    ):
        """
        Args:
            trace: the requests, e.g. ``make_workload(200, rate, "tiny_geometric")``; arrival times in seconds.
            num_blocks: blocks in the paged pool; the contiguous arenas get ``num_blocks * block_size`` slots.
            block_size: slots per block.
            max_len: what max reservation reserves per request; no request may be longer.
            max_wait: steps a request may wait in the queue before it is rejected.
            systems: which allocators to run; "paged" is always one of them.
            step_time: seconds per toy step (> 0): request i arrives at step ``floor(arrival_time / step_time)``.
                The default 1.0 makes a rate in requests per second a rate per step.
        """
        num_blocks = check_int(num_blocks, "num_blocks", minimum=1)
        block_size = check_int(block_size, "block_size", minimum=1)
        max_len = check_int(max_len, "max_len", minimum=1)
        max_wait = check_int(max_wait, "max_wait")
        step_time = check_real(step_time, "step_time", minimum=0, strict=True)
        unknown = set(systems) - set(SYSTEMS)
        if unknown or "paged" not in systems:
            raise ValueError(f"systems must include 'paged' and come from {SYSTEMS}, got {systems}")
        for i, r in enumerate(trace):
            if not isinstance(r, RequestSpec):
                raise TypeError(f"trace[{i}] must be a RequestSpec, got {type(r).__name__}")
        too_long = [i for i, r in enumerate(trace) if r.num_prompt_tokens + r.num_output_tokens > max_len]
        if too_long:
            raise ValueError(f"requests {too_long[:5]} of the trace are longer than max_len={max_len}")
        self.trace, self.num_blocks, self.block_size = trace, num_blocks, block_size
        self.max_len, self.max_wait, self.systems, self.step_time = max_len, max_wait, systems, step_time
        self.reset()

    def reset(self) -> None:
        num_slots = self.num_blocks * self.block_size
        make = {
            "paged": lambda: PagedPool(self.num_blocks, self.block_size),
            "max_reservation": lambda: MaxReservation(num_slots, self.max_len),
            "grow_in_place": lambda: GrowInPlace(num_slots),
        }
        self.runs = {name: PoolRun(make[name](), self.trace, self.max_wait, self.step_time) for name in self.systems}
        self.now = 0
        self.history: list[dict[str, PoolStats]] = []

    @property
    def allocator(self) -> BlockAllocator:
        return self.runs["paged"].pool.allocator

    @property
    def tables(self) -> dict[object, BlockTable]:
        return self.runs["paged"].pool.tables

    @property
    def done(self) -> bool:
        return all(r.done for r in self.runs.values())

    def step(self) -> bool:
        """Advance every system one step; False once the whole trace has been served."""
        if self.done:
            return False
        for run in self.runs.values():
            run.step(self.now)
        self.history.append({name: r.stats() for name, r in self.runs.items()})
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
                "mean utilisation": _mean(rows, "utilisation", 3),
                "mean running": _mean(rows, "running", 1),
                "mean ext. fragmentation": _mean(rows, "external_fragmentation", 3),
                "finished": last.finished if last else 0,
                "rejected": last.rejected if last else 0,
                "preempted": last.preempted if last else 0,
                "relocations": last.relocations if last else 0,
                "slots moved": last.slots_moved if last else 0,
                "last step": self.runs[name].done_at,
            }
        return out
