"""PagedKVCache and write_kv: write/gather round trip through block tables, input validation, memory report."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.accounting import memory_report
from minipaged.attention import write_kv
from minipaged.blocks import OutOfBlocks
from minipaged.cache import PagedKVCache

pytestmark = pytest.mark.ch02

H, D = 2, 4


def make_cache(num_blocks=8, block_size=4, layers=2, dtype=torch.float32):
    cache = PagedKVCache(layers, num_blocks, block_size, H, D, dtype=dtype)
    # Unowned slots hold NaN, so a read through a wrong slot poisons the result instead of passing quietly.
    for t in cache.k_caches + cache.v_caches:
        t.fill_(float("nan"))
    return cache


def kv(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.lists(st.tuples(st.integers(0, 2), st.integers(1, 7)), max_size=12))
def test_write_then_gather_returns_each_sequence_in_order(block_size, appends):
    """Interleaved appends of 3 sequences land in scattered blocks; gather must still read them back in order."""
    cache = make_cache(num_blocks=30, block_size=block_size)
    tables = [cache.new_table(i) for i in range(3)]
    written = [[[], []] for _ in range(3)]  # per sequence, per layer
    for step, (i, n) in enumerate(appends):
        try:
            slots = tables[i].append_tokens(n)
        except OutOfBlocks:
            continue
        for layer in range(2):
            k, v = kv(n, seed=step * 2 + layer)
            cache.write(layer, k, v, slots)
            written[i][layer].append((k, v))
    for i, table in enumerate(tables):
        for layer in range(2):
            k, v = cache.gather(layer, table)
            assert k.shape == (table.num_tokens, H, D)
            if written[i][layer]:
                assert torch.equal(k, torch.cat([a for a, _ in written[i][layer]]))
                assert torch.equal(v, torch.cat([b for _, b in written[i][layer]]))
            assert not torch.isnan(k).any() and not torch.isnan(v).any()


def test_layout_is_flash_and_slot_addresses_block_and_offset():
    cache = make_cache(num_blocks=4, block_size=4, layers=1)
    assert cache.k_caches[0].shape == (4, 4, H, D)
    filler = cache.new_table("filler")
    filler.append_tokens(4)  # block 0
    table = cache.new_table("s")
    slots = table.append_tokens(6)  # blocks 1 and 2
    k, v = kv(6, seed=0)
    cache.write(0, k, v, slots)
    assert torch.equal(cache.k_caches[0][1, 3], k[3])
    assert torch.equal(cache.v_caches[0][2, 1], v[5])
    assert torch.isnan(cache.k_caches[0][2, 2:]).all(), "the tail of the last block must stay untouched"


def test_slot_minus_one_is_skipped():
    cache = make_cache(layers=1)
    table = cache.new_table()
    slots = table.append_tokens(3)
    k, v = kv(4, seed=1)
    cache.write(0, k, v, torch.cat([slots[:1], torch.tensor([-1]), slots[1:]]))
    got_k, _ = cache.gather(0, table)
    assert torch.equal(got_k, k[[0, 2, 3]])
    assert torch.isnan(cache.k_caches[0][1]).all()


def test_write_rejects_bad_inputs_before_touching_the_cache():
    cache = make_cache(layers=1)
    slots = cache.new_table().append_tokens(2)
    k, v = kv(2, seed=2)
    before = cache.k_caches[0].clone()
    cases = [
        ((0, k[:, :1], v, slots), ValueError, "key and value must be \\[num_tokens, 2, 4\\]"),
        ((0, k, v[:1], slots), ValueError, "key and value must be"),
        ((0, k.double(), v, slots), TypeError, "must share a dtype, got torch.float64"),
        ((0, k, v, slots.float()), TypeError, "slot_mapping must be int64 \\(or int32\\)"),
        ((0, k, v, slots[:1]), ValueError, "slot_mapping must be \\[num_tokens=2\\]"),
        ((0, k, v, torch.tensor([0, 32])), IndexError, "must lie in \\[-1, 32\\)"),
        ((0, k, v, torch.tensor([-2, 0])), IndexError, "must lie in \\[-1, 32\\)"),
        ((1, k, v, slots), IndexError, "layer 1 is out of range"),
        ((0, k.numpy(), v, slots), TypeError, "key must be a torch.Tensor"),
    ]
    for args, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            cache.write(*args)
    assert torch.equal(before.isnan(), cache.k_caches[0].isnan())


def test_write_rejects_wrong_device():
    cache = make_cache(layers=1)
    k, v = kv(1, seed=3)
    with pytest.raises(ValueError, match="is on cpu, but key is on meta"):
        cache.write(0, k.to("meta"), v, torch.tensor([0]))


def test_gather_rejects_a_table_from_another_cache():
    a, b = make_cache(), make_cache()
    with pytest.raises(ValueError, match="another allocator"):
        a.gather(0, b.new_table())


def test_bf16_round_trip():
    cache = PagedKVCache(1, 4, 2, H, D, dtype=torch.bfloat16)
    table = cache.new_table()
    k, v = (t.bfloat16() for t in kv(3, seed=4))
    cache.write(0, k, v, table.append_tokens(3))
    assert torch.equal(cache.gather(0, table)[0], k)


def test_memory_report_counts_tail_waste_and_bytes():
    cache = PagedKVCache(2, 10, 4, H, D, dtype=torch.float16)
    a, b = cache.new_table("a"), cache.new_table("b")
    a.append_tokens(5)  # 2 blocks, 3 wasted
    b.append_tokens(8)  # 2 blocks, 0 wasted
    r = memory_report(cache, [a, b])
    assert (r.used_blocks, r.free_blocks, r.effective_tokens, r.tail_waste) == (4, 6, 13, 3)
    assert r.bytes_per_block == 2 * 2 * 4 * H * D * 2
    assert r.block_table_bytes == 2 * 2 * 4
    assert r.utilisation == pytest.approx(13 / 16)
    text = str(r)
    assert "13" in text and "81.25%" in text and "tail waste         3 slots" in text


def test_constructor_validates():
    with pytest.raises(ValueError, match="num_kv_heads must be >= 1"):
        PagedKVCache(1, 4, 4, 0, 8)
    with pytest.raises(TypeError, match="head_dim must be an int"):
        PagedKVCache(1, 4, 4, 1, 8.0)
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        PagedKVCache(1, 4, 4, 1, 8, dtype="float32")


def test_write_kv_lands_at_slots_and_skips_minus_one():
    k_cache = torch.zeros(4, 2, 1, 3)
    v_cache = torch.zeros(4, 2, 1, 3)
    key = torch.arange(1, 10, dtype=torch.float32).view(3, 1, 3)
    slots = torch.tensor([5, -1, 0])
    write_kv(key, -key, k_cache, v_cache, slots)
    flat = k_cache.view(-1, 1, 3)
    assert torch.equal(flat[5], key[0]) and torch.equal(flat[0], key[2])  # slot 5 = block 2, offset 1
    assert torch.equal(k_cache[2, 1], key[0]) and torch.equal(v_cache[2, 1], -key[0])
    assert int((k_cache != 0).any(-1).sum()) == 2  # the -1 token went nowhere


def test_write_kv_rejects_bad_input_before_writing():
    k_cache, v_cache = torch.zeros(2, 4, 1, 2), torch.zeros(2, 4, 1, 2)
    key = torch.ones(2, 1, 2)
    with pytest.raises(IndexError, match="slot_mapping"):
        write_kv(key, key, k_cache, v_cache, torch.tensor([0, 8]))
    with pytest.raises(TypeError, match="slot_mapping"):
        write_kv(key, key, k_cache, v_cache, torch.tensor([0.0, 1.0]))
    with pytest.raises(TypeError, match="dtype"):
        write_kv(key.half(), key.half(), k_cache, v_cache, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="key"):
        write_kv(torch.ones(2, 2, 2), torch.ones(2, 2, 2), k_cache, v_cache, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="contiguous"):
        write_kv(key, key, k_cache.transpose(0, 1).contiguous().transpose(0, 1), v_cache, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="backend must be one of"):
        write_kv(key, key, k_cache, v_cache, torch.tensor([0, 1]), backend="cuda")
    assert not k_cache.any() and not v_cache.any()  # nothing was written
