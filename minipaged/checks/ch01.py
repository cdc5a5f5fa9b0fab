"""Checks for exercise 01 (KV-cache memory): questions the chapter's formulas answer, not the formulas themselves.

The cases include 2**60-scale numbers, where a float division rounds and an integer one does not.
The references and the hidden cases are on the instructor's side (``minipaged.checks.instructor.ch01``).
"""

from __future__ import annotations

from minipaged.block_math import ceil_div
from minipaged.checks import CheckFailed, check, expect_equal, expect_int

# The package modules this exercise rebuilds: none (its tasks are arithmetic on the package's sizes)
REBUILDS = ()

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


def _args(case) -> str:
    return ", ".join(map(repr, case))


@check("ch01.blocks_that_fit", hint=HINTS["1.1"][0], label=lambda c: f"blocks_that_fit({_args(c)})",
       summary="{n} budgets, from 0 bytes to 2**60 scale")
def check_blocks_that_fit(case, fn):
    """``case`` = (budget_bytes, num_layers, num_kv_heads, head_dim, dtype_bytes, block_size)."""
    return fn(*case)


@check_blocks_that_fit.judge
def _judge_fit(case, got, want):
    if type(got) is not int:
        raise CheckFailed(f"returned {got!r}; return an int (a count of whole blocks)")
    expect_equal(got, want)


@check("ch01.new_blocks", hint=HINTS["1.2"][0], label=lambda c: f"new_blocks({_args(c)})",
       summary="{n} appends, partly filled last blocks and 2**60-scale lengths included")
def check_new_blocks(case, fn):
    """``case`` = (num_tokens, num_new_tokens, block_size)."""
    return fn(*case)


@check_new_blocks.judge
def _judge_new(case, got, want):
    expect_int(got)
    n, k, b = case
    if got == ceil_div(k, b) and got != want:
        raise CheckFailed(f"returned {got}, expected {want}: the sequence's last block already has room for "
                          f"{ceil_div(n, b) * b - n} of the new tokens")
    expect_equal(got, want)


@check("ch01.best_block_size", hint=HINTS["1.3"][0], label=lambda c: f"best_block_size({c[0]}, {c[1]})",
       summary="{n} batches, ties included")
def check_best_block_size(case, fn):
    """``case`` = (lengths, candidates)."""
    lengths, candidates = case
    return fn(list(lengths), list(candidates))


@check_best_block_size.judge
def _judge_best(case, got, want):
    lengths, candidates = case
    if got != want and type(got) is int and got in candidates:
        slots = {b: sum(b * ceil_div(n, b) for n in lengths) for b in candidates}
        raise CheckFailed(f"returned {got}, expected {want}; slots held per block size: {slots}")
    expect_equal(got, want)
