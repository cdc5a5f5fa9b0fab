"""Exercise 04's reference, public cases and hidden cases (the instructor's side of ``minipaged.checks.ch04``)."""

from __future__ import annotations

import torch

from minipaged.attention import contiguous_attention
from minipaged.checks.instructor import Side


def decode(q, k_cache, v_cache, block_tables, seq_lens, window):
    """Each new token over the last ``window`` positions of its sequence, gathered through its table, in float64."""
    block_size = k_cache.shape[1]
    rows = []
    for i, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(max(n - window, 0), n, device=q.device)
        blocks = block_tables[i].long()[pos // block_size]
        k, v = k_cache[blocks, pos % block_size], v_cache[blocks, pos % block_size]
        rows.append(contiguous_attention(q[i : i + 1].double(), k.double(), v.double()))
    return torch.cat(rows).to(q.dtype)


def kernel():
    """The reference needs no kernel: ``decode`` computes the answer itself."""


def _case(seq_lens, window, block_size, heads):
    return {"seq_lens": seq_lens, "window": window, "block_size": block_size, "num_heads": heads[0],
            "num_kv_heads": heads[1]}


# Each batch runs with MHA, then with a GQA group of 2: windows that start mid-block (block 0 of the long
# sequences is skipped), a window longer than the sequence, one that starts on a boundary.
CASES = [_case(seq_lens, window, block_size, heads) for seq_lens, window, block_size in
         [([5, 19, 9], 6, 4), ([1, 16, 23], 8, 8)] for heads in [(2, 2), (4, 2)]]


def _hidden(rng):
    seq_lens = [rng.randrange(1, 30) for _ in range(3)]
    return [_case(seq_lens, rng.randrange(2, 12), rng.choice([4, 8]), rng.choice([(2, 2), (4, 2)]))]


SIDES = {"window_decode_kernel": Side(lambda: CASES, _hidden, lambda: (decode, kernel))}
