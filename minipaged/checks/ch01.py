"""Checks for exercise 01 (KV-cache memory): questions the chapter's formulas answer, not the formulas themselves.

The references are built from ``minipaged.accounting``'s integer helpers. The
cases include 2**60-scale numbers, where a float division rounds and an
integer one does not.
"""

from __future__ import annotations

from minipaged.accounting import ceil_div
from minipaged.checks import CheckFailed, check, expect_equal

HINTS = {
    "1.1": [
        "a KV block holds block_size tokens, and each token costs the bytes of chapter 01's formula for one token",
        "bytes per block = 2 · num_layers · num_kv_heads · head_dim · dtype_bytes · block_size; "
        "only whole blocks count",
        "divide with //, not /: at 2**60 bytes a float division can round up past the true quotient",
    ],
    "1.2": [
        "a sequence holds ceil(n / B) blocks; appending fills the partly filled last block before taking new ones",
        "new blocks = blocks held after the append − blocks held before it",
        "write the ceiling in integers, (n + B − 1) // B or −(−n // B): math.ceil(n / B) is wrong at n = 2**60 + 1",
    ],
    "1.3": [
        "U = tokens / slots, and the tokens are the same for every block size: compare the slots",
        "slots for one sequence = B · ceil(n / B), rounded per sequence; the fewest slots wins",
        "on equal slots keep the larger block size: it needs fewer block-table entries",
    ],
}

# (budget_bytes, num_layers, num_kv_heads, head_dim, dtype_bytes, block_size)
FIT_CASES = [
    (0, 32, 8, 128, 2, 16),
    (2 * 32 * 8 * 128 * 2 * 16, 32, 8, 128, 2, 16),  # exactly one block
    (2 * 32 * 8 * 128 * 2 * 16 - 1, 32, 8, 128, 2, 16),  # one byte short of one block
    (80 * 2**30, 32, 8, 128, 2, 16),  # 80 GiB, Llama-3-8B
    (40 * 2**30, 40, 40, 128, 2, 16),  # OPT-13B (MHA)
    (10**9, 1, 1, 1, 1, 1),
    # 2**60-scale: one byte short of a whole number of blocks, where a float quotient rounds up
    (2 * 3 * 2**58 - 1, 1, 1, 1, 1, 3),
    (2**61 - 1, 1, 1, 1, 1, 1),
]


def _fit(budget, num_layers, num_kv_heads, head_dim, dtype_bytes, block_size) -> int:
    return budget // (2 * num_layers * num_kv_heads * head_dim * dtype_bytes * block_size)


@check("ch01.blocks_that_fit", hint=HINTS["1.1"][0])
def check_blocks_that_fit(fn):
    for case in FIT_CASES:
        got = fn(*case)
        if isinstance(got, bool) or not isinstance(got, int):
            raise CheckFailed(f"blocks_that_fit{case} returned {got!r}; return an int (a count of whole blocks)")
        expect_equal(got, _fit(*case), f"blocks_that_fit{case}")
    return f"{len(FIT_CASES)} budgets, from 0 bytes to 2**60 scale"


# (num_tokens, num_new_tokens, block_size)
NEW_BLOCK_CASES = [
    (0, 0, 16), (0, 1, 16), (0, 16, 16), (0, 17, 16),
    (5, 3, 16),  # fits in the partly filled block
    (5, 11, 16),  # fills it exactly
    (5, 12, 16),  # one past it
    (16, 1, 16),  # the last block is full
    (15, 34, 16), (37, 0, 16), (7, 7, 1), (3, 100, 64),
    (2**60, 1, 16),  # math.ceil((2**60 + 1) / 16) is 2**56 in floating point
    (2**60 - 1, 2, 2**10),
]


@check("ch01.new_blocks", hint=HINTS["1.2"][0])
def check_new_blocks(fn):
    for n, k, b in NEW_BLOCK_CASES:
        got = fn(n, k, b)
        if isinstance(got, bool) or not isinstance(got, int):
            raise CheckFailed(f"new_blocks({n}, {k}, {b}) returned {got!r}; return an int")
        expected = ceil_div(n + k, b) - ceil_div(n, b)
        if got == ceil_div(k, b) and got != expected:
            raise CheckFailed(
                f"new_blocks({n}, {k}, {b}) returned {got}, expected {expected}: the sequence's last block "
                f"already has room for {ceil_div(n, b) * b - n} of the new tokens"
            )
        expect_equal(got, expected, f"new_blocks({n}, {k}, {b})")
    return f"{len(NEW_BLOCK_CASES)} appends, partly filled last blocks and 2**60-scale lengths included"


# (lengths, candidates)
BEST_CASES = [
    ([37, 91, 128, 201, 511], [16, 32]),
    ([37, 91, 128, 201, 511], [8, 16, 32, 64]),
    ([32, 64, 96], [16, 32]),  # a tie at U = 1: the larger block wins
    ([64, 64], [32, 8, 16]),  # a tie, candidates out of order
    ([1, 1, 1], [16, 1, 4]),
    ([24, 24], [8, 16, 32]),  # 16 rounds each up to 32: 8 wins over the "total" answer
    ([17, 15], [16, 32]),  # the total (32) fits 16 or 32 exactly; per sequence, 16 holds 48 slots and 32 holds 64
    ([100], [7, 10, 25]),
]


def _best(lengths, candidates) -> int:
    return min(candidates, key=lambda b: (sum(b * ceil_div(n, b) for n in lengths), -b))


@check("ch01.best_block_size", hint=HINTS["1.3"][0])
def check_best_block_size(fn):
    for lengths, candidates in BEST_CASES:
        got = fn(list(lengths), list(candidates))
        want = _best(lengths, candidates)
        if got != want and got in candidates:
            slots = {b: sum(b * ceil_div(n, b) for n in lengths) for b in candidates}
            raise CheckFailed(
                f"best_block_size({lengths}, {candidates}) returned {got}, expected {want}; "
                f"slots held per block size: {slots}"
            )
        expect_equal(got, want, f"best_block_size({lengths}, {candidates})")
    return f"{len(BEST_CASES)} batches, ties included"
