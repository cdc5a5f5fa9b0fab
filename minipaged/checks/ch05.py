"""Checks for exercise 05: the scheduler's decisions in the situations chapter 05 does not spell out.

Chapter 05 shows the yes/no admission of a whole chunk and the choice of one
victim. The exercise asks for the *size* of a prefill chunk when the token
budget, the pool and the watermark all limit it, for a sequence that may already
hold a partly filled block; and for the whole list of victims when the sequence
that needs blocks must not be preempted for itself unless nothing else frees
enough. The references are on the instructor's side (``minipaged.checks.instructor.ch05``).
"""

from __future__ import annotations

from minipaged.accounting import ceil_div
from minipaged.checks import CheckFailed, check, expect_equal

# The package modules this exercise rebuilds: the grader flags a learner's cell that imports, subclasses or
# calls them (a flag for the instructor, not a verdict).
REBUILDS = ("minipaged.scheduler", "minipaged.request_queue")

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


@check("ch05.prefill_chunk", hint=HINTS["5.1"][0], label=lambda c: f"prefill_chunk({', '.join(map(repr, c))})",
       summary="{n} cases: budget, pool, watermark and a partly filled block as the limit")
def check_prefill_chunk(case, fn):
    """``case`` = (num_tokens, num_computed_tokens, token_budget, num_free_blocks, watermark_blocks, block_size)."""
    return fn(*case)


@check_prefill_chunk.judge
def _judge_chunk(case, got, want):
    if type(got) is not int:
        raise CheckFailed(f"returned {got!r}; return a number of tokens (an int)")
    n, c, budget, free, wm, b = case
    if got != want and got == max(0, min(n - c, budget, max(free - wm, 0) * b)):
        raise CheckFailed(f"returned {got}, expected {want}: the sequence already holds {ceil_div(c, b)} block(s) "
                          f"with {ceil_div(c, b) * b - c} free slot(s)")
    if got != want and got == 0 and want:
        raise CheckFailed(f"returned 0, expected {want}: a chunk may be shorter than the rest of the prompt; take "
                          "as many tokens as fit")
    expect_equal(got, want)


def _victims_label(case) -> str:
    running, requester, needed, free = case
    return (f"pick_victims({[tuple(r) for r in running]}, requester={requester!r}, num_blocks_needed={needed}, "
            f"num_free_blocks={free})")


@check("ch05.pick_victims", hint=HINTS["5.2"][0], label=_victims_label,
       summary="{n} cases: youngest first, ties, the requester spared, free blocks counted")
def check_pick_victims(case, fn):
    """``case`` = (running as [seq_id, arrival_time, num_blocks] rows, requester, num_blocks_needed, num_free)."""
    running, requester, needed, free = case
    given = [tuple(r) for r in running]
    got = fn(given, requester, needed, free)
    return {"victims": got, "input_unchanged": given == [tuple(r) for r in running]}


@check_pick_victims.judge
def _judge_victims(case, got, want):
    if type(got) is not dict or got.get("input_unchanged") is not True:
        raise CheckFailed("changed the list it was given; only pick, don't remove or sort in place")
    mine, right = got.get("victims"), want["victims"]
    requester = case[1]
    if type(mine) is list and requester in mine and requester not in right:
        raise CheckFailed(f"returned {mine}, expected {right}: the requester goes only after every other sequence, "
                          "and only if they free too little")
    expect_equal(mine, right)
