"""Chunked-prefill attention in Triton: a tile of queries from one sequence per program.

Layout as in :mod:`.paged_attention`, plus the packed queries of
:func:`minipaged.attention.paged_prefill_attention`:

* ``q``               ``[num_tokens, num_heads, head_dim]``: sequence ``i``'s new tokens are rows
  ``query_start_loc[i] : query_start_loc[i + 1]``, the last ``q_len`` positions of its context
* ``seq_lens``        ``[num_seqs]``, context length *after* this chunk (its K/V already written)
* ``query_start_loc`` ``[num_seqs + 1]``, cumulative query counts from 0

Why a different loop from decode. A decode program owns one query (times its GQA group)
and must read its whole context once; nothing can be shared. A prefill chunk has ``q_len``
queries of one sequence, and query ``j`` sees positions ``0 .. context_len + j``: every
query reads the same prefix. So one program takes a **query tile** of ``BLOCK_Q``
consecutive queries (times the ``GROUP`` query heads of one KV head: ``BLOCK_Q * GROUP``
rows of one ``tl.dot``) and walks the paged context **once** for all of them. Running
each query as its own decode "sequence" (:func:`prefill_as_decode`) reads the prefix
``q_len`` times instead.

1. **Grid** ``(num_tokens // BLOCK_Q + num_seqs, num_kv_heads)``. Sequence ``i``'s query
   tiles are programs ``query_start_loc[i] // BLOCK_Q + i`` onwards; a program finds its
   sequence by binary search over that increasing list (:func:`_find_seq`), so the
   launch needs no host-side loop and no read of ``query_start_loc``. The count is an
   upper bound: a program past its sequence's last tile returns at once.
2. **Causal mask aligned to the end of the context** (chapter 03): the chunk is the last
   ``q_len`` positions, so query ``j`` sits at ``context_len + j`` with
   ``context_len = seq_len - q_len`` and sees key ``t`` iff ``t <= context_len + j``.
   The tile's last query bounds the loop: keys after it are never read.
3. **Online softmax** in fp32, per row: each tile is one call of decode's step,
   :func:`.attend_tile`, with the causal mask as its ``visible``.
4. **Padding.** Rows past ``BLOCK_Q * GROUP`` or past the chunk load zeros and are never
   stored; head dims are padded to ``HEAD_DIM_PAD`` lanes as in decode.

Decode rows are chunks of one query, so a mixed step (decodes and prefill chunks, chapter
05) runs in **one launch** of this kernel. A decode-only step still goes to
:func:`.paged_decode_attention`: its programs carry only the GQA group (no rows wasted on
a query tile), and it splits long contexts across programs (split-KV), which this kernel
does not.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minipaged._triton import check_device, interpreted
from minipaged.attention_checks import check_paged_attention
from minipaged.pieces import unbuilt
from minipaged.validation import check_scale

from .paged_attention import attend_tile, check_supported, load_kv_tile, paged_decode_attention

# Rows (query tokens x the GQA group) one program serves per tl.dot; BLOCK_Q = ROWS // GROUP queries.
ROWS = 64
# Keys per loop step.
KV_TILE = 32


def query_tile(group: int) -> tuple[int, int]:
    """``(BLOCK_Q, BLOCK_M)`` for a GQA group: queries per program, and rows padded to a power of two >= 16."""
    block_q = max(1, ROWS // group)
    return block_q, max(16, triton.next_power_of_2(block_q * group))


@triton.jit
def _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence ``i`` with ``query_start_loc[i] // BLOCK_Q + i <= tile`` (a binary search)."""
    lo: tl.int32 = 0  # a loop-carried int32 on the GPU from the start
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr,
    scale, num_seqs,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bts, stride_btb,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # queries per program
    BLOCK_M: tl.constexpr,  # rows: BLOCK_Q * GROUP rounded up to a power of two >= 16 (tl.dot's M)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two for tl.arange
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,  # keys per loop step
    DOT_FP32: tl.constexpr,  # cast tiles to fp32 before tl.dot: fp32 inputs, or the interpreter
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, tile_id, num_seqs, BLOCK_Q)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    q_tile = tile_id - (q_begin // BLOCK_Q + seq)  # this program's query tile within its sequence
    if q_tile * BLOCK_Q >= q_len:
        return  # the grid is an upper bound: no queries left for this program

    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # tokens before this chunk

    # Row r is query q_tile * BLOCK_Q + r // GROUP, query head kv_head * GROUP + r % GROUP.
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // GROUP
    heads = rows % GROUP + kv_head * GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = context_len + q_idx  # each row's position in the sequence: the causal bound
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM

    q_rows = (q_begin + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
        mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    # The tile's last query sees keys up to its own position; nothing after it is read.
    kv_end = tl.minimum(seq_len, context_len + (q_tile + 1) * BLOCK_Q)
    block_table = block_tables_ptr + seq * stride_bts
    offs = tl.arange(0, TILE)
    for tile_start in range(0, kv_end, TILE):
        tokens = tile_start + offs
        valid = tokens < kv_end
        k, v = load_kv_tile(
            k_cache_ptr, v_cache_ptr, block_table, tokens, valid, kv_head, dims, dim_ok,
            stride_kb, stride_kt, stride_kh, stride_kd,
            stride_vb, stride_vt, stride_vh, stride_vd,
            stride_btb, BLOCK_SIZE, DOT_FP32,
        )

        visible = valid[None, :] & (tokens[None, :] <= q_pos[:, None])  # causal, aligned to the context's end
        # Key 0 is visible to every row (q_pos >= 0) and lies in the first tile, so m_i is
        # finite from the first step on, and a later tile that a row cannot see adds nothing.
        m_i, l_i, acc = attend_tile(q, k, v, visible, m_i, l_i, acc, scale)

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :],
    )


def paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *, scale=None, validate=True):
    """Chunked-prefill attention (decode rows included): each sequence's packed queries over its paged context.

    The inputs are :func:`minipaged.attention.paged_prefill_attention`'s (see the module
    docstring), checked by the same :func:`minipaged.attention_checks.check_paged_attention`,
    plus the kernels' limits (:func:`.check_supported`). Returns ``[num_tokens, num_heads,
    head_dim]`` in ``q.dtype``; ``scale`` defaults to ``head_dim ** -0.5``.

    The grid depends on shapes only, so ``validate=False`` (skip the checks that read
    ``seq_lens``, ``block_tables`` and ``query_start_loc``) makes the call free of host-device
    syncs; out-of-range values are then undefined behaviour, as in vLLM.
    """
    check_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, check_values=validate)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_supported(block_size, head_dim, q.dtype)
    check_device(q.device)
    scale = check_scale(scale, head_dim)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    num_seqs = block_tables.shape[0]
    if num_tokens == 0:
        return out
    todo = unbuilt(attend_tile)  # a learner's handout before exercise 04: a raise cannot run inside the kernel
    if todo is not None:
        raise todo
    group = num_heads // num_kv_heads
    block_q, block_m = query_tile(group)
    _paged_prefill_kernel[(num_tokens // block_q + num_seqs, num_kv_heads)](
        q, k_cache, v_cache, block_tables, seq_lens.contiguous(), query_start_loc.contiguous(), out,
        scale, num_seqs,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        TILE=KV_TILE,
        DOT_FP32=interpreted() or q.dtype == torch.float32,
    )
    return out


def prefill_as_decode(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *, scale=None):
    """Prefill with the decode kernel, the stand-in the prefill kernel replaced: what chapter 04 measures against.

    Query ``j`` of a chunk becomes its own decode "sequence" that shares its parent's block
    table row and has ``context_len + j + 1`` tokens, so the decode kernel's length mask is
    exactly the causal mask. Right, but every query re-reads its whole prefix.
    """
    check_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    starts = query_start_loc.tolist()
    rows, lens = [], []
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_len = starts[i + 1] - starts[i]
        rows += [i] * q_len
        lens += range(seq_len - q_len + 1, seq_len + 1)
    rows = torch.tensor(rows, dtype=torch.long, device=q.device)
    lens = torch.tensor(lens, dtype=torch.int32, device=q.device)
    return paged_decode_attention(q, k_cache, v_cache, block_tables[rows], lens, scale=scale, num_splits=1)


def prefill_kv_tokens(seq_lens, query_lens, group: int) -> tuple[int, int]:
    """K/V token rows one KV head reads for a batch: ``(prefill_as_decode, the prefill kernel)``.

    Counted from the launch grid and the tile loops, not measured. Masked lanes are not
    memory reads, so a program reads exactly the tokens its loop leaves unmasked:

    * as decode (``num_splits=1``), query ``j`` of a chunk is a program over
      ``context_len + j + 1`` tokens;
    * the prefill kernel's query tile ``t`` reads ``min(seq_len, context_len + (t + 1) * BLOCK_Q)``.

    Multiply by ``2 * num_kv_heads * head_dim * element_size`` for bytes (K and V).

    Args:
        seq_lens: each sequence's context length after the chunk.
        query_lens: each sequence's chunk length (``1 <= q_len <= seq_len``).
        group: query heads per KV head (it sets ``BLOCK_Q``).
    """
    block_q, _ = query_tile(group)
    as_decode = prefill = 0
    for seq_len, q_len in zip(seq_lens, query_lens):
        context_len = seq_len - q_len
        as_decode += sum(context_len + j + 1 for j in range(q_len))
        prefill += sum(min(seq_len, context_len + (t + 1) * block_q) for t in range(triton.cdiv(q_len, block_q)))
    return as_decode, prefill


__all__ = ["paged_prefill_attention", "prefill_as_decode", "prefill_kv_tokens", "query_tile"]
