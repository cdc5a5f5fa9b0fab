"""Attention that reads K/V through a block table, and the contiguous reference it must match.

Per layer the cache is ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]``.
A sequence's logical token ``t`` lives in physical block ``block_tables[s, t // block_size]``
at offset ``t % block_size``; its *slot* is ``block_id * block_size + offset``.

- The write path, new tokens' K/V to their slots, is chapter 02's :func:`minipaged.cache.write_kv`.
- :func:`paged_attention` is the decode read path: one query token per sequence.
- :func:`paged_prefill_attention` is the prefill / chunked-prefill read path: several
  query tokens per sequence, packed, each attending causally over the paged context.
- :class:`AttentionMetadata` describes one packed batch: where each new token's K/V
  goes and what each sequence reads.

Every read path has the same signature and the same input checks
(:func:`minipaged.validation.check_paged_attention`) for every backend:

- ``"loop"``: block by block, one sequence at a time. Slow and obviously right.
- ``"torch"``: vectorised gather through the block table, masked softmax, batched matmul.
- ``"triton"``: the chapter-04 kernels in :mod:`minipaged.kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from minipaged.accounting import blocks_needed
from minipaged.block_manager import BlockTable, block_tables_tensor
from minipaged.validation import check_choice, check_paged_attention, check_scale, check_tensor

BACKENDS = ("loop", "torch", "triton")

# Gathered K+V bytes the "torch" backend handles at once. A short batch is gathered
# whole (one gather and one attention call per layer, whatever the batch size). A
# long one goes a few sequences at a time, so that the copy is still in the CPU
# cache when the attention reads it back: at 32 sequences x 1024 tokens x 8 KV heads
# of 128 (256 MiB) gathering everything first measured several times slower.
GATHER_BUDGET_BYTES = 8 << 20


# --------------------------------------------------------------------------- reference


def contiguous_attention(q, k, v, *, scale=None, causal=True):
    """Reference attention for one sequence whose K/V sit in one contiguous tensor.

    ``q: [q_len, num_heads, head_dim]``, ``k, v: [kv_len, num_kv_heads, head_dim]``.
    The queries are the *last* ``q_len`` positions of the context, so query ``i``
    sits at position ``kv_len - q_len + i`` and (with ``causal``) sees keys up to
    and including that position. Computed with ``scaled_dot_product_attention`` in
    float32 (float64 for float64 inputs, the exact reference :mod:`minipaged.testing` uses);
    returns ``[q_len, num_heads, head_dim]`` in ``q.dtype``.
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
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = F.scaled_dot_product_attention(
        q.to(compute).transpose(0, 1),
        k.to(compute).transpose(0, 1),
        v.to(compute).transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1).to(q.dtype)


# --------------------------------------------------------------------------- backends


def _check_backend(backend):
    check_choice(backend, "backend", BACKENDS)


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


# --------------------------------------------------------------------------- the loop reference


def _attend_blocks(q, k_cache, v_cache, block_ids, seq_len, scale):
    """One sequence, block by block: ``q [q_len, num_heads, head_dim]`` are its last ``q_len`` tokens."""
    q_len, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    q = q.float().view(q_len, num_kv_heads, group, head_dim) * scale
    query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
    scores, values = [], []
    for logical in range(blocks_needed(seq_len, block_size)):
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
    if backend == "triton":  # the kernel runs the same checks, plus its own limits
        return _kernel("paged_decode_attention")(q, k_cache, v_cache, block_tables, seq_lens, scale=scale)
    check_paged_attention(q, k_cache, v_cache, block_tables, seq_lens)
    scale = check_scale(scale, q.shape[-1])
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
    ctx = blocks_needed(max(lens), block_size) * block_size
    # Every position's slot, through the block table. Positions past a sequence's end
    # (the unwritten tail of its last block, and whole blocks that only a longer
    # sequence in the batch has) read the sequence's first slot instead: its own,
    # always written, so finite. Their weight is made 0 by the mask; a 0 weight would
    # not cancel whatever else might be there (0 * NaN = NaN).
    pos = torch.arange(ctx, device=q.device)
    valid = pos[None, :] < seq_lens[:, None]  # [num_seqs, ctx]
    slots = block_tables[:, pos // block_size].long() * block_size + pos % block_size
    slots = torch.where(valid, slots, slots[:, :1])
    # GQA without copying K/V per query head: the `group` query heads that share a KV
    # head are that head's `group` query rows, all against the same keys.
    qg = q.reshape(num_seqs, num_kv_heads, group, head_dim).float()
    out = torch.empty(num_seqs, num_kv_heads, group, head_dim, device=q.device)
    # One row per slot. A view of the pool when it is contiguous (always, in the engine); a copy when a
    # caller passes a strided view, as the loop and Triton paths accept too.
    rows_k, rows_v = k_cache.reshape(-1, num_kv_heads, head_dim), v_cache.reshape(-1, num_kv_heads, head_dim)
    chunk = max(1, GATHER_BUDGET_BYTES // (2 * ctx * num_kv_heads * head_dim * k_cache.element_size()))
    k_buf, v_buf = _gather_buffers(min(chunk, num_seqs) * ctx // block_size, k_cache)
    for start in range(0, num_seqs, chunk):
        end = min(start + chunk, num_seqs)
        n = blocks_needed(max(lens[start:end]), block_size) * block_size  # this chunk's context
        ids = slots[start:end, :n].flatten()
        # One index_select per cache: every sequence's context, in logical order, in one buffer.
        k = torch.index_select(rows_k, 0, ids, out=k_buf.view(-1, num_kv_heads, head_dim)[: len(ids)])
        v = torch.index_select(rows_v, 0, ids, out=v_buf.view(-1, num_kv_heads, head_dim)[: len(ids)])
        k = k.view(end - start, n, num_kv_heads, head_dim).transpose(1, 2).float()  # [c, num_kv_heads, n, head_dim]
        v = v.view(end - start, n, num_kv_heads, head_dim).transpose(1, 2).float()
        mask = valid[start:end, None, None, :n] if min(lens[start:end]) < n else None
        # One fused call: scores, masked softmax and the weighted sum of V.
        out[start:end] = F.scaled_dot_product_attention(qg[start:end], k, v, attn_mask=mask, scale=scale)
    return out.view(num_seqs, num_heads, head_dim).to(q.dtype)


# --------------------------------------------------------------------------- prefill


def paged_prefill_attention(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *, scale=None, backend="torch"
):
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
    if backend == "triton":  # one launch for the whole batch; the kernel runs the same checks, plus its own limits
        return _kernel("paged_prefill_attention")(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=scale
        )
    check_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    starts = query_start_loc.tolist()
    scale = check_scale(scale, q.shape[-1])
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
        ids = block_tables[i, : blocks_needed(seq_len, block_size)]
        # Slicing to seq_len drops the unwritten tail, so no masking of V is needed here.
        k = k_cache.index_select(0, ids).view(-1, num_kv_heads, head_dim)[:seq_len]
        v = v_cache.index_select(0, ids).view(-1, num_kv_heads, head_dim)[:seq_len]
        out[a:b] = contiguous_attention(q[a:b], k, v, scale=scale)
    return out


# --------------------------------------------------------------------------- one batch, as the model sees it


@dataclass
class AttentionMetadata:
    """What the attention layers need to know about one packed batch, beyond the tokens themselves.

    Sequence ``i``'s new tokens are ``input_ids[query_start_loc[i] : query_start_loc[i + 1]]``,
    the last ``num_new_tokens[i]`` positions of its context.
    """

    slot_mapping: torch.Tensor  # int64 [num_tokens]: where each new token's K/V is written; -1 = nowhere
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]: logical block -> physical block
    seq_lens: torch.Tensor  # int32 [num_seqs]: context length *after* this step's tokens are written
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]: cumulative num_new_tokens, starting at 0
    max_query_len: int  # 1 means a decode-only batch (paged_attention); more means prefill chunks

    @classmethod
    def pack(cls, tables: list[BlockTable], num_new_tokens: list[int], slot_mapping: torch.Tensor, device="cpu"):
        """Describe a step whose new tokens were just appended to the tables.

        Args:
            tables: one :class:`~minipaged.block_manager.BlockTable` per sequence, already
                holding this step's tokens.
            num_new_tokens: ``num_new_tokens[i]`` tokens of ``tables[i]`` are computed in this step.
            slot_mapping: int64 ``[sum(num_new_tokens)]``, the slots ``append_tokens`` returned.
            device: where the metadata tensors go (the model's device).
        """
        return cls(
            slot_mapping=slot_mapping.to(device),
            block_tables=block_tables_tensor(tables).to(device),
            seq_lens=torch.tensor([t.num_tokens for t in tables], dtype=torch.int32, device=device),
            query_start_loc=torch.tensor([0, *accumulate(num_new_tokens)], dtype=torch.int32, device=device),
            max_query_len=max(num_new_tokens),
        )

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1

    def positions(self) -> torch.Tensor:
        """int64 ``[num_tokens]``: each new token's position in its sequence (for RoPE)."""
        num_new_tokens = (self.query_start_loc[1:] - self.query_start_loc[:-1]).long()
        first = torch.repeat_interleave(self.seq_lens.long() - num_new_tokens, num_new_tokens)
        starts = torch.repeat_interleave(self.query_start_loc[:-1].long(), num_new_tokens)
        return first + torch.arange(len(first), device=first.device) - starts


__all__ = ["BACKENDS", "AttentionMetadata", "contiguous_attention", "paged_attention", "paged_prefill_attention"]
