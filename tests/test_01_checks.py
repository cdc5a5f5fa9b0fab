"""Exercise 01's checks by mutation: the package's pieces and other right answers PASS, every known wrong one FAILs.

Tasks 1.1 and 1.2 are ``fixed_breakdown`` and ``paged_breakdown`` in ``minipaged/accounting.py`` (holes in the
handout); Task 1.3 is a notebook function that decides with ``paged_breakdown``.
"""

import math
from itertools import accumulate

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged import accounting as acc
from minipaged.accounting import Breakdown
from minipaged.checks import FAIL, PASS, ch01
from minipaged.checks.instructor import ch01 as ref

pytestmark = pytest.mark.ch01


# ----------------------------------------------------------------- Task 1.1: fixed reservation


def fixed_loop(lengths, budget, max_len, slot):
    """Right, and unlike the package: one reservation at a time."""
    left, seqs, tokens = budget, 0, 0
    for n in lengths:
        if left < max_len * slot:
            break
        left -= max_len * slot
        seqs, tokens = seqs + 1, tokens + min(n, max_len)
    return Breakdown("fixed", seqs, tokens * slot, 0, seqs * max_len * slot - tokens * slot, 0, left)


def _fixed_with(count=None, cut=True):
    def fixed(lengths, budget, max_len, slot):
        k = count(lengths, budget, max_len * slot) if count else min(len(lengths), budget // (max_len * slot))
        tokens = sum(min(n, max_len) if cut else n for n in lengths[:k])
        held = k * max_len * slot
        return Breakdown("fixed", k, tokens * slot, 0, held - tokens * slot, 0, budget - held)

    return fixed


# name: (wrong implementation, a piece of its FAIL message, its hint)
FIXED_MUTANTS = {
    "float division": (_fixed_with(lambda ls, b, r: min(len(ls), int(b / r))),
                       "unused is -1: the 7 sequences admitted take more", ch01.SPEC_HINTS["float"]),
    "an exact fit refused": (_fixed_with(lambda ls, b, r: min(len(ls), (b - 1) // r if b else 0)),
                             "admits 5 sequences, expected 6", ch01.SPEC_HINTS["exact"]),
    "more sequences than lengths": (_fixed_with(lambda ls, b, r: b // r), "admits 62 sequences, but there are only 2",
                                    ch01.SPEC_HINTS["count"]),
    "lengths not cut at max_len": (_fixed_with(cut=False), "effective_kv is 76 bytes, expected 66",
                                   ch01.SPEC_HINTS["cut"]),
    "the rest is not unused": (lambda ls, b, m, s: Breakdown("fixed", min(len(ls), b // (m * s)), 0, 0, 0, 0, 0),
                               "the parts sum to 0, not a split of the budget", ch01.SPEC_HINTS["sum"]),
    "a float part": (lambda ls, b, m, s: Breakdown("fixed", 0, 0, 0, 0, 0, b / 1), "unused is float",
                     ch01.SPEC_HINTS["float"]),
    "a tuple, not a Breakdown": (lambda ls, b, m, s: tuple(_fixed_with()(ls, b, m, s).parts().values()),
                                 "expected a Breakdown", ch01.SPEC_HINTS["type"]),
}


# ----------------------------------------------------------------- Task 1.2: paging


def paged_numpy(lengths, budget, B, max_len, slot):
    """Right, and unlike the package: vectorised with NumPy's int64 (exact for every case's sizes)."""
    n = np.minimum(np.asarray(lengths, dtype=np.int64), max_len)
    row = 4 * (-(-max_len // B))
    held = -(-n // B) * B
    k = int(np.searchsorted(np.cumsum(held * slot + row), budget, side="right"))
    tokens, slots = int(n[:k].sum()), int(held[:k].sum())
    return Breakdown("paged", k, tokens * slot, (slots - tokens) * slot, 0, k * row, budget - slots * slot - k * row)


def paged_accumulate(lengths, budget, B, max_len, slot):
    """Right, and unlike the package: running totals with itertools, a generator of costs."""
    row = 4 * (-(-max_len // B))
    cut = [min(n, max_len) for n in lengths]
    costs = [B * -(-n // B) * slot + row for n in cut]
    k = sum(1 for total in accumulate(costs) if total <= budget)
    tokens = sum(cut[:k])
    slots = sum(B * -(-n // B) for n in cut[:k])
    return Breakdown("paged", k, tokens * slot, (slots - tokens) * slot, 0, k * row, budget - slots * slot - k * row)


def _paged_with(held=lambda n, B: B * -(-n // B), row=lambda m, B, n: 4 * -(-m // B), cut=True, fits=None,
                skip=False):
    """The package's rule with one part swapped for a mistake."""
    fits = fits or (lambda cost, left: cost <= left)

    def paged(lengths, budget, B, max_len, slot):
        seqs = tokens = slots = table = 0
        for n in lengths:
            n = min(n, max_len) if cut else n
            h, r = held(n, B), row(max_len, B, n)
            if not fits(h * slot + r, budget - slots * slot - table):
                if skip:
                    continue
                break
            seqs, tokens, slots, table = seqs + 1, tokens + n, slots + h, table + r
        return Breakdown("paged", seqs, tokens * slot, (slots - tokens) * slot, 0, table,
                         budget - slots * slot - table)

    return paged


PAGED_MUTANTS = {
    "float division": (_paged_with(held=lambda n, B: B * math.ceil(n / B)), "tail_waste is -1, below 0",
                       ch01.SPEC_HINTS["tail"]),
    "the block-table row forgotten": (_paged_with(row=lambda m, B, n: 0), "no block-table bytes for 6 sequences",
                                      ch01.SPEC_HINTS["row"]),
    "the row charged per block": (_paged_with(row=lambda m, B, n: 4 * -(-n // B)),
                                  "bytes of block table for", ch01.SPEC_HINTS["row"]),
    "a later, shorter one admitted": (_paged_with(skip=True),
                                      "admits 3 sequences, expected 1: sequence 1 (30 tokens, 80 bytes)",
                                      ch01.SPEC_HINTS["prefix"]),
    "lengths not cut at max_len": (_paged_with(cut=False), "admits 3 sequences, expected 4: sequence 3 (9 tokens)",
                                   ch01.SPEC_HINTS["cut"]),
    "an exact fit refused": (_paged_with(fits=lambda cost, left: cost < left), "admits 2 sequences, expected 3",
                             ch01.SPEC_HINTS["exact"]),
    "blocks of the tokens, not whole blocks": (_paged_with(held=lambda n, B: n),
                                               "but a sequence of 5 tokens does not fill its last block of 4",
                                               ch01.SPEC_HINTS["tail"]),
}


# ----------------------------------------------------------------- Task 1.3: the largest max_len


def largest_by_bisection_on_ints(lengths, budget, B, slot, target):
    """Right, and unlike the reference: one bisection over [0, 2**64), with 0 meaning 'none'."""
    def ok(m):
        return m == 0 or acc.paged_breakdown(lengths, budget, B, m, slot).num_seqs >= target

    lo, hi = 0, 2**64
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def _search(limit=None, strict=False, none=0, off_by_one=False, scheme=acc.paged_breakdown):
    def largest(lengths, budget, B, slot, target):
        def ok(m):
            b = scheme(lengths, budget, B, m, slot) if scheme is acc.paged_breakdown else scheme(lengths, budget, m,
                                                                                                  slot)
            return b.num_seqs > target if strict else b.num_seqs >= target

        if not ok(1):
            return none
        lo, hi = 1, 2
        while ok(hi) and (limit is None or hi < limit(lengths)):
            lo, hi = hi, 2 * hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid)
        return hi if off_by_one else lo

    return largest


DECISION_MUTANTS = {
    "stops at the longest length": (_search(limit=lambda ls: max(ls)), "a longer max_len still admits",
                                    ch01.HINTS["1.3"][1]),
    "more than target": (_search(strict=True), "returned 2496, expected 2528", ch01.HINTS["1.3"][2]),
    "the first max_len that fails": (_search(off_by_one=True), "returned 2529, expected 2528", ch01.HINTS["1.3"][2]),
    "None when nothing fits": (_search(none=None), "returned None; return an int", ch01.HINTS["1.3"][0]),
    "fixed reservation's count": (_search(scheme=acc.fixed_breakdown), "expected 2528", ch01.HINTS["1.3"][2]),
}


# ----------------------------------------------------------------- the tests


@pytest.mark.parametrize("check, rights", [
    (ch01.check_fixed_breakdown, [acc.fixed_breakdown, fixed_loop]),
    (ch01.check_paged_breakdown, [acc.paged_breakdown, paged_numpy, paged_accumulate]),
    (ch01.check_largest_max_len, [ref.largest_max_len, largest_by_bisection_on_ints]),
], ids=["fixed_breakdown", "paged_breakdown", "largest_max_len"])  # fmt: skip
def test_the_package_and_other_right_answers_pass(check, rights, capsys):
    for right in rights:
        assert check(right).status == PASS, right.__name__
    assert "Traceback" not in capsys.readouterr().out


@pytest.mark.parametrize("check, mutants", [
    (ch01.check_fixed_breakdown, FIXED_MUTANTS), (ch01.check_paged_breakdown, PAGED_MUTANTS),
    (ch01.check_largest_max_len, DECISION_MUTANTS),
], ids=["fixed_breakdown", "paged_breakdown", "largest_max_len"])  # fmt: skip
def test_each_named_mistake_fails_with_its_message_and_hint(check, mutants):
    assert len(mutants) >= 5
    for name, (mutant, message, hint) in mutants.items():
        result = check(mutant)
        assert result.status == FAIL, name
        assert message in result.message, (name, result.message)
        assert result.hint == hint, (name, result.hint)


@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.integers(0, 300), max_size=12), budget=st.integers(0, 5000),
       B=st.sampled_from([1, 2, 3, 4, 16]), max_len=st.integers(1, 200), slot=st.integers(1, 4))
def test_the_pieces_split_the_budget_and_admit_a_prefix(lengths, budget, B, max_len, slot):
    """What both pieces promise: parts that sum to the budget, a prefix of the order, the next one refused."""
    fixed = acc.fixed_breakdown(lengths, budget, max_len, slot)
    paged = acc.paged_breakdown(lengths, budget, B, max_len, slot)
    row = 4 * -(-max_len // B)
    assert fixed.total == budget == paged.total and min(*fixed.parts().values(), *paged.parts().values()) >= 0
    assert (fixed.tail_waste, fixed.block_table, paged.reservation_waste) == (0, 0, 0)
    for b, cost in ((fixed, lambda n: max_len * slot), (paged, lambda n: B * -(-min(n, max_len) // B) * slot + row)):
        k = b.num_seqs
        assert sum(cost(n) for n in lengths[:k]) == budget - b.unused
        assert k == len(lengths) or b.unused < cost(lengths[k])  # the next one really does not fit
        assert b.effective_kv == slot * sum(min(n, max_len) for n in lengths[:k])
    assert paged.tail_waste < B * slot * paged.num_seqs or paged.tail_waste == 0
    assert paged.block_table == row * paged.num_seqs
    assert paged == paged_numpy(lengths, budget, B, max_len, slot) == paged_accumulate(lengths, budget, B, max_len,
                                                                                         slot)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 3000), min_size=1, max_size=8), budget=st.integers(0, 2**22),
       B=st.sampled_from([1, 8, 16]), slot=st.sampled_from([1, 64]), target=st.integers(1, 9))
def test_the_largest_max_len_is_the_last_that_admits_the_target(lengths, budget, B, slot, target):
    m = ref.largest_max_len(lengths, budget, B, slot, target)
    assert m == largest_by_bisection_on_ints(lengths, budget, B, slot, target)
    if m:
        assert acc.paged_breakdown(lengths, budget, B, m, slot).num_seqs >= target
    assert acc.paged_breakdown(lengths, budget, B, m + 1, slot).num_seqs < target
