"""The ``"loop"`` attention backend: block by block, one sequence at a time. Slow and obviously right.

It walks each sequence's block table, scores its queries against the keys of one physical block
at a time, and takes one softmax over everything it collected. Chapter 03 reads it first, as
the reference the vectorised ``"torch"`` backend (:mod:`minipaged.attention`) must match.

It is also the example of the backend seam: this file plus one registration,
``register_backend("loop", ...)`` in :mod:`minipaged.attention`, is the whole backend. It writes
K/V as the torch backend does (:func:`minipaged.cache.write_kv_torch`).
"""

from __future__ import annotations

import torch

from minipaged.attention import AttentionBackend
from minipaged.block_math import blocks_needed
from minipaged.cache import write_kv_torch


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


def loop_decode(q, k_cache, v_cache, block_tables, seq_lens, scale):
    """Decode, one sequence at a time: row ``s`` of ``q`` against sequence ``s``'s blocks.

    The arguments and the result are :class:`~minipaged.attention.AttentionBackend`'s ``decode``'s.
    """
    out = [
        _attend_blocks(q[s : s + 1], k_cache, v_cache, block_tables[s], seq_len, scale)
        for s, seq_len in enumerate(seq_lens.tolist())
    ]
    return torch.cat(out).to(q.dtype)


def loop_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
    """Prefill, one sequence at a time: sequence ``i``'s queries are rows ``query_start_loc[i] : query_start_loc[i+1]``.

    The arguments and the result are :class:`~minipaged.attention.AttentionBackend`'s ``prefill``'s.
    """
    starts = query_start_loc.tolist()
    out = torch.empty_like(q)
    for i, seq_len in enumerate(seq_lens.tolist()):
        a, b = starts[i], starts[i + 1]
        out[a:b] = _attend_blocks(q[a:b], k_cache, v_cache, block_tables[i], seq_len, scale).to(q.dtype)
    return out


LOOP = AttentionBackend("loop", decode=loop_decode, prefill=loop_prefill, write=write_kv_torch)
