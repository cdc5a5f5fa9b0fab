"""Writing new keys and values into the paged cache: a scatter by slot.

Each new token has a slot, ``block_id * block_size + offset``, chosen by the block
manager; slot ``-1`` marks a token that must not be written (padding). One program
copies one token's ``[num_kv_heads, head_dim]`` rows of K and of V.
"""

from __future__ import annotations

import triton
import triton.language as tl

from minipaged._triton import check_device
from minipaged.attention_checks import check_kv_write

from .paged_attention import check_layout


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kct, stride_kch, stride_kcd,
    stride_vcb, stride_vct, stride_vch, stride_vcd,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # NUM_KV_HEADS rounded up to a power of two for tl.arange
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two; the lanes past HEAD_DIM are masked
    BLOCK_SIZE: tl.constexpr,  # any size: the slot is split by division, not by a tl.arange
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # int64: slot * strides can pass 2**31
    if slot >= 0:
        block_id = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        heads = tl.arange(0, HEADS_PAD)
        dims = tl.arange(0, HEAD_DIM_PAD)
        mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
        k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd, mask=mask)
        v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd, mask=mask)
        k_dst = k_cache_ptr + block_id * stride_kcb + offset * stride_kct
        v_dst = v_cache_ptr + block_id * stride_vcb + offset * stride_vct
        k_dst += heads[:, None] * stride_kch + dims[None, :] * stride_kcd
        v_dst += heads[:, None] * stride_vch + dims[None, :] * stride_vcd
        tl.store(k_dst, k, mask=mask)
        tl.store(v_dst, v, mask=mask)


def _check_write_inputs(key, value, k_cache, v_cache, slot_mapping) -> None:
    """The checks every write backend shares, then this kernel's own limits."""
    check_kv_write(key, value, k_cache, v_cache, slot_mapping)
    check_device(key.device)
    block_size, _, head_dim = k_cache.shape[1:]
    check_layout(block_size, head_dim)


def write_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Scatter ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into their cache slots, in place.

    ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]``; ``slot_mapping[i]``
    is token ``i``'s slot ``block_id * block_size + offset``, and ``-1`` skips the token. The
    inputs are checked like :func:`minipaged.attention.write_kv`'s, plus the kernels' layout limits
    (``block_size`` up to 256, ``head_dim`` a multiple of 8 from 16 to 256).
    """
    _check_write_inputs(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping.contiguous(),
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
    )


__all__ = ["write_kv"]
