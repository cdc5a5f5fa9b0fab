"""Exercise 01's references, public cases and hidden cases (the instructor's side of ``minipaged.checks.ch01``).

Tasks 1.1 and 1.2: the package's own ``fixed_breakdown`` and ``paged_breakdown`` are the reference.
Task 1.3: :func:`largest_max_len` below, the model answer of the exercise's notebook cell.
"""

from __future__ import annotations

from minipaged import accounting as acc
from minipaged.checks.instructor import Side


def paged_cost(n: int, block_size: int, max_len: int, slot_bytes: int) -> int:
    """What one sequence of ``n`` tokens costs under paging: its whole blocks and its block-table row (for cases)."""
    n = min(n, max_len)
    return (block_size * -(-n // block_size) * slot_bytes
            + acc.BLOCK_TABLE_ENTRY_BYTES * -(-max_len // block_size))  # fmt: skip


def _fixed(lengths, budget, max_len, slot) -> dict:
    return {"lengths": lengths, "budget_bytes": budget, "max_len": max_len, "slot_bytes": slot}


def _paged(lengths, budget, block_size, max_len, slot) -> dict:
    return {"lengths": lengths, "budget_bytes": budget, "block_size": block_size, "max_len": max_len,
            "slot_bytes": slot}


BIG = [2**58 + 1, 3 * 2**56, 2**57 + 5, 7, 2**58]  # 2**60-scale lengths: float(2**58 + 1) is 2**58

FIXED_CASES = [
    _fixed([5, 12, 3, 9, 2, 7], 100, 8, 2),  # 6 reservations of 16 bytes fit in 100; 12 counts as 8
    _fixed([5, 12, 3, 9, 2, 7], 96, 8, 2),  # an exact fit: 6 reservations take the whole budget
    _fixed([5, 12, 3, 9, 2, 7], 95, 8, 2),  # one byte short of the sixth
    _fixed([3, 4], 1000, 8, 2),  # fewer lengths than reservations that fit
    _fixed([3, 4], 0, 8, 2),
    _fixed([], 64, 8, 2),
    _fixed([0, 2048, 4000, 17], 16 * 2**30, 2048, 128 * 2**10),  # Llama-3-8B's 128 KiB per token, 16 GiB
    _fixed([2**19, 5, 2**20, 3, 2**20 + 9, 1, 2, 4, 8, 16], 7 * 2**57 - 1, 2**20, 2**37),  # float quotient: 7.0
]

PAGED_CASES = [
    _paged([5, 12, 3, 9, 2, 7], 100, 4, 8, 2),  # rows of 2 entries (8 bytes); 12 counts as 8
    _paged([4, 30, 2, 2], 32 + 79, 4, 16, 4),  # 30 (cut to 16) needs 80 of the 79 left; the 2s wait behind it
    _paged([5, 12, 3, 9], 16 + 8 + 16 + 8 + 8 + 8, 4, 8, 2),  # an exact fit of the first three
    _paged([5, 12, 3, 9], 16 + 8 + 16 + 8 + 8 + 8 - 1, 4, 8, 2),  # one byte short of the third
    _paged([3, 4], 1000, 16, 64, 2),  # every length fits
    _paged([3, 4], 0, 16, 64, 2),
    _paged([], 64, 4, 8, 2),
    _paged([100, 100, 100, 100], 4 * (128 * 2 + 4 * 64), 2, 128, 2),  # rows as large as the KV: B = 2
    _paged([37, 91, 128, 201, 511, 3000], 2 * 2**30, 16, 2048, 128 * 2**10),  # Llama-3-8B, 2 GiB
    _paged(BIG, sum(paged_cost(n, 2**20, 2**60, 1) for n in BIG[:2]), 2**20, 2**60, 1),  # 2**60 scale, exact fit
    _paged(BIG, sum(paged_cost(n, 2**20, 2**60, 1) for n in BIG[:3]) - 1, 2**20, 2**60, 1),
]


def _exact_or_near(rng, costs: list[int]) -> int:
    """A budget at, just under or just over what the first j sequences cost, or anywhere up to all of them."""
    j = rng.randrange(0, len(costs) + 1)
    exact = sum(costs[:j])
    return max(0, rng.choice([exact, exact - 1, exact + 1, rng.randrange(0, sum(costs) + 2)]))


def _hidden_lengths(rng, max_len: int) -> list[int]:
    return [rng.choice([rng.randrange(0, 3 * max_len + 1), rng.randrange(1, max_len + 1), max_len])
            for _ in range(rng.randrange(1, 16))]


def _hidden_fixed(rng):
    cases = []
    for _ in range(8):
        max_len, slot = rng.choice([1, 8, 64, 2048]), rng.choice([1, 2, 3, 2**17])
        lengths = _hidden_lengths(rng, max_len)
        cases.append(_fixed(lengths, _exact_or_near(rng, [max_len * slot] * len(lengths)), max_len, slot))
    for _ in range(2):  # 2**60 scale: a float quotient rounds up at k · reservation - 1
        max_len, slot = 2 ** rng.randrange(18, 24), rng.randrange(2**34, 2**36)
        k = rng.randrange(3, 9)
        cases.append(_fixed(_hidden_lengths(rng, max_len) + [1] * 9, k * max_len * slot - 1, max_len, slot))
    return cases


def _hidden_paged(rng):
    cases = []
    for _ in range(8):
        B, max_len, slot = rng.choice([1, 2, 4, 16, 32]), rng.choice([8, 64, 100, 2048]), rng.choice([1, 2, 2**17])
        lengths = _hidden_lengths(rng, max_len)
        costs = [paged_cost(n, B, max_len, slot) for n in lengths]
        cases.append(_paged(lengths, _exact_or_near(rng, costs), B, max_len, slot))
    for _ in range(2):  # 2**60 scale, lengths a float cannot hold
        B, max_len = 2 ** rng.randrange(10, 24), 2**60
        lengths = [rng.randrange(2**56, 2**58) | 1 for _ in range(rng.randrange(3, 7))]
        costs = [paged_cost(n, B, max_len, 1) for n in lengths]
        cases.append(_paged(lengths, _exact_or_near(rng, costs), B, max_len, 1))
    return cases


def largest_max_len(lengths, budget_bytes, block_size, slot_bytes, target) -> int:
    """The largest max_len at which paging admits at least ``target`` of ``lengths`` (0: not even max_len = 1)."""

    def admits(max_len):
        return acc.paged_breakdown(lengths, budget_bytes, block_size, max_len, slot_bytes).num_seqs >= target

    if not admits(1):
        return 0
    lo, hi = 1, 2
    while admits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if admits(mid) else (lo, mid)
    return lo


def _decision(lengths, budget, block_size, slot, target) -> dict:
    return {"lengths": lengths, "budget_bytes": budget, "block_size": block_size, "slot_bytes": slot,
            "target": target}


CHAT = [328, 90, 1021, 57, 2980, 410, 133, 760, 5120, 244, 61, 1800]  # chat-like lengths, one past 4096
DECISION_CASES = [
    _decision(CHAT, 2**30, 16, 128 * 2**10, 10),  # the answer cuts the two long ones: max_len below 2980
    _decision(CHAT, 64 * 2**20, 16, 128 * 2**10, 13),  # more than there are lengths: 0
    _decision(CHAT, 16 * 2**30, 16, 128 * 2**10, 12),  # every sequence whole: only the rows still grow, far past 5120
    _decision([40, 40, 40], 3 * (48 * 2 + 4 * 3), 16, 2, 3),  # exactly at max_len = 48 (rows of 3 entries)
    _decision([10, 10, 10], 3 * (16 + 4) - 1, 16, 1, 3),  # one byte short even at max_len = 1
    _decision([1, 2, 3, 2**30], 2**60, 4, 1, 4),  # a huge answer: a step-by-step search does not finish
]


def _hidden_decision(rng):
    cases = []
    for _ in range(5):
        lengths = [rng.randrange(1, 6000) for _ in range(rng.randrange(3, 14))]
        B, slot = rng.choice([1, 8, 16, 64]), rng.choice([2, 64, 128 * 2**10])
        target = rng.randrange(1, len(lengths) + 2)
        budget = sum(sorted(lengths)[:target]) * slot * rng.choice([1, 2, 3]) + rng.randrange(0, 2**20)
        cases.append(_decision(lengths, budget, B, slot, target))
    return cases


SIDES = {
    "fixed_breakdown": Side(lambda: FIXED_CASES, _hidden_fixed, lambda: (acc.fixed_breakdown,)),
    "paged_breakdown": Side(lambda: PAGED_CASES, _hidden_paged, lambda: (acc.paged_breakdown,)),
    "largest_max_len": Side(lambda: DECISION_CASES, _hidden_decision, lambda: (largest_max_len,)),
}
