"""The attention seam's checks: every input of the read and write paths, the packed batch, a backend's registration.

One validator per input kind, shared by the PyTorch paths (:mod:`minipaged.attention`,
:mod:`minipaged.cache`) and the Triton wrappers (:mod:`minipaged.kernels`), so the same bad input
raises the same error on every backend and a learner's backend repeats no check. A backend adds
only its own limits (the kernels' block-size and head-size limits, ``num_splits``).

They run at the boundary: where a user or a learner calls ``write_kv``, ``paged_attention``,
``paged_prefill_attention``, ``contiguous_attention``, the model's forward or ``register_backend``.
The engine's step passes ``check=False``: it builds its batch from pieces it checked where they were
handed in, so this module loads only when something asks for a check.
"""

from __future__ import annotations

import torch

from minipaged.validation import check_instance, check_multiple, check_scale


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
    tensors = {"key": key, "value": value, "k_cache": k_cache, "v_cache": v_cache, "slot_mapping": slot_mapping}
    for name, t in tensors.items():
        check_instance(t, name, torch.Tensor, "a torch.Tensor")
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
        check_instance(t, name, torch.Tensor, "a torch.Tensor")
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
        check_instance(t, name, torch.Tensor, "a torch.Tensor")
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


def check_packed_batch(input_ids, positions, attn_metadata, caches, num_layers: int, logits_rows=None) -> None:
    """A packed batch's tokens against its attention metadata and the caches (``LlamaForCausalLM.forward``'s inputs).

    The forward checks its first layer's K/V write and attention in full and the other layers' not
    at all, so here every layer's caches must be like the first layer's.

    Args:
        input_ids, positions: int64 ``[num_tokens]``, every sequence's new tokens and their positions.
        attn_metadata: an :class:`~minipaged.attention.AttentionMetadata` whose ``slot_mapping`` and
            ``query_start_loc`` must describe ``num_tokens`` tokens.
        caches: per layer, the ``(k_cache, v_cache)`` given.
        num_layers: the model's layers.
        logits_rows: None, or the packed tokens whose logits the forward returns (:func:`check_logits_rows`).

    Raises:
        TypeError: a layer's caches are not two tensors.
        ValueError: a shape that does not fit, or a layer's caches unlike the first layer's
            (shape, dtype, device or layout).
    """
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
    if logits_rows is not None:
        check_logits_rows(logits_rows, num_tokens)


def check_logits_rows(logits_rows, num_tokens: int) -> torch.Tensor:
    """``LlamaForCausalLM.forward``'s ``logits_rows`` (see it) as an int64 tensor; a ValueError names a bad one."""
    rows = logits_rows if isinstance(logits_rows, torch.Tensor) else torch.tensor(list(logits_rows) or [], dtype=None)
    rows = rows.long() if rows.numel() == 0 else rows  # an empty list: no sequence ends this step
    if rows.dtype != torch.int64 or rows.dim() != 1 or (len(rows) and not 0 <= rows.min() <= rows.max() < num_tokens):
        raise ValueError(f"logits_rows must be ints in [0, {num_tokens}) (the packed batch's tokens), "
                         f"got {logits_rows!r}")  # fmt: skip
    return rows


def check_backend_registration(name, backend, replace, registry: dict, backend_class: type) -> None:
    """The arguments of ``attention.register_backend``, checked before the registry changes.

    Args:
        name: the key, a non-empty str not in ``registry`` (unless ``replace``).
        backend: a ``backend_class`` instance named ``name``, or a function (a loader that returns one).
        replace: a bool; True allows replacing a registered name.
        registry: the registry as it is now.
        backend_class: :class:`~minipaged.attention.AttentionBackend`.

    Raises:
        TypeError: ``name`` is not a str, ``replace`` not a bool, or ``backend`` neither a backend nor a function.
        ValueError: ``name`` is empty or taken (without ``replace``), or ``backend`` carries another name.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__} {name!r:.60}")
    if not name:
        raise ValueError("name must not be empty")
    if not isinstance(replace, bool):
        raise TypeError(f"replace must be a bool, got {type(replace).__name__}")
    if isinstance(backend, backend_class):
        if backend.name != name:
            raise ValueError(f"backend is named {backend.name!r}, but it is being registered as {name!r}")
    elif not callable(backend):
        raise TypeError(f"backend must be an AttentionBackend or a function that returns one, "
                        f"got {type(backend).__name__}")  # fmt: skip
    if name in registry and not replace:
        raise ValueError(f"backend {name!r} is already registered; pass replace=True to replace it")


def check_loaded_backend(entry, name: str, backend_class: type) -> None:
    """A ``TypeError`` unless a backend loader returned a ``backend_class`` named ``name``.

    Args:
        entry: what the loader registered as ``name`` returned.
        name: the registered name.
        backend_class: :class:`~minipaged.attention.AttentionBackend`.
    """
    if not isinstance(entry, backend_class) or entry.name != name:
        raise TypeError(f"the loader of backend {name!r} must return an AttentionBackend named {name!r}, "
                        f"got {entry!r:.80}")  # fmt: skip
