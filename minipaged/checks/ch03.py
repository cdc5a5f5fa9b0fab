"""Checks for exercise 03: attention for one sequence's chunk of new tokens, read through its block table.

Chapter 03 builds *decode* attention: one query per sequence, which sees every
token. The exercise asks for a *chunk* of queries at positions
``start .. start + n - 1`` (chunked prefill), where query ``i`` sees positions
``0 .. start + i`` only. The cases are :func:`minipaged.testing.make_paged_case`'s:
shuffled blocks and NaN in every slot the sequence did not write. The check also
catches the classic mistakes by name: the wrong KV head under GQA, a causal mask
that forgets ``start``, a shared cache changed in place, a dtype not preserved.
"""

from __future__ import annotations

import torch

from minipaged.attention import contiguous_attention
from minipaged.checks import CheckFailed, check, expect_tensor_close
from minipaged.testing import make_paged_case

HINTS = {
    "3.1": [
        "causal masking with an offset: query i of the chunk sits at position start + i of the sequence",
        "gather the first start + n positions through block_table (position p: block_table[p // B], slot p % B); "
        "query i may see positions p <= start + i; query head h reads KV head h // (num_heads // num_kv_heads)",
        "build the mask as positions[None, :] <= (start + arange(n))[:, None]; fill masked scores with -inf and "
        "never multiply by 0 (0 · NaN is NaN); work on gathered copies, never on k_cache or v_cache in place, and "
        "return q.dtype",
    ],
}

# (name, total tokens, start, block_size, num_heads, num_kv_heads, dtype)
CASES = [
    ("a whole prompt, MHA", 7, 0, 4, 2, 2, torch.float32),
    ("a chunk starting mid-block, GQA", 13, 6, 4, 4, 2, torch.float32),
    ("a chunk of one token, MQA", 10, 9, 3, 4, 1, torch.float32),
    ("a chunk crossing two blocks, GQA", 20, 5, 4, 8, 2, torch.float32),
    ("bfloat16, GQA", 11, 3, 4, 4, 2, torch.bfloat16),
]
HEAD_DIM = 8


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where the other has NaN."""
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _wrong_head(q, k, v):
    """Attention with query head h on KV head h % num_kv_heads (``repeat`` where ``repeat_interleave`` belongs)."""
    group = q.shape[1] // k.shape[1]
    return contiguous_attention(q.double(), k.double().repeat(1, group, 1), v.double().repeat(1, group, 1))


@check("ch03.chunk_attention", hint=HINTS["3.1"][0])
def check_chunk_attention(fn):
    for name, total, start, block_size, num_heads, num_kv_heads, dtype in CASES:
        n = total - start
        case = make_paged_case([total], num_new_tokens=[n], block_size=block_size, num_heads=num_heads,
                               num_kv_heads=num_kv_heads, head_dim=HEAD_DIM, dtype=dtype, seed=len(name))
        k_before, v_before = case.k_cache.clone(), case.v_cache.clone()
        table = case.block_tables[0].clone()
        what = f"{name} (start={start}, {n} new tokens, block_size={block_size})"
        out = fn(case.q, case.k_cache, case.v_cache, table, start)
        if not (_same(case.k_cache, k_before) and _same(case.v_cache, v_before)):
            raise CheckFailed(f"{what}: your function changed k_cache or v_cache. The pool is shared by every "
                              "sequence: compute on copies (torch.where, masked_fill without _), never in place")
        if isinstance(out, torch.Tensor) and out.dtype != dtype:
            raise CheckFailed(f"{what}: the output is {out.dtype} for {dtype} inputs; return q.dtype")
        expected = case.reference()
        tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-4)
        if isinstance(out, torch.Tensor) and out.shape == expected.shape:
            if out.isnan().any():
                rows = sorted({int(i) for i in out.isnan().nonzero()[:, 0]})
                raise CheckFailed(
                    f"{what}: query row(s) {rows} hold NaN. Unwritten slots hold NaN here: something read past "
                    "the sequence's tokens or through a padding entry, or multiplied NaN by a 0 weight"
                )
            k, v = case.keys[0], case.values[0]
            if 1 < num_kv_heads < num_heads and torch.allclose(out.double(), _wrong_head(case.q, k, v), **tol):
                raise CheckFailed(f"{what}: query head h read KV head h % num_kv_heads; with GQA it must read "
                                  "KV head h // (num_heads // num_kv_heads), the group it belongs to")
            if start and torch.allclose(out.double(), contiguous_attention(case.q.double(), k[:n].double(),
                                                                            v[:n].double()), **tol):
                raise CheckFailed(f"{what}: query i saw positions 0..i; it sits at position start + i and "
                                  "must see everything up to there")
        expect_tensor_close(out, expected, f"{what}: your attention", **tol)
    case = make_paged_case([9], num_new_tokens=[4], block_size=4, num_heads=2, num_kv_heads=1, head_dim=HEAD_DIM)
    got = fn(case.q, case.k_cache, case.v_cache, case.block_tables[0].clone(), 5, scale=0.5)
    expect_tensor_close(got, case.reference(scale=0.5), "with scale=0.5: your attention", atol=1e-5, rtol=1e-4)
    return f"{len(CASES) + 1} chunks: mid-block starts, MHA/GQA/MQA, bfloat16, NaN in every unwritten slot"
