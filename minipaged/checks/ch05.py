"""Checks for exercise 05: the scheduler's decisions in the situations chapter 05 does not spell out.

Chapter 05 shows the yes/no admission of a whole chunk and the choice of one
victim. The exercise asks for the *size* of a prefill chunk when the token
budget, the pool and the watermark all limit it, for a sequence that may already
hold a partly filled block; and for the whole list of victims when the sequence
that needs blocks must not be preempted for itself unless nothing else frees
enough. The references below are written out in full, so the check stands on
its own.
"""

from __future__ import annotations

from minipaged.accounting import ceil_div
from minipaged.checks import CheckFailed, check, expect_equal

HINTS = {
    "5.1": [
        "three limits at once: the tokens left to prefill, the step's token budget, and the slots the pool can "
        "give without eating the watermark; a partly filled block the sequence already holds has free slots too",
        "slots available = (blocks already held + usable free blocks) · block_size − num_computed_tokens, where "
        "usable free blocks = num_free_blocks − watermark_blocks, never below 0",
        "the chunk is the smallest of the three limits, and never negative; blocks held = ceil(num_computed / B)",
    ],
    "5.2": [
        "recompute preemption frees a victim's blocks; youngest first (largest arrival_time, ties to the later "
        "one in the list), and never the requester while someone else can go",
        "sort the others youngest first and take victims until num_free_blocks plus what they hold covers "
        "num_blocks_needed",
        "if all the others together are not enough, the requester preempts itself as well: append it last",
    ],
}

# (num_tokens, num_computed_tokens, token_budget, num_free_blocks, watermark_blocks, block_size)
CHUNK_CASES = [
    (10, 0, 32, 10, 1, 4),  # the whole prompt fits
    (10, 0, 6, 10, 1, 4),  # the token budget limits it
    (40, 0, 64, 5, 1, 4),  # the pool limits it: 4 usable blocks, 16 tokens
    (40, 6, 64, 2, 1, 4),  # holds 2 blocks with 2 free slots, plus 1 usable block
    (40, 8, 64, 1, 1, 4),  # holds 2 full blocks, nothing usable: 0
    (40, 7, 64, 1, 1, 4),  # nothing usable, but one free slot in the held block
    (9, 9, 8, 5, 0, 4),  # nothing left to prefill
    (30, 3, 100, 0, 2, 8),  # fewer free blocks than the watermark: only the held block's slots
    (2**60 + 5, 2**60 + 1, 2**61, 3, 1, 16),  # 2**60-scale positions
    (2**62, 0, 2**61 + 3, 2**57, 2, 16),
]


def _chunk(num_tokens, num_computed, budget, num_free, watermark, block_size) -> int:
    held = ceil_div(num_computed, block_size)
    room = (held + max(num_free - watermark, 0)) * block_size - num_computed
    return max(0, min(num_tokens - num_computed, budget, room))


@check("ch05.prefill_chunk", hint=HINTS["5.1"][0])
def check_prefill_chunk(fn):
    for case in CHUNK_CASES:
        got = fn(*case)
        if isinstance(got, bool) or not isinstance(got, int):
            raise CheckFailed(f"prefill_chunk{case} returned {got!r}; return a number of tokens (an int)")
        want = _chunk(*case)
        n, c, budget, free, wm, b = case
        if got != want and got == max(0, min(n - c, budget, max(free - wm, 0) * b)):
            raise CheckFailed(f"prefill_chunk{case} returned {got}, expected {want}: the sequence already holds "
                              f"{ceil_div(c, b)} block(s) with {ceil_div(c, b) * b - c} free slot(s)")
        if got != want and got == 0 and want:
            raise CheckFailed(f"prefill_chunk{case} returned 0, expected {want}: a chunk may be shorter than the "
                              "rest of the prompt; take as many tokens as fit")
        expect_equal(got, want, f"prefill_chunk{case}")
    return f"{len(CHUNK_CASES)} cases: budget, pool, watermark and a partly filled block as the limit"


def _victims(running, requester, num_blocks_needed, num_free_blocks) -> list[str]:
    order = sorted(range(len(running)), key=lambda i: (running[i][1], i), reverse=True)
    victims, free = [], num_free_blocks
    for i in order:
        if free >= num_blocks_needed:
            break
        seq_id, _, blocks = running[i]
        if seq_id != requester:
            victims.append(seq_id)
            free += blocks
    if free < num_blocks_needed:
        victims.append(requester)
    return victims


# (running as (seq_id, arrival_time, num_blocks), requester, num_blocks_needed, num_free_blocks)
VICTIM_CASES = [
    ([("a", 0.0, 3), ("b", 1.0, 2), ("c", 2.0, 1)], "a", 1, 0),  # the youngest
    ([("a", 0.0, 3), ("b", 1.0, 2), ("c", 2.0, 1)], "a", 3, 0),  # two victims, youngest first
    ([("a", 0.0, 3), ("b", 1.0, 2), ("c", 2.0, 1)], "c", 1, 0),  # the requester is the youngest: skip it
    ([("a", 0.0, 3), ("b", 1.0, 2), ("c", 2.0, 1)], "a", 2, 1),  # free blocks count too
    ([("a", 0.0, 3), ("b", 1.0, 2)], "a", 1, 1),  # enough free already: nobody
    ([("a", 1.0, 1), ("b", 1.0, 1), ("c", 0.0, 1)], "c", 1, 0),  # a tie: the later in the list
    ([("a", 0.0, 1), ("b", 1.0, 1)], "b", 5, 0),  # not enough even with everyone: the requester goes too
    ([("x", 3.0, 2)], "x", 1, 0),  # alone: preempts itself
    ([("a", 5.0, 1), ("b", 0.0, 4), ("c", 9.0, 1), ("d", 2.0, 2)], "d", 3, 1),  # arrival order differs from list
]


@check("ch05.pick_victims", hint=HINTS["5.2"][0])
def check_pick_victims(fn):
    for running, requester, needed, free in VICTIM_CASES:
        given = [tuple(r) for r in running]
        what = f"pick_victims({running}, requester={requester!r}, num_blocks_needed={needed}, num_free_blocks={free})"
        got = fn(given, requester, needed, free)
        if given != running:
            raise CheckFailed(f"{what} changed the list it was given; only pick, don't remove or sort in place")
        want = _victims(running, requester, needed, free)
        if isinstance(got, list) and requester in got and requester not in want:
            raise CheckFailed(f"{what} returned {got}, expected {want}: the requester goes only after every "
                              "other sequence, and only if they free too little")
        expect_equal(got, want, what)
    return f"{len(VICTIM_CASES)} cases: youngest first, ties, the requester spared, free blocks counted"
