"""What the engine records at every step: queue lengths, the cache's memory use, preemptions.

Per step, :class:`Metrics` keeps a ``history`` of :class:`StepRecord` (queue
lengths, the cache's memory use, preemptions): every step, or only the latest
``window`` of them (a long-running engine's memory stays bounded), with running
totals (``num_steps``, ``num_finished``, ``num_preemptions``) that count every step. It learns about
preemptions, swaps and copies from the step's allocator events, not by polling; the blocks in use
it reads from the allocator itself (``allocator.num_used``: one count, kept by its owner). Memory
use is two fractions of the pool, never to be confused with chapter 01's
utilisation U (tokens / *allocated* slots):

* **KV usage** = blocks in use / blocks in the pool (vLLM's ``kv_cache_usage_perc``);
* **token occupancy** = tokens held / token slots in the pool. The gap
  between the two is the tail waste of the sequences' last blocks.

Per-request latencies and a run's summary are :mod:`minipaged.latency`'s; :mod:`minipaged.viz.serving`
draws both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minipaged.block_math import kv_usage, token_occupancy
from minipaged.sequence import Sequence
from minipaged.step_state import StepState
from minipaged.validation import check_int

HISTORY_WINDOW = 1024  # step records an engine keeps by default (EngineConfig(keep_finished=True): all)


@dataclass(frozen=True)
class StepRecord:
    step: int
    time: float  # clock time at the end of the step
    num_running: int
    num_waiting: int
    num_batched_tokens: int
    num_prefill_tokens: int  # tokens of sequences still in prefill (their chunk is not a single decode token)
    kv_used_blocks: int
    kv_usage: float  # blocks in use / blocks in the pool
    token_occupancy: float  # tokens the running sequences hold / token slots in the pool
    tail_waste: int  # reserved but unfilled slots in the last block of each running sequence
    preemptions: int  # in this step
    finished: int  # in this step


@dataclass
class Metrics(StepState):
    """Step history plus counters fed by the step's allocator events (:meth:`count_events`).

    A record's blocks in use are the attached allocator's ``num_used`` (0 while none is attached).
    ``num_blocks`` and ``block_size`` are the pool's, the denominators of KV usage and token occupancy.
    ``window`` bounds the history to the latest ``window`` records (the oldest is dropped as a
    new one comes); None keeps every record. The counters always count every step.
    """

    _step_containers = ("history",)  # see minipaged.step_state

    num_blocks: int
    block_size: int
    window: int | None = None
    history: list[StepRecord] = field(default_factory=list)
    num_steps: int = 0  # steps recorded, including those the window dropped
    num_finished: int = 0  # sequences finished, over all steps
    num_preemptions: int = 0
    max_running: int = 0
    swapped_out_blocks: int = 0  # swap-mode preemption: blocks copied to CPU memory ...
    swapped_in_blocks: int = 0  # ... and back into the pool when the victim is readmitted
    num_cow: int = 0  # copy-on-write block copies (parallel sampling)
    _step_preemptions: int = 0
    _allocator: object = field(default=None, repr=False)  # attached; its prefix-cache counters, if any

    def __post_init__(self):
        if self.window is not None:
            self.window = check_int(self.window, "window", minimum=1)

    @property
    def prefix_cache(self):
        """A copy of the prefix cache's counters now (a :class:`~minipaged.prefix_cache.PrefixCacheStats`: requests,
        queried and hit tokens, new and preempted apart, evictions, collisions), or None when prefix caching is off."""
        stats = getattr(self._allocator, "stats", None)
        return stats() if stats else None

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit / queried tokens of new requests, preempted ones apart (0.0 before any query or with caching off)."""
        stats = self.prefix_cache
        return stats.hit_rate if stats else 0.0

    def attach(self, allocator) -> None:
        """Read ``allocator``'s blocks in use and its prefix-cache counters from now on."""
        self._allocator = allocator

    def count_events(self, events) -> None:
        """Count a step's preemptions, swaps and copies-on-write from its events (before :meth:`record_step`).

        Args:
            events: the step's :class:`~minipaged.events.BlockEvent` list, in order.
        """
        for event in events:
            if event.kind == "preempt":
                self.num_preemptions += 1
                self._step_preemptions += 1
                self.swapped_out_blocks += event.info.get("swapped_blocks", 0)
            elif event.kind == "swap_in":
                self.swapped_in_blocks += event.info["swapped_blocks"]
            elif event.kind == "cow":
                self.num_cow += 1

    def record_step(self, time: float, running: list[Sequence], num_waiting: int, num_new_tokens: list[int],
                    num_prefill_tokens: int, num_finished: int) -> StepRecord:
        """Append the record of the step that just ended (dropping the oldest beyond the window) and return it.

        Args:
            time: the clock at the end of the step.
            running: the running sequences after the step.
            num_waiting: how many sequences wait.
            num_new_tokens: the tokens each scheduled sequence computed in the step.
            num_prefill_tokens: how many of those belong to sequences still in prefill.
            num_finished: how many sequences finished in the step.
        """
        tables = [s.block_table for s in running if s.block_table is not None]
        used = self._allocator.num_used if self._allocator is not None else 0
        occupancy = token_occupancy(sum(t.num_tokens for t in tables), self.num_blocks * self.block_size)
        record = StepRecord(step=self.num_steps, time=time, num_running=len(running), num_waiting=num_waiting,
                            num_batched_tokens=sum(num_new_tokens), num_prefill_tokens=num_prefill_tokens,
                            kv_used_blocks=used, kv_usage=kv_usage(used, self.num_blocks), token_occupancy=occupancy,
                            tail_waste=sum(t.tail_waste for t in tables), preemptions=self._step_preemptions,
                            finished=num_finished)  # fmt: skip
        self._step_preemptions = 0
        self.max_running = max(self.max_running, len(running))
        self.num_steps += 1
        self.num_finished += num_finished
        self.history.append(record)
        if self.window is not None and len(self.history) > self.window:
            del self.history[0]  # a memmove of `window` pointers: cheap next to a step
        return record
