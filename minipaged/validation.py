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
        raise ValueError(
            f"{what} would take {num_bytes / 2**30:,.1f} GiB, more than the {total / 2**30:,.1f} GiB "
            f"of {kind} memory this machine has in total"
        )


# --------------------------------------------------------------------------- tensors
#
# One validator per input kind, shared by the PyTorch paths (minipaged.cache,
# minipaged.attention) and the Triton wrappers (minipaged.kernels), so the same bad
# input raises the same error on every backend. A backend adds only its own limits
# (the kernels' block-size and head-size limits, num_splits). torch is
# imported inside the functions: chapter 01 uses check_int without needing torch.


def check_tensor(value, name: str):
    """``value`` if it is a ``torch.Tensor``, else a ``TypeError`` that names ``name``."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _check_devices(first: str, tensors: dict) -> None:
    """Every tensor on the device of ``tensors[first]``; a ``ValueError`` names the first one that is not."""
    device = tensors[first].device
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, but {first} is on {device}: all inputs must share a device")


def _check_cache_pair(k_cache, v_cache) -> None:
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache has shape {tuple(v_cache.shape)}, but k_cache has {tuple(k_cache.shape)}")
    if 0 in k_cache.shape[1:]:
        raise ValueError(f"k_cache's block_size, num_kv_heads and head_dim must be >= 1, got {tuple(k_cache.shape)}")


def check_kv_write(key, value, k_cache, v_cache, slot_mapping) -> None:
    """The inputs of a K/V write by slot (``attention.write_kv``, ``kernels.write_kv``).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, the new tokens' K and V.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, same dtype as ``key``.
        slot_mapping: int64 or int32 ``[num_tokens]``; token ``i`` goes to slot ``slot_mapping[i]``
            (``block_id * block_size + offset``), ``-1`` skips it.

    Raises:
        TypeError: an argument is not a tensor, ``slot_mapping`` is not an integer tensor,
            or the dtypes of K/V and the caches differ.
        ValueError: a shape does not fit, or the tensors are on different devices.
        ValueError: also a slot that appears twice (``-1`` may repeat).
        IndexError: a slot outside ``[-1, num_blocks * block_size)``. Reading the
            bounds and the repeats costs one host-device sync.
    """
    import torch

    tensors = {"key": key, "value": value, "k_cache": k_cache, "v_cache": v_cache, "slot_mapping": slot_mapping}
    for name, t in tensors.items():
        check_tensor(t, name)
    _check_cache_pair(k_cache, v_cache)
    row = tuple(k_cache.shape[2:])
    if key.dim() != 3 or tuple(key.shape[1:]) != row or value.shape != key.shape:
        raise ValueError(
            f"key and value must be [num_tokens, {row[0]}, {row[1]}] (the cache's num_kv_heads, head_dim), "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    num_tokens = key.shape[0]
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [num_tokens={num_tokens}], got shape {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"slot_mapping must be int64 (or int32), got {slot_mapping.dtype}")
    if not key.dtype == value.dtype == k_cache.dtype == v_cache.dtype:
        raise TypeError(
            "key, value, k_cache and v_cache must share a dtype, "
            f"got {key.dtype}, {value.dtype}, {k_cache.dtype} and {v_cache.dtype}"
        )
    _check_devices("key", tensors)
    if num_tokens:
        pool_slots = k_cache.shape[0] * k_cache.shape[1]
        # Two tokens writing one slot would race on a GPU (the last write wins here): refuse it.
        ordered = slot_mapping.sort().values
        repeats = (ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)
        lo, hi, num_repeats = torch.stack([ordered[0], ordered[-1], repeats.sum()]).tolist()
        if lo < -1 or hi >= pool_slots:
            raise IndexError(f"slot_mapping must lie in [-1, {pool_slots}) (-1 = skip), got {lo} .. {hi}")
        if num_repeats:
            slot = int(ordered[1:][repeats][0])
            raise ValueError(f"slot_mapping holds slot {slot} more than once: each slot takes one token per write")


def check_paged_attention(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc=None, *, check_values: bool = True
) -> int | None:
    """The inputs of attention through block tables, decode or prefill, on any backend.

    Args:
        q: float ``[num_tokens, num_heads, head_dim]``; for decode (no ``query_start_loc``)
            one token per sequence, so ``num_tokens == num_seqs``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, ``q``'s dtype;
            ``num_heads`` must be a multiple of ``num_kv_heads``.
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]`` (the cache-layout convention);
            only the first ``ceil(seq_lens[i] / block_size)`` entries of row ``i`` are read.
        seq_lens: int32 or int64 ``[num_seqs]``, each context length including the new tokens.
        query_start_loc: None for decode; for prefill int32 or int64 ``[num_seqs + 1]``,
            sequence ``i``'s queries are rows ``query_start_loc[i] : query_start_loc[i + 1]`` of ``q``.
        check_values: also check the values of ``seq_lens``, ``block_tables`` and
            ``query_start_loc`` (one host-device sync). ``False`` checks shapes, dtypes
            and devices only, which reads nothing from the device.

    Returns:
        ``max(seq_lens)`` when the values were read, else None.

    Raises:
        TypeError: a non-tensor, a non-float ``q``, mixed float dtypes, or a wrong integer dtype.
        ValueError: a shape that does not fit, mixed devices, a ``seq_lens`` entry below 1, or a
            ``query_start_loc`` that does not run from 0 to ``num_tokens`` in steps of 1 .. ``seq_len``.
        IndexError: a sequence longer than its block-table row can map, or an owned
            block-table entry outside the pool.
    """
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables, "seq_lens": seq_lens}
    if query_start_loc is not None:
        tensors["query_start_loc"] = query_start_loc
    for name, t in tensors.items():
        check_tensor(t, name)
    num_seqs = _paged_attention_shapes(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    _paged_attention_dtypes(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    _check_devices("q", tensors)
    if not check_values:
        return None
    if num_seqs == 0:
        if query_start_loc is not None and query_start_loc.tolist() != [q.shape[0]]:
            raise ValueError(f"query_start_loc must be [0] for an empty batch, got {query_start_loc.tolist()}")
        return 0
    return _paged_attention_values(q, k_cache, block_tables, seq_lens, query_start_loc)


def _paged_attention_shapes(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc) -> int:
    """:func:`check_paged_attention`'s shape checks; returns ``num_seqs``."""
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D [num_tokens, num_heads, head_dim], got shape {tuple(q.shape)}")
    _check_cache_pair(k_cache, v_cache)
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"q has head_dim {head_dim}, but k_cache has head_dim {cache_head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"q's num_heads ({num_heads}) must be a multiple of k_cache's num_kv_heads ({num_kv_heads})"
        )
    if query_start_loc is None:
        num_seqs = num_tokens
    elif query_start_loc.dim() != 1 or query_start_loc.shape[0] < 1:
        raise ValueError(f"query_start_loc must be [num_seqs + 1], got shape {tuple(query_start_loc.shape)}")
    else:
        num_seqs = query_start_loc.shape[0] - 1
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must be [num_seqs={num_seqs}, max_blocks_per_seq], got shape {tuple(block_tables.shape)}"
        )
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens must be [num_seqs={num_seqs}], got shape {tuple(seq_lens.shape)}")
    return num_seqs


def _paged_attention_dtypes(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc) -> None:
    """:func:`check_paged_attention`'s dtype checks: a float ``q`` the caches share, integer indices."""
    import torch

    if not q.dtype.is_floating_point:
        raise TypeError(f"q must be a floating-point tensor, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(
            f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype} and {v_cache.dtype}"
        )
    if block_tables.dtype != torch.int32:
        raise TypeError(f"block_tables must be int32, got {block_tables.dtype}")
    if seq_lens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"seq_lens must be int32 or int64, got {seq_lens.dtype}")
    if query_start_loc is not None and query_start_loc.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"query_start_loc must be int32 (or int64), got {query_start_loc.dtype}")


def _paged_attention_values(q, k_cache, block_tables, seq_lens, query_start_loc) -> int:
    """:func:`check_paged_attention`'s value checks of a non-empty batch, in one host sync; returns ``max(seq_lens)``.

    Lengths, owned block ids and query boundaries are reduced on the device and read together.
    """
    import torch

    num_tokens = q.shape[0]
    num_blocks, block_size = k_cache.shape[:2]
    max_blocks_per_seq = block_tables.shape[1]
    lens = seq_lens.long()
    owned = torch.arange(max_blocks_per_seq, device=q.device)[None, :] < (lens[:, None] + block_size - 1) // block_size
    bad_ids = owned & ((block_tables < 0) | (block_tables >= num_blocks))
    stats = [lens.min(), lens.max(), bad_ids.sum()]
    if query_start_loc is not None:
        starts = query_start_loc.long()
        num_new_tokens = starts[1:] - starts[:-1]
        stats += [starts[0], starts[-1], ((num_new_tokens < 1) | (num_new_tokens > lens)).sum()]
    stats = torch.stack(stats).tolist()
    lo, hi, num_bad_ids = stats[:3]
    if lo < 1:
        raise ValueError(f"seq_lens must be >= 1 (the new tokens are already in the cache), got {lo}")
    if hi > max_blocks_per_seq * block_size:
        raise IndexError(
            f"seq_lens holds {hi}, but block_tables has room for only "
            f"{max_blocks_per_seq} blocks x {block_size} = {max_blocks_per_seq * block_size} tokens"
        )
    if num_bad_ids:
        s, i = bad_ids.nonzero()[0].tolist()
        entry = int(block_tables[s, i])
        raise IndexError(f"block_tables[{s}, {i}] = {entry} is outside the pool's {num_blocks} blocks")
    if query_start_loc is not None:
        first, last, num_bad_queries = stats[3:]
        if first != 0 or last != num_tokens:
            raise ValueError(f"query_start_loc must run from 0 to num_tokens={num_tokens}, got {first} .. {last}")
        if num_bad_queries:
            i = int(((num_new_tokens < 1) | (num_new_tokens > lens)).nonzero()[0])
            raise ValueError(
                f"sequence {i} has {int(num_new_tokens[i])} query tokens; it needs 1 .. seq_lens[{i}]={int(lens[i])}"
            )
    return hi


def check_contiguous_attention(q, k, v, scale) -> float:
    """The inputs of attention over one contiguous context (``attention.contiguous_attention``); returns the scale.

    Args:
        q: float ``[q_len, num_heads, head_dim]``, the last ``q_len`` positions of the context.
        k, v: ``[kv_len, num_kv_heads, head_dim]``, with ``kv_len >= q_len``; ``num_heads`` must be a
            multiple of ``num_kv_heads``.
        scale: the softmax scale, or None for ``head_dim ** -0.5`` (see :func:`check_scale`).

    Raises:
        TypeError: a non-tensor, or a non-float ``q``.
        ValueError: a shape that does not fit, or a bad ``scale``.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(t, name)
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D [tokens, heads, head_dim], got shape {tuple(t.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v has shape {tuple(v.shape)}, but k has {tuple(k.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q has head_dim {q.shape[2]}, but k has head_dim {k.shape[2]}")
    if not q.dtype.is_floating_point:
        raise TypeError(f"q must be a floating-point tensor, got {q.dtype}")
    scale = check_scale(scale, q.shape[2])
    if q.shape[0] > k.shape[0]:
        raise ValueError(f"q has {q.shape[0]} tokens but k only {k.shape[0]}: the queries must be part of the context")
    check_multiple(q.shape[1], "num_heads", k.shape[1], "num_kv_heads")
    return scale


def check_packed_batch(input_ids, positions, attn_metadata, caches, num_layers: int) -> None:
    """A packed batch's tokens against its attention metadata and the caches (``LlamaForCausalLM.forward``'s inputs).

    The forward checks its first layer's K/V write and attention in full and the other layers' not
    at all, so here every layer's caches must be like the first layer's.

    Args:
        input_ids, positions: int64 ``[num_tokens]``, every sequence's new tokens and their positions.
        attn_metadata: an :class:`~minipaged.attention.AttentionMetadata` whose ``slot_mapping`` and
            ``query_start_loc`` must describe ``num_tokens`` tokens.
        caches: per layer, the ``(k_cache, v_cache)`` given.
        num_layers: the model's layers.

    Raises:
        TypeError: a layer's caches are not two tensors.
        ValueError: a shape that does not fit, or a layer's caches unlike the first layer's
            (shape, dtype, device or layout).
    """
    import torch

    md = attn_metadata
    num_tokens = input_ids.shape[0] if input_ids.dim() == 1 else -1
    if input_ids.dim() != 1 or positions.shape != input_ids.shape:
        raise ValueError(
            "input_ids and positions must both be [num_tokens], "
            f"got {tuple(input_ids.shape)} and {tuple(positions.shape)}"
        )
    if md.slot_mapping.shape != (num_tokens,) or int(md.query_start_loc[-1]) != num_tokens:
        raise ValueError(
            f"attn_metadata describes {md.slot_mapping.shape[0]} slots and {int(md.query_start_loc[-1])} "
            f"query tokens, but input_ids has {num_tokens}"
        )
    if len(caches) != num_layers:
        raise ValueError(f"kv_caches has {len(caches)} layers, the model {num_layers}")

    def kind(t):
        return t.shape, t.dtype, t.device, t.stride()

    for layer, pair in enumerate(caches):
        if len(pair) != 2 or not all(isinstance(t, torch.Tensor) for t in pair):
            raise TypeError(f"kv_caches[{layer}] must be a (k_cache, v_cache) pair of tensors")
        if kind(pair[0]) != kind(caches[0][0]) or kind(pair[1]) != kind(caches[0][1]):
            raise ValueError(f"kv_caches[{layer}] differs from kv_caches[0] in shape, dtype, device or strides: "
                             "every layer's caches must be alike")  # fmt: skip


