"""Paged decode attention in Triton: one query token per sequence, K/V read through a block table.

Layout (vLLM's flash layout, see CONTRIBUTING.md):

* ``q``            ``[num_seqs, num_heads, head_dim]``, the current token of every sequence
* ``k_cache``      ``[num_blocks, block_size, num_kv_heads, head_dim]`` (``v_cache`` the same)
* ``block_tables`` ``int32 [num_seqs, max_blocks_per_seq]``, logical block -> physical block
* ``seq_lens``     ``int32 [num_seqs]``, context length *including* the current token

Design, in the order the chapter builds it:

1. **One program per (sequence, KV head).** With grouped-query attention the
   ``num_heads // num_kv_heads`` query heads of a group read the *same* K/V, so one
   program loads each K/V tile once and serves the whole group with ``tl.dot``.
   The group is padded to ``GROUP_PAD`` >= 16 rows (padding rows hold zeros and are
   never stored): a tensor-core instruction computes 16 rows or more anyway, and Triton
   before PR #7451 refused a ``tl.dot`` with fewer.
2. **Walk the sequence tile by tile.** A tile is ``KV_TILE`` tokens, independent of how
   the cache is paged: each token's physical block comes from the block table
   (``block_tables[seq, token // block_size]``), so with 16-token blocks one tile reads
   four blocks, with 256-token blocks a quarter of one, and a block size that is not a
   power of two (12, 48) is only different arithmetic. A tile of 64 keeps enough bytes in
   flight per loop step for a bandwidth-bound kernel, and small enough a K/V tile (64 KB
   at head_dim 256, fp16) for any head size.
   Head dims that are not powers of two (80, 96) are padded the same way:
   ``HEAD_DIM_PAD`` lanes, the ones past ``head_dim`` masked off.
3. **Online softmax in fp32.** A running max ``m``, running denominator ``l`` and
   unnormalised output ``acc`` are rescaled whenever a tile raises the max, so the
   softmax never needs all scores at once. One tile's step is :func:`attend_tile`,
   which the prefill kernel calls too.
4. **Split-KV (flash-decoding).** With few sequences and long contexts the grid
   above has too few programs to keep a GPU busy. A third grid axis cuts each
   sequence into ``num_splits`` ranges; each program writes its partial
   ``(m, l, acc)`` to a workspace and a second kernel merges them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minipaged._triton import check_device, interpreted
from minipaged.attention_checks import check_paged_attention
from minipaged.pieces import unbuilt
from minipaged.validation import check_int, check_scale

# Head dims the kernels take: every multiple of 8 from 16 to 256 (Llama 64/128, Phi-2 80,
# Phi-3-mini 96, 112, 120, 192 ...). tl.arange needs a power of two, so a row is loaded
# HEAD_DIM_PAD = next_power_of_2(head_dim) wide with the lanes past head_dim masked off:
# they load 0, add 0 to every dot product, and are never stored. Multiples of 8 keep
# each fp16 row 16-byte aligned; tl.dot needs >= 16; above 256 one K tile no longer
# fits comfortably in registers/shared memory.
HEAD_DIMS = tuple(range(16, 257, 8))
# Any block size up to this: a token's block is found by integer division through the
# block table, so the block size never sizes a tl.arange.
MAX_BLOCK_SIZE = 256
# Split-KV heuristic: a split should stream at least this many tokens, or the
# extra reduction pass costs more than the parallelism gains.
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64
# Tokens per loop step, whatever the block size: 64 tokens of K and V (32 KB at head_dim
# 128, fp16) per step, and tl.dot's K dimension (the tile) stays >= 16.
KV_TILE = 64
# Stands in for the SM count when there is no GPU, so the heuristic is deterministic on a CPU.
CPU_PARALLELISM = 8


@triton.jit
def load_kv_tile(
    k_cache_ptr, v_cache_ptr, block_table, tokens, valid, kv_head, dims, dim_ok,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_btb,
    BLOCK_SIZE: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """One KV head's K and V rows for a tile of token positions, read through the block table.

    Shared by the decode and the prefill kernel: the paged part of their loops.

    Args:
        k_cache_ptr, v_cache_ptr: the caches, ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_table: this sequence's row of the block table (a pointer to its first entry).
        tokens: ``[TILE]`` positions in the sequence.
        valid: ``[TILE]``, the positions to read; the others load zeros, and their block
            table entries are not looked up.
        kv_head: the KV head to read.
        dims: ``tl.arange(0, HEAD_DIM_PAD)``, the head-dim lanes.
        dim_ok: ``dims < HEAD_DIM``; the padding lanes load zeros.
        stride_kb, stride_kt, stride_kh, stride_kd: ``k_cache``'s strides (block, slot, head, dim).
        stride_vb, stride_vt, stride_vh, stride_vd: ``v_cache``'s strides, the same order.
        stride_btb: the block table's column stride.
        BLOCK_SIZE: tokens per block; any size, only ever divided by.
        DOT_FP32: cast the tiles to fp32 for ``tl.dot`` (fp32 inputs, or the interpreter).

    Returns:
        ``(k, v)``, each ``[TILE, HEAD_DIM_PAD]``, in the cache's dtype (fp32 if ``DOT_FP32``).
    """
    # Logical block -> physical block. Only blocks the sequence owns are looked up:
    # entries past its end may hold anything. int64 before the multiply by the
    # block stride, so a large pool cannot overflow 32-bit offsets. (The tokens of one
    # block all load the same entry; repeated addresses are served from cache.)
    block_ids = tl.load(block_table + (tokens // BLOCK_SIZE) * stride_btb, mask=valid, other=0).to(tl.int64)
    in_block = tokens % BLOCK_SIZE
    kv_mask = valid[:, None] & dim_ok[None, :]
    k = tl.load(
        k_cache_ptr + block_ids[:, None] * stride_kb + in_block[:, None] * stride_kt
        + kv_head * stride_kh + dims[None, :] * stride_kd,
        mask=kv_mask, other=0.0,
    )
    v = tl.load(
        v_cache_ptr + block_ids[:, None] * stride_vb + in_block[:, None] * stride_vt
        + kv_head * stride_vh + dims[None, :] * stride_vd,
        mask=kv_mask, other=0.0,
    )
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def attend_tile(q, k, v, visible, m_i, l_i, acc, scale):
    """One tile's step of the online softmax, for every row of ``q`` at once: the state after the tile.

    Shared by the decode and the prefill kernel: what their loops do with each tile they load. A row is one
    query head of one query token; ``ROWS`` and ``TILE`` are powers of two (``tl.arange``'s), ``ROWS`` padded to 16
    or more (``GROUP_PAD``, ``BLOCK_M``).

    Args:
        q: ``[ROWS, HEAD_DIM_PAD]`` queries, fp32 if the caller's ``DOT_FP32`` is set (padding rows and lanes 0).
        k, v: ``[TILE, HEAD_DIM_PAD]``, the tile's K and V rows from :func:`load_kv_tile`, in the same dtype
            as ``q`` (masked positions hold 0).
        visible: bool, ``[ROWS, TILE]`` or ``[1, TILE]`` for every row alike: which keys of the tile each row
            attends to. An invisible key weighs exactly nothing in that row, whatever its score (where the tile
            has no key, :func:`load_kv_tile` loaded zeros into ``k`` and ``v``).
        m_i: ``[ROWS]`` fp32, each row's running max, which ``l_i`` and ``acc`` are relative to: the largest
            visible score so far (``-inf`` before any), or any larger number that keeps ``exp`` in range.
        l_i: ``[ROWS]`` fp32, each row's running sum of ``exp(score - m_i)``.
        acc: ``[ROWS, HEAD_DIM_PAD]`` fp32, each row's running sum of ``exp(score - m_i) * v``.
        scale: the softmax scale; a score is ``q · k * scale``.

    Returns:
        ``(m_i, l_i, acc)`` after the tile: ``acc / l_i`` is each row's attention over every key it has seen
        visible so far. Both products (``q · Kᵀ`` and ``p · V``) are ``tl.dot``s with
        ``input_precision="ieee"``, and a ``tl.dot``'s operands share a dtype: the fp32 weights ``p`` go to
        ``v``'s dtype (a no-op under ``DOT_FP32``; fp16 or bf16 into the tensor cores on a GPU). A row must see
        at least one key in the first tile its loop visits, or its max stays ``-inf`` and ``-inf - (-inf)``
        makes it NaN; after that, a tile it cannot see adds nothing.
    """
    ### BEGIN SOLUTION (Exercise 04, Task 4.1)
    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [ROWS, TILE], fp32
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp(m_i - m_new)  # rescales what was summed under the old max
    p = tl.exp(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc
    ### END SOLUTION


@triton.jit
def store_partials(
    part_m_ptr, part_l_ptr, part_acc_ptr, m_i, l_i, acc, seq, heads, row_ok, split, dims, dim_ok, num_heads,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """Store one split's partial softmax for a group's query heads, for :func:`launch_decode`'s merge.

    Args:
        part_m_ptr, part_l_ptr: fp32 workspaces ``[num_seqs, num_heads, NUM_SPLITS]``, contiguous.
        part_acc_ptr: fp32 workspace ``[num_seqs, num_heads, NUM_SPLITS, HEAD_DIM]``, contiguous.
        m_i, l_i: ``[GROUP_PAD]``, the split's running max and running sum per row.
        acc: ``[GROUP_PAD, HEAD_DIM_PAD]``, its unnormalised accumulator.
        seq, split: the program's sequence and split.
        heads: ``[GROUP_PAD]``, the query head of each row; ``row_ok`` the rows that are real (not padding).
        dims, dim_ok: the head-dim lanes and which of them are real.
        num_heads: query heads in all: in the decode kernel, ``tl.num_programs(1) * GROUP`` (its grid's second
            axis is the KV heads).
        HEAD_DIM: the real head dim (the workspace's last dimension).
        NUM_SPLITS: splits per (sequence, KV head).
    """
    part = (seq * num_heads + heads) * NUM_SPLITS + split
    tl.store(part_m_ptr + part, m_i, mask=row_ok)
    tl.store(part_l_ptr + part, l_i, mask=row_ok)
    tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    scale,
    stride_qs, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bts, stride_btb,
    stride_os, stride_oh, stride_od,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two >= 16 (tl.dot's M)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two for tl.arange
    BLOCK_SIZE: tl.constexpr,  # any size: only ever divided by, never a tl.arange length
    TILE: tl.constexpr,  # tokens per loop step (KV_TILE), a power of two independent of BLOCK_SIZE
    NUM_SPLITS: tl.constexpr,
    DOT_FP32: tl.constexpr,  # cast tiles to fp32 before tl.dot: fp32 inputs, or the interpreter (its bf16 dot is wrong)
):
    """Decode attention of program ``(seq, kv_head, split)``: the GQA group of ``kv_head``, over ``split``'s tiles.

    Exercise 04, Task 4.1 builds the body below the given lines; :func:`launch_decode` launches it on a grid
    of ``(num_seqs, num_kv_heads, NUM_SPLITS)`` and, with several splits, merges their partials.

    The program serves query heads ``kv_head * GROUP`` to ``kv_head * GROUP + GROUP - 1``, as the rows of one
    ``[GROUP_PAD, HEAD_DIM_PAD]`` query matrix (padding rows and lanes load 0 and are never stored), so that
    each K/V row it reads serves the whole group. The sequence's ``cdiv(seq_len, TILE)`` tiles of ``TILE``
    positions are shared out in runs of ``cdiv(cdiv(seq_len, TILE), NUM_SPLITS)`` whole tiles, one run per
    split, in split order; a split may own none. Each tile's K and V come from :func:`load_kv_tile`, and
    :func:`attend_tile` takes the tile into the online softmax's fp32 state, per row a running max ``m``, a
    running sum ``l`` of ``exp(score - m)`` and an unnormalised ``acc``, the sum of ``exp(score - m) * v``:
    after each tile ``acc / l`` is the attention over the positions seen so far. Positions at or past the
    end of the run are never read and weigh nothing.

    With ``NUM_SPLITS == 1`` the program stores ``acc / l`` into ``out`` at the group's query heads, in
    ``out``'s dtype; otherwise :func:`store_partials` stores the run's ``(m, l, acc)``, with ``m = -inf``,
    ``l = 0`` and ``acc = 0`` for a split that owns no tile.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM  # the padding lanes load 0 and are never stored
    offs = tl.arange(0, TILE)  # a position inside a tile
    seq_len = tl.load(seq_lens_ptr + seq)
    table = block_tables_ptr + seq * stride_bts  # this sequence's row of the block table
    ### BEGIN SOLUTION (Exercise 04, Task 4.1)
    rows = tl.arange(0, GROUP_PAD)  # query heads of this group, padded
    row_ok = rows < GROUP
    heads = kv_head * GROUP + rows

    q = tl.load(
        q_ptr + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
        mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)

    # This program's share of the sequence: whole tiles, so splits never share a tile.
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, TILE), NUM_SPLITS)
    start = split * tiles_per_split * TILE
    end = tl.minimum(start + tiles_per_split * TILE, seq_len)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)  # running max of the scores
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)  # running sum of exp(score - m_i)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)  # running sum of exp(score - m_i) * v

    for tile_start in range(start, end, TILE):
        pos = tile_start + offs
        valid = pos < end  # the last tile of a sequence (or split) is partial
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, table, pos, valid, kv_head, dims, dim_ok, stride_kb, stride_kt,
            stride_kh, stride_kd, stride_vb, stride_vt, stride_vh, stride_vd, stride_btb, BLOCK_SIZE, DOT_FP32)

        # Every tile holds at least one valid token, so the state stays finite from the first tile on.
        m_i, l_i, acc = attend_tile(q, k, v, valid[None, :], m_i, l_i, acc, scale)

    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + seq * stride_os + heads[:, None] * stride_oh + dims[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :],
        )
    else:  # an empty split (a short sequence) stores m = -inf, l = 0, acc = 0: it weighs nothing in the merge
        store_partials(part_m_ptr, part_l_ptr, part_acc_ptr, m_i, l_i, acc, seq, heads, row_ok, split, dims, dim_ok,
                       tl.num_programs(1) * GROUP, HEAD_DIM, NUM_SPLITS)
    ### END SOLUTION


@triton.jit
def _merge_splits_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr,
    stride_os, stride_oh, stride_od,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # NUM_SPLITS rounded up to a power of two for tl.arange
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two for tl.arange
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    part = (seq * tl.num_programs(1) + head) * NUM_SPLITS + splits
    ok = splits < NUM_SPLITS

    m = tl.load(part_m_ptr + part, mask=ok, other=float("-inf"))
    l = tl.load(part_l_ptr + part, mask=ok, other=0.0)
    acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=ok[:, None] & dim_ok[None, :], other=0.0
    )

    # Bring every split to the common max, exactly as the online softmax does per tile.
    m_max = tl.max(m, axis=0)
    weight = tl.exp(m - m_max)  # 0 for padding and for empty splits (m = -inf)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l * weight, axis=0)
    out_ptrs = out_ptr + seq * stride_os + head * stride_oh + dims * stride_od
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, parallelism: int) -> int:
    """How many splits per sequence: enough programs to fill ``parallelism`` units twice, no more.

    Splitting only pays when the plain grid (``num_seqs * num_kv_heads`` programs) is
    smaller than the machine and each split still streams ``MIN_TOKENS_PER_SPLIT`` tokens.
    """
    programs = num_seqs * num_kv_heads
    if programs >= parallelism:
        return 1
    wanted = triton.cdiv(2 * parallelism, programs)
    affordable = max(1, max_seq_len // MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, affordable, MAX_SPLITS))


def check_supported(block_size: int, head_dim: int, dtype: torch.dtype) -> None:
    """Raise unless the kernel can run this cache shape; the engine asks before it builds anything.

    Args:
        block_size: tokens per block: any int from 1 to ``MAX_BLOCK_SIZE``.
        head_dim: one of ``HEAD_DIMS``: a multiple of 8 from 16 to 256.
        dtype: of q and the cache: float32, float16 or bfloat16.

    Raises:
        ValueError: ``block_size`` or ``head_dim`` is outside the kernel's limits.
        TypeError: ``dtype`` is not one the kernel takes.
    """
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"dtype must be float32, float16 or bfloat16 for the kernel, got {dtype}")
    check_layout(block_size, head_dim)


def check_layout(block_size: int, head_dim: int) -> None:
    """Raise ``ValueError`` unless every kernel (attention and write) takes this cache layout."""
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be in 1..{MAX_BLOCK_SIZE} for the kernels, got {block_size}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be a multiple of 8 from 16 to 256 for the kernels, got {head_dim}")


def supports(block_size: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernel can run this ``block_size``, ``head_dim`` and ``dtype`` (see :func:`check_supported`)."""
    try:
        check_supported(block_size, head_dim, dtype)
    except (TypeError, ValueError):
        return False
    return True


def _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, num_splits, validate) -> int | None:
    """The shared checks of every paged-attention backend, then this kernel's own limits.

    Returns ``max(seq_lens)`` when ``validate`` read it (one host-device sync), else None.
    """
    max_seq_len = check_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, check_values=validate)
    _, block_size, _, head_dim = k_cache.shape
    check_supported(block_size, head_dim, q.dtype)
    check_device(q.device)
    if num_splits is not None:
        check_int(num_splits, "num_splits", minimum=1)
        if num_splits > MAX_SPLITS:
            raise ValueError(f"num_splits must be None or an int in 1..{MAX_SPLITS}, got {num_splits}")
    return max_seq_len


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, *, scale=None, num_splits=None, validate=True):
    """Decode attention for one new token per sequence, reading K/V through ``block_tables``.

    The inputs are :func:`minipaged.attention.paged_attention`'s (see the module docstring)
    and are checked by the same :func:`minipaged.attention_checks.check_paged_attention`, plus
    the kernel's limits (:func:`check_supported`): fp32/fp16/bf16, ``block_size`` up to
    ``MAX_BLOCK_SIZE``, ``head_dim`` a multiple of 8 from 16 to 256.

    Returns ``[num_seqs, num_heads, head_dim]`` in ``q.dtype``. ``scale`` defaults to
    ``head_dim ** -0.5``. ``num_splits=None`` picks unsplit or split-KV with
    :func:`choose_num_splits`; an int forces it (1 = unsplit).

    ``validate=False`` skips the checks that read ``seq_lens`` and ``block_tables``
    (their one host-device sync), so a step can be captured in a CUDA graph or timed
    without the sync; the split heuristic then assumes the longest context the block
    table can hold. Out-of-range values are then undefined behaviour, as in vLLM.
    """
    max_len = _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, num_splits, validate)
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    scale = check_scale(scale, head_dim)
    if num_seqs == 0:
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_splits is None:
        parallelism = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else CPU_PARALLELISM
        if max_len is None:
            max_len = block_tables.shape[1] * block_size
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_len, parallelism)
    return launch_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits)


def launch_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, tile=KV_TILE):
    """Launch the decode kernel (and the merge) on inputs :func:`paged_decode_attention` has checked.

    Exercise 04's check calls it directly, with the exercise's tile and its check model's head_dim 8
    (which only the interpreter's ``tl.dot`` takes).

    Args:
        q, k_cache, v_cache, block_tables, seq_lens: as :func:`paged_decode_attention`'s, at least one sequence.
        scale: the softmax scale, a float.
        num_splits: programs per (sequence, KV head), 1 to ``MAX_SPLITS``.
        tile: tokens per loop step, a power of two >= 16 on a GPU.

    Raises:
        PieceNotBuilt: the kernel's body or :func:`attend_tile` is still exercise 04's stub (a learner's handout).
    """
    todo = unbuilt(attend_tile) or unbuilt(_paged_decode_kernel)  # a raise cannot run in a kernel: say it here
    if todo is not None:
        raise todo
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    group = num_heads // num_kv_heads
    seq_lens = seq_lens.contiguous()
    if num_splits == 1:
        part_m = part_l = part_acc = out  # unused: the kernel writes the result directly
    else:
        part_m = torch.empty(num_seqs, num_heads, num_splits, device=q.device, dtype=torch.float32)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(num_seqs, num_heads, num_splits, head_dim, device=q.device, dtype=torch.float32)

    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens,
        out, part_m, part_l, part_acc,
        scale,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        TILE=tile,
        NUM_SPLITS=num_splits,
        DOT_FP32=interpreted() or q.dtype == torch.float32,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            part_m, part_l, part_acc, out, *out.stride(),
            NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        )
    return out


def decode_bytes(q, k_cache, block_tables, seq_lens) -> int:
    """Bytes a decode step must move at least: the K and V rows it reads, q in, out out.

    The benchmark divides this by the measured time to get achieved bandwidth.
    """
    _, _, num_kv_heads, head_dim = k_cache.shape
    kv = 2 * int(seq_lens.sum()) * num_kv_heads * head_dim * k_cache.element_size()
    return kv + 2 * q.numel() * q.element_size() + block_tables.numel() * block_tables.element_size()


__all__ = ["paged_decode_attention", "launch_decode", "choose_num_splits", "decode_bytes", "HEAD_DIMS"]
