"""Operation counts, the measure of the O(1) checks (``ch02.constant_time``, ``ch06.constant_time``).

A call's cost is the number of container elements it touches plus the lines of the learner's code it
runs. :func:`instrument` swaps each list, deque, dict, ordered dict, set and bytearray an object holds
for a subclass that counts the elements each method touches (``x in list`` walks the list, ``x in set``
touches one, ``list.pop(0)`` moves every element after it, ``OrderedDict.popitem`` touches one), and
:func:`measured` runs a call under a tracer that counts the learner's lines. Run the same calls on a
small pool and on a large one: an O(1) call costs about the same on both.
"""

from __future__ import annotations

import sys
from collections import OrderedDict, deque

from minipaged.checks import CheckFailed, _is_learners

_OPS = [0]  # the operations counted so far (a list, so the counting containers and the tracer share it)


def _add(n: int) -> None:
    _OPS[0] += n


def _counting(base: type) -> type:
    """A subclass of ``base`` that counts the elements each call touches."""
    hashed = issubclass(base, (dict, set))

    def walks(self, *args):
        return len(self)

    def one(self, *args):
        return 1

    def at(self, index=None, *args):  # list.pop(i), list.insert(i, x): everything after i moves
        if index is None or type(index) is not int:
            return 1
        return len(self) - (index if index >= 0 else len(self) + index)

    def item(self, key, *args):
        return len(range(*key.indices(len(self)))) if isinstance(key, slice) else 1

    costs = {"__contains__": one if hashed else walks, "index": walks, "count": walks,
             "remove": one if base is set else walks, "copy": walks, "sort": walks, "reverse": walks,
             "__eq__": walks, "__getitem__": item, "__setitem__": item, "__delitem__": item if hashed else at,
             "append": one, "appendleft": one, "popleft": one, "add": one, "discard": one, "get": one,
             "popitem": one, "setdefault": one, "move_to_end": one,
             "pop": one if hashed or base is deque else at,
             "insert": at, "rotate": lambda self, n=1: abs(n), "find": walks, "rfind": walks,
             "extend": lambda self, xs: len(xs) if hasattr(xs, "__len__") else 1}  # fmt: skip
    namespace = {name: _counted(getattr(base, name), cost) for name, cost in costs.items() if hasattr(base, name)}

    def __iter__(self):
        for x in base.__iter__(self):
            _add(1)
            yield x

    def __reversed__(self):
        for x in base.__reversed__(self):
            _add(1)
            yield x

    namespace["__iter__"] = __iter__
    if hasattr(base, "__reversed__"):
        namespace["__reversed__"] = __reversed__
    return type(f"Counting{base.__name__[0].upper()}{base.__name__[1:]}", (base,), namespace)


def _counted(method, cost):
    def counted(self, *args, **kwargs):  # OrderedDict.popitem(last=False), move_to_end(key, last=False)
        _add(cost(self, *args))
        return method(self, *args, **kwargs)

    return counted


_COUNTING = {base: _counting(base) for base in (list, deque, dict, OrderedDict, set, bytearray)}


def instrument(obj) -> None:
    """Swap each container ``obj`` holds in an attribute for a counting copy of it."""
    for name, value in list(vars(obj).items()):
        counting = _COUNTING.get(type(value))
        if counting is not None:
            copy = counting(value, value.maxlen) if type(value) is deque else counting(value)
            object.__setattr__(obj, name, copy)


def _trace(frame, event, arg):
    if event == "call" and _is_learners(frame.f_code.co_filename):
        return _count_line
    return None


def _count_line(frame, event, arg):
    if event == "line":
        _add(1)
    return _count_line


def measured(fn, *args) -> tuple[object, int]:
    """``fn(*args)`` and the operations it took (container elements touched and lines of the learner's code)."""
    previous, _OPS[0] = sys.gettrace(), 0
    sys.settrace(_trace)
    try:
        result = fn(*args)
    finally:
        sys.settrace(previous)
    return result, _OPS[0]


def judge_growth(calls: list[str], sizes: list[int], counts: list[list[int]], hint) -> None:
    """Raise CheckFailed for the first of ``calls`` whose cost grows with the pool.

    ``counts`` holds each call's operations on the small pool and on the large one (``sizes``); a call
    may cost up to twice as much on the large one, plus a few operations (a dict that resizes, a longer
    id's repr). ``hint(call)`` is the FAIL's hint.
    """
    if len(counts) != len(sizes) or any(type(c) is not list or len(c) != len(calls) for c in counts):
        raise CheckFailed("the probe's record of the calls is incomplete")
    small, large = sizes
    for call, few, many in zip(calls, *counts):
        if many > 2 * few + 8:
            raise CheckFailed(f"{call} took {few} operations on a pool of {small} blocks but {many} on a pool of "
                              f"{large}: its cost grows with the pool (operations: elements of your containers "
                              "touched, plus lines of your code run)", hint(call))  # fmt: skip
