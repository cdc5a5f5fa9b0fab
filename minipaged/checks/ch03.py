"""Checks for exercise 03: attention for one sequence's chunk of new tokens, read through its block table.

Chapter 03 builds *decode* attention: one query per sequence, which sees every
token. The exercise asks for a *chunk* of queries at positions
``start .. start + n - 1`` (chunked prefill), where query ``i`` sees positions
``0 .. start + i`` only. The cases are :func:`minipaged.testing.make_paged_case`'s:
shuffled blocks and NaN in every slot the sequence did not write. The check also
catches the classic mistakes by name: the wrong KV head under GQA, a causal mask
that forgets ``start``, a shared cache changed in place, a dtype not preserved. The
reference and the hidden cases are in ``minipaged.checks.instructor.ch03``.
"""

from __future__ import annotations

import torch

from minipaged.attention import contiguous_attention
from minipaged.checks import CheckFailed, as_tensor, check, expect_tensor_close
from minipaged.testing import make_paged_case

# The package modules this exercise rebuilds: the grader flags a learner's cell that imports, subclasses or
# calls them (a flag for the instructor, not a verdict).
REBUILDS = ("minipaged.attention", "minipaged.attention_loop")

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

HEAD_DIM = 8


def paged_case(case):
    """The :func:`~minipaged.testing.make_paged_case` a case names (its inputs only; deterministic)."""
    n = case["total"] - case["start"]
    return make_paged_case([case["total"]], num_new_tokens=[n], block_size=case["block_size"],
                           num_heads=case["num_heads"], num_kv_heads=case["num_kv_heads"], head_dim=HEAD_DIM,
                           dtype=getattr(torch, case["dtype"]), seed=case["seed"])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where the other has NaN."""
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _wrong_head(q, k, v):
    """Attention with query head h on KV head h % num_kv_heads (``repeat`` where ``repeat_interleave`` belongs)."""
    group = q.shape[1] // k.shape[1]
    return contiguous_attention(q.double(), k.double().repeat(1, group, 1), v.double().repeat(1, group, 1))


def _label(case) -> str:
    scale = f", scale={case['scale']}" if case["scale"] is not None else ""
    return (f"{case['name']} (start={case['start']}, {case['total'] - case['start']} new tokens, "
            f"block_size={case['block_size']}{scale})")


@check("ch03.chunk_attention", hint=HINTS["3.1"][0], label=_label,
       summary="{n} chunks: mid-block starts, MHA/GQA/MQA, bfloat16, NaN in every unwritten slot")
def check_chunk_attention(case, fn):
    """``case`` = {"name", "total", "start", "block_size", "num_heads", "num_kv_heads", "dtype", "seed", "scale"}."""
    paged = paged_case(case)
    k_before, v_before = paged.k_cache.clone(), paged.v_cache.clone()
    args = (paged.q, paged.k_cache, paged.v_cache, paged.block_tables[0].clone(), case["start"])
    out = fn(*args) if case["scale"] is None else fn(*args, scale=case["scale"])
    return {"out": out if isinstance(out, torch.Tensor) else repr(out)[:200],
            "cache_unchanged": _same(paged.k_cache, k_before) and _same(paged.v_cache, v_before)}


@check_chunk_attention.judge
def _judge(case, got, want):
    if got["cache_unchanged"] is not True:
        raise CheckFailed("your function changed k_cache or v_cache. The pool is shared by every sequence: compute "
                          "on copies (torch.where, masked_fill without _), never in place")
    out, expected = as_tensor(got["out"]), as_tensor(want["out"])
    if out is None:
        raise CheckFailed(f"returned {got['out']}, expected a torch.Tensor")
    dtype = expected.dtype
    if out.dtype != dtype:
        raise CheckFailed(f"the output is {out.dtype} for {dtype} inputs; return q.dtype")
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-4)
    if out.shape == expected.shape:
        if out.isnan().any():
            rows = sorted({int(i) for i in out.isnan().nonzero()[:, 0]})
            raise CheckFailed(f"query row(s) {rows} hold NaN. Unwritten slots hold NaN here: something read past the "
                              "sequence's tokens or through a padding entry, or multiplied NaN by a 0 weight")
        paged = paged_case(case)
        n, start = case["total"] - case["start"], case["start"]
        k, v = paged.keys[0], paged.values[0]
        if 1 < case["num_kv_heads"] < case["num_heads"] and torch.allclose(out.double(), _wrong_head(paged.q, k, v),
                                                                           **tol):
            raise CheckFailed("query head h read KV head h % num_kv_heads; with GQA it must read KV head "
                              "h // (num_heads // num_kv_heads), the group it belongs to")
        if start and torch.allclose(out.double(), contiguous_attention(paged.q.double(), k[:n].double(),
                                                                       v[:n].double()), **tol):
            raise CheckFailed("query i saw positions 0..i; it sits at position start + i and must see everything "
                              "up to there")
    expect_tensor_close(out, expected, "your attention", **tol)
