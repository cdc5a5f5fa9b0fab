"""The random paged test case and the reference attention, built in one place.

Chapters 03 and 04 check every paged-attention path the same way: K/V of several
sequences written into a pool through **shuffled** block tables (a random
permutation of the pool, so a sequence's consecutive logical blocks land
anywhere), and the output compared with ordinary attention over the same K/V
kept contiguously. Every slot no sequence wrote holds NaN by default, so a read
past a sequence's length, through a padding entry of its table, or a NaN
multiplied by a zero weight turns the output into NaN instead of passing by luck.

The exercise checks, the tests, the benchmarks and the notebooks all use
:func:`make_paged_case`; the reference is :func:`minipaged.attention.contiguous_attention`
in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minipaged.attention import contiguous_attention, write_kv
from minipaged.block_math import blocks_needed
from minipaged.validation import check_int


@dataclass
class PagedCase:
    """A paged-attention input and the contiguous K/V it was written from."""

    q: torch.Tensor  # [num_tokens, num_heads, head_dim]: every sequence's new tokens, packed
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    keys: list[torch.Tensor]  # keys[i]: sequence i's K, contiguous [seq_lens[i], num_kv_heads, head_dim]
    values: list[torch.Tensor]

    @property
    def decode_args(self) -> tuple:
        """``(q, k_cache, v_cache, block_tables, seq_lens)``: ``paged_attention``'s arguments."""
        return self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens

    @property
    def prefill_args(self) -> tuple:
        """``decode_args`` plus ``query_start_loc``: ``paged_prefill_attention``'s arguments."""
        return (*self.decode_args, self.query_start_loc)

    def reference(self, scale: float | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Causal attention of each sequence's queries over its contiguous K/V, computed in float64.

        Args:
            scale: the softmax scale (default ``head_dim ** -0.5``).
            dtype: of the result (default ``q.dtype``); ``torch.float64`` keeps it unrounded.
        """
        starts = self.query_start_loc.tolist()
        out = [
            contiguous_attention(self.q[a:b].double(), k.double(), v.double(), scale=scale)
            for a, b, k, v in zip(starts, starts[1:], self.keys, self.values)
        ]
        return torch.cat(out).to(dtype or self.q.dtype)


def make_paged_case(
    seq_lens: list[int],
    *,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_new_tokens: list[int] | None = None,
    dtype: torch.dtype = torch.float32,
    spare_blocks: int = 3,
    extra_columns: int = 1,
    fill: float = float("nan"),
    seed: int = 0,
    device="cpu",
) -> PagedCase:
    """Random K/V for each sequence, written into a ``fill``-ed pool through shuffled block tables.

    Args:
        seq_lens: each sequence's context length (>= 1), the new tokens included.
        block_size, num_kv_heads, head_dim: the pool's layout.
        num_heads: query heads (a multiple of ``num_kv_heads``).
        num_new_tokens: query tokens per sequence, the last positions of its context
            (default: 1 each, a decode step).
        dtype: of ``q`` and the pools.
        spare_blocks: blocks no sequence owns. Padding entries of the tables point at the
            first of them (or hold -1 when there is none): they must never be read.
        extra_columns: table columns past the longest sequence's blocks.
        fill: what the slots no sequence wrote hold (NaN catches stray reads).
        seed: the random draws (on ``device``'s generator, so the numbers differ by device).
        device: where every tensor is made.
    """
    seq_lens = [check_int(n, "seq_lens[i]", minimum=1) for n in seq_lens]
    if not seq_lens:
        raise ValueError("seq_lens must hold at least one sequence")
    num_new_tokens = [1] * len(seq_lens) if num_new_tokens is None else list(num_new_tokens)
    if len(num_new_tokens) != len(seq_lens):
        raise ValueError(f"num_new_tokens has {len(num_new_tokens)} entries, seq_lens {len(seq_lens)}")
    for i, (n, seq_len) in enumerate(zip(num_new_tokens, seq_lens)):
        if not 1 <= check_int(n, "num_new_tokens[i]") <= seq_len:
            raise ValueError(f"num_new_tokens[{i}] must be in 1..seq_lens[{i}]={seq_len}, got {n}")
    spare_blocks = check_int(spare_blocks, "spare_blocks")
    extra_columns = check_int(extra_columns, "extra_columns")

    gen = torch.Generator(device=device).manual_seed(seed)
    need = [blocks_needed(n, block_size) for n in seq_lens]
    num_blocks = sum(need) + spare_blocks
    # A random permutation of the pool: consecutive logical blocks land anywhere.
    physical = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    pad = int(physical[sum(need)]) if spare_blocks else -1
    block_tables = torch.full((len(seq_lens), max(need) + extra_columns), pad, dtype=torch.int32, device=device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, fill, dtype=dtype, device=device)
    v_cache = torch.full(shape, fill, dtype=dtype, device=device)
    keys, values, used = [], [], 0
    for i, n in enumerate(seq_lens):
        block_tables[i, : need[i]] = physical[used : used + need[i]]
        used += need[i]
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
        pos = torch.arange(n, device=device)
        write_kv(k, v, k_cache, v_cache, block_tables[i].long()[pos // block_size] * block_size + pos % block_size)
        keys.append(k)
        values.append(v)
    q = torch.randn(sum(num_new_tokens), num_heads, head_dim, generator=gen, device=device).to(dtype)
    query_start_loc = torch.tensor([0, *num_new_tokens], device=device).cumsum(0).to(torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return PagedCase(q, k_cache, v_cache, block_tables, seq_lens_t, query_start_loc, keys, values)
