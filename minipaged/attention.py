"""Attention that reads K/V through a block table, the contiguous reference it must match, and the backend seam.

Per layer the cache is ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]``.
A sequence's logical token ``t`` lives in physical block ``block_tables[s, t // block_size]``
at offset ``t % block_size``; its *slot* is ``block_id * block_size + offset``.

- The write path, new tokens' K/V to their slots, is :func:`write_kv`, by the same backends (chapter 02's
  :func:`minipaged.cache.write_kv_torch` for ``"torch"``).
- :func:`paged_attention` is the decode read path: one query token per sequence.
- :func:`paged_prefill_attention` is the prefill / chunked-prefill read path: several
  query tokens per sequence, packed, each attending causally over the paged context.
- :class:`AttentionMetadata` describes one packed batch: where each new token's K/V
  goes and what each sequence reads.

Every path takes a ``backend=``: the name of an :class:`AttentionBackend` in the registry
(:func:`register_backend`, :func:`get_backend`). The read and write paths run the same input
checks (:func:`minipaged.attention_checks.check_paged_attention`, ``check_kv_write``) before they hand
the call to the backend, so a bad input gets the same error on every backend. Registered here:

- ``"torch"``: vectorised gather through the block table, then batched matmuls and a masked softmax (this module).
  Its decode and prefill are exercise 03's pieces (Tasks 3.1 and 3.2, :mod:`minipaged.pieces`): in a learner's
  copy of the package they are the learner's own.
- ``"loop"``: block by block, one sequence at a time. Slow and obviously right
  (:mod:`minipaged.attention_loop`, loaded when asked for).
- ``"triton"``: the chapter-04 kernels in :mod:`minipaged.kernels` (loaded when asked for, so an
  engine on ``"torch"`` never imports Triton).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from minipaged.block_math import blocks_needed
from minipaged.blocks import BlockTable, block_tables_tensor
from minipaged.cache import write_kv_torch
from minipaged.validation import check_callable, check_choice, check_scale

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
    from minipaged.attention_checks import check_contiguous_attention  # the checks load when a caller asks

    return _contiguous_attention(q, k, v, check_contiguous_attention(q, k, v, scale), causal)


def _contiguous_attention(q, k, v, scale: float, causal: bool = True):
    """:func:`contiguous_attention` on inputs known to be valid."""
    q_len, kv_len = q.shape[0], k.shape[0]
    # SDPA's is_causal aligns query 0 with key 0; our queries are the end of the context.
    pos = torch.arange(kv_len, device=q.device)
    mask = pos[None, :] <= pos[kv_len - q_len :, None] if causal and q_len > 1 else None
    compute = torch.promote_types(q.dtype, torch.float32)
    qt, kt, vt = (t.to(compute).transpose(0, 1) for t in (q, k, v))  # [heads, tokens, head_dim]
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1).to(q.dtype)


# --------------------------------------------------------------------------- the backend seam


def no_limits(block_size: int, head_dim: int, dtype: torch.dtype) -> None:
    """The ``check`` of a backend that runs any cache shape and dtype: it accepts everything."""


def check_backend_fields(backend) -> None:
    """A ``TypeError`` unless an attention backend's ``name`` is a non-empty str and its four functions are callable.

    Args:
        backend: the :class:`~minipaged.attention.AttentionBackend`, just constructed.
    """
    if not isinstance(backend.name, str) or not backend.name:
        raise TypeError(f"AttentionBackend.name must be a non-empty str, got {backend.name!r:.60}")
    check_functions(backend, "AttentionBackend", ("decode", "prefill", "write", "check"))


def check_functions(obj, prefix: str, names: tuple[str, ...]) -> None:
    """A ``TypeError`` for the first attribute ``names`` of ``obj`` that is not callable.

    Args:
        obj: the object holding functions (an attention backend).
        prefix: its class name, for the message (``"AttentionBackend"``).
        names: the attributes that must be functions, checked in this order.
    """
    for name in names:
        check_callable(getattr(obj, name), f"{prefix}.{name}", "a function")


@dataclass(frozen=True)
class AttentionBackend:
    """One attention backend: the functions that write new K/V into the paged cache and read it back.

    A backend is a name and four functions. Build one, register it with
    ``register_backend(name, backend)``, and ``backend=name`` reaches it everywhere: the read and
    write paths below, ``LlamaForCausalLM.forward``, ``generate_paged`` and the engine. The
    callers check every input first (``check_paged_attention`` for the reads, ``check_kv_write``
    for the write) and handle the empty batch, so a backend's functions receive valid tensors of
    at least one sequence and may assume:

    - ``q``: float ``[num_tokens, num_heads, head_dim]``; ``num_heads`` is a multiple of
      ``num_kv_heads`` (GQA: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``).
    - ``k_cache, v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]`` in ``q.dtype``;
      one layer's pools. Slot ``s`` is block ``s // block_size``, offset ``s % block_size``.
    - ``block_tables``: int32 ``[num_seqs, max_blocks_per_seq]``; logical block ``j`` of
      sequence ``i`` is physical block ``block_tables[i, j]``. Entries past the sequence's
      ``ceil(seq_lens[i] / block_size)`` blocks are padding: never read them.
    - ``seq_lens``: int32 or int64 ``[num_seqs]``, each context length *including* this step's
      tokens, whose K/V is already in the cache (the write runs first).
    - ``scale``: a float, the softmax scale (``head_dim ** -0.5`` unless the caller chose one);
      passed by keyword.

    Args:
        name: the registry key, e.g. ``"torch"``.
        decode: ``decode(q, k_cache, v_cache, block_tables, seq_lens, scale=...)``, one query token per
            sequence (``num_tokens == num_seqs``), each attending to its whole context.
            Returns ``[num_seqs, num_heads, head_dim]`` in ``q.dtype``.
        prefill: ``prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=...)``.
            ``query_start_loc``: int32 or int64 ``[num_seqs + 1]``; sequence ``i``'s queries are rows
            ``query_start_loc[i] : query_start_loc[i + 1]`` of ``q``, the *last* ``q_len`` positions of
            its context, so query ``j`` sees positions ``0 .. seq_lens[i] - q_len + j`` (causal).
            Returns ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.
        write: ``write(key, value, k_cache, v_cache, slot_mapping)``, in place, returns None.
            ``key, value: [num_tokens, num_kv_heads, head_dim]``; ``slot_mapping``: int32 or int64
            ``[num_tokens]``, token ``i``'s slot, or ``-1`` for "don't write" (skip that token).
        check: ``check(block_size, head_dim, dtype)``, returns None. The engine calls it once, before it
            builds anything, so a backend that cannot run that cache shape or dtype (a kernel's
            limits) says so at once instead of failing at every step: raise ``TypeError`` for a
            dtype and ``ValueError`` for a shape, naming the problem. :func:`no_limits` (the
            default) accepts everything, as the torch backend does.

    The read functions must not change the caches; ``write`` changes only the slots it is given.
    """

    name: str
    decode: Callable
    prefill: Callable
    write: Callable
    check: Callable = no_limits

    def __post_init__(self):
        check_backend_fields(self)


# name -> the backend, or a loader (no arguments) that imports its module and returns it on first use
_REGISTRY: dict[str, AttentionBackend | Callable[[], AttentionBackend]] = {}


def register_backend(name: str, backend, *, replace: bool = False) -> None:
    """Make ``backend=name`` reach ``backend`` in every read and write path.

    Args:
        name: the key, a non-empty str.
        backend: an :class:`AttentionBackend` named ``name``, or a loader: a function of no
            arguments that returns one. A loader runs the first time :func:`get_backend` asks for
            ``name`` (so the backend's module, and what it imports, loads only when used).
        replace: a name already registered is refused unless this is True, so that no backend is
            replaced by accident (``"torch"`` included).

    Raises:
        TypeError: ``name`` is not a str, or ``backend`` is neither a backend nor a function.
        ValueError: ``name`` is empty or already registered (without ``replace``), or ``backend``
            carries another name.
    """
    from minipaged.attention_checks import check_backend_registration

    check_backend_registration(name, backend, replace, _REGISTRY, AttentionBackend)
    _REGISTRY[name] = backend


def backend_names() -> tuple[str, ...]:
    """The registered backends' names, in registration order."""
    return tuple(_REGISTRY)


def get_backend(name: str) -> AttentionBackend:
    """The backend registered as ``name``, loading it on first use.

    Raises:
        TypeError: ``name`` is not a str (``backend=1``), or a loader returned something else.
        ValueError: no backend is registered as ``name``; the message lists those that are.
        ImportError: the backend's module cannot be imported (``"triton"`` without Triton).
    """
    check_choice(name, "backend", backend_names())
    entry = _REGISTRY[name]
    if not isinstance(entry, AttentionBackend):
        entry = entry()
        from minipaged.attention_checks import check_loaded_backend

        check_loaded_backend(entry, name, AttentionBackend)
        _REGISTRY[name] = entry
    return entry


def resolve_backend(backend) -> AttentionBackend:
    """``backend`` itself if it is an :class:`AttentionBackend` (resolved once by a caller), else the registered one.

    Args:
        backend: a registered name, or an :class:`AttentionBackend` (registered or not).
    """
    return backend if isinstance(backend, AttentionBackend) else get_backend(backend)


def _load_loop() -> AttentionBackend:
    from minipaged.attention_loop import LOOP  # chapter 03's block-by-block reference, loaded when asked for

    return LOOP


def _load_triton() -> AttentionBackend:
    """The chapter-04 kernels' backend (:func:`minipaged.kernels.attention_backend`), imported only when asked for."""
    try:
        from minipaged import kernels
    except ImportError as exc:
        raise ImportError(f"backend='triton' needs minipaged.kernels ({exc}); use backend='torch' instead") from exc
    return kernels.attention_backend()  # TritonUnavailable, with what to do, where Triton is not installed


# --------------------------------------------------------------------------- decode


def write_kv(key, value, k_cache, v_cache, slot_mapping, *, backend="torch", check=True) -> None:
    """Store token ``i``'s K and V at slot ``slot_mapping[i]`` of ``k_cache`` and ``v_cache``, in place.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, the new tokens' K and V.
        k_cache, v_cache: one layer's pools, ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: int64 (or int32) ``[num_tokens]``: ``block_id * block_size + offset``,
            or ``-1`` to skip the token (a padding token).
        backend: the attention backend whose ``write`` stores them (a registered name, see
            :class:`AttentionBackend`, or a backend itself): ``"torch"`` and ``"loop"`` use
            :func:`~minipaged.cache.write_kv_torch`; ``"triton"``, chapter 04's scatter kernel.
        check: False skips the checks, for a caller that has checked the same slots and shapes
            already (the model's forward checks its first layer's write, once per step).

    The inputs are checked here with :func:`minipaged.attention_checks.check_kv_write`, for every
    backend, and a bad one raises before anything is written.
    """
    impl = resolve_backend(backend)
    if check:
        from minipaged.attention_checks import check_kv_write

        check_kv_write(key, value, k_cache, v_cache, slot_mapping)
    impl.write(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, *, scale=None, backend="torch", check=True):
    """Decode attention: each sequence's one new query against its whole paged context.

    ``q: [num_seqs, num_heads, head_dim]``; ``k_cache, v_cache: [num_blocks,
    block_size, num_kv_heads, head_dim]``; ``block_tables: int32 [num_seqs,
    max_blocks_per_seq]``; ``seq_lens: [num_seqs]`` context lengths *including*
    the current token, whose K/V is already in the cache. ``scale`` defaults to
    ``head_dim ** -0.5``. Returns ``[num_seqs, num_heads, head_dim]`` in ``q.dtype``.

    ``backend`` is a registered name (see :class:`AttentionBackend`) or a backend itself. The
    inputs are checked here, for every backend, before the backend's ``decode`` runs, unless
    ``check=False``: for a caller that has checked the same metadata and shapes already, as
    the model's forward does once per step, at its first layer (reading the values costs a
    host-device sync, and the checks cost more than a small batch's attention).
    """
    impl = resolve_backend(backend)
    if check:
        from minipaged.attention_checks import check_paged_attention

        check_paged_attention(q, k_cache, v_cache, block_tables, seq_lens)
    scale = check_scale(scale, q.shape[-1])
    if q.shape[0] == 0:
        return torch.empty_like(q)
    return _checked_output(impl.decode(q, k_cache, v_cache, block_tables, seq_lens, scale=scale), q, impl, "decode")


def _checked_output(out, q, backend: AttentionBackend, call: str):
    """``out``, what ``backend``'s ``call`` returned, if it is a tensor of ``q``'s shape and dtype; else an error."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"attention backend {backend.name!r}: its {call} returned a {type(out).__name__}, not a tensor")
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"attention backend {backend.name!r}: its {call} returned a {out.dtype} tensor of shape "
                         f"{tuple(out.shape)}; expected q's, {q.dtype} {tuple(q.shape)}")  # fmt: skip
    return out


_workspace: dict = {}  # (device, dtype) -> flat gather buffer, kept between calls


def _gather_buffers(num_rows, k_cache):
    """K and V gather buffers of ``num_rows`` rows of ``head_dim`` values each, reused across calls and chunks.

    Reused so they stay in the CPU cache, and because a fresh multi-MiB tensor
    per call pays the OS a page fault per 4 KiB on first touch: at batch 1,
    context 1024 that cost more than the attention itself.
    """
    head_dim, numel = k_cache.shape[-1], num_rows * k_cache.shape[-1]
    key = (k_cache.device, k_cache.dtype)
    buf = _workspace.get(key)
    if buf is None or buf.numel() < 2 * numel:
        # A tensor made under inference_mode could not be written outside it later.
        with torch.inference_mode(False):
            buf = _workspace[key] = torch.empty(2 * numel, dtype=k_cache.dtype, device=k_cache.device)
    return buf[:numel].view(num_rows, head_dim), buf[numel : 2 * numel].view(num_rows, head_dim)


def gathered_attention(q, k, v, padded=None, out=None):
    """The torch backend's attention on gathered K/V: scores, softmax, weighted sum, as two batched matmuls.

    Args:
        q: float ``[num_seqs * num_kv_heads, group, head_dim]``, already multiplied by the softmax
            scale: the ``group`` query heads that share a KV head, as that head's query rows.
        k, v: ``[num_seqs * num_kv_heads, context, head_dim]``, each KV head's context contiguous.
        padded: None, or bool ``[num_seqs, 1, 1, context]``: True where a position is past its
            sequence's end, whose score becomes ``-inf`` (weight exactly 0; K/V there must be finite).
        out: where to write the result, ``[num_seqs * num_kv_heads, group, head_dim]`` float (None: a new tensor).

    For a decode step's handful of query rows per KV head, the two matmuls measured faster on a CPU
    than one ``scaled_dot_product_attention`` call, whose fused kernel pays a fixed cost per head.
    Given (not a piece): a decode (exercise 03) may call it, and ``bench attention`` times it alone.
    """
    scores = torch.bmm(q, k.float().transpose(1, 2))
    if padded is not None:
        scores.view(padded.shape[0], -1, q.shape[1], scores.shape[-1]).masked_fill_(padded, -torch.inf)
    return torch.bmm(scores.softmax(-1), v.float(), out=out)


_last_plan: list = []  # the last decode's metadata (copied) and its gather plan: see _gather_plan


def _gather_plan(block_tables, seq_lens, block_size: int, num_kv_heads: int):
    """Which pool row each gathered position reads, for a decode batch: ``(lens, ctx, padded, rows)``.

    ``lens`` is ``seq_lens`` as a list, ``ctx`` the longest context rounded up to whole blocks,
    ``padded`` None or bool ``[num_seqs, 1, 1, ctx]`` (True past a sequence's end), and ``rows``
    ``[num_seqs, num_kv_heads, ctx]``: the pool row (one KV head of one slot) of every position.
    Every layer of a step asks with the same metadata, so the last plan is kept and given again while
    the metadata's values are the same: compared, not trusted by identity (a caller may change a table
    in place, or free it and make another at the same address).

    A helper of the package's decode, part of its answer to Task 3.1: a decode of your own may use it (and fill it
    in), or leave it as it is.
    """
    ### BEGIN SOLUTION (Exercise 03, Task 3.1)
    key = (block_size, num_kv_heads, block_tables.shape, block_tables.device, seq_lens.shape, seq_lens.dtype)
    if _last_plan and _last_plan[0] == key and all(map(torch.equal, _last_plan[1:3], (block_tables, seq_lens))):
        return _last_plan[3]
    lens = seq_lens.tolist()
    ctx = blocks_needed(max(lens), block_size) * block_size
    # Every position's slot, through the block table. Positions past a sequence's end
    # (the unwritten tail of its last block, and whole blocks that only a longer
    # sequence in the batch has) read the sequence's first slot instead: its own,
    # always written, so finite. Their weight is made 0 by the mask; a 0 weight would
    # not cancel whatever else might be there (0 * NaN = NaN).
    first = block_tables[:, : ctx // block_size].long()[:, :, None] * block_size  # each block's first slot
    slots = (first + torch.arange(block_size, device=seq_lens.device)).flatten(1)  # [num_seqs, ctx]
    valid = torch.arange(ctx, device=seq_lens.device) < seq_lens[:, None] if min(lens) < ctx else None  # None: all
    slots = slots if valid is None else torch.where(valid, slots, slots[:, :1])
    # A pool row is one KV head of one slot, so the gather can lay out each KV head's context
    # contiguously, [num_seqs, num_kv_heads, ctx, head_dim]: what a batched matmul reads.
    rows = slots[:, None, :] * num_kv_heads + torch.arange(num_kv_heads, device=seq_lens.device)[:, None]
    _last_plan[:] = [key, block_tables.clone(), seq_lens.clone(),
                     (lens, ctx, None if valid is None else ~valid[:, None, None, :], rows)]  # fmt: skip
    return _last_plan[3]
    ### END SOLUTION


def _paged_decode_torch(q, k_cache, v_cache, block_tables, seq_lens, scale):
    """The torch backend's decode: each context gathered through its block table, head by head, then attended.

    The arguments and the result are :class:`AttentionBackend`'s ``decode``'s: each sequence's one query
    against its positions ``0 .. seq_lens[s] - 1``, read through its block table, for the whole batch at once
    (no Python loop over blocks or positions). The contract and what is free: exercise 03, Task 3.1.
    """
    ### BEGIN SOLUTION (Exercise 03, Task 3.1)
    (num_seqs, num_heads, head_dim), (block_size, num_kv_heads) = q.shape, k_cache.shape[1:3]
    lens, ctx, padded, rows = _gather_plan(block_tables, seq_lens, block_size, num_kv_heads)
    # GQA without copying K/V per query head: the query heads that share a KV head are its query rows.
    qg = q.reshape(num_seqs * num_kv_heads, num_heads // num_kv_heads, head_dim).float() * scale
    out = torch.empty_like(qg)
    # A view of the pool when it is contiguous (always, in the engine); a copy when a caller passes
    # a strided view, as the loop and Triton paths accept too.
    rows_k, rows_v = k_cache.reshape(-1, head_dim), v_cache.reshape(-1, head_dim)
    chunk = max(1, GATHER_BUDGET_BYTES // (2 * ctx * num_kv_heads * head_dim * k_cache.element_size()))
    k_buf, v_buf = _gather_buffers(min(chunk, num_seqs) * num_kv_heads * ctx, k_cache)
    for start, end in zip(range(0, num_seqs, chunk), range(chunk, num_seqs + chunk, chunk)):  # slices clamp `end`
        n = blocks_needed(max(lens[start:end]), block_size) * block_size  # this chunk's context
        ids, heads = rows[start:end, :, :n].flatten(), slice(start * num_kv_heads, end * num_kv_heads)
        # One index_select per cache: every sequence's context, head by head, in logical order.
        k = torch.index_select(rows_k, 0, ids, out=k_buf[: len(ids)]).view(-1, n, head_dim)
        v = torch.index_select(rows_v, 0, ids, out=v_buf[: len(ids)]).view(-1, n, head_dim)
        mask = padded[start:end, ..., :n] if min(lens[start:end]) < n else None
        gathered_attention(qg[heads], k, v, mask, out=out[heads])
    return out.view(num_seqs, num_heads, head_dim).to(q.dtype)
    ### END SOLUTION


# --------------------------------------------------------------------------- prefill


def paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *, scale=None,
                            backend="torch", check=True):  # fmt: skip
    """Prefill or chunked-prefill attention over the paged context, several queries per sequence.

    ``q: [num_tokens, num_heads, head_dim]`` packs every sequence's new tokens:
    sequence ``i`` owns rows ``query_start_loc[i] : query_start_loc[i + 1]``.
    ``seq_lens[i]`` is its context length *after* this chunk, and the chunk's
    K/V are already in the cache. So the chunk is the last ``q_len`` positions
    of the context, and query ``j`` attends causally over positions
    ``0 .. seq_len - q_len + j``: the earlier chunks already paged in, plus
    this chunk up to itself. Returns ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.

    ``backend`` is a registered name (see :class:`AttentionBackend`) or a backend itself. The
    inputs are checked here, for every backend, before the backend's ``prefill`` runs, unless
    ``check=False`` (as for :func:`paged_attention`).
    """
    impl = resolve_backend(backend)
    if check:
        from minipaged.attention_checks import check_paged_attention

        check_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    scale = check_scale(scale, q.shape[-1])
    if q.shape[0] == 0:
        return torch.empty_like(q)
    out = impl.prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=scale)
    return _checked_output(out, q, impl, "prefill")


def _paged_prefill_torch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
    """The torch backend's prefill: each sequence's new tokens attend causally over its paged context.

    The arguments and the result are :class:`AttentionBackend`'s ``prefill``'s: sequence ``s``'s rows of ``q``
    are the last ``q_len`` positions of its context, and its query ``j`` sees positions
    ``0 .. seq_lens[s] - q_len + j`` (no Python loop over blocks or query tokens). The contract and what is
    free: exercise 03, Task 3.2.
    """
    ### BEGIN SOLUTION (Exercise 03, Task 3.2)
    bounds = query_start_loc.tolist()  # sequence i's rows are bounds[i] : bounds[i + 1]
    out, (block_size, num_kv_heads, head_dim) = q.new_empty(q.shape), k_cache.shape[1:]  # every row is written
    # In a mixed step (chapter 05: decodes plus prefill chunks) a one-token query is
    # plain decode: those rows take the vectorised decode path in one call instead of
    # one small attention call per sequence.
    decoding = [i for i in range(len(bounds) - 1) if bounds[i + 1] - bounds[i] == 1]
    if len(decoding) > 1:
        rows, seqs = (torch.tensor(x, device=q.device) for x in ([bounds[i] for i in decoding], decoding))
        out[rows] = _paged_decode_torch(q[rows], k_cache, v_cache, block_tables[seqs], seq_lens[seqs], scale)
    done = set(decoding) if len(decoding) > 1 else set()
    wide = torch.promote_types(q.dtype, torch.float32)  # what SDPA computes in
    for i, (seq_len, a, b) in enumerate(zip(seq_lens.tolist(), bounds, bounds[1:])):
        if i in done:
            continue
        ids = block_tables[i, : blocks_needed(seq_len, block_size)]
        # Slicing to seq_len drops the unwritten tail, so no masking of V is needed here.
        k, v = (c.index_select(0, ids).view(-1, num_kv_heads, head_dim)[:seq_len] for c in (k_cache, v_cache))
        # The chunk is the context's last b - a positions, so the causal mask is aligned to the context's end
        # (SDPA's is_causal aligns query 0 with key 0). A single query sees the whole context: no mask.
        pos = torch.arange(seq_len, device=q.device)
        sees = None if b - a == 1 else pos[None, :] <= pos[seq_len - (b - a) :, None]
        heads_first = [t.to(wide).transpose(0, 1) for t in (q[a:b], k, v)]  # [heads, tokens, head_dim]
        attended = F.scaled_dot_product_attention(*heads_first, attn_mask=sees, scale=scale, enable_gqa=True)
        out[a:b] = attended.transpose(0, 1)
    return out
    ### END SOLUTION


# The built-in backends go straight in (register_backend checks what a caller hands in).
_REGISTRY.update(loop=_load_loop, torch=AttentionBackend("torch", _paged_decode_torch, _paged_prefill_torch,
                                                         write_kv_torch), triton=_load_triton)  # fmt: skip


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
            tables: one :class:`~minipaged.blocks.BlockTable` per sequence, already
                holding this step's tokens.
            num_new_tokens: ``num_new_tokens[i]`` tokens of ``tables[i]`` are computed in this step.
            slot_mapping: int64 ``[sum(num_new_tokens)]``, the slots ``append_tokens`` returned.
            device: where the metadata tensors go (the model's device).
        """
        seq_lens = torch.tensor([t.num_tokens for t in tables], dtype=torch.int32, device=device)
        query_start_loc = torch.tensor([0, *accumulate(num_new_tokens)], dtype=torch.int32, device=device)
        return cls(slot_mapping=slot_mapping.to(device), block_tables=block_tables_tensor(tables).to(device),
                   seq_lens=seq_lens, query_start_loc=query_start_loc, max_query_len=max(num_new_tokens))

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1

    def positions(self) -> torch.Tensor:
        """int64 ``[num_tokens]``: each new token's position in its sequence (for RoPE)."""
        num_new_tokens = (self.query_start_loc[1:] - self.query_start_loc[:-1]).long()
        first = torch.repeat_interleave(self.seq_lens.long() - num_new_tokens, num_new_tokens)
        starts = torch.repeat_interleave(self.query_start_loc[:-1].long(), num_new_tokens)
        return first + torch.arange(len(first), device=first.device) - starts
