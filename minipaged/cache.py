"""The paged KV cache: per-layer K and V pools allocated once, addressed by slot.

Layout per layer (vLLM's flash layout): ``[num_blocks, block_size, num_kv_heads, head_dim]``.
Viewed as ``[num_blocks * block_size, num_kv_heads, head_dim]``, a token's row
index is its slot, ``block_id * block_size + offset``, so a write is one
``index_copy_`` and a read is one ``index_select``.

- :func:`write_kv_torch` is the write path on raw cache tensors: new tokens' K/V go to
  their slots (``-1`` = skip), one ``index_copy_`` per pool. Chapter 03's
  :func:`minipaged.attention.write_kv` checks the inputs and hands the write to an attention
  backend's ``write`` (this one, for ``"torch"``).
- :class:`PagedKVCache` owns the pools of every layer and their allocator.
"""

from __future__ import annotations

import torch

from minipaged.blocks import AllocatorBase, BlockAllocator, BlockTable
from minipaged.validation import check_block_ids, check_fits_memory, check_int


def write_kv_torch(key, value, k_cache, v_cache, slot_mapping) -> None:
    """The torch write: one ``index_copy_`` per pool on its flattened view, where a slot is a row number.

    The arguments are :func:`minipaged.attention.write_kv`'s, already checked; ``-1`` slots are skipped.
    """
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous: a slot is a row of their flattened view")
    keep, slots = slot_mapping >= 0, slot_mapping.long()
    if not bool(keep.all()):  # padding to skip; without any, no boolean indexing (it copies every input)
        key, value, slots = key[keep], value[keep], slots[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value)


class PagedKVCache:
    """The K and V pools of every layer, allocated once, and the allocator that hands out their blocks.

    Args:
        num_layers: decoder layers; each gets its own ``k_caches[layer]`` and ``v_caches[layer]``.
        num_blocks, block_size: the pool, ``num_blocks`` blocks of ``block_size`` token slots
            (checked by :class:`~minipaged.blocks.BlockAllocator`).
        num_kv_heads, head_dim: one token's K (and V) row is ``[num_kv_heads, head_dim]``.
        dtype, device: of the pools.
        allocator: the allocator class, called as ``allocator(num_blocks, block_size)`` (the seam
            that chapter 06's prefix cache plugs into; a learner's allocator drops in the same way).
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device="cpu", allocator=BlockAllocator):  # fmt: skip
        num_layers, num_blocks, block_size, num_kv_heads, head_dim = check_pool_args(
            num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
        self.allocator = allocator(num_blocks, block_size)
        if not isinstance(self.allocator, AllocatorBase):  # a seam's result, checked where it is received
            raise TypeError(f"allocator={allocator!r:.60} returned a {type(self.allocator).__name__}: a block "
                            "allocator must subclass minipaged.blocks.AllocatorBase")  # fmt: skip
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # The whole pool is allocated here, once; afterwards allocation is bookkeeping only.
        self.k_caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block over all layers."""
        row_bytes = self.num_kv_heads * self.head_dim * self.k_caches[0].element_size()
        return 2 * self.num_layers * self.block_size * row_bytes

    def pools(self) -> list[torch.Tensor]:
        """Every pool, the K pools of every layer, then the V pools."""
        return [*self.k_caches, *self.v_caches]

    def new_table(self, seq_id=None) -> BlockTable:
        return BlockTable(self.allocator, seq_id)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store token ``i``'s K/V of ``layer`` at ``slot_mapping[i]``; a slot of -1 is skipped (padding).

        The inputs are checked first (:func:`minipaged.attention_checks.check_kv_write`). Chapter 03's
        :func:`minipaged.attention.write_kv` is the same write on raw pools, by any attention backend.

        Args:
            layer: which layer's pools.
            key, value: ``[num_tokens, num_kv_heads, head_dim]``, the new tokens' K and V.
            slot_mapping: int64 (or int32) ``[num_tokens]``, each token's slot.
        """
        layer = check_index(layer, "layer", self.num_layers, f"the cache has {self.num_layers} layers")
        k_cache, v_cache = self.k_caches[layer], self.v_caches[layer]
        from minipaged.attention_checks import check_kv_write

        check_kv_write(key, value, k_cache, v_cache, slot_mapping)
        write_kv_torch(key, value, k_cache, v_cache, slot_mapping)

    def gather(self, layer: int, table: BlockTable) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference read: one sequence's K and V as contiguous ``[num_tokens, heads, head_dim]``."""
        layer = check_index(layer, "layer", self.num_layers, f"the cache has {self.num_layers} layers")
        if table.allocator is not self.allocator:
            raise ValueError("table belongs to another allocator: its block ids mean nothing in this cache")
        slots = table.slots().to(self.device)
        row, pools = (self.num_kv_heads, self.head_dim), (self.k_caches[layer], self.v_caches[layer])
        return tuple(pool.view(-1, *row).index_select(0, slots) for pool in pools)

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(num_layers={self.num_layers}, num_blocks={self.num_blocks}, "
            f"block_size={self.block_size}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"dtype={self.dtype}, device={self.device})"
        )

    @torch.inference_mode()
    def copy_blocks(self, src_block_ids: list[int], dst_block_ids: list[int]) -> None:
        """Copy whole blocks inside the pool, in every layer (copy-on-write gives a writer its own block this way).

        Args:
            src_block_ids: the blocks to read.
            dst_block_ids: where each one goes, pairwise (same length, no repeats). A destination may also
                be a source: every source is read before anything is written.
        """
        src = check_block_ids(src_block_ids, "src_block_ids", self.num_blocks)
        dst = check_block_ids(dst_block_ids, "dst_block_ids", self.num_blocks, unique=True)
        if len(src) != len(dst):
            raise ValueError(f"src_block_ids and dst_block_ids must pair up, got {len(src)} and {len(dst)} ids")
        src_index = torch.tensor(src, dtype=torch.int64, device=self.device)
        dst_index = torch.tensor(dst, dtype=torch.int64, device=self.device)
        for pool in self.pools():
            pool.index_copy_(0, dst_index, pool.index_select(0, src_index))

    def copy_pending(self, copies: list[tuple[int, int]]) -> None:
        """Carry out copy-on-write's ``(src, dst)`` block copies (``SchedulerOutput.copies``); none: nothing to do."""
        if copies:
            self.copy_blocks([src for src, _ in copies], [dst for _, dst in copies])

    def move_kv(self, out, swap_space: dict) -> int:
        """Carry out a step plan's K/V moves before its forward pass; return the tokens moved to or from CPU memory.

        A plan that swaps (``preemption_mode="swap"``) goes to :func:`minipaged.swap.move_kv`, loaded then;
        any other plan's moves are its copies-on-write.

        Args:
            out: the step's :class:`~minipaged.scheduler.SchedulerOutput`.
            swap_space: seq_id -> the K/V :func:`minipaged.swap.swap_out` saved for it; updated in place.
        """
        if out.swap_out or out.swap_in:
            from minipaged.swap import move_kv

            return move_kv(self, out, swap_space)
        self.copy_pending(out.copies)
        return 0


def check_pool_args(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device) -> tuple[int, ...]:
    """A paged KV cache's sizes as ints ``(num_layers, num_blocks, block_size, num_kv_heads, head_dim)``, checked.

    Args:
        num_layers, num_blocks, block_size, num_kv_heads, head_dim: the pools' sizes, each an int >= 1.
        dtype: the pools' ``torch.dtype``.
        device: where they would live; the K/V pools must fit its total memory (:func:`check_fits_memory`).

    Raises:
        TypeError: a size that is not an int, or a ``dtype`` that is not a ``torch.dtype``.
        ValueError: a size below 1, or pools larger than the device's memory.
    """
    num_layers = check_int(num_layers, "num_layers", minimum=1)
    num_kv_heads = check_int(num_kv_heads, "num_kv_heads", minimum=1)
    head_dim = check_int(head_dim, "head_dim", minimum=1)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    num_blocks = check_int(num_blocks, "num_blocks", minimum=1)
    block_size = check_int(block_size, "block_size", minimum=1)
    pool_bytes = 2 * num_layers * num_blocks * block_size * num_kv_heads * head_dim * dtype.itemsize
    check_fits_memory(pool_bytes, f"PagedKVCache(num_blocks={num_blocks}, block_size={block_size})'s K/V pools",
                      device)  # fmt: skip
    return num_layers, num_blocks, block_size, num_kv_heads, head_dim


def check_index(value, name: str, size: int, what: str) -> int:
    """``value`` as an int in ``[0, size)``, or an error that names ``name``.

    Args:
        value: the index.
        name: the argument's name, as the caller's signature spells it.
        size: the number of entries it indexes.
        what: what holds them, for the message (``"the cache has 2 layers"``).

    Raises:
        TypeError: ``value`` is not an int.
        ValueError: ``value`` is negative.
        IndexError: ``value`` is ``size`` or more.
    """
    value = check_int(value, name)
    if value >= size:
        raise IndexError(f"{name} {value} is out of range: {what}")
    return value
