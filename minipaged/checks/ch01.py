"""Checks for exercise 01: the admission decision of chapter 01's capacity estimator, and a decision built on it.

Tasks 1.1 and 1.2 are holes in the learner's ``minipaged/accounting.py``: ``fixed_breakdown`` and
``paged_breakdown``, which :func:`~minipaged.accounting.capacity` calls. Their probes call the learner's
function on a list of lengths (plain ints: no NumPy needed) and record the ``Breakdown`` it returns;
the judges check what must hold whatever the implementation (the parts are ints and sum to the
budget, the block-table rows are whole rows) and then compare with the reference, naming the first
thing that differs and the hint for that mistake. The cases include 2**60-scale budgets and lengths,
where a float division rounds and an integer one does not. Task 1.3 is a notebook function that
decides with the learner's ``paged_breakdown``. The references and the hidden cases are on the
instructor's side (``minipaged.checks.instructor.ch01``).
"""

from __future__ import annotations

from numbers import Integral

from minipaged.checks import CheckFailed, check, expect_equal, expect_int

# The package modules this exercise rebuilds in a notebook cell: none (its pieces are holes in the learner's own
# minipaged/accounting.py, which Task 1.3's cell is meant to call)
REBUILDS = ()

ROW_ENTRY_BYTES = 4  # an int32 block-table entry, as the contract states (accounting.BLOCK_TABLE_ENTRY_BYTES)

HINTS = {
    "1.1": [
        "admit sequences in order while one more reservation of max_len slots fits in the budget; the parts of the "
        "Breakdown are bytes and must add up to the budget",
        "a reservation is max_len · slot_bytes bytes whatever the length; the tokens of the admitted sequences (each "
        "cut at max_len) are the effective KV, the rest of their reservations is reservation waste, and what no "
        "reservation took is unused",
        "count with // on ints, never /: at 2**60 bytes a float quotient can round up to a reservation that does not "
        "fit; and there may be fewer lengths than reservations that fit",
    ],
    "1.2": [
        "walk the lengths in order, charging each sequence its whole blocks and one block-table row, and stop at the "
        "first that does not fit in what is left",
        "a sequence of n tokens (cut at max_len) holds B · ceil(n / B) slots, n of them tokens and the rest tail "
        "waste; its row is ceil(max_len / B) int32 entries of 4 bytes, the same for every sequence",
        "stay in integers (ceil(n / B) is -(-n // B)); admission stops at the first sequence that does not fit, even "
        "if a later one would; an exact fit (unused = 0) is a fit",
    ],
    "1.3": [
        "the longer max_len, the more each sequence costs (more of it is kept, and its row is longer), so the number "
        "paging admits never grows with max_len: search for the last max_len where it is still at least target",
        "grow an upper bound by doubling until paged_breakdown admits fewer than target, then bisect between the "
        "last good max_len and it; past the longest length only the rows still grow, so the answer can be huge",
        "keep the invariant 'lo admits >= target, hi admits < target' and stop when hi == lo + 1; return 0 when even "
        "max_len = 1 admits fewer than target",
    ],
}

# The hint a FAIL prints for each diagnosis (none is the solution).
SPEC_HINTS = {
    "type": "return accounting.Breakdown(scheme, num_seqs, effective_kv, tail_waste, reservation_waste, block_table, "
            "unused): the counts and bytes as ints",
    "float": "every part is a whole number of bytes: count with ints (// and -(-a // b)); a float at 2**60 bytes is "
             "not exact",
    "sum": "the Breakdown says where every byte of the budget goes: unused is what the admitted sequences did not "
           "take, so the parts sum to budget_bytes",
    "exact": "a sequence that needs exactly what is left fits: compare with <=, not <",
    "prefix": "sequences are admitted in order and admission stops at the first that does not fit: a later, "
              "shorter one is not admitted past it (the scheduler serves requests in the order they came)",
    "count": "count the sequences admitted in order until the next one's cost is more than what is left (and no more "
             "than there are lengths)",
    "cut": "a server stops a sequence at max_len: a length above it holds max_len tokens",
    "row": "each admitted sequence has one block-table row of ceil(max_len / B) int32 entries (4 bytes each): the "
           "row it needs to grow to max_len, whatever its length now",
    "tail": "a sequence of n tokens holds B · ceil(n / B) slots: its tail waste is that minus n, under B slots; "
            "ceil with ints, -(-n // B)",
    "reservation": "each admitted sequence reserves max_len slots: the slots its tokens do not fill are "
                   "reservation waste",
    "scheme": "the fixed scheme has no tail waste and no block table; the paged one no reservation waste",
}

FIXED_ARGS = ("budget_bytes", "max_len", "slot_bytes")  # after the lengths, in the signature's order
PAGED_ARGS = ("budget_bytes", "block_size", "max_len", "slot_bytes")
FIELDS = ("num_seqs", "effective_kv", "tail_waste", "reservation_waste", "block_table", "unused")
PARTS = FIELDS[1:]


def _observe(result) -> dict:
    """A returned ``Breakdown`` as plain data: ints as ints, anything else by its type's name and value."""
    if not all(hasattr(result, f) for f in ("scheme", *FIELDS)):
        return {"returned": f"{type(result).__name__} {result!r}"[:200]}
    seen = {"class": type(result).__name__, "scheme": str(result.scheme)}
    for f in FIELDS:
        value = getattr(result, f)
        ok = isinstance(value, Integral) and not isinstance(value, bool)
        seen[f] = int(value) if ok else f"{type(value).__name__} {value!r}"[:80]
    return seen


def _label(name: str, *args: str):
    """How a FAIL names a case: the call, with a long list of lengths shortened."""
    def label(case) -> str:
        lengths = case["lengths"]
        shown = lengths if len(lengths) <= 8 else [*lengths[:8], "..."]
        return f"{name}({shown}, " + ", ".join(f"{a}={case[a]}" for a in args) + ")"

    return label


@check("ch01.fixed_breakdown", hint=HINTS["1.1"][0], label=_label("fixed_breakdown", *FIXED_ARGS),
       summary="{n} budgets: exact fits, lengths past max_len, fewer lengths than reservations, 2**60 bytes")
def check_fixed_breakdown(case, fn):
    """``case`` = {"lengths", "budget_bytes", "max_len", "slot_bytes"}."""
    return _observe(fn(list(case["lengths"]), *(case[a] for a in FIXED_ARGS)))


@check("ch01.paged_breakdown", hint=HINTS["1.2"][0], label=_label("paged_breakdown", *PAGED_ARGS),
       summary="{n} budgets: exact fits, a shorter sequence after a refused one, lengths past max_len, 2**60 bytes")
def check_paged_breakdown(case, fn):
    """``case`` = {"lengths", "budget_bytes", "block_size", "max_len", "slot_bytes"}."""
    return _observe(fn(list(case["lengths"]), *(case[a] for a in PAGED_ARGS)))


def _shape(got: dict, scheme: str) -> None:
    """What any right answer satisfies before it is compared with the reference: its type, ints, its scheme."""
    if "returned" in got:
        raise CheckFailed(f"returned {got['returned']}; expected a Breakdown", hint=SPEC_HINTS["type"])
    for f in FIELDS:
        if type(got[f]) is not int:
            raise CheckFailed(f"{f} is {got[f]}; every part is a whole number of bytes (an int)",
                              hint=SPEC_HINTS["float"])
    if got["scheme"] != scheme:
        raise CheckFailed(f"the scheme is {got['scheme']!r}, expected {scheme!r}", hint=SPEC_HINTS["type"])


def _sums(got: dict, budget: int) -> None:
    total = sum(got[f] for f in PARTS)
    if got["unused"] < 0:
        raise CheckFailed(f"unused is {got['unused']:,}: the {got['num_seqs']} sequences admitted take more than the "
                          f"budget of {budget:,} bytes", hint=SPEC_HINTS["float" if budget > 2**53 else "count"])
    negative = [f for f in FIELDS if got[f] < 0]
    if negative:
        raise CheckFailed(f"{negative[0]} is {got[negative[0]]:,}, below 0",
                          hint=SPEC_HINTS[{"reservation_waste": "cut", "tail_waste": "tail"}.get(negative[0], "sum")])
    if total != budget:
        raise CheckFailed(f"the parts sum to {total:,}, not a split of the budget of {budget:,} bytes",
                          hint=SPEC_HINTS["sum"])


def _count(got: dict, want: dict, case: dict, cost_of_next: int) -> None:
    """The admitted prefix's length against the reference's, with the hint for the likely mistake."""
    k, right = got["num_seqs"], want["num_seqs"]
    if k == right:
        return
    if k < right:
        longer = "block_size" in case and any(n > case["max_len"] for n in case["lengths"][: k + 1])
        hint = SPEC_HINTS["exact" if k == right - 1 and want["unused"] == 0 else "cut" if longer else "count"]
        raise CheckFailed(f"admits {k} sequences, expected {right}: sequence {k} ({case['lengths'][k]} tokens) still "
                          f"fits in what the first {k} leave", hint=hint)
    if right < len(case["lengths"]):
        raise CheckFailed(f"admits {k} sequences, expected {right}: sequence {right} "
                          f"({case['lengths'][right]} tokens, {cost_of_next:,} bytes) does not fit in what the first "
                          f"{right} leave, and admission stops there", hint=SPEC_HINTS["prefix"])
    raise CheckFailed(f"admits {k} sequences, but there are only {len(case['lengths'])}", hint=SPEC_HINTS["count"])


@check_fixed_breakdown.judge
def _judge_fixed(case, got, want):
    _shape(got, "fixed")
    _sums(got, case["budget_bytes"])
    if got["tail_waste"] or got["block_table"]:
        raise CheckFailed("fixed reservation has no tail waste and no block table", hint=SPEC_HINTS["scheme"])
    _count(got, want, case, case["max_len"] * case["slot_bytes"])
    if got["effective_kv"] != want["effective_kv"]:
        longer = any(n > case["max_len"] for n in case["lengths"][: got["num_seqs"]])
        raise CheckFailed(f"effective_kv is {got['effective_kv']:,} bytes, expected {want['effective_kv']:,}",
                          hint=SPEC_HINTS["cut" if longer and got["effective_kv"] > want["effective_kv"] else "count"])
    if got["reservation_waste"] != want["reservation_waste"]:
        raise CheckFailed(f"reservation_waste is {got['reservation_waste']:,} bytes, expected "
                          f"{want['reservation_waste']:,}", hint=SPEC_HINTS["reservation"])
    expect_equal({f: got[f] for f in FIELDS}, {f: want[f] for f in FIELDS})


def _row_bytes(case) -> int:
    """One block-table row, as the contract states it: ceil(max_len / B) int32 entries."""
    return ROW_ENTRY_BYTES * -(-case["max_len"] // case["block_size"])


@check_paged_breakdown.judge
def _judge_paged(case, got, want):
    _shape(got, "paged")
    _sums(got, case["budget_bytes"])
    if got["reservation_waste"]:
        raise CheckFailed("paging reserves nothing ahead: its reservation_waste is 0", hint=SPEC_HINTS["scheme"])
    row = _row_bytes(case)
    if got["block_table"] != got["num_seqs"] * row:
        what = "no block-table bytes" if got["block_table"] == 0 else f"{got['block_table']:,} bytes of block table"
        raise CheckFailed(f"{what} for {got['num_seqs']} sequences; each has one row of {row:,} bytes",
                          hint=SPEC_HINTS["row"])
    B, slot = case["block_size"], case["slot_bytes"]
    partial = [n for n in case["lengths"][: got["num_seqs"]] if min(n, case["max_len"]) % B]
    if partial and got["tail_waste"] == 0 or got["tail_waste"] >= got["num_seqs"] * B * slot > 0:
        why = (f"a sequence of {partial[0]} tokens does not fill its last block of {B}" if got["tail_waste"] == 0
               else f"each leaves fewer than {B} slots of its last block empty")
        raise CheckFailed(f"tail_waste is {got['tail_waste']:,} bytes for {got['num_seqs']} sequences, but {why}",
                          hint=SPEC_HINTS["tail"])
    k = want["num_seqs"]
    n = min(case["lengths"][k], case["max_len"]) if k < len(case["lengths"]) else 0
    _count(got, want, case, B * -(-n // B) * slot + row)
    if got["effective_kv"] != want["effective_kv"]:
        longer = any(n > case["max_len"] for n in case["lengths"][:k])
        raise CheckFailed(f"effective_kv is {got['effective_kv']:,} bytes, expected {want['effective_kv']:,}",
                          hint=SPEC_HINTS["cut" if longer and got["effective_kv"] > want["effective_kv"] else "tail"])
    if got["tail_waste"] != want["tail_waste"]:
        raise CheckFailed(f"tail_waste is {got['tail_waste']:,} bytes, expected {want['tail_waste']:,}",
                          hint=SPEC_HINTS["tail"])
    expect_equal({f: got[f] for f in FIELDS}, {f: want[f] for f in FIELDS})


@check("ch01.largest_max_len", hint=HINTS["1.3"][0],
       label=lambda c: f"largest_max_len({len(c['lengths'])} lengths, budget_bytes={c['budget_bytes']:,}, "
                       f"block_size={c['block_size']}, slot_bytes={c['slot_bytes']:,}, target={c['target']})",
       summary="{n} decisions: answers from 0 to past every length, where only the rows still grow")
def check_largest_max_len(case, fn):
    """``case`` = {"lengths", "budget_bytes", "block_size", "slot_bytes", "target"}."""
    return fn(list(case["lengths"]), case["budget_bytes"], case["block_size"], case["slot_bytes"], case["target"])


@check_largest_max_len.judge
def _judge_largest(case, got, want):
    expect_int(got)
    if got == want:
        return
    if want == 0:
        raise CheckFailed(f"returned {got}, expected 0: even max_len = 1 admits fewer than {case['target']}")
    if got < want:
        raise CheckFailed(f"returned {got}, expected {want}: a longer max_len still admits {case['target']} "
                          "sequences", hint=HINTS["1.3"][1 if max(case["lengths"]) < want else 2])
    raise CheckFailed(f"returned {got}, expected {want}: with max_len = {got} paging admits fewer than "
                      f"{case['target']} sequences", hint=HINTS["1.3"][2])
