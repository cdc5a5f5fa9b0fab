"""Input checks shared by every chapter, so the same bad input gets the same error everywhere.

The rule (CONTRIBUTING.md): a wrong type, including a float or a bool where an
int is expected, is a ``TypeError``; a bad value or range is a ``ValueError``;
a block id or position outside the pool or the sequence is an ``IndexError``.
Every message names the argument. Checks run before any state changes.
"""

from __future__ import annotations


def check_int(value, name: str, minimum: int | None = 0) -> int:
    """``value`` as a Python int, or an error that names ``name``.

    Args:
        value: anything with ``__index__`` (Python and NumPy ints, 0-d integer tensors);
            ``bool`` is refused, because ``True`` tokens is a bug, not a count.
        name: the argument's name, as the caller's signature spells it.
        minimum: the smallest value allowed (``None``: no bound).

    Raises:
        TypeError: ``value`` is not an integer (a float such as ``3.0`` included).
        ValueError: ``value`` is below ``minimum``.
    """
    try:
        if isinstance(value, bool):
            raise TypeError
        value = value.__index__()  # float tensors have __index__ but refuse
    except (TypeError, AttributeError):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value
