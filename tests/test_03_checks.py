"""The chapter 03 exercise check passes correct paged attention and catches the usual mistakes."""

import pytest
import torch

from minipaged.accounting import blocks_needed
from minipaged.attention import paged_attention
from minipaged.checks import FAIL, PASS, TODO
from minipaged.checks.ch03 import check_paged_attention

pytestmark = pytest.mark.ch03


def gather_times_zero(q, k_cache, v_cache, block_tables, seq_lens, scale=None):
    """Masks the scores but then lets garbage V rows in with weight 0: NaN * 0 = NaN."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    out = []
    for i in range(num_seqs):
        n = int(seq_lens[i])
        blocks = block_tables[i, : blocks_needed(n, block_size)].long()
        k = k_cache[blocks].flatten(0, 1).repeat_interleave(num_heads // num_kv_heads, 1)
        v = v_cache[blocks].flatten(0, 1).repeat_interleave(num_heads // num_kv_heads, 1)
        scores = torch.einsum("hd,thd->ht", q[i], k) * scale
        scores = torch.where(torch.arange(len(k)) < n, scores, float("-inf"))
        out.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v))
    return torch.stack(out)


def heads_grouped_wrongly(q, k_cache, v_cache, block_tables, seq_lens, scale=None):
    """Pairs query head h with KV head h % num_kv_heads instead of h // group."""
    s, h, d = q.shape
    q = q.view(s, -1, k_cache.shape[2], d).transpose(1, 2).reshape(s, h, d)
    return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=scale)


def ignores_scale(q, k_cache, v_cache, block_tables, seq_lens, scale=None):
    return paged_attention(q, k_cache, v_cache, block_tables, seq_lens)


def not_done(*args, **kwargs):
    raise NotImplementedError("Task 3.1 is not implemented yet.")


@pytest.mark.parametrize("backend", ["loop", "torch"])
def test_reference_passes(backend, capsys):
    result = check_paged_attention(lambda *a, **k: paged_attention(*a, backend=backend, **k))
    assert result.status == PASS
    assert capsys.readouterr().out.startswith("✅ PASS")


@pytest.mark.parametrize(
    "fn, words",
    [(gather_times_zero, "holds NaN"), (heads_grouped_wrongly, "differs"), (ignores_scale, "scale=0.5")],
)
def test_mistakes_fail_with_a_reason(fn, words, capsys):
    result = check_paged_attention(fn)
    assert result.status == FAIL
    assert words in result.message
    assert "hint:" in capsys.readouterr().out


def test_stub_is_not_implemented():
    assert check_paged_attention(not_done).status == TODO
