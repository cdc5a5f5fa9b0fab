"""Attention that reads K/V through a block table, and the contiguous reference it must match.

Per layer the cache is ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]``.
A sequence's logical token ``t`` lives in physical block ``block_tables[s, t // block_size]``
at offset ``t % block_size``; its *slot* is ``block_id * block_size + offset``.

- :func:`write_kv` is the write path: new tokens' K/V go to their slots (``-1`` = skip).
- :func:`paged_attention` is the decode read path: one query token per sequence.
- :func:`paged_prefill_attention` is the prefill / chunked-prefill read path: several
  query tokens per sequence, packed, each attending causally over the paged context.

Every read path has the same signature for every backend:

- ``"loop"``: block by block, one sequence at a time. Slow and obviously right.
- ``"torch"``: vectorised gather through the block table, masked softmax, batched matmul.
- ``"triton"``: the chapter-04 kernels in :mod:`minipaged.kernels`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BACKENDS = ("loop", "torch", "triton")

# Gathered K+V bytes the "torch" backend handles at once. Small, so that the copy
# is still in the CPU cache when the matmuls read it back: gathering a whole batch
# of long sequences first, then computing, measured 5-8x slower than one sequence
# at a time. Short sequences are still batched together, which saves Python overhead.
GATHER_BUDGET_BYTES = 1 << 20


# --------------------------------------------------------------------------- reference


def contiguous_attention(q, k, v, *, scale=None, causal=True):
    """Reference attention for one sequence whose K/V sit in one contiguous tensor.

    ``q: [q_len, num_heads, head_dim]``, ``k, v: [kv_len, num_kv_heads, head_dim]``.
    The queries are the *last* ``q_len`` positions of the context, so query ``i``
    sits at position ``kv_len - q_len + i`` and (with ``causal``) sees keys up to
    and including that position. Computed in float32 with
    ``scaled_dot_product_attention``; returns ``[q_len, num_heads, head_dim]`` in ``q.dtype``.
    """
    q_len, kv_len = q.shape[0], k.shape[0]
    if q_len > kv_len:
        raise ValueError(f"q has {q_len} tokens but k only {kv_len}: the queries must be part of the context")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"num_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({k.shape[1]})")
    mask = None
    if causal and q_len > 1:
        # SDPA's is_causal aligns query 0 with key 0; our queries are the end of the context.
        query_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
        mask = torch.arange(kv_len, device=q.device)[None, :] <= query_pos[:, None]
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1),
        k.float().transpose(0, 1),
        v.float().transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1).to(q.dtype)


# --------------------------------------------------------------------------- validation


def _check_backend(backend):
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def _check_common(q, k_cache, v_cache, block_tables, seq_lens, num_seqs):
    """Shapes, dtypes, devices and lengths shared by the decode and prefill paths."""
    for name, t in [("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables), ("seq_lens", seq_lens)]:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D [tokens, num_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache has shape {tuple(v_cache.shape)}, but k_cache has {tuple(k_cache.shape)}")
    num_heads, head_dim = q.shape[1:]
    num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"q has head_dim {head_dim}, but k_cache has head_dim {cache_head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"q's num_heads ({num_heads}) must be a multiple of k_cache's num_kv_heads ({num_kv_heads})")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [num_seqs={num_seqs}, max_blocks_per_seq], got shape {tuple(block_tables.shape)}")
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens must be [num_seqs={num_seqs}], got shape {tuple(seq_lens.shape)}")

    if not q.dtype.is_floating_point:
        raise TypeError(f"q must be a floating-point tensor, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype} and {v_cache.dtype}")
    if block_tables.dtype != torch.int32:
        raise TypeError(f"block_tables must be int32, got {block_tables.dtype}")
    if seq_lens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"seq_lens must be int32 or int64, got {seq_lens.dtype}")
    for name, t in [("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables), ("seq_lens", seq_lens)]:
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, but q is on {q.device}: all inputs must share a device")
    if num_seqs == 0:
        return

    lens = seq_lens.tolist()
    max_blocks_per_seq = block_tables.shape[1]
    if min(lens) < 1:
        raise ValueError(f"seq_lens must be >= 1 (the current token is already in the cache), got {min(lens)}")
    if max(lens) > max_blocks_per_seq * block_size:
        raise ValueError(
            f"seq_lens holds {max(lens)}, but block_tables has room for only "
            f"{max_blocks_per_seq} blocks x {block_size} = {max_blocks_per_seq * block_size} tokens"
        )
    # Only the blocks a sequence owns are read, so only those must point into the pool.
    owned = torch.arange(max_blocks_per_seq, device=q.device)[None, :] < (seq_lens[:, None] + block_size - 1) // block_size
    bad = owned & ((block_tables < 0) | (block_tables >= num_blocks))
    if bad.any():
        s, i = bad.nonzero()[0].tolist()
        raise IndexError(f"block_tables[{s}, {i}] = {int(block_tables[s, i])} is outside the pool's {num_blocks} blocks")


def _check_query_start_loc(query_start_loc, seq_lens, num_tokens, device):
    if not isinstance(query_start_loc, torch.Tensor):
        raise TypeError(f"query_start_loc must be a torch.Tensor, got {type(query_start_loc).__name__}")
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] < 1:
        raise ValueError(f"query_start_loc must be [num_seqs + 1], got shape {tuple(query_start_loc.shape)}")
    if query_start_loc.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"query_start_loc must be int32 (or int64), got {query_start_loc.dtype}")
    if query_start_loc.device != device:
        raise ValueError(f"query_start_loc is on {query_start_loc.device}, but q is on {device}")
    starts = query_start_loc.tolist()
    if starts[0] != 0 or starts[-1] != num_tokens:
        raise ValueError(f"query_start_loc must run from 0 to num_tokens={num_tokens}, got {starts[0]} .. {starts[-1]}")
    query_lens = [b - a for a, b in zip(starts, starts[1:])]
    for i, (q_len, ctx) in enumerate(zip(query_lens, seq_lens.tolist())):
        if not 1 <= q_len <= ctx:
            raise ValueError(f"sequence {i} has {q_len} query tokens; it needs 1 .. seq_lens[{i}]={ctx}")
    return starts


def _kernel(name):
    """A chapter-04 kernel, imported only when asked for, with an error that says what to do."""
    try:
        from minipaged import kernels
    except ImportError as exc:
        raise ImportError(f"backend='triton' needs minipaged.kernels ({exc}); use backend='torch' instead") from exc
    fn = getattr(kernels, name, None)
    if fn is None:
        raise NotImplementedError(f"minipaged.kernels has no {name} yet (chapter 04 writes it); use backend='torch'")
    return fn


# --------------------------------------------------------------------------- write path


def write_kv(key, value, k_cache, v_cache, slot_mapping, *, backend="torch"):
    """Store token ``i``'s K/V ``[num_tokens, num_kv_heads, head_dim]`` at slot ``slot_mapping[i]``, in place.

    A slot of ``-1`` is skipped (a padding token). ``"triton"`` uses the chapter-04
    scatter kernel; ``"torch"`` and ``"loop"`` (so a model can pass one backend to
    both paths) use one ``index_copy_`` on the flattened cache.
    """
    _check_backend(backend)
    if backend == "triton":
        return _kernel("write_kv")(key, value, k_cache, v_cache, slot_mapping)
    for name, t in [("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slot_mapping)]:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    row = tuple(k_cache.shape[2:])
    if key.dim() != 3 or tuple(key.shape[1:]) != row or value.shape != key.shape:
        raise ValueError(f"key and value must be [num_tokens, {row[0]}, {row[1]}], got {tuple(key.shape)} and {tuple(value.shape)}")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [num_tokens={key.shape[0]}], got shape {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"slot_mapping must be int64 (or int32), got {slot_mapping.dtype}")
    if not key.dtype == value.dtype == k_cache.dtype == v_cache.dtype:
        raise TypeError(f"key, value and the caches must share a dtype, got {key.dtype}, {value.dtype}, {k_cache.dtype}")
    for name, t in [("value", value), ("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slot_mapping)]:
        if t.device != key.device:
            raise ValueError(f"{name} is on {t.device}, but key is on {key.device}: all inputs must share a device")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous: a slot is a row of their flattened view")
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if key.shape[0] and not (-1 <= int(slot_mapping.min()) and int(slot_mapping.max()) < num_slots):
        raise IndexError(f"slot_mapping must lie in [-1, {num_slots}) (-1 = skip), got {slot_mapping.min()} .. {slot_mapping.max()}")

    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *row).index_copy_(0, slots, key[keep])
    v_cache.view(-1, *row).index_copy_(0, slots, value[keep])


# --------------------------------------------------------------------------- the loop reference


def _attend_blocks(q, k_cache, v_cache, block_ids, seq_len, scale):
    """One sequence, block by block: ``q [q_len, num_heads, head_dim]`` are its last ``q_len`` tokens."""
    q_len, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    q = q.float().view(q_len, num_kv_heads, group, head_dim) * scale
    query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
    scores, values = [], []
    for logical in range(-(-seq_len // block_size)):
        physical = int(block_ids[logical])  # the block table lookup
        start = logical * block_size
        n = min(block_size, seq_len - start)  # the last block may be partly filled
        k = k_cache[physical, :n].float()  # [n, num_kv_heads, head_dim]
        v = v_cache[physical, :n].float()
        s = torch.einsum("qhgd,khd->qhgk", q, k)  # every query head against its KV head
        key_pos = torch.arange(start, start + n, device=q.device)
        s = s.masked_fill((key_pos[None, :] > query_pos[:, None])[:, None, None, :], float("-inf"))  # causal
        scores.append(s)
        values.append(v)
    p = torch.cat(scores, dim=-1).softmax(dim=-1)  # one softmax over the whole context
    out = torch.einsum("qhgk,khd->qhgd", p, torch.cat(values))
    return out.reshape(q_len, num_heads, head_dim)


# --------------------------------------------------------------------------- decode


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, *, scale=None, backend="torch"):
    """Decode attention: each sequence's one new query against its whole paged context.

    ``q: [num_seqs, num_heads, head_dim]``; ``k_cache, v_cache: [num_blocks,
    block_size, num_kv_heads, head_dim]``; ``block_tables: int32 [num_seqs,
    max_blocks_per_seq]``; ``seq_lens: [num_seqs]`` context lengths *including*
    the current token, whose K/V is already in the cache. ``scale`` defaults to
    ``head_dim ** -0.5``. Returns ``[num_seqs, num_heads, head_dim]`` in ``q.dtype``.
    """
    _check_backend(backend)
    _check_common(q, k_cache, v_cache, block_tables, seq_lens, num_seqs=q.shape[0] if q.dim() == 3 else -1)
    if backend == "triton":
        return _kernel("paged_decode_attention")(q, k_cache, v_cache, block_tables, seq_lens, scale=scale)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if q.shape[0] == 0:
        return torch.empty_like(q)
    if backend == "loop":
        out = [
            _attend_blocks(q[s : s + 1], k_cache, v_cache, block_tables[s], seq_len, scale)
            for s, seq_len in enumerate(seq_lens.tolist())
        ]
        return torch.cat(out).to(q.dtype)
    return _paged_decode_torch(q, k_cache, v_cache, block_tables, seq_lens, scale)


_workspace: dict = {}  # (device, dtype) -> flat gather buffer, kept between calls


def _gather_buffers(num_blocks, k_cache):
    """K and V gather buffers of ``num_blocks`` blocks each, reused across calls and chunks.

    Reused so they stay in the CPU cache, and because a fresh multi-MiB tensor
    per call pays the OS a page fault per 4 KiB on first touch: at batch 1,
    context 1024 that cost more than the attention itself.
    """
    block_shape = k_cache.shape[1:]
    numel = num_blocks * block_shape.numel()
    key = (k_cache.device, k_cache.dtype)
    buf = _workspace.get(key)
    if buf is None or buf.numel() < 2 * numel:
        # A tensor made under inference_mode could not be written outside it later.
        with torch.inference_mode(False):
            buf = _workspace[key] = torch.empty(2 * numel, dtype=k_cache.dtype, device=k_cache.device)
    return buf[:numel].view(num_blocks, *block_shape), buf[numel : 2 * numel].view(num_blocks, *block_shape)


def _paged_decode_torch(q, k_cache, v_cache, block_tables, seq_lens, scale):
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    lens = seq_lens.tolist()
    max_blocks = -(-max(lens) // block_size)
    # Table entries past a sequence's own blocks may hold anything: read block 0 there instead.
    owned = torch.arange(max_blocks, device=q.device)[None, :] < (seq_lens[:, None].long() + block_size - 1) // block_size
    block_ids = torch.where(owned, block_tables[:, :max_blocks], 0)
    past_end = torch.arange(max_blocks * block_size, device=q.device)[None, :] >= seq_lens[:, None]
    # GQA without copying K/V per query head: the `group` query heads that share a
    # KV head become the rows of one matmul against that head's keys.
    qg = q.float().view(num_seqs, num_kv_heads, group, head_dim) * scale
    out = torch.empty(num_seqs, num_kv_heads, group, head_dim, device=q.device)
    chunk = max(1, GATHER_BUDGET_BYTES // (2 * max(lens) * num_kv_heads * head_dim * 4))
    k_buf, v_buf = _gather_buffers(min(chunk, num_seqs) * max_blocks, k_cache)
    for start in range(0, num_seqs, chunk):
        end = min(start + chunk, num_seqs)
        n = -(-max(lens[start:end]) // block_size)
        ctx = n * block_size
        # One index_select per cache: whole blocks, in logical order, into a contiguous buffer.
        ids = block_ids[start:end, :n].flatten()
        k = torch.index_select(k_cache, 0, ids, out=k_buf[: len(ids)])
        v = torch.index_select(v_cache, 0, ids, out=v_buf[: len(ids)])
        k = k.view(end - start, ctx, num_kv_heads, head_dim).float()
        v = v.view(end - start, ctx, num_kv_heads, head_dim).float()
        scores = qg[start:end] @ k.permute(0, 2, 3, 1)  # [c, num_kv_heads, group, ctx]
        if min(lens[start:end]) < ctx:
            pad = past_end[start:end, :ctx]
            scores.masked_fill_(pad[:, None, None, :], float("-inf"))
            # Rows past a sequence's length may hold NaN (an unwritten slot, another sequence's
            # block). A 0 softmax weight does not cancel NaN (0 * NaN = NaN), so overwrite
            # them, and only them: a mask over all of v would cost another pass over it.
            v[pad.nonzero(as_tuple=True)] = 0
        torch.matmul(scores.softmax(dim=-1), v.transpose(1, 2), out=out[start:end])
    return out.view(num_seqs, num_heads, head_dim).to(q.dtype)


# --------------------------------------------------------------------------- prefill


def paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *, scale=None, backend="torch"):
    """Prefill or chunked-prefill attention over the paged context, several queries per sequence.

    ``q: [num_tokens, num_heads, head_dim]`` packs every sequence's new tokens:
    sequence ``i`` owns rows ``query_start_loc[i] : query_start_loc[i + 1]``.
    ``seq_lens[i]`` is its context length *after* this chunk, and the chunk's
    K/V are already in the cache. So the chunk is the last ``q_len`` positions
    of the context, and query ``j`` attends causally over positions
    ``0 .. seq_len - q_len + j``: the earlier chunks already paged in, plus
    this chunk up to itself. Returns ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.
    """
    _check_backend(backend)
    num_seqs = query_start_loc.shape[0] - 1 if isinstance(query_start_loc, torch.Tensor) and query_start_loc.dim() == 1 else -1
    _check_common(q, k_cache, v_cache, block_tables, seq_lens, num_seqs=num_seqs)
    starts = _check_query_start_loc(query_start_loc, seq_lens, q.shape[0], q.device)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if backend == "triton":
        return _prefill_as_decode(q, k_cache, v_cache, block_tables, seq_lens, starts, scale)
    block_size = k_cache.shape[1]
    num_kv_heads, head_dim = k_cache.shape[2:]
    out = torch.empty_like(q)
    # In a mixed step (chapter 05: decodes plus prefill chunks) a one-token query is
    # plain decode: those rows take the vectorised decode path in one call instead of
    # one small attention call per sequence.
    decoding = [i for i in range(len(starts) - 1) if starts[i + 1] - starts[i] == 1] if backend == "torch" else []
    if len(decoding) > 1:
        rows = torch.tensor([starts[i] for i in decoding], device=q.device)
        seqs = torch.tensor(decoding, device=q.device)
        out[rows] = _paged_decode_torch(q[rows], k_cache, v_cache, block_tables[seqs], seq_lens[seqs], scale)
    done = set(decoding) if len(decoding) > 1 else set()
    for i, seq_len in enumerate(seq_lens.tolist()):
        if i in done:
            continue
        a, b = starts[i], starts[i + 1]
        if backend == "loop":
            out[a:b] = _attend_blocks(q[a:b], k_cache, v_cache, block_tables[i], seq_len, scale).to(q.dtype)
            continue
        ids = block_tables[i, : -(-seq_len // block_size)]
        # Slicing to seq_len drops the unwritten tail, so no masking of V is needed here.
        k = k_cache.index_select(0, ids).view(-1, num_kv_heads, head_dim)[:seq_len]
        v = v_cache.index_select(0, ids).view(-1, num_kv_heads, head_dim)[:seq_len]
        out[a:b] = contiguous_attention(q[a:b], k, v, scale=scale)
    return out


def _prefill_as_decode(q, k_cache, v_cache, block_tables, seq_lens, starts, scale):
    """Prefill with the decode kernel: query ``j`` of a chunk is a decode query whose context ends at itself.

    Each query token becomes its own "sequence" that shares its parent's block
    table row and has ``seq_len - q_len + j + 1`` tokens, so the kernel's
    length mask is exactly the causal mask. Nothing is copied but table rows.
    """
    rows, lens = [], []
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_len = starts[i + 1] - starts[i]
        rows += [i] * q_len
        lens += range(seq_len - q_len + 1, seq_len + 1)
    rows = torch.tensor(rows, device=q.device)
    lens = torch.tensor(lens, dtype=torch.int32, device=q.device)
    return _kernel("paged_decode_attention")(q, k_cache, v_cache, block_tables[rows], lens, scale=scale)


__all__ = ["BACKENDS", "contiguous_attention", "paged_attention", "paged_prefill_attention", "write_kv"]
