"""Checks for chapter 03: paged decode attention, read through a block table.

The learner's function has :func:`minipaged.attention.paged_attention`'s
signature (without ``backend``). It is compared with contiguous attention on
caches whose blocks are a random permutation of the pool, where every slot no
sequence wrote holds NaN: a read through a wrong table entry, past a sequence's
length, or a NaN multiplied by a zero weight all show up.
"""

from __future__ import annotations

import torch

from minipaged.attention import contiguous_attention
from minipaged.checks import CheckFailed, check, expect_tensor_close

# (name, seq_lens, block_size, num_heads, num_kv_heads)
CASES = [
    ("one sequence, whole blocks, MHA", [8], 4, 2, 2),
    ("equal lengths, GQA", [12, 12, 12], 4, 4, 2),
    ("lengths 1, 5, 16, 17, GQA", [1, 5, 16, 17], 4, 4, 2),
    ("odd lengths, MQA, block 3", [7, 2, 10], 3, 4, 1),
    ("long and short, GQA, block 16", [40, 3], 16, 8, 2),
]
HEAD_DIM = 8


def make_case(seq_lens, block_size, num_heads, num_kv_heads, seed=0):
    """A NaN-filled pool with each sequence's K/V written through a random block table."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + 2
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, HEAD_DIM), float("nan"))
    v_cache = k_cache.clone()
    perm = torch.randperm(num_blocks, generator=g).tolist()
    spare = perm[sum(need)]  # padding points at a NaN block: it must never be read
    block_tables = torch.full((len(seq_lens), max(need) + 1), spare, dtype=torch.int32)
    q = torch.randn(len(seq_lens), num_heads, HEAD_DIM, generator=g)
    expected = []
    for i, n in enumerate(seq_lens):
        blocks, perm = perm[: need[i]], perm[need[i] :]
        block_tables[i, : need[i]] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn(n, num_kv_heads, HEAD_DIM, generator=g)
        v = torch.randn(n, num_kv_heads, HEAD_DIM, generator=g)
        for t in range(n):
            k_cache[blocks[t // block_size], t % block_size] = k[t]
            v_cache[blocks[t // block_size], t % block_size] = v[t]
        expected.append(contiguous_attention(q[i : i + 1], k, v))
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    return (q, k_cache, v_cache, block_tables, seq_lens), torch.cat(expected)


@check(
    "ch03.paged_attention",
    hint="gather each sequence's blocks in table order and keep its first seq_len tokens; "
    "query head h reads KV head h // (num_heads // num_kv_heads); "
    "mask with torch.where or masked_fill, never by multiplying by 0 (0 * NaN is NaN)",
)
def check_paged_attention(fn):
    for name, seq_lens, block_size, num_heads, num_kv_heads in CASES:
        args, expected = make_case(seq_lens, block_size, num_heads, num_kv_heads)
        out = fn(*args)
        if isinstance(out, torch.Tensor) and out.shape == expected.shape and out.isnan().any():
            rows = sorted({int(i) for i in out.isnan().nonzero()[:, 0]})
            raise CheckFailed(
                f"{name}: the output of sequence(s) {rows} holds NaN. Unowned slots hold NaN here, "
                "so something read past a sequence's tokens, through a padding entry, or multiplied NaN by a 0 weight"
            )
        expect_tensor_close(out, expected, f"{name}: your paged attention", atol=1e-5, rtol=1e-4)
        # A custom scale must be honoured too.
        scaled = torch.cat(
            [contiguous_attention(args[0][i : i + 1], *_contiguous_kv(args, i), scale=0.5) for i in range(len(seq_lens))]
        )
        expect_tensor_close(fn(*args, scale=0.5), scaled, f"{name}, scale=0.5: your paged attention", atol=1e-5, rtol=1e-4)
    return f"{len(CASES)} cases: random block tables, lengths 1 to 40, MHA/GQA/MQA, NaN in every unowned slot"


def _contiguous_kv(args, i):
    """Sequence ``i``'s K and V read back through its table, as contiguous tensors."""
    _, k_cache, v_cache, block_tables, seq_lens = args
    n = int(seq_lens[i])
    blocks = block_tables[i, : -(-n // k_cache.shape[1])].long()
    return k_cache[blocks].flatten(0, 1)[:n], v_cache[blocks].flatten(0, 1)[:n]
