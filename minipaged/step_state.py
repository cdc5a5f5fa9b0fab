"""The state an engine step may change, saved and put back by the class that owns it.

An engine step is all or nothing (:mod:`minipaged.rollback`): before it starts, every object it may
change saves its state with :meth:`StepState.save_state`; if the step raises, each puts it back with
:meth:`StepState.restore_state`. A class says what its state is in one line, ``_step_containers``:
its plain attributes (counters, flags, references) are saved as they are, and the containers it
names (lists, deques, dicts, a mutable record) have their contents copied. A subclass
names only its own containers: its bases' are saved too. Restoring
puts each container's contents back *in place*, so whoever holds a list or a table sees the old
state again.

A learner's piece writes none of this: the base classes it extends (the allocator's, the
scheduler's) name the state of their interface.
"""

from __future__ import annotations

from collections import deque
from functools import cache


class StepState:
    """Mixin: :meth:`save_state` and :meth:`restore_state` over the attributes and ``_step_containers``."""

    _step_containers: tuple[str, ...] = ()  # this class's attributes whose contents a step may change in place

    def save_state(self) -> tuple:
        """This object's attributes as they are, and a copy of the contents of each container its classes name."""
        return save_state(self, _containers(type(self)))

    def restore_state(self, state: tuple) -> None:
        """Put back what :meth:`save_state` returned: the attributes, then each container's contents, in place."""
        restore_state(self, state)


@cache
def _containers(cls: type) -> tuple[str, ...]:
    """The containers ``cls`` and its bases name, bases first."""
    return tuple(dict.fromkeys(n for c in reversed(cls.__mro__) for n in vars(c).get("_step_containers", ())))


def save_state(obj, containers: tuple[str, ...]) -> tuple:
    """``obj``'s attributes, and ``{name: (container, a copy of its contents)}`` for each name in ``containers``.

    Args:
        obj: any object with a ``__dict__``.
        containers: the names of its attributes that a step may change in place.
    """
    return vars(obj).copy(), {name: _contents(getattr(obj, name)) for name in containers}


def _contents(value) -> tuple:
    if isinstance(value, dict):  # a list, set or dict value is copied too (a prefix cache's blocks by key)
        return value, {k: v.copy() if isinstance(v, (list, set, dict)) else v for k, v in value.items()}
    if isinstance(value, (list, deque, bytearray, set)):
        return value, list(value)
    return value, vars(value).copy()  # a mutable record (a dataclass of counters)


def restore_state(obj, state: tuple) -> None:
    """Put back what :func:`save_state` returned.

    Args:
        obj: the object saved.
        state: what :func:`save_state` returned for it.
    """
    attrs, containers = state
    vars(obj).clear()
    vars(obj).update(attrs)
    for value, contents in containers.values():
        if isinstance(value, (dict, set, deque, bytearray, list)):
            value.clear()
            (value.update if isinstance(value, (dict, set)) else value.extend)(contents)
        else:
            vars(value).clear()
            vars(value).update(contents)
