"""Chapter 04: the Triton paged decode kernel and the cache-write kernel against a float64 reference.

On a CPU every kernel runs in Triton's interpreter, which costs a few ms per
program step, so the shapes are small; the same tests run unchanged on a GPU.
The prefill kernel's tests are in test_04_prefill.py.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_shapes import SHAPES, shape_id

from minipaged.attention import contiguous_attention, paged_attention
from minipaged.kernels import paged_decode_attention, paged_prefill_attention, write_kv
from minipaged.kernels.paged_attention import MIN_TOKENS_PER_SPLIT, choose_num_splits
from minipaged.testing import PagedCase, make_paged_case

pytestmark = pytest.mark.ch04

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Output is rounded to the input dtype once; the reference is float64 on the same inputs.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def make_case(
    seq_lens, *, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32, spare_blocks=5, seed=0
):
    """Shuffled block tables over a NaN pool, with two table columns past the longest sequence."""
    return make_paged_case(
        seq_lens, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        dtype=dtype, spare_blocks=spare_blocks, extra_columns=2, seed=seed, device=DEVICE,
    )


def assert_matches_reference(case, out, dtype=torch.float32, scale=None):
    expected = case.reference(scale=scale, dtype=torch.float64)
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    assert torch.isfinite(out).all(), "the kernel read a NaN from a block or slot it does not own"
    err = (out.double() - expected).abs().max().item()
    assert err <= TOLERANCE[dtype], f"max abs error {err:.3g} > {TOLERANCE[dtype]}"


LENGTHS = [1, 37, 64, 150]  # a single token, partial last blocks and tiles, an exact tile, three tiles


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2), (4, 1)], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("num_splits", [1, 3], ids=["unsplit", "split3"])
def test_decode_matches_reference(dtype, num_heads, num_kv_heads, num_splits):
    case = make_case(LENGTHS, num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=dtype)
    out = paged_decode_attention(*case.decode_args, num_splits=num_splits)
    assert_matches_reference(case, out, dtype)


# The block sizes: one token, odd, not a power of two (12, 48), the default, and up to the limit.
BLOCK_SIZES = [1, 3, 12, 16, 48, 128, 256]


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_every_block_size(block_size):
    # Below KV_TILE (64) one loop step covers several blocks, above it part of one, each with its own table lookup;
    # a block size that is not a power of two leaves tiles that straddle blocks.
    case = make_case([1, 45, 130], block_size=block_size, num_heads=2, num_kv_heads=1, head_dim=16, spare_blocks=1)
    assert_matches_reference(case, paged_decode_attention(*case.decode_args, num_splits=2))


@pytest.mark.parametrize("shape", SHAPES, ids=map(shape_id, SHAPES))
def test_head_sizes_block_sizes_and_groups(shape):
    """Padded head dims (80, 96: 128 lanes, the last ones masked) through the decode and merge kernels."""
    head_dim, block_size, group, dtype = shape
    case = make_case([1, 40, 70], head_dim=head_dim, block_size=block_size, num_heads=2 * group, num_kv_heads=2,
                     dtype=dtype, spare_blocks=1)
    assert_matches_reference(case, paged_decode_attention(*case.decode_args, num_splits=2), dtype)


def test_custom_scale_and_more_splits_than_tiles():
    # 8 splits of a 1-tile sequence leave empty splits; the merge must give them no weight.
    case = make_case([3, 20, 50])
    assert_matches_reference(case, paged_decode_attention(*case.decode_args, scale=0.3, num_splits=8), scale=0.3)


# The interpreter runs a case in ~0.1-0.5 s, so the property tests draw few, small examples.
KERNEL_SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@KERNEL_SETTINGS
@given(
    seq_lens=st.lists(st.integers(1, 200), min_size=1, max_size=3),
    block_size=st.integers(1, 40),
    heads=st.sampled_from([(2, 2), (4, 1), (8, 2), (5, 1), (6, 2)]),
    head_dim=st.sampled_from([16, 24, 40, 48]),
    num_splits=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_any_shapes_lengths_tables_and_splits_match_the_reference(seq_lens, block_size, heads, head_dim, num_splits,
                                                                  seed):
    case = make_case(seq_lens, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim, block_size=block_size,
                     seed=seed)
    assert_matches_reference(case, paged_decode_attention(*case.decode_args, num_splits=num_splits))


def test_split_heuristic():
    assert choose_num_splits(num_seqs=64, num_kv_heads=8, max_seq_len=8192, parallelism=132) == 1  # grid already full
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=100, parallelism=132) == 1  # too short to split
    long_context = choose_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=32768, parallelism=132)
    assert long_context > 1 and 8 * long_context >= 132  # enough programs to cover the SMs
    assert choose_num_splits(1, 1, 3 * MIN_TOKENS_PER_SPLIT, parallelism=132) == 3  # each split keeps its minimum


def test_automatic_split_on_a_long_context():
    # One long sequence and one KV head: the heuristic splits (CPU_PARALLELISM stands in for SMs).
    lens = [3 * MIN_TOKENS_PER_SPLIT + 5, 9]
    case = make_case(lens, num_heads=2, num_kv_heads=1, head_dim=16, block_size=64, spare_blocks=0)
    assert choose_num_splits(2, 1, 3 * MIN_TOKENS_PER_SPLIT + 5, parallelism=8) > 1
    assert_matches_reference(case, paged_decode_attention(*case.decode_args))
    # Without the value checks (no host sync) the heuristic bounds the context by the table width.
    assert_matches_reference(case, paged_decode_attention(*case.decode_args, validate=False))


def test_non_contiguous_views():
    case = make_case([7, 40])
    q, k_cache, v_cache, block_tables, seq_lens = case.decode_args
    # K and V interleaved in one pool, q with heads and seqs swapped in memory, a sliced table.
    kv = torch.stack([k_cache, v_cache], dim=1)
    q_t = q.transpose(0, 1).contiguous().transpose(0, 1)
    wide_tables = torch.cat([block_tables, block_tables], dim=1)[:, : block_tables.shape[1]]
    assert not (q_t.is_contiguous() or kv[:, 0].is_contiguous() or wide_tables.is_contiguous())
    assert_matches_reference(case, paged_decode_attention(q_t, kv[:, 0], kv[:, 1], wide_tables, seq_lens, num_splits=2))
    for backend in ("torch", "loop"):  # the PyTorch paths take the same strided views (issue 25)
        assert_matches_reference(case, paged_attention(q_t, kv[:, 0], kv[:, 1], wide_tables, seq_lens, backend=backend))


def test_offsets_past_2_to_the_31():
    """A pool with more than 2**31 elements, where only the last blocks are touched (decode, prefill, write).

    ``torch.empty`` leaves the pool untouched, so the OS commits only the pages we
    write: the test costs a few MB of real memory although the pool spans 4 GiB of
    address space (fp16). The sequences own blocks at the very end, so
    ``block_id * stride`` exceeds 2**31: with 32-bit offsets the kernel would read
    the wrong rows (or crash).
    """
    block_size, num_kv_heads, head_dim = 16, 1, 16
    per_block = block_size * num_kv_heads * head_dim
    num_blocks = 2**31 // per_block + 64
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    try:
        k_cache = torch.empty(shape, dtype=torch.float16, device=DEVICE)
        v_cache = torch.empty(shape, dtype=torch.float16, device=DEVICE)
    except (RuntimeError, MemoryError) as exc:  # a GPU under 9 GB, or a host that refuses to overcommit
        pytest.skip(f"cannot reserve two 4 GiB pools here: {exc}")
    seq_lens = torch.tensor([40, 17], dtype=torch.int32, device=DEVICE)
    rows = [[num_blocks - 1, num_blocks - 10, num_blocks - 3], [num_blocks - 20, num_blocks - 2, 0]]
    block_tables = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    assert int(block_tables.max()) * per_block > 2**31
    gen = torch.Generator().manual_seed(1)
    for ids in rows:
        for b in ids:
            k_cache[b] = torch.randn(shape[1:], generator=gen).half().to(DEVICE)
            v_cache[b] = torch.randn(shape[1:], generator=gen).half().to(DEVICE)
    q = torch.randn(2, 2, head_dim, generator=gen).half().to(DEVICE)
    # The contiguous K/V each sequence's table points at, for the reference.
    keys = [k_cache[ids].flatten(0, 1)[:n] for ids, n in zip(rows, seq_lens.tolist())]
    values = [v_cache[ids].flatten(0, 1)[:n] for ids, n in zip(rows, seq_lens.tolist())]
    starts = torch.arange(3, dtype=torch.int32, device=DEVICE)
    case = PagedCase(q, k_cache, v_cache, block_tables, seq_lens, starts, keys, values)
    assert_matches_reference(case, paged_decode_attention(*case.decode_args, num_splits=1), torch.float16)
    # The prefill kernel, on a chunk of 5 (mid-block) and a decode row, through the same far blocks.
    q = torch.randn(6, 2, head_dim, generator=gen).half().to(DEVICE)
    starts = torch.tensor([0, 5, 6], dtype=torch.int32, device=DEVICE)
    case = PagedCase(q, k_cache, v_cache, block_tables, seq_lens, starts, keys, values)
    assert_matches_reference(case, paged_prefill_attention(*case.prefill_args), torch.float16)

    key = torch.randn(2, num_kv_heads, head_dim, generator=gen).half().to(DEVICE)
    slots = torch.tensor([(num_blocks - 1) * block_size + 5, -1], device=DEVICE)
    write_kv(key, key, k_cache, v_cache, slots)
    assert torch.equal(k_cache[num_blocks - 1, 5], key[0]) and torch.equal(v_cache[num_blocks - 1, 5], key[0])


# ---- the cache-write kernel -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
@pytest.mark.parametrize("block_size, head_dim", [(4, 16), (3, 80), (12, 96), (1, 24)])
def test_write_kv_scatters_and_skips_minus_one(dtype, slot_dtype, block_size, head_dim):
    gen = torch.Generator().manual_seed(2)
    num_blocks, num_kv_heads = 10, 3  # 3 heads padded to 4 inside; 80, 96 and 24 lanes padded to 128 and 32
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(5, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    value = torch.randn(5, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    slots = torch.tensor([0, 7, -1, num_blocks * block_size - 1, 5], dtype=slot_dtype, device=DEVICE)
    write_kv(key, value, k_cache, v_cache, slots)

    expected_k, expected_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    keep = slots >= 0
    expected_k.view(-1, num_kv_heads, head_dim)[slots[keep].long()] = key[keep]
    expected_v.view(-1, num_kv_heads, head_dim)[slots[keep].long()] = value[keep]
    # Exactly the written slots changed: the padding lanes past head_dim wrote nothing next door.
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_write_kv_every_block_size(block_size):
    gen = torch.Generator().manual_seed(block_size)
    k_cache = torch.zeros(3, block_size, 2, 16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([0, block_size - 1, 2 * block_size, 3 * block_size - 1], device=DEVICE).unique()
    key = torch.randn(len(slots), 2, 16, generator=gen).to(DEVICE)
    write_kv(key, -key, k_cache, v_cache, slots)
    expected = torch.zeros(3 * block_size, 2, 16, device=DEVICE).index_copy_(0, slots, key)
    assert torch.equal(k_cache.flatten(0, 1), expected) and torch.equal(v_cache.flatten(0, 1), -expected)


@KERNEL_SETTINGS
@given(data=st.data(), num_tokens=st.integers(0, 12), seed=st.integers(0, 2**16))
def test_write_kv_equals_index_copy(data, num_tokens, seed):
    pool_slots = 6 * 4
    slot_ids = st.integers(0, pool_slots - 1)
    targets = data.draw(st.lists(slot_ids, min_size=num_tokens, max_size=num_tokens, unique=True))
    skipped = data.draw(st.lists(st.booleans(), min_size=num_tokens, max_size=num_tokens))
    slots = torch.tensor([-1 if skip else t for t, skip in zip(targets, skipped)], dtype=torch.int64, device=DEVICE)
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(num_tokens, 2, 16, generator=gen).to(DEVICE)
    value = torch.randn(num_tokens, 2, 16, generator=gen).to(DEVICE)
    k_cache = torch.zeros(6, 4, 2, 16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    write_kv(key, value, k_cache, v_cache, slots)
    keep = slots >= 0
    expected_k = torch.zeros(pool_slots, 2, 16, device=DEVICE).index_copy_(0, slots[keep], key[keep])
    expected_v = torch.zeros(pool_slots, 2, 16, device=DEVICE).index_copy_(0, slots[keep], value[keep])
    assert torch.equal(k_cache.view(pool_slots, 2, 16), expected_k)
    assert torch.equal(v_cache.view(pool_slots, 2, 16), expected_v)


def test_write_then_decode_round_trip():
    # Prefill two sequences through write_kv into scattered blocks, then decode over them:
    # equal to attention over the contiguous K/V the tokens came from.
    gen = torch.Generator().manual_seed(3)
    block_size, num_kv_heads, head_dim, lens = 8, 2, 32, [13, 21]
    k_cache = torch.full((12, block_size, num_kv_heads, head_dim), float("nan"), device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    block_tables = torch.tensor([[9, 2, 0], [4, 11, 7]], dtype=torch.int32, device=DEVICE)
    keys = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(DEVICE) for n in lens]
    values = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(DEVICE) for n in lens]
    positions = [torch.arange(n, device=DEVICE) for n in lens]
    slots = torch.cat(
        [block_tables[s].long()[p // block_size] * block_size + p % block_size for s, p in enumerate(positions)]
    )
    padding = torch.full((3,), -1, device=DEVICE)  # padded tokens must not land anywhere
    key, value = torch.cat(keys + [keys[0][:3]]), torch.cat(values + [values[0][:3]])
    write_kv(key, value, k_cache, v_cache, torch.cat([slots, padding]))

    q = torch.randn(2, 4, head_dim, generator=gen).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens)
    for s in range(2):
        expected = contiguous_attention(q[s : s + 1], keys[s], values[s])[0]
        torch.testing.assert_close(out[s], expected, atol=2e-5, rtol=1e-5)


# ---- clear errors before launch ------------------------------------------------------------


def _bad(change):
    q, k_cache, v_cache, block_tables, seq_lens = make_case(
        [5, 20], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8
    ).decode_args
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens)
    change(args)
    return args


def _all(a, fn):
    a.update(q=fn(a["q"]), k_cache=fn(a["k_cache"]), v_cache=fn(a["v_cache"]))


# The checks every backend shares are tested in test_04_validation; these are the kernel's own limits.
@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda a: _all(a, torch.Tensor.double), TypeError, "float32, float16 or bfloat16"),
        (lambda a: a.update(k_cache=a["k_cache"].repeat(1, 33, 1, 1), v_cache=a["v_cache"].repeat(1, 33, 1, 1)),
         ValueError, "block_size must be in 1..256"),
        (lambda a: _all(a, lambda t: t[..., :12]), ValueError, "head_dim must be a multiple of 8 from 16 to 256"),
        (lambda a: _all(a, lambda t: t[..., :8]), ValueError, "head_dim must be a multiple of 8 from 16 to 256"),
        (lambda a: _all(a, lambda t: torch.cat([t] * 17, dim=-1)[..., :264]), ValueError, "head_dim must be a"),
    ],
    ids=["float64", "block-size-264", "head-dim-12", "head-dim-8", "head-dim-264"],
)
def test_decode_rejects_bad_input(change, error, match):
    with pytest.raises(error, match=match):
        paged_decode_attention(**_bad(change))


def test_decode_rejects_bad_num_splits():
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(**_bad(lambda a: None), num_splits=0)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(**_bad(lambda a: None), num_splits=1000)
    with pytest.raises(TypeError, match="num_splits"):
        paged_decode_attention(**_bad(lambda a: None), num_splits=2.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to mix with the CPU")
def test_decode_rejects_mixed_devices():
    with pytest.raises(ValueError, match="share a device"):
        paged_decode_attention(**_bad(lambda a: a.update(seq_lens=a["seq_lens"].cpu())))


def test_write_kv_rejects_what_the_kernel_cannot_take():
    key = torch.ones(2, 2, 16, device=DEVICE)
    slots = torch.tensor([0, 1], device=DEVICE)
    k_cache = torch.zeros(4, 257, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="block_size must be in 1..256"):
        write_kv(key, key, k_cache, k_cache.clone(), slots)
    k_cache = torch.zeros(4, 8, 2, 12, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 8"):
        write_kv(key[..., :12], key[..., :12], k_cache, k_cache.clone(), slots)
    assert not k_cache.any(), "nothing may be written when the input is rejected"


def test_without_triton_the_kernels_explain_how_to_get_it():
    code = """
        import sys
        sys.modules["triton"] = None  # makes `import triton` fail, as on macOS
        from minipaged.kernels import paged_decode_attention, write_kv
        from minipaged._triton import TritonUnavailable
        for fn in (paged_decode_attention, write_kv):
            try:
                fn()
            except TritonUnavailable as exc:
                assert "pip install triton" in str(exc), exc
            else:
                raise AssertionError(f"{fn.__name__} ran without triton")
        print("ok")
    """
    command = [sys.executable, "-c", textwrap.dedent(code)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
