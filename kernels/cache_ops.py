"""Writing new keys and values into the paged cache: a scatter by slot.

Each new token has a slot, ``block_id * block_size + offset``, chosen by the block
manager; slot ``-1`` marks a token that must not be written (padding). One program
copies one token's ``[num_kv_heads, head_dim]`` rows of K and of V.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_attention import HEAD_DIMS, _is_power_of_two


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
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # int64: slot * strides can pass 2**31
    if slot >= 0:
        block_id = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        heads = tl.arange(0, HEADS_PAD)
        dims = tl.arange(0, HEAD_DIM)
        mask = (heads < NUM_KV_HEADS)[:, None]
        k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd, mask=mask)
        v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd, mask=mask)
        k_dst = k_cache_ptr + block_id * stride_kcb + offset * stride_kct + heads[:, None] * stride_kch + dims[None, :] * stride_kcd
        v_dst = v_cache_ptr + block_id * stride_vcb + offset * stride_vct + heads[:, None] * stride_vch + dims[None, :] * stride_vcd
        tl.store(k_dst, k, mask=mask)
        tl.store(v_dst, v, mask=mask)


def _check_write_inputs(key, value, k_cache, v_cache, slot_mapping) -> None:
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slot_mapping)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            f"key and value must both be [num_tokens, num_kv_heads, head_dim], got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_tokens, num_kv_heads, head_dim = key.shape
    num_blocks, block_size = k_cache.shape[:2]
    if k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"key rows are {tuple(key.shape[1:])} but cache rows are {tuple(k_cache.shape[2:])} (num_kv_heads, head_dim)")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [num_tokens={num_tokens}], got shape {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"slot_mapping must be int64 (or int32), got {slot_mapping.dtype}")
    if not (key.dtype == value.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(
            f"key, value, k_cache and v_cache must share a dtype, got {key.dtype}, {value.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    devices = {t.device for t in (key, value, k_cache, v_cache, slot_mapping)}
    if len(devices) > 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    if not _is_power_of_two(block_size):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    if num_tokens:
        lo, hi = torch.stack([slot_mapping.min(), slot_mapping.max()]).tolist()
        if lo < -1 or hi >= num_blocks * block_size:
            raise IndexError(f"slot_mapping must lie in [-1, {num_blocks * block_size}) (-1 = skip), got min {lo}, max {hi}")


def write_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Scatter ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into their cache slots, in place.

    ``slot_mapping[i]`` is token ``i``'s slot ``block_id * block_size + offset``; ``-1`` skips the token.
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
        BLOCK_SIZE=k_cache.shape[1],
    )


__all__ = ["write_kv"]
