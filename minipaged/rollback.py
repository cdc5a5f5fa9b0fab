"""All-or-nothing engine steps: a snapshot of every piece of bookkeeping, put back if the step raises.

:class:`StepUndo` walks everything the engine reaches (its scheduler and queues, the sequences,
their tables, the allocator, the metrics, the clock) before a step, and saves each mutable
object's state: an object's attributes, a container's contents, a generator's state. Nothing is
listed by hand, so a new field, a heap or a dict of sets is covered the day it is added.
Restoring puts each one back *in place*, so a view that holds a list or a table sees the old
state again. What is not bookkeeping is not walked: tensors (the K/V pools, whose rollback is
:meth:`StepUndo.protect_kv`'s), modules, functions, classes, and instances of frozen dataclasses
(immutable by contract). A class may name attributes that a rollback must leave alone (event
plumbing, the step's own flags) in ``_not_rolled_back``, and an object whose ``is_finished`` is True
(a finished sequence: no step changes it again) is not walked. A list whose class says
``_numbers_only = True`` (a sequence's :class:`~minipaged.sequence.TokenList` of token ids or times)
is copied whole without a look at each item: the walk's cost per step is mostly per object, and
those lists hold most of the items.
"""

from __future__ import annotations

import dataclasses
import gc
import types
from collections import deque
from enum import Enum
from functools import partial

import torch

_ATOMS = (int, float, complex, str, bytes, bool, type(None), type, Enum, torch.dtype, torch.device, torch.Tensor,
          torch.nn.Module, types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.ModuleType,
          partial)  # fmt: skip
ATOM, NUMBERS, SEQUENCE, MAPPING, IMMUTABLE, GENERATOR, OBJECT = range(7)  # what the walk does with an object
_CONTAINERS = ((SEQUENCE, (list, deque, bytearray, set)), (MAPPING, dict), (IMMUTABLE, (tuple, frozenset)),
               (GENERATOR, torch.Generator))  # fmt: skip
_PLAIN = {int, float, str, bytes, bool, type(None)}  # token ids and times: never pushed on the walk's stack


class _Kinds(dict):
    """type -> what the walk does with its instances, worked out on a type's first lookup (the walk meets the
    same few types over and over, so a lookup is a plain dict hit)."""

    def __missing__(self, cls: type) -> int:
        frozen = dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
        numbers = getattr(cls, "_numbers_only", False)  # a list whose items are numbers only, by its class's word
        self[cls] = ATOM if frozen or issubclass(cls, _ATOMS) else NUMBERS if numbers else next(
            (kind for kind, bases in _CONTAINERS if issubclass(cls, bases)), OBJECT)
        return self[cls]


_KINDS = _Kinds()


class Snapshot:
    """The state of every mutable object reachable from ``root``, to put back with :meth:`restore`.

    Args:
        root: the object to walk from (the engine).
    """

    def __init__(self, root):
        self._saved: dict[int, tuple[object, object]] = {}  # id -> (object, its saved state)
        saved, stack = self._saved, [root]
        while stack:
            obj = stack.pop()
            kind = _KINDS[type(obj)]
            if kind == ATOM or id(obj) in saved or kind == OBJECT and getattr(obj, "is_finished", False):
                continue
            # Its state (what restore() puts back) and the objects it holds, most frequent kinds first.
            if kind == OBJECT:  # most classes name nothing to leave alone: then a plain copy of the attributes
                skip = getattr(type(obj), "_not_rolled_back", ())
                state = {n: v for n, v in vars(obj).items() if n not in skip} if skip else vars(obj).copy()
                children = state.values()
            elif kind in (NUMBERS, SEQUENCE):  # a list of numbers only (its class's _numbers_only): items not walked
                state = list(obj)
                children = state if kind == SEQUENCE else ()
            elif kind == MAPPING:
                state = list(obj.items())
                children = [x for item in state for x in item]
            else:  # a tuple or frozenset holds no state of its own; a generator holds no objects
                state, children = (None, obj) if kind == IMMUTABLE else (obj.get_state(), ())
            saved[id(obj)] = (obj, state)
            for child in children:  # token ids, times and other plain values never go on the stack
                if type(child) not in _PLAIN:
                    stack.append(child)

    def before(self, obj, default=None):
        """``obj``'s saved state: a container's contents (a list, a dict's items) or an object's attributes.

        Args:
            obj: any object.
            default: what to return for an object the snapshot holds no state of (an immutable one, or one
                the step made).
        """
        state = self._saved.get(id(obj), (None, None))[1]
        return default if state is None else state

    def restore(self) -> None:
        """Put every saved object back as it was, in place."""
        for obj, state in self._saved.values():
            _restore(obj, state)


def _restore(obj, state) -> None:
    kind = _KINDS[type(obj)]
    if kind in (NUMBERS, SEQUENCE, MAPPING):
        obj.clear()
        (obj.update if isinstance(obj, (set, dict)) else obj.extend)(state)
    elif kind == GENERATOR:
        obj.set_state(state)
    elif state is not None:  # its attributes as they were (one the step made goes), less those left alone
        kept = {n: v for n, v in vars(obj).items() if n in getattr(type(obj), "_not_rolled_back", ())}
        vars(obj).clear()
        vars(obj).update(state, **kept)


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
            self._gc_back()
            self.engine._apply_deferred_aborts()

    def __init__(self, engine, events: list):
        self.engine, self._gc_back = engine, gc.enable if gc.isenabled() else gc.disable  # GC as it was
        self.events, self.num_events_before = events, len(events)
        # The walk and the step make thousands of short-lived containers, none in a cycle: a collection
        # they trigger would only pause the step (vLLM's engine freezes the collector's view for the same reason).
        gc.disable()
        self.snapshot = Snapshot(engine)
        self.saved_kv = None  # (block ids, their K/V) that the step may overwrite although they hold K/V

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
        targets |= {dst for _, dst in out.copies}
        targets.update(*(seq.block_table.blocks for seq in out.swap_in))
        refcounts = self._attr_before(allocator, "_refcounts", ())
        entries = self._attr_before(allocator, "entries", None)  # None: no prefix cache
        held = sorted(b for b in targets if refcounts[b] > 0 or (entries is not None and entries[b] is not None))
        if held:
            self.saved_kv = (held, self.engine.cache.swap_out(held))

    def _attr_before(self, obj, name: str, default):
        """The contents of ``obj.name`` before the step (``default`` for an object or attribute the step made)."""
        value = self.snapshot.before(obj, {}).get(name, default)
        return self.snapshot.before(value, value)

    def restore(self) -> None:
        """Put the bookkeeping and the protected K/V back; the step's events give way to one ``"rollback"`` event."""
        if self.saved_kv is not None:
            self.engine.cache.swap_in(*self.saved_kv)
        self.snapshot.restore()
        del self.events[self.num_events_before :]
        self.engine.cache.allocator.emit("rollback")
