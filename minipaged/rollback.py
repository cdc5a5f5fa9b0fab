"""All-or-nothing engine steps: what a step may change is saved before it, and put back if it raises.

:class:`StepUndo` asks each object a step may change to save its own state
(:class:`~minipaged.step_state.StepState`): the engine (its requests and swap space), the scheduler
(its queues), every sequence it holds and their block tables, the allocator (free queue,
refcounts, and the prefix cache's keys), the metrics and the clock. Each class names its state in
one line, so a step costs a copy of the bookkeeping it may touch and no walk over objects. The
K/V a step may overwrite in blocks that held K/V before it is the other half
(:meth:`StepUndo.protect_kv`). A test walks the whole object graph before and after a failed step
(``tests/test_05_faults.py``), so a field a class forgets to name cannot go unnoticed.
"""

from __future__ import annotations

import torch

from minipaged.blocks import BlockTable
from minipaged.step_state import StepState, restore_state, save_state


class StepUndo:
    """What :meth:`~minipaged.engine.Engine.step` changes, saved before it starts, so that a failed step can be undone.

    Used as ``with StepUndo(engine, events) as undo:`` around a step, inside the allocator's
    ``hold_events()``: inside it the engine is *in its step* (an abort waits for its end); if the
    block raises, :meth:`restore` runs and the exception propagates; either way the aborts asked
    for during the step then run.

    Args:
        engine: the engine about to step.
        events: the allocator's held events (what ``hold_events()`` yielded): a failed step's are dropped.
    """

    def __enter__(self) -> StepUndo:
        self.engine._in_step = True
        return self

    def __exit__(self, kind, exc, traceback) -> None:
        try:
            if exc is not None:
                self.restore()
        finally:
            self.engine._in_step = False
            self.engine._apply_deferred_aborts()

    def __init__(self, engine, events: list):
        self.engine, self.events, self.num_events_before = engine, events, len(events)
        seqs = engine.scheduler.sequences()
        owners = [engine, engine.scheduler, engine.cache.allocator, engine.metrics, engine.clock, *seqs]
        owners += [engine.speculator] if isinstance(engine.speculator, StepState) else []  # its counters
        self.saved = {id(obj): (obj, obj.save_state()) for obj in owners}
        for table in (s.block_table for s in seqs if s.block_table is not None):
            self.saved[id(table)] = (table, _table_state(table))
        self.saved_kv = None  # (block ids, each pool's K/V of them): blocks the step may overwrite that held K/V

    def protect_kv(self, out) -> None:
        """Save the K/V of blocks this step will write although they held K/V before it (a victim's, a cached one's).

        Writes into a sequence's own blocks land in slots it does not count as computed, which
        a rollback may leave as they are. A block that changed hands this step is different:
        after a rollback its old holder (or the prefix cache) counts on its K/V again.

        Args:
            out: the step's :class:`~minipaged.scheduler.SchedulerOutput`.
        """
        block_size, allocator = self.engine.config.block_size, self.engine.cache.allocator
        targets = set()
        for seq, slots in zip(out.seqs, out.slot_mappings):  # the blocks it writes, less those it held before
            targets |= {s // block_size for s in slots.tolist()} - set(self._attr_before(seq.block_table, "blocks", []))
        targets.update((dst for _, dst in out.copies), *(seq.block_table.blocks for seq in out.swap_in))
        refcounts = self._attr_before(allocator, "_refcounts", ())
        entries = self._attr_before(allocator, "entries", None)  # None: no prefix cache
        held = sorted(b for b in targets if refcounts[b] > 0 or (entries is not None and entries[b] is not None))
        if held:
            index = torch.tensor(held, device=self.engine.cache.device)
            self.saved_kv = index, [pool.index_select(0, index) for pool in self.engine.cache.pools()]

    def _attr_before(self, obj, name: str, default):
        """The contents of ``obj.name`` before the step (``default`` for an object or attribute the step made)."""
        if id(obj) not in self.saved:
            return default
        attrs, containers = self.saved[id(obj)][1]
        return containers[name][1] if name in containers else attrs.get(name, default)

    def restore(self) -> None:
        """Put the bookkeeping and the protected K/V back; the step's events give way to one ``"rollback"`` event."""
        if self.saved_kv is not None:
            index, saved = self.saved_kv
            for pool, blocks in zip(self.engine.cache.pools(), saved):
                pool.index_copy_(0, index, blocks)
        for obj, state in self.saved.values():
            if isinstance(obj, StepState):
                obj.restore_state(state)
            else:  # a table of the learner's own (see _table_state)
                restore_state(obj, state)
        del self.events[self.num_events_before :]
        self.engine.cache.allocator.emit("rollback")


def _table_state(table) -> tuple:
    """A table's state: its own pair, or, for a table of the learner's own (exercise 02), the seam's names it has."""
    if isinstance(table, StepState):
        return table.save_state()
    return save_state(table, tuple(name for name in BlockTable._step_containers if hasattr(table, name)))
