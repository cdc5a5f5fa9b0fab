"""PagedKVCache's block copies: swap out to CPU memory, swap back in elsewhere, copy blocks inside the pool."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.cache import PagedKVCache
from minipaged.swap import swap_in, swap_out

pytestmark = pytest.mark.ch05

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 2, 8, 4, 2, 3


def filled_cache(seed: int = 0) -> PagedKVCache:
    """A cache whose every slot holds distinct random K and V."""
    cache = PagedKVCache(NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
    gen = torch.Generator().manual_seed(seed)
    for pool in (*cache.k_caches, *cache.v_caches):
        pool.copy_(torch.randn(pool.shape, generator=gen))
    return cache


def snapshot(cache):
    return [t.clone() for t in (*cache.k_caches, *cache.v_caches)]


block_lists = st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=0, max_size=NUM_BLOCKS, unique=True)


@settings(max_examples=40, deadline=None)
@given(src=block_lists, data=st.data())
def test_swap_out_then_in_moves_exactly_those_blocks(src, data):
    cache = filled_cache()
    before = snapshot(cache)
    saved = swap_out(cache, src)
    assert len(saved) == NUM_LAYERS
    for layer, (k, v) in enumerate(saved):
        assert k.device.type == "cpu" and k.shape == (len(src), BLOCK_SIZE, HEADS, HEAD_DIM)
        assert torch.equal(k, before[layer][src]) and torch.equal(v, before[NUM_LAYERS + layer][src])
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(cache)))  # swap_out changes nothing
    dst = data.draw(st.permutations(range(NUM_BLOCKS)))[: len(src)]
    for pool in (*cache.k_caches, *cache.v_caches):
        pool.zero_()  # the blocks were reused by someone else meanwhile
    swap_in(cache, dst, saved)
    untouched = [b for b in range(NUM_BLOCKS) if b not in dst]
    for layer in range(NUM_LAYERS):
        for pool, old in ((cache.k_caches[layer], before[layer]), (cache.v_caches[layer], before[NUM_LAYERS + layer])):
            assert torch.equal(pool[dst], old[src])
            assert not pool[untouched].any()


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_copy_blocks_copies_every_layer_pairwise(data):
    dst = data.draw(block_lists)
    src = data.draw(st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=len(dst), max_size=len(dst)))
    cache = filled_cache(1)
    before = snapshot(cache)
    cache.copy_blocks(src, dst)
    for old, new in zip(before, snapshot(cache)):
        for b in range(NUM_BLOCKS):
            want = old[src[dst.index(b)]] if b in dst else old[b]  # sources are read before any write
            assert torch.equal(new[b], want)


def test_swap_preserves_dtype_and_survives_a_round_trip_in_bf16():
    cache = PagedKVCache(1, 4, 2, 1, 4, dtype=torch.bfloat16)
    cache.k_caches[0][1] = 1.5
    saved = swap_out(cache, [1])
    assert saved[0][0].dtype == torch.bfloat16
    swap_in(cache, [3], saved)
    assert torch.equal(cache.k_caches[0][3], cache.k_caches[0][1])


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda c: swap_out(c, [0, NUM_BLOCKS]), IndexError, r"block_ids\[1\] = 8 is outside"),
        (lambda c: swap_out(c, [-1]), IndexError, r"block_ids\[0\] = -1"),
        (lambda c: swap_out(c, [1.0]), TypeError, r"block_ids\[0\] must be an int"),
        (lambda c: swap_out(c, [True]), TypeError, r"block_ids\[0\]"),
        (lambda c: swap_out(c, 3), TypeError, "block_ids must be a list"),
        (lambda c: swap_in(c, [0, 0], swap_out(c, [1, 2])), ValueError, "must not repeat"),
        (lambda c: swap_in(c, [0], swap_out(c, [1, 2])), ValueError, r"saved\[0\] k has shape"),
        (lambda c: swap_in(c, [0], swap_out(c, [1])[:1]), ValueError, "one \\(k, v\\) pair per layer"),
        (lambda c: swap_in(c, [0], "saved"), TypeError, "saved must be"),
        (lambda c: swap_in(c, [0], [(torch.zeros(1), None)] * NUM_LAYERS), ValueError, r"saved\[0\] k has shape"),
        (lambda c: swap_in(c, [0], [(1, 2)] * NUM_LAYERS), TypeError, r"saved\[0\] k must be a torch.Tensor"),
        (lambda c: swap_in(c, [9], swap_out(c, [1])), IndexError, r"block_ids\[0\] = 9"),
        (lambda c: c.copy_blocks([0, 1], [2]), ValueError, "must pair up, got 2 and 1"),
        (lambda c: c.copy_blocks([0, 1], [2, 2]), ValueError, "dst_block_ids must not repeat"),
        (lambda c: c.copy_blocks([0, 99], [2, 3]), IndexError, r"src_block_ids\[1\] = 99"),
        (lambda c: c.copy_blocks([0], [-2]), IndexError, r"dst_block_ids\[0\] = -2"),
    ],
)
def test_bad_arguments_raise_before_anything_changes(call, error, match):
    cache = filled_cache(2)
    before = snapshot(cache)
    with pytest.raises(error, match=match):
        call(cache)
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(cache)))
