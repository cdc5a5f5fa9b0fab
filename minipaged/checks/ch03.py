"""Checks for chapter 03: paged decode attention, read through a block table.

The learner's function has :func:`minipaged.attention.paged_attention`'s
signature (without ``backend``). It is compared with contiguous attention on
:func:`minipaged.testing.make_paged_case`'s caches, whose blocks are a random
permutation of the pool and where every slot no sequence wrote holds NaN: a read
through a wrong table entry, past a sequence's length, or a NaN multiplied by a
zero weight all show up.
"""

from __future__ import annotations

import torch

from minipaged.checks import CheckFailed, check, expect_tensor_close
from minipaged.testing import make_paged_case

# (name, seq_lens, block_size, num_heads, num_kv_heads)
CASES = [
    ("one sequence, whole blocks, MHA", [8], 4, 2, 2),
    ("equal lengths, GQA", [12, 12, 12], 4, 4, 2),
    ("lengths 1, 5, 16, 17, GQA", [1, 5, 16, 17], 4, 4, 2),
    ("odd lengths, MQA, block 3", [7, 2, 10], 3, 4, 1),
    ("long and short, GQA, block 16", [40, 3], 16, 8, 2),
]
HEAD_DIM = 8


@check(
    "ch03.paged_attention",
    hint="gather each sequence's blocks in table order and keep its first seq_len tokens; "
    "query head h reads KV head h // (num_heads // num_kv_heads); "
    "mask with torch.where or masked_fill, never by multiplying by 0 (0 * NaN is NaN)",
)
def check_paged_attention(fn):
    for name, seq_lens, block_size, num_heads, num_kv_heads in CASES:
        case = make_paged_case(
            seq_lens, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=HEAD_DIM
        )
        args, expected = case.decode_args, case.reference()
        out = fn(*args)
        if isinstance(out, torch.Tensor) and out.shape == expected.shape and out.isnan().any():
            rows = sorted({int(i) for i in out.isnan().nonzero()[:, 0]})
            raise CheckFailed(
                f"{name}: the output of sequence(s) {rows} holds NaN. Unowned slots hold NaN here, "
                "so something read past a sequence's tokens, through a padding entry, or multiplied NaN by a 0 weight"
            )
        expect_tensor_close(out, expected, f"{name}: your paged attention", atol=1e-5, rtol=1e-4)
        # A custom scale must be honoured too.
        what = f"{name}, scale=0.5: your paged attention"
        expect_tensor_close(fn(*args, scale=0.5), case.reference(scale=0.5), what, atol=1e-5, rtol=1e-4)
    return f"{len(CASES)} cases: random block tables, lengths 1 to 40, MHA/GQA/MQA, NaN in every unowned slot"

