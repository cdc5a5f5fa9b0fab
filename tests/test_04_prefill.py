"""Chapter 04: the chunked-prefill kernel against a float64 reference, and the K/V bytes it reads.

The reference is contiguous attention over each sequence's K/V with the causal mask
aligned to the end of the context (chapter 03), computed in float64 by
:meth:`minipaged.testing.PagedCase.reference`; the pool holds NaN wherever no sequence
wrote, so a stray read shows. Shapes are small: every kernel runs in the interpreter here.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_shapes import DTYPES, SHAPES, shape_id

from minipaged.attention import paged_prefill_attention as prefill_backend
from minipaged.kernels import paged_prefill_attention
from minipaged.kernels.prefill_attention import prefill_as_decode, prefill_kv_tokens, query_tile
from minipaged.kernels.traffic import count_loads
from minipaged.testing import make_paged_case

pytestmark = pytest.mark.ch04

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def make_case(seq_lens, q_lens, *, head_dim=32, block_size=16, group=4, num_kv_heads=2, dtype=torch.float32, seed=0):
    return make_paged_case(
        seq_lens, num_new_tokens=q_lens, block_size=block_size, num_heads=group * num_kv_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, spare_blocks=1, extra_columns=2, seed=seed,
        device=DEVICE,
    )


def assert_matches_reference(case, out, dtype=torch.float32, scale=None):
    expected = case.reference(scale=scale, dtype=torch.float64)
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    assert torch.isfinite(out).all(), "the kernel read a NaN from a slot it does not own, or stored padding"
    err = (out.double() - expected).abs().max().item()
    assert err <= TOLERANCE[dtype], f"max abs error {err:.3g} > {TOLERANCE[dtype]}"


# (seq_lens, q_lens): each chunk is the last q_len tokens of its sequence's context.
LAYOUTS = {
    "whole-prompts": ([37, 5, 64, 1], [37, 5, 64, 1]),
    "chunks-mid-block": ([40, 29, 70], [13, 7, 30]),  # contexts of 27, 22, 40 tokens: chunks start mid-block
    "one-token-chunks": ([1, 30, 65], [1, 1, 1]),  # plain decode rows
    "mixed-step": ([50, 9, 33, 1, 17], [20, 1, 33, 1, 1]),  # a chunk, decodes, a whole prompt: one launch
}


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_chunk_layouts(layout, dtype):
    case = make_case(*layout, dtype=dtype)
    assert_matches_reference(case, paged_prefill_attention(*case.prefill_args), dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=map(shape_id, SHAPES))
def test_head_sizes_block_sizes_and_groups(shape):
    head_dim, block_size, group, dtype = shape
    case = make_case([30, 9, 26], [30, 1, 8], head_dim=head_dim, block_size=block_size, group=group, dtype=dtype)
    assert_matches_reference(case, paged_prefill_attention(*case.prefill_args), dtype)


@pytest.mark.parametrize("group", [1, 5, 64])
def test_query_tiles_fill_exactly_and_overhang(group):
    # BLOCK_Q queries per program: chunks of exactly one and two tiles, and one query more.
    block_q, block_m = query_tile(group)
    assert block_q * group <= block_m and block_m & (block_m - 1) == 0 and block_m >= 16
    lens = [block_q, 2 * block_q, block_q + 1]
    case = make_case([n + 3 for n in lens], lens, group=group, num_kv_heads=1, head_dim=16, block_size=4)
    assert_matches_reference(case, paged_prefill_attention(*case.prefill_args))


KERNEL_SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@KERNEL_SETTINGS
@given(
    data=st.data(),
    seq_lens=st.lists(st.integers(1, 70), min_size=1, max_size=4),
    block_size=st.integers(1, 20),
    heads=st.sampled_from([(2, 2), (4, 1), (5, 1), (6, 2), (8, 1)]),
    head_dim=st.sampled_from([16, 24, 40]),
    seed=st.integers(0, 2**16),
)
def test_any_batch_matches_the_reference(data, seq_lens, block_size, heads, head_dim, seed):
    q_lens = [data.draw(st.integers(1, n), label=f"q_lens[{i}]") for i, n in enumerate(seq_lens)]
    case = make_case(seq_lens, q_lens, head_dim=head_dim, block_size=block_size, group=heads[0] // heads[1],
                     num_kv_heads=heads[1], seed=seed)
    assert_matches_reference(case, paged_prefill_attention(*case.prefill_args))


def test_scale_views_and_no_value_checks():
    case = make_case(*LAYOUTS["mixed-step"])
    q, k_cache, v_cache, block_tables, seq_lens, starts = case.prefill_args
    kv = torch.stack([k_cache, v_cache], dim=1)  # K and V interleaved in one pool, as vLLM keeps them
    q_t = q.transpose(0, 1).contiguous().transpose(0, 1)
    assert not (q_t.is_contiguous() or kv[:, 0].is_contiguous())
    out = paged_prefill_attention(q_t, kv[:, 0], kv[:, 1], block_tables, seq_lens, starts, scale=0.3, validate=False)
    assert_matches_reference(case, out, scale=0.3)


def test_empty_batch():
    case = make_case([5], [5])
    q, k_cache, v_cache = case.q[:0], case.k_cache, case.v_cache
    starts = case.query_start_loc[:1]
    out = paged_prefill_attention(q, k_cache, v_cache, case.block_tables[:0], case.seq_lens[:0], starts)
    assert out.shape == (0, *q.shape[1:])


def test_the_backend_switch_runs_the_prefill_kernel():
    case = make_case([20, 9], [6, 1])
    expected = prefill_backend(*case.prefill_args, backend="torch")
    torch.testing.assert_close(prefill_backend(*case.prefill_args, backend="triton"), expected, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(prefill_as_decode(*case.prefill_args), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts loads in the interpreter, which a GPU run does not use")
@pytest.mark.parametrize("group", [1, 4])
def test_kv_bytes_read_equal_the_count_from_the_grid(group):
    """The instrumented interpreter's K/V bytes equal :func:`prefill_kv_tokens`, for both ways to prefill."""
    seq_lens, q_lens = [24, 9, 30], [24, 1, 7]
    case = make_case(seq_lens, q_lens, group=group, head_dim=16)
    row_bytes = 2 * case.k_cache.shape[2] * case.k_cache.shape[3] * case.k_cache.element_size()  # K and V, all heads
    as_decode, prefill = prefill_kv_tokens(seq_lens, q_lens, group)
    for fn, tokens in [(paged_prefill_attention, prefill), (prefill_as_decode, as_decode)]:
        with count_loads(k=case.k_cache, v=case.v_cache) as loaded:
            fn(*case.prefill_args)
        assert loaded["k"] + loaded["v"] == tokens * row_bytes, fn.__name__
    assert prefill < as_decode / 2


def test_prefill_kv_tokens_by_hand():
    # One whole prompt of 5 with BLOCK_Q = 64 (group 1): one tile reads 5 tokens; as decode 1+2+3+4+5.
    assert prefill_kv_tokens([5], [5], group=1) == (15, 5)
    # A decode row reads its whole context either way; a chunk of 3 after 10 tokens: 11+12+13 against 13.
    assert prefill_kv_tokens([7, 13], [1, 3], group=1) == (7 + 36, 7 + 13)
    block_q, _ = query_tile(4)  # 16 queries per tile: a 40-token prompt has tiles ending at 16, 32, 40
    assert prefill_kv_tokens([40], [40], group=4) == (40 * 41 // 2, 16 + 32 + 40)


def test_count_loads_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="interpreter"):
        with count_loads(k=torch.ones(1)):
            pass


# Each breaks one thing the kernel's own limits refuse (the shared checks are in test_04_validation).
@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda c: c.update(q=c["q"].double(), k_cache=c["k_cache"].double(), v_cache=c["v_cache"].double()),
         TypeError, "float32, float16 or bfloat16"),
        (lambda c: c.update(q=c["q"][..., :12], k_cache=c["k_cache"][..., :12], v_cache=c["v_cache"][..., :12]),
         ValueError, "head_dim must be a multiple of 8"),
        (lambda c: c.update(scale=-1.0), ValueError, "scale must be > 0"),
    ],
    ids=["float64", "head-dim-12", "scale"],
)
def test_prefill_rejects_what_the_kernel_cannot_take(change, error, match):
    case = make_case([9, 5], [4, 1])
    args = dict(zip(["q", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc"], case.prefill_args))
    change(args)
    with pytest.raises(error, match=match):
        paged_prefill_attention(**args)
