"""Exercise 03's check by mutation: the reference PASSes, every known wrong answer FAILs with its reason."""

import pytest
import torch

from minipaged.attention import _paged_decode_torch
from minipaged.attention_loop import _attend_blocks
from minipaged.checks import FAIL, PASS, ch03

pytestmark = pytest.mark.ch03


def chunk_attention(q, k_cache, v_cache, block_table, start, scale=None, *, head_map="group", offset=True,
                    in_place=False, fp32=False, multiply_mask=False):
    """The reference, with switches that turn it into the known wrong answers."""
    n, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    scale = head_dim**-0.5 if scale is None else scale
    if in_place:
        k_cache.nan_to_num_(0.0)
        v_cache.nan_to_num_(0.0)
    # multiply_mask: gather whole blocks (the last one's unwritten slots hold NaN) and zero V by multiplying
    total = -(-(start + n) // block_size) * block_size if multiply_mask else start + n
    pos = torch.arange(total)
    rows = block_table.long()[pos // block_size]
    k, v = k_cache[rows, pos % block_size].float(), v_cache[rows, pos % block_size].float()
    group = num_heads // num_kv_heads
    if head_map == "group":
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    else:  # query head h on KV head h % num_kv_heads
        k, v = k.repeat(1, group, 1), v.repeat(1, group, 1)
    logits = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    sees = pos[None, :] <= ((start if offset else 0) + torch.arange(n))[:, None]
    if multiply_mask:
        v = v * (pos < start + n)[:, None, None]
    out = torch.einsum("hqk,khd->qhd", logits.masked_fill(~sees, float("-inf")).softmax(-1), v)
    return out if fp32 else out.to(q.dtype)


def variant(**switches):
    return lambda *args, **kw: chunk_attention(*args, **kw, **switches)


MUTANTS = {
    "nan_to_num_ on the shared cache": (variant(in_place=True), "changed k_cache or v_cache"),
    "always float32": (variant(fp32=True), "return q.dtype"),
    "wrong KV head": (variant(head_map="modulo"), "KV head h % num_kv_heads"),
    "causal mask without start": (variant(offset=False), "sits at position start + i"),
    "multiplies by a 0 weight": (variant(multiply_mask=True), "NaN"),
    "chapter's decode attention": (_paged_decode_torch, ""),
    "chapter's _attend_blocks": (_attend_blocks, ""),
}


def test_reference_passes():
    assert ch03.check_chunk_attention(chunk_attention).status == PASS


@pytest.mark.parametrize("name", MUTANTS)
def test_mutant_fails_with_its_reason(name, capsys):
    mutant, reason = MUTANTS[name]
    result = ch03.check_chunk_attention(mutant)
    assert result.status == FAIL and reason in result.message, result.message
    assert "Traceback" not in capsys.readouterr().out
