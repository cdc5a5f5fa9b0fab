"""Exercise 03's reference, public cases and hidden cases (the instructor's side of ``minipaged.checks.ch03``)."""

from __future__ import annotations

import torch

from minipaged.attention import contiguous_attention
from minipaged.checks.instructor import Side


def chunk_attention(q, k_cache, v_cache, block_table, start, scale=None):
    """Gather positions 0 .. start + n - 1 through the table; causal attention in float64, cast to q's dtype."""
    block_size = k_cache.shape[1]
    pos = torch.arange(start + q.shape[0])
    rows = block_table.long()[pos // block_size]
    k, v = k_cache[rows, pos % block_size], v_cache[rows, pos % block_size]
    return contiguous_attention(q.double(), k.double(), v.double(), scale=scale).to(q.dtype)


def _case(name, total, start, block_size, num_heads, num_kv_heads, dtype="float32", scale=None, seed=None):
    return {"name": name, "total": total, "start": start, "block_size": block_size, "num_heads": num_heads,
            "num_kv_heads": num_kv_heads, "dtype": dtype, "seed": len(name) if seed is None else seed, "scale": scale}


CASES = [
    _case("a whole prompt, MHA", 7, 0, 4, 2, 2),
    _case("a chunk starting mid-block, GQA", 13, 6, 4, 4, 2),
    _case("a chunk of one token, MQA", 10, 9, 3, 4, 1),
    _case("a chunk crossing two blocks, GQA", 20, 5, 4, 8, 2),
    _case("bfloat16, GQA", 11, 3, 4, 4, 2, dtype="bfloat16"),
    _case("with scale=0.5", 9, 5, 4, 2, 1, scale=0.5, seed=0),
]


def _hidden(rng):
    cases = []
    for i in range(3):
        heads, kv_heads = rng.choice([(2, 2), (4, 2), (4, 1), (8, 2)])
        total = rng.randrange(2, 24)
        cases.append(_case(f"hidden {i}", total, rng.randrange(0, total), rng.choice([2, 3, 4, 8]), heads, kv_heads,
                           seed=rng.randrange(1000)))
    return cases


SIDES = {"chunk_attention": Side(lambda: CASES, _hidden, lambda: (chunk_attention,))}
