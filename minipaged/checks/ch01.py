"""Checks for chapter 01 (KV-cache memory): the learner's functions against ``minipaged.accounting``."""

from __future__ import annotations

from minipaged import accounting as acc
from minipaged.checks import CheckFailed, check, expect_close, expect_equal

# (num_tokens, block_size): empty, one token, exact fits, one past a boundary, B = 1, B > n
BLOCK_CASES = [(0, 16), (1, 16), (15, 16), (16, 16), (17, 16), (37, 16), (128, 32), (511, 32), (7, 1), (5, 64)]

UTIL_CASES = [
    ([37, 91, 128, 201, 511], 16),
    ([37, 91, 128, 201, 511], 32),
    ([16, 32, 48], 16),  # every block full: U = 1
    ([1, 1], 16),  # rounding each sequence, not the total
    ([0, 5, 100], 8),  # an empty sequence holds no block
    ([3], 1),
]


@check("ch01.kv_bytes_per_token",
       hint="one K and one V per layer, per KV head (not per query head), head_dim numbers of dtype_bytes each")
def check_kv_bytes_per_token(fn):
    for spec in acc.MODEL_PRESETS.values():
        args = (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype_bytes)
        expect_equal(fn(*args), acc.kv_bytes_per_token(spec), f"kv_bytes_per_token{args} ({spec.name})")
    expect_equal(fn(40, 40, 128, 2), 819200, "kv_bytes_per_token(40, 40, 128, 2) (OPT-13B)")
    expect_equal(fn(32, 8, 128, 1), acc.kv_bytes_per_token("Llama-3-8B", "fp8"), "kv_bytes_per_token(32, 8, 128, 1)")
    return f"{len(acc.MODEL_PRESETS) + 2} models"


@check("ch01.blocks_needed", hint="a partly filled block is still a whole block; 0 tokens need 0 blocks")
def check_blocks_needed(fn):
    for n, b in BLOCK_CASES:
        expect_equal(fn(n, b), acc.blocks_needed(n, b), f"blocks_needed({n}, {b})")
    return f"{len(BLOCK_CASES)} cases"


@check("ch01.tail_waste", hint="W_B(n) = B·ceil(n/B) − n; a sequence that fills its last block exactly wastes 0, not B")
def check_tail_waste(fn):
    for n, b in BLOCK_CASES:
        expect_equal(fn(n, b), acc.tail_waste(n, b), f"tail_waste({n}, {b})")
    return f"{len(BLOCK_CASES)} cases"


@check("ch01.utilisation",
       hint="round each sequence up to whole blocks separately, then divide total tokens by total slots")
def check_utilisation(fn):
    for lengths, b in UTIL_CASES:
        got = fn(list(lengths), b)
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            raise CheckFailed(f"utilisation({lengths}, {b}) returned {got!r}; return a float between 0 and 1")
        expect_close(got, acc.utilisation(lengths, b), f"utilisation({lengths}, {b})")
    return f"{len(UTIL_CASES)} batches"
