"""Input checks shared by every chapter, so the same bad input gets the same error everywhere.

The rule (CONTRIBUTING.md): a wrong type, including a float or a bool where an
int is expected, is a ``TypeError``; a bad value or range is a ``ValueError``;
a block id or position outside the pool or the sequence is an ``IndexError``.
Every message names the argument. Checks run before any state changes.
"""

from __future__ import annotations

import math
import numbers
import os
from contextlib import contextmanager


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


def check_real(value, name: str, minimum: float | None = None, finite: bool = True, strict: bool = False) -> float:
    """``value`` as a Python float, or an error that names ``name``.

    The one real-number validator: every argument that takes a real number goes through it.

    Args:
        value: an int or a float (NumPy scalars included); ``bool`` and strings are refused.
        name: the argument's name, as the caller's signature spells it.
        minimum: the smallest value allowed (``None``: no bound).
        finite: refuse ``inf`` as well (``nan`` is always refused: it compares false with everything).
        strict: refuse ``minimum`` itself too (the value must be greater).

    Raises:
        TypeError: ``value`` is not a real number.
        ValueError: ``value`` is NaN, infinite (when ``finite``) or below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    if math.isnan(value) or (finite and math.isinf(value)):
        raise ValueError(f"{name} must be a {'finite ' if finite else ''}number, got {value!r}")
    if minimum is not None and (value < minimum or (strict and value == minimum)):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {minimum:g}, got {value!r}")
    return value


def check_bool(value, name: str) -> bool:
    """``value`` if it is a ``bool``, else a ``TypeError`` that names ``name`` (``"no"`` is not False)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def check_hashable(value, name: str):
    """``value`` if it can be a dict key (an id), else a ``TypeError`` that names ``name``."""
    try:
        hash(value)
    except TypeError:
        raise TypeError(f"{name} must be hashable (an int, a str, a tuple, ...), got {type(value).__name__} "
                        f"{value!r:.60}") from None
    return value


def check_choice(value, name: str, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of the names ``choices``, or an error that names ``name``.

    Args:
        value: the option given.
        name: the argument's name, as the caller's signature spells it.
        choices: the names allowed.

    Raises:
        TypeError: ``value`` is not a string (``backend=1``).
        ValueError: ``value`` is a string but not one of ``choices``.
    """
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {choices}, got {type(value).__name__} {value!r:.60}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def check_salt(cache_salt, name: str = "cache_salt") -> str | bytes | None:
    """``cache_salt`` normalised: a str or bytes salt as it is, None for no salt; a ``TypeError`` naming ``name`` else.

    An empty salt (``""`` or ``b""``) is no salt, as in vLLM (``if request.cache_salt``): it returns
    None, so a request with it shares blocks with requests that have none.

    Args:
        cache_salt: the prefix cache's salt (str, bytes or None).
        name: the argument's name in the caller, for the message.
    """
    if cache_salt is not None and not isinstance(cache_salt, (str, bytes)):
        raise TypeError(f"{name} must be a str, bytes or None, got {type(cache_salt).__name__} {cache_salt!r:.40}")
    return cache_salt or None


def check_token_ids(token_ids, name: str, vocab_size: int) -> list[int]:
    """``token_ids`` as a non-empty list of Python ints in ``[0, vocab_size)``, or an error that names ``name``.

    Args:
        token_ids: a list or tuple of ints (a 1-D integer tensor also works).
        name: the argument's name, as the caller's signature spells it.
        vocab_size: the model's vocabulary size.

    Raises:
        TypeError: ``token_ids`` is a string or not a sequence, or an id is not an int (``3.7``, ``nan``).
        ValueError: ``token_ids`` is empty, or an id lies outside ``[0, vocab_size)``.
    """
    if isinstance(token_ids, (str, bytes, dict)) or not hasattr(token_ids, "__len__"):
        raise TypeError(f"{name} must be a list of token ids (ints), got {type(token_ids).__name__} {token_ids!r:.60}")
    if len(token_ids) == 0:
        raise ValueError(f"{name} must hold at least one token")
    ids = [check_int(t, f"{name}[{i}]") for i, t in enumerate(token_ids)]
    check_ids_below(ids, name, vocab_size)
    return ids


def check_ids_below(ids, name: str, vocab_size: int, owner: str = "the vocabulary") -> None:
    """A ``ValueError`` naming ``name[i]`` for the first id ``ids[i]`` at or above ``vocab_size``.

    Args:
        ids: token ids, already ints >= 0.
        name: the argument's name, as the caller's signature spells it.
        vocab_size: the vocabulary's size.
        owner: whose token ids they must be, for the message (``"the model"``).
    """
    for i, t in enumerate(ids):
        if t >= vocab_size:
            raise ValueError(f"{name}[{i}] = {t} is outside the token ids [0, {vocab_size}) of {owner}")


def check_fields(obj, prefix: str, names: tuple[str, ...], check, **kwargs) -> None:
    """Replace each attribute ``names`` of ``obj`` by what ``check`` returns for it; an error names ``prefix.name``.

    Args:
        obj: the object whose attributes are checked in place (a config dataclass).
        prefix: the class name the messages use (``"EngineConfig"`` gives ``"EngineConfig.num_blocks"``).
        names: the attributes, checked in this order.
        check: a validator called as ``check(value, name, **kwargs)`` (:func:`check_int`, :func:`check_real`).
        **kwargs: passed on to ``check`` (``minimum=1``).
    """
    for name in names:
        setattr(obj, name, check(getattr(obj, name), f"{prefix}.{name}", **kwargs))


@contextmanager
def errors_named(prefix: str):
    """Re-raise a ``TypeError`` or ``ValueError`` from inside the block with ``prefix`` before its message.

    Args:
        prefix: what to put first, such as ``"LlamaConfig."`` (a check's message names the argument
            alone; the prefix says whose argument it is).
    """
    try:
        yield
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{prefix}{exc}") from None


def check_instance(value, name: str, kind, what: str):
    """``value`` if it is an instance of ``kind``, else a ``TypeError``: "``name`` must be ``what``, got <its type>".

    Args:
        value: the argument.
        name: the argument's name, as the caller's signature spells it.
        kind: a class or a tuple of classes, as for ``isinstance``.
        what: the expected kind in words, for the message (``"an EngineConfig"``).
    """
    if not isinstance(value, kind):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__}")
    return value


def check_callable(value, name: str, what: str):
    """``value`` if it can be called, else a ``TypeError``: "``name`` must be ``what``, got <its type>".

    Args:
        value: the argument.
        name: the argument's name, as the caller's signature spells it.
        what: the expected kind in words (``"a function"``).
    """
    if not callable(value):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__}")
    return value


def check_multiple(value: int, name: str, divisor: int, divisor_name: str) -> None:
    """A ``ValueError`` unless ``divisor`` divides ``value`` (query heads per KV head, say).

    Args:
        value: the count that must be a multiple.
        name: its name, for the message.
        divisor: what it must be a multiple of.
        divisor_name: the divisor's name, for the message.
    """
    if value % divisor:
        raise ValueError(f"{name} ({value}) must be a multiple of {divisor_name} ({divisor})")


def check_in_interval(value, name: str, low: float = 0, high: float = 1) -> float:
    """``value`` as a Python float in ``[low, high)``, or an error that names ``name``.

    Args:
        value: a real number (see :func:`check_real` for the types refused).
        name: the argument's name, as the caller's signature spells it.
        low: the smallest value allowed.
        high: the bound it must stay below.
    """
    value = check_real(value, name)
    if not low <= value < high:
        raise ValueError(f"{name} must be in [{low}, {high}), got {value!r}")
    return value


def check_scale(scale, head_dim: int) -> float:
    """The attention ``scale``: ``head_dim ** -0.5`` for None, else a finite number > 0."""
    if scale is None:
        return head_dim**-0.5
    scale = check_real(scale, "scale")
    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale!r}")
    return scale


def total_memory_bytes(device="cpu") -> int:
    """The total memory of ``device``: a CUDA device's own memory, else the machine's physical RAM.

    A fixed number (not what is free now), so a check against it gives the same answer
    whatever else runs on the machine.
    """
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits_memory(num_bytes: int, what: str, device="cpu") -> None:
    """A ``ValueError`` before allocating ``num_bytes`` that ``device`` could never hold.

    Args:
        num_bytes: what the allocation would take.
        what: the allocation and the arguments that size it, for the message.
        device: where it would live.
    """
    total = total_memory_bytes(device)
    if num_bytes > total:
        kind = "GPU" if str(device).startswith("cuda") else "physical"
        raise ValueError(f"{what} would take {num_bytes / 2**30:,.1f} GiB, more than the {total / 2**30:,.1f} GiB "
                         f"of {kind} memory this machine has in total")  # fmt: skip


def check_block_ids(block_ids, name: str, num_blocks: int, unique: bool = False) -> list[int]:
    """``block_ids`` as a list of ints in ``[0, num_blocks)``, or an error that names ``name``.

    Args:
        block_ids: an iterable of block ids (not a string).
        name: the argument's name, as the caller's signature spells it.
        num_blocks: the pool's size.
        unique: refuse an id that appears twice (two copies into one block would race for it).

    Raises:
        TypeError: ``block_ids`` is not an iterable of ints.
        IndexError: an id outside the pool.
        ValueError: a repeated id, with ``unique``.
    """
    if isinstance(block_ids, (str, bytes)) or not hasattr(block_ids, "__iter__"):
        raise TypeError(f"{name} must be a list of block ids, got {type(block_ids).__name__}")
    ids = [check_int(b, f"{name}[{i}]", minimum=None) for i, b in enumerate(block_ids)]
    for i, b in enumerate(ids):
        if not 0 <= b < num_blocks:
            raise IndexError(f"{name}[{i}] = {b} is outside the pool of {num_blocks} blocks")
    if unique and len(set(ids)) != len(ids):
        raise ValueError(f"{name} must not repeat a block id (two copies would race for it), got {ids}")
    return ids
