"""The paged KV cache: per-layer K and V pools allocated once, addressed by slot.

Layout per layer (vLLM's flash layout): ``[num_blocks, block_size, num_kv_heads, head_dim]``.
Viewed as ``[num_blocks * block_size, num_kv_heads, head_dim]``, a token's row
index is its slot, ``block_id * block_size + offset``, so a write is one
``index_copy_`` and a read is one ``index_select``.

- :func:`write_kv` is the write path on raw cache tensors: new tokens' K/V go to
  their slots (``-1`` = skip). Chapter 03's model calls it for every layer; it checks the
  inputs and hands the write to the attention backend's ``write`` (for ``"torch"``,
  :func:`write_kv_torch`: one ``index_copy_`` per pool).
- :class:`PagedKVCache` owns the pools of every layer and their allocator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minipaged.block_manager import BlockAllocator, BlockTable
from minipaged.validation import check_fits_memory, check_int, check_kv_write


@dataclass
class MemoryReport:
    num_seqs: int
    block_size: int
    total_blocks: int
    used_blocks: int
    free_blocks: int
    effective_tokens: int  # tokens the sequences actually hold
    tail_waste: int  # reserved but unused slots in the sequences' last blocks
    bytes_per_block: int  # K and V, all layers
    block_table_bytes: int  # the padded int32 [num_seqs, max_blocks] tensor the kernel reads

    @property
    def utilisation(self) -> float:
        """Effective tokens over allocated slots. Above 1 only when forks share blocks."""
        return self.effective_tokens / (self.used_blocks * self.block_size) if self.used_blocks else 0.0

    @property
    def kv_bytes_used(self) -> int:
        return self.used_blocks * self.bytes_per_block

    def __str__(self) -> str:
        return "\n".join(
            [
                f"sequences          {self.num_seqs}",
                f"blocks used/total  {self.used_blocks}/{self.total_blocks} "
                f"({self.free_blocks} free, block_size {self.block_size})",
                f"effective tokens   {self.effective_tokens}",
                f"tail waste         {self.tail_waste} slots",
                f"utilisation        {self.utilisation:.2%}",
                f"bytes per block    {self.bytes_per_block:,}",
                f"KV bytes used      {self.kv_bytes_used:,} ({_binary(self.kv_bytes_used)})",
                f"block-table bytes  {self.block_table_bytes:,}",
            ]
        )


def _binary(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def write_kv(key, value, k_cache, v_cache, slot_mapping, *, backend="torch") -> None:
    """Store token ``i``'s K and V at slot ``slot_mapping[i]`` of ``k_cache`` and ``v_cache``, in place.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, the new tokens' K and V.
        k_cache, v_cache: one layer's pools, ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: int64 (or int32) ``[num_tokens]``: ``block_id * block_size + offset``,
            or ``-1`` to skip the token (a padding token).
        backend: the attention backend whose ``write`` stores them (a registered name, see
            :class:`minipaged.attention.AttentionBackend`, or a backend itself): ``"torch"`` and
            ``"loop"`` use :func:`write_kv_torch`; ``"triton"``, chapter 04's scatter kernel.

    The inputs are checked here with :func:`minipaged.validation.check_kv_write`, for every
    backend, and a bad one raises before anything is written.
    """
    from minipaged.attention import resolve_backend  # chapter 03's backend registry, reached by name only

    impl = resolve_backend(backend)
    check_kv_write(key, value, k_cache, v_cache, slot_mapping)
    impl.write(key, value, k_cache, v_cache, slot_mapping)


def write_kv_torch(key, value, k_cache, v_cache, slot_mapping) -> None:
    """The torch write: one ``index_copy_`` per pool on its flattened view, where a slot is a row number.

    The arguments are :func:`write_kv`'s, already checked; ``-1`` slots are skipped.
    """
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous: a slot is a row of their flattened view")
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    row = k_cache.shape[2:]
    k_cache.view(-1, *row).index_copy_(0, slots, key[keep])
    v_cache.view(-1, *row).index_copy_(0, slots, value[keep])


class PagedKVCache:
    """The K and V pools of every layer, allocated once, and the allocator that hands out their blocks.

    Args:
        num_layers: decoder layers; each gets its own ``k_caches[layer]`` and ``v_caches[layer]``.
        num_blocks, block_size: the pool, ``num_blocks`` blocks of ``block_size`` token slots
            (checked by :class:`~minipaged.block_manager.BlockAllocator`).
        num_kv_heads, head_dim: one token's K (and V) row is ``[num_kv_heads, head_dim]``.
        dtype, device: of the pools.
        allocator: the allocator class, called as ``allocator(num_blocks, block_size)`` (the seam
            that chapter 06's prefix cache plugs into; a learner's allocator drops in the same way).
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device="cpu",
        allocator=BlockAllocator,
    ):
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
        self.allocator = allocator(num_blocks, block_size)
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

    def new_table(self, seq_id=None) -> BlockTable:
        return BlockTable(self.allocator, seq_id)

    def _check_layer(self, layer) -> int:
        layer = check_int(layer, "layer")
        if layer >= self.num_layers:
            raise IndexError(f"layer {layer} is out of range: the cache has {self.num_layers} layers")
        return layer

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, *,
              backend="torch") -> None:  # fmt: skip
        """Store token ``i``'s K/V of ``layer`` at ``slot_mapping[i]``; a slot of -1 is skipped (padding).

        Args:
            layer: which layer's pools.
            key, value: ``[num_tokens, num_kv_heads, head_dim]``, the new tokens' K and V.
            slot_mapping: int64 (or int32) ``[num_tokens]``, each token's slot.
            backend: the attention backend whose ``write`` stores them, as for :func:`write_kv`.
        """
        layer = self._check_layer(layer)
        write_kv(key, value, self.k_caches[layer], self.v_caches[layer], slot_mapping, backend=backend)

    def gather(self, layer: int, table: BlockTable) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference read: one sequence's K and V as contiguous ``[num_tokens, heads, head_dim]``."""
        layer = self._check_layer(layer)
        if table.allocator is not self.allocator:
            raise ValueError("table belongs to another allocator: its block ids mean nothing in this cache")
        slots = table.slots().to(self.device)
        row = (self.num_kv_heads, self.head_dim)
        return (
            self.k_caches[layer].view(-1, *row).index_select(0, slots),
            self.v_caches[layer].view(-1, *row).index_select(0, slots),
        )

    def memory_report(self, tables: list[BlockTable]) -> MemoryReport:
        width = max((t.num_blocks for t in tables), default=0)
        return MemoryReport(
            num_seqs=len(tables),
            block_size=self.block_size,
            total_blocks=self.num_blocks,
            used_blocks=self.allocator.num_used,
            free_blocks=self.allocator.num_free,
            effective_tokens=sum(t.num_tokens for t in tables),
            tail_waste=sum(t.tail_waste for t in tables),
            bytes_per_block=self.bytes_per_block,
            block_table_bytes=len(tables) * width * 4,
        )

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(num_layers={self.num_layers}, num_blocks={self.num_blocks}, "
            f"block_size={self.block_size}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"dtype={self.dtype}, device={self.device})"
        )

    def _check_block_ids(self, block_ids, name: str, unique: bool = False) -> list[int]:
        """``block_ids`` as a list of ints in ``[0, num_blocks)``, or an error that names ``name``."""
        if isinstance(block_ids, (str, bytes)) or not hasattr(block_ids, "__iter__"):
            raise TypeError(f"{name} must be a list of block ids, got {type(block_ids).__name__}")
        ids = [check_int(b, f"{name}[{i}]", minimum=None) for i, b in enumerate(block_ids)]
        for i, b in enumerate(ids):
            if not 0 <= b < self.num_blocks:
                raise IndexError(f"{name}[{i}] = {b} is outside the pool of {self.num_blocks} blocks")
        if unique and len(set(ids)) != len(ids):
            raise ValueError(f"{name} must not repeat a block id (two copies would race for it), got {ids}")
        return ids

    @torch.inference_mode()
    def swap_out(self, block_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copy some blocks' K and V to CPU memory, e.g. before a preempted sequence's blocks are freed.

        Args:
            block_ids: the blocks to save, in the order :meth:`swap_in` will restore them.

        Returns:
            Per layer, ``(k, v)`` CPU tensors of shape ``[len(block_ids), block_size, num_kv_heads, head_dim]``.
            The pool is unchanged.
        """
        ids = torch.tensor(self._check_block_ids(block_ids, "block_ids"), dtype=torch.int64, device=self.device)
        pools = zip(self.k_caches, self.v_caches)
        return [(k.index_select(0, ids).cpu(), v.index_select(0, ids).cpu()) for k, v in pools]

    @torch.inference_mode()
    def swap_in(self, block_ids: list[int], saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy K and V saved by :meth:`swap_out` back into the pool, usually into other blocks than before.

        Args:
            block_ids: the destination blocks, one per saved block, in the saved order (no repeats).
            saved: what :meth:`swap_out` returned: per layer, ``(k, v)`` of shape
                ``[len(block_ids), block_size, num_kv_heads, head_dim]``, on any device.
        """
        ids = self._check_block_ids(block_ids, "block_ids", unique=True)
        if not isinstance(saved, (list, tuple)):
            raise TypeError(f"saved must be the list swap_out returned, got {type(saved).__name__}")
        if len(saved) != self.num_layers:
            raise ValueError(f"saved must hold one (k, v) pair per layer: {self.num_layers}, got {len(saved)}")
        shape = (len(ids), self.block_size, self.num_kv_heads, self.head_dim)
        for layer, pair in enumerate(saved):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise ValueError(f"saved[{layer}] must be a (k, v) pair of tensors")
            for name, t in zip("kv", pair):
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"saved[{layer}] {name} must be a torch.Tensor, got {type(t).__name__}")
                if tuple(t.shape) != shape:
                    got = tuple(t.shape)
                    raise ValueError(f"saved[{layer}] {name} has shape {got}; {len(ids)} blocks need {shape}")
        index = torch.tensor(ids, dtype=torch.int64, device=self.device)
        for k, v, (k_saved, v_saved) in zip(self.k_caches, self.v_caches, saved):
            k.index_copy_(0, index, k_saved.to(device=self.device, dtype=self.dtype))
            v.index_copy_(0, index, v_saved.to(device=self.device, dtype=self.dtype))

    @torch.inference_mode()
    def copy_blocks(self, src_block_ids: list[int], dst_block_ids: list[int]) -> None:
        """Copy whole blocks inside the pool, in every layer (copy-on-write gives a writer its own block this way).

        Args:
            src_block_ids: the blocks to read.
            dst_block_ids: where each one goes, pairwise (same length, no repeats). A destination may also
                be a source: every source is read before anything is written.
        """
        src = self._check_block_ids(src_block_ids, "src_block_ids")
        dst = self._check_block_ids(dst_block_ids, "dst_block_ids", unique=True)
        if len(src) != len(dst):
            raise ValueError(f"src_block_ids and dst_block_ids must pair up, got {len(src)} and {len(dst)} ids")
        src_index = torch.tensor(src, dtype=torch.int64, device=self.device)
        dst_index = torch.tensor(dst, dtype=torch.int64, device=self.device)
        for pool in (*self.k_caches, *self.v_caches):
            pool.index_copy_(0, dst_index, pool.index_select(0, src_index))

    def move_kv(self, out, swap_space: dict) -> int:
        """Carry out a step plan's K/V moves: save victims' K/V to CPU memory, copy-on-write, restore readmitted ones'.

        Reads before writes: a victim's freed blocks, or a copy's source, may already belong to
        someone else this step, who is about to write into them. Returns the tokens moved between
        the pool and CPU memory (the clock charges them).

        Args:
            out: the step's :class:`~minipaged.scheduler.SchedulerOutput` (its ``swap_out``,
                ``copies``, ``swap_in`` and ``swap_in_hit_blocks``).
            swap_space: seq_id -> what :meth:`swap_out` saved for it; updated in place.
        """
        moved = 0
        for seq, block_ids in out.swap_out:
            swap_space[seq.seq_id] = self.swap_out(block_ids)
            moved += seq.num_computed_tokens
        if out.copies:  # after the victims' K/V is saved, before anything lands in the new blocks
            self.copy_blocks([src for src, _ in out.copies], [dst for _, dst in out.copies])
        for seq, num_hit_blocks in zip(out.swap_in, out.swap_in_hit_blocks):
            saved = swap_space.pop(seq.seq_id)
            if num_hit_blocks < len(saved[0][0]):  # the blocks a prefix hit did not restore come back from CPU
                rest = [(k[num_hit_blocks:], v[num_hit_blocks:]) for k, v in saved]
                self.swap_in(seq.block_table.blocks[num_hit_blocks : len(saved[0][0])], rest)
                moved += seq.num_computed_tokens - num_hit_blocks * self.block_size
        return moved
