"""Paged attention (decode, prefill, chunked prefill) against contiguous attention.

Every case is :func:`minipaged.testing.make_paged_case`: each sequence's blocks are
drawn from a random permutation of the pool, and every slot no sequence wrote holds
NaN, so a read through a wrong entry (or a NaN multiplied by a 0 weight) shows up as NaN.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged._triton import HAVE_TRITON
from minipaged.attention import contiguous_attention, paged_attention, paged_prefill_attention, write_kv
from minipaged.testing import make_paged_case

pytestmark = pytest.mark.ch03

# Outputs are computed in float32 from the same stored values on both sides,
# so the error is the final rounding to the input dtype plus summation order.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
HEADS = {"MHA": (4, 4), "GQA": (8, 2), "MQA": (4, 1)}


def decode_case(seq_lens, block_size, heads, head_dim=16, dtype=torch.float32, seed=0):
    num_heads, num_kv_heads = heads
    case = make_paged_case(
        seq_lens, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        dtype=dtype, seed=seed,
    )
    return case.decode_args, case.reference()


def prefill_case(seq_lens, num_new_tokens, block_size, heads, head_dim=16, dtype=torch.float32, seed=0):
    num_heads, num_kv_heads = heads
    case = make_paged_case(
        seq_lens, num_new_tokens=num_new_tokens, block_size=block_size, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, seed=seed,
    )
    return case.prefill_args, case.reference()


def assert_close(actual, expected, dtype):
    assert actual.dtype == expected.dtype == dtype
    assert actual.shape == expected.shape
    assert not actual.isnan().any(), "NaN leaked in from a slot the sequence does not own"
    err = (actual.float() - expected.float()).abs().max().item()
    assert err <= TOL[dtype], f"max abs error {err:.3g} > {TOL[dtype]} for {dtype}"


# --------------------------------------------------------------------------- reference sanity


def test_contiguous_attention_matches_explicit_softmax():
    """The reference itself, against softmax(q k^T / sqrt(d)) v written out by hand with repeated KV heads."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 4, 8, generator=g), torch.randn(7, 2, 8, generator=g), torch.randn(7, 2, 8, generator=g)
    k4, v4 = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k4) / 8**0.5
    causal = torch.arange(7)[None, :] <= torch.arange(4, 7)[:, None]  # queries are positions 4, 5, 6
    scores = scores.masked_fill(~causal, float("-inf"))
    expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v4)
    assert torch.allclose(contiguous_attention(q, k, v), expected, atol=1e-6)
    # The last query sees everything: the same as non-causal attention for that row.
    assert torch.allclose(contiguous_attention(q, k, v, causal=False)[-1], expected[-1], atol=1e-6)


# --------------------------------------------------------------------------- decode


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("backend", ["loop", "torch"])
def test_decode_matches_contiguous(backend, heads, dtype):
    # 1, a block minus one, exactly a block, a block plus one, and a few blocks plus a bit.
    args, expected = decode_case([1, 7, 8, 9, 29], block_size=8, heads=heads, dtype=dtype)
    assert_close(paged_attention(*args, backend=backend), expected, dtype)


@settings(max_examples=40, deadline=None)
@given(
    seq_lens=st.lists(st.integers(1, 70), min_size=1, max_size=6),
    block_size=st.sampled_from([1, 2, 3, 4, 8, 16, 32]),
    num_kv_heads=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 1000),
)
def test_decode_any_lengths_and_block_sizes(seq_lens, block_size, num_kv_heads, group, seed):
    args, expected = decode_case(seq_lens, block_size, (num_kv_heads * group, num_kv_heads), head_dim=8, seed=seed)
    assert_close(paged_attention(*args, backend="torch"), expected, torch.float32)


def test_decode_small_gather_budget_chunks_the_batch(monkeypatch):
    """The torch backend splits the batch to keep its gather in cache; every chunking gives the same answer."""
    import minipaged.attention as attention

    args, expected = decode_case([5, 40, 1, 33, 16, 2], block_size=4, heads=(8, 2))
    for budget in [1, 2 * 40 * 2 * 16 * 4 * 2, 1 << 30]:  # one seq, two seqs, all at once
        monkeypatch.setattr(attention, "GATHER_BUDGET_BYTES", budget)
        assert_close(paged_attention(*args), expected, torch.float32)


def test_decode_works_in_and_out_of_inference_mode(monkeypatch):
    """The torch backend reuses a gather buffer; one made under inference_mode must not break later calls."""
    import minipaged.attention as attention

    monkeypatch.setattr(attention, "_workspace", {})
    args, expected = decode_case([9, 30], block_size=4, heads=(4, 2))
    with torch.inference_mode():
        assert_close(paged_attention(*args), expected, torch.float32)
    assert_close(paged_attention(*args), expected, torch.float32)
    with torch.no_grad():
        assert_close(paged_attention(*args), expected, torch.float32)


def test_loop_and_torch_backends_agree():
    args, _ = decode_case([3, 50, 17], block_size=16, heads=(8, 2), seed=5)
    assert torch.allclose(paged_attention(*args, backend="loop"), paged_attention(*args, backend="torch"), atol=1e-6)


def test_scale_is_used():
    case = make_paged_case([9, 4], block_size=4, num_heads=4, num_kv_heads=2, head_dim=16)
    for backend in ["loop", "torch"]:
        out = paged_attention(*case.decode_args, scale=0.3, backend=backend)
        assert_close(out, case.reference(scale=0.3), torch.float32)
        assert not torch.allclose(out, paged_attention(*case.decode_args, backend=backend))


def test_moving_a_block_and_its_table_entry_changes_nothing():
    """Copy a block's contents to a free block and repoint the table: the read follows the table."""
    args, expected = decode_case([30, 5], block_size=8, heads=(4, 2))
    q, k_cache, v_cache, block_tables, seq_lens = args
    for backend in ["loop", "torch"]:  # the torch backend keeps this table's gather plan
        assert_close(paged_attention(*args, backend=backend), expected, torch.float32)
    old, new = int(block_tables[0, 1]), int(block_tables[0, -1])  # the padding entry is an unowned block
    for cache in (k_cache, v_cache):
        cache[new] = cache[old]
        cache[old] = float("nan")
    block_tables[0, 1] = new
    for backend in ["loop", "torch"]:
        out = paged_attention(q, k_cache, v_cache, block_tables, seq_lens, backend=backend)
        assert_close(out, expected, torch.float32)


# --------------------------------------------------------------------------- prefill


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("backend", ["loop", "torch"])
def test_prefill_matches_contiguous(backend, heads, dtype):
    # Whole prompts (q_len == seq_len), a chunk after earlier chunks, a single token, a chunk across blocks.
    args, expected = prefill_case([1, 13, 21, 9, 30], [1, 13, 6, 1, 17], block_size=8, heads=heads, dtype=dtype)
    assert_close(paged_prefill_attention(*args, backend=backend), expected, dtype)


@settings(max_examples=30, deadline=None)
@given(
    data=st.data(),
    block_size=st.sampled_from([1, 3, 4, 16]),
    heads=st.sampled_from(list(HEADS.values())),
)
def test_prefill_any_chunks(data, block_size, heads):
    seq_lens = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=4))
    num_new_tokens = [data.draw(st.integers(1, n)) for n in seq_lens]
    args, expected = prefill_case(seq_lens, num_new_tokens, block_size, heads, head_dim=8)
    assert_close(paged_prefill_attention(*args, backend="torch"), expected, torch.float32)


@pytest.mark.parametrize("backend", ["loop", "torch"])
@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_chunked_prefill_equals_one_causal_pass(backend, chunk):
    """Write a prompt chunk by chunk, attending after each write: the rows must equal one causal pass."""
    n, block_size, (num_heads, num_kv_heads), head_dim = 37, 8, (8, 2), 16
    g = torch.Generator().manual_seed(3)
    q = torch.randn(n, num_heads, head_dim, generator=g)
    k = torch.randn(n, num_kv_heads, head_dim, generator=g)
    v = torch.randn(n, num_kv_heads, head_dim, generator=g)
    k_cache = torch.full((9, block_size, num_kv_heads, head_dim), float("nan"))
    v_cache = k_cache.clone()
    block_tables = torch.tensor([[7, 2, 5, 0, 8]], dtype=torch.int32)
    rows = []
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        pos = torch.arange(start, end)
        slots = block_tables[0].long()[pos // block_size] * block_size + pos % block_size
        write_kv(k[start:end], v[start:end], k_cache, v_cache, slots)
        starts = torch.tensor([0, end - start], dtype=torch.int32)
        seq_lens = torch.tensor([end], dtype=torch.int32)
        args = (q[start:end], k_cache, v_cache, block_tables, seq_lens, starts)
        rows.append(paged_prefill_attention(*args, backend=backend))
    assert_close(torch.cat(rows), contiguous_attention(q, k, v), torch.float32)


def test_prefill_of_one_token_per_sequence_is_decode():
    args, _ = decode_case([4, 17, 1], block_size=4, heads=(4, 2))
    starts = torch.arange(4, dtype=torch.int32)
    assert torch.allclose(paged_prefill_attention(*args, starts), paged_attention(*args), atol=1e-6)


# --------------------------------------------------------------------------- validation


def good_decode_args():
    args, _ = decode_case([5, 9], block_size=4, heads=(4, 2))
    return list(args)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda a: a.__setitem__(0, a[0][0]), ValueError, "q must be 3-D"),
        (lambda a: a.__setitem__(0, a[0][..., :8]), ValueError, "head_dim"),
        (lambda a: a.__setitem__(0, torch.randn(2, 3, 16)), ValueError, "multiple of"),
        (lambda a: a.__setitem__(0, a[0][:1]), ValueError, "block_tables must be"),
        (lambda a: a.__setitem__(1, a[1][..., :1, :]), ValueError, "v_cache"),
        (lambda a: a.__setitem__(0, a[0].half()), TypeError, "share a dtype"),
        (lambda a: a.__setitem__(0, a[0].long()), TypeError, "q must be a floating"),
        (lambda a: a.__setitem__(3, a[3].long()), TypeError, "block_tables must be int32"),
        (lambda a: a.__setitem__(4, a[4].float()), TypeError, "seq_lens must be int32"),
        (lambda a: a.__setitem__(4, a[4][:1]), ValueError, "seq_lens must be"),
        (lambda a: a.__setitem__(4, torch.tensor([5, 0], dtype=torch.int32)), ValueError, ">= 1"),
        (lambda a: a.__setitem__(4, torch.tensor([5, 99], dtype=torch.int32)), IndexError, "room for only"),
        (lambda a: a[3].__setitem__((1, 0), 1000), IndexError, r"block_tables\[1, 0\]"),
        (lambda a: a.__setitem__(0, a[0].to("meta")), ValueError, "share a device"),
        (lambda a: a.__setitem__(3, a[3].to("meta")), ValueError, "block_tables is on meta"),
        (lambda a: a.__setitem__(2, a[2].tolist()), TypeError, "v_cache must be a torch.Tensor"),
    ],
)
@pytest.mark.parametrize("backend", ["loop", "torch"])
def test_decode_errors_name_the_argument(change, error, match, backend):
    args = good_decode_args()
    change(args)
    with pytest.raises(error, match=match):
        paged_attention(*args, backend=backend)


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of"):
        paged_attention(*good_decode_args(), backend="cuda")


def test_prefill_errors_name_query_start_loc():
    args, _ = prefill_case([6, 9], [2, 3], block_size=4, heads=(4, 2))
    q, k_cache, v_cache, block_tables, seq_lens, starts = args
    with pytest.raises(ValueError, match="query_start_loc must run from 0"):
        short = torch.tensor([0, 2, 4], dtype=torch.int32)
        paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, short)
    with pytest.raises(ValueError, match="sequence 0 has 7 query tokens"):
        q10 = torch.zeros(10, *q.shape[1:])
        starts10 = torch.tensor([0, 7, 10], dtype=torch.int32)
        paged_prefill_attention(q10, k_cache, v_cache, block_tables, seq_lens, starts10)
    with pytest.raises(TypeError, match="query_start_loc must be int32"):
        paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, starts.float())
    with pytest.raises(ValueError, match="query_start_loc is on meta"):
        paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, starts.to("meta"))
    with pytest.raises(ValueError, match="block_tables must be"):
        one_seq = torch.tensor([0, 5], dtype=torch.int32)
        paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, one_seq)


# --------------------------------------------------------------------------- triton backend (small shapes)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_triton_backend_matches_on_decode_and_prefill():
    """The same call with backend='triton' reaches the chapter-04 kernels (interpreted on CPU)."""
    args, expected = decode_case([1, 9, 20], block_size=8, heads=(4, 2), head_dim=16)
    assert_close(paged_attention(*args, backend="triton"), expected, torch.float32)
    args, expected = prefill_case([6, 11], [6, 3], block_size=8, heads=(4, 2), head_dim=16)
    assert_close(paged_prefill_attention(*args, backend="triton"), expected, torch.float32)
