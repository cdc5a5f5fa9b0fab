"""Swap: K/V blocks copied out of the paged pool into CPU memory, and back into other blocks later.

Two chapters move K/V this way, and neither is on a plain decoding step's path, so an engine loads
this module the first time a step swaps:

- **swap-mode preemption** (chapter 05, ``EngineConfig(preemption_mode="swap")``): a victim's K/V
  is saved before its blocks are freed and restored when it is readmitted (:func:`move_kv`);
- **disaggregated serving** (chapter 08, :func:`minipaged.disagg.transfer_kv`): a prefill engine's
  K/V is copied into a decode engine's pool.

vLLM V1 preempts by recompute only; its V0 engine swapped, as the paper describes.
"""

from __future__ import annotations

import torch

from minipaged.validation import check_block_ids


@torch.inference_mode()
def swap_out(cache, block_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copy some blocks' K and V to CPU memory, e.g. before a preempted sequence's blocks are freed.

    Args:
        cache: the :class:`~minipaged.cache.PagedKVCache` to read.
        block_ids: the blocks to save, in the order :func:`swap_in` will restore them.

    Returns:
        Per layer, ``(k, v)`` CPU tensors of shape ``[len(block_ids), block_size, num_kv_heads, head_dim]``.
        The pool is unchanged.
    """
    ids = check_block_ids(block_ids, "block_ids", cache.num_blocks)
    index = torch.tensor(ids, dtype=torch.int64, device=cache.device)
    pools = zip(cache.k_caches, cache.v_caches)
    return [(k.index_select(0, index).cpu(), v.index_select(0, index).cpu()) for k, v in pools]


@torch.inference_mode()
def swap_in(cache, block_ids: list[int], saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy K and V saved by :func:`swap_out` back into the pool, usually into other blocks than before.

    Args:
        cache: the :class:`~minipaged.cache.PagedKVCache` to write.
        block_ids: the destination blocks, one per saved block, in the saved order (no repeats).
        saved: what :func:`swap_out` returned: per layer, ``(k, v)`` of shape
            ``[len(block_ids), block_size, num_kv_heads, head_dim]``, on any device.
    """
    ids = check_block_ids(block_ids, "block_ids", cache.num_blocks, unique=True)
    check_saved_kv(saved, cache.num_layers, (len(ids), cache.block_size, cache.num_kv_heads, cache.head_dim))
    index = torch.tensor(ids, dtype=torch.int64, device=cache.device)
    for k, v, (k_saved, v_saved) in zip(cache.k_caches, cache.v_caches, saved):
        k.index_copy_(0, index, k_saved.to(device=cache.device, dtype=cache.dtype))
        v.index_copy_(0, index, v_saved.to(device=cache.device, dtype=cache.dtype))


def move_kv(cache, out, swap_space: dict) -> int:
    """A step plan's K/V moves when it swaps: victims' K/V to CPU memory, copy-on-write, readmitted ones' back.

    Reads before writes: a victim's freed blocks, or a copy's source, may already belong to someone
    else this step, who is about to write into them. Returns the tokens moved between the pool and
    CPU memory (the clock charges them).

    Args:
        cache: the engine's :class:`~minipaged.cache.PagedKVCache`.
        out: the step's :class:`~minipaged.scheduler.SchedulerOutput` (its ``swap_out``, ``copies``,
            ``swap_in`` and ``swap_in_hit_blocks``).
        swap_space: seq_id -> what :func:`swap_out` saved for it; updated in place.
    """
    moved = 0
    for seq, block_ids in out.swap_out:
        swap_space[seq.seq_id] = swap_out(cache, block_ids)
        moved += seq.num_computed_tokens
    cache.copy_pending(out.copies)  # after the victims' K/V is saved, before anything lands in the new blocks
    for seq, num_hit_blocks in zip(out.swap_in, out.swap_in_hit_blocks):
        saved = swap_space.pop(seq.seq_id)
        if num_hit_blocks < len(saved[0][0]):  # the blocks a prefix hit did not restore come back from CPU
            rest = [(k[num_hit_blocks:], v[num_hit_blocks:]) for k, v in saved]
            swap_in(cache, seq.block_table.blocks[num_hit_blocks : len(saved[0][0])], rest)
            moved += seq.num_computed_tokens - num_hit_blocks * cache.block_size
    return moved


def check_saved_kv(saved, num_layers: int, shape: tuple[int, ...]) -> None:
    """K/V saved block by block (what :func:`swap_out` returns), before it is copied back.

    Args:
        saved: per layer, a ``(k, v)`` pair of tensors.
        num_layers: the layers it must hold.
        shape: each tensor's shape, ``[num_saved_blocks, block_size, num_kv_heads, head_dim]``.

    Raises:
        TypeError: ``saved`` is not a list or tuple, or an entry is not a tensor.
        ValueError: the wrong number of layers, an entry that is not a pair, or a tensor of another shape.
    """
    if not isinstance(saved, (list, tuple)):
        raise TypeError(f"saved must be the list swap_out returned, got {type(saved).__name__}")
    if len(saved) != num_layers:
        raise ValueError(f"saved must hold one (k, v) pair per layer: {num_layers}, got {len(saved)}")
    for layer, pair in enumerate(saved):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError(f"saved[{layer}] must be a (k, v) pair of tensors")
        for name, t in zip("kv", pair):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"saved[{layer}] {name} must be a torch.Tensor, got {type(t).__name__}")
            if tuple(t.shape) != shape:
                raise ValueError(f"saved[{layer}] {name} has shape {tuple(t.shape)}; {shape[0]} blocks need {shape}")
