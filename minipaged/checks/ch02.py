"""Checks for exercise 02: an allocator that takes and returns many blocks at once, and a chunk's slot mapping.

Chapter 02 shows :class:`~minipaged.block_manager.BlockAllocator`, which hands out
and frees one block per call. The exercise's allocator does it for a whole list,
all or nothing, which is where reference counts and repeated ids bite; and its
slot mapping starts at any position, not at the sequence's end. The probes run a
script on the learner's allocator and record each call's outcome and the pool's
state; the reference (``minipaged.checks.instructor.ch02``) runs the same script.
"""

from __future__ import annotations

from minipaged.checks import CheckFailed, check, expect_equal, expect_raised, outcome

# The package modules this exercise rebuilds: the grader flags a learner's cell that imports, subclasses or
# calls them (a flag for the instructor, not a verdict).
REBUILDS = ("minipaged.block_manager",)

HINTS = {
    "2.1": [
        "all or nothing: decide whether the whole request fits before touching the pool",
        "compare num_blocks with len(self.free_block_ids) first; only then take ids from the left of the deque",
        "every id you hand out starts with refcount 1; an empty request returns []",
    ],
    "2.2": [
        "validate the whole list before changing anything; the same id may appear more than once in it",
        "count how many times each id appears (collections.Counter) and compare with its refcount",
        "then decrement once per appearance; a block rejoins free_block_ids (on the right) when its count hits 0",
    ],
    "2.3": [
        "a chunk that starts in the middle of a block crosses a block boundary wherever p % block_size wraps to 0",
        "compute each position's slot on its own: position p lives in logical block p // block_size",
        "raise IndexError when the chunk's last position is beyond len(blocks) * block_size, before computing slots",
    ],
}


def _state(alloc) -> list:
    return [list(alloc.free_block_ids), list(alloc.refcounts)]


def _steps(alloc, method: str, args: list) -> list[dict]:
    """Call ``alloc.<method>(arg)`` for each arg; record the outcome and the pool before and after."""
    steps = []
    for arg in args:
        before = _state(alloc)
        result = outcome(getattr(alloc, method), list(arg) if type(arg) is list else arg)
        steps.append({"outcome": result, "before": before, "after": _state(alloc)})
    return steps


def _judge_steps(steps, want_steps, call: str, why: dict) -> None:
    if type(steps) is not list or len(steps) != len(want_steps):
        raise CheckFailed("the probe's record of the script is incomplete")
    for step, want in zip(steps, want_steps):
        arg = want["arg"]
        what = f"{call}({arg}){' (' + why[str(arg)] + ')' if str(arg) in why else ''} with " \
               f"{len(want['before'][0])} free blocks"
        if "raised" in want["outcome"]:
            expect_raised(step["outcome"], want["outcome"]["raised"][0], what)
            if step["after"] != step["before"]:
                advice = ("validate the whole list first" if call == "free"
                          else "check that the whole request fits first")
                raise CheckFailed(f"{what} changed free_block_ids or refcounts before raising; {advice}")
            continue
        got = step["outcome"].get("returned") if "returned" in step["outcome"] else step["outcome"]
        if "raised" in step["outcome"]:
            raise CheckFailed(f"{what} raised {step['outcome']['raised'][0]}: {step['outcome'].get('message')}")
        if call == "allocate" and type(got) is not list:
            raise CheckFailed(f"{what} returned {got!r}; return a list of block ids")
        expect_equal(got, want["outcome"]["returned"], what)
        expect_equal(step["after"], want["after"], f"(free_block_ids, refcounts) after {what}:")


def _with_args(steps, args):
    return [dict(step, arg=arg) for step, arg in zip(steps, args)]


@check("ch02.allocate_many", hint=HINTS["2.1"][0], label=lambda c: f"a pool of {c['num_blocks']} blocks",
       summary="in pool order, refcount 1 each, all or nothing on a short pool")
def check_allocate_many(case, cls):
    """``case`` = {"num_blocks", "requests"}: ``cls(num_blocks, 4)``, then ``allocate(n)`` for each request."""
    return _steps(cls(case["num_blocks"], 4), "allocate", case["requests"])


@check_allocate_many.judge
def _judge_allocate(case, got, want):
    _judge_steps(got, _with_args(want, case["requests"]), "allocate", {})


@check("ch02.free_many", hint=HINTS["2.2"][0], label=lambda c: f"a pool of {c['num_blocks']} blocks",
       summary="shared blocks kept until their last holder, repeated ids counted, nothing changed by a bad list")
def check_free_many(case, cls):
    """``case`` = {"num_blocks", "shared", "frees", "why"}: allocate all but one, share some, then free lists."""
    alloc = cls(case["num_blocks"], 4)
    alloc.allocate(case["num_blocks"] - 1)
    for b in case["shared"]:
        alloc.refcounts[b] += 1  # a second holder
    return _steps(alloc, "free", case["frees"])


@check_free_many.judge
def _judge_free(case, got, want):
    _judge_steps(got, _with_args(want, case["frees"]), "free", case.get("why", {}))


def _slots_label(case) -> str:
    blocks, start, n, b = case
    return f"chunk_slots({blocks}, start={start}, num_tokens={n}, block_size={b})"


@check("ch02.chunk_slots", hint=HINTS["2.3"][0], label=_slots_label,
       summary=lambda cases, seen: f"{sum('returned' in s for s in seen)} chunks, mid-block starts and boundaries "
                                   "crossed, IndexError past the table")
def check_chunk_slots(case, fn):
    """``case`` = (blocks, start, num_tokens, block_size)."""
    blocks, start, n, b = case
    result = outcome(lambda: [int(s) for s in fn(list(blocks), start, n, b)])
    return result


@check_chunk_slots.judge
def _judge_slots(case, got, want):
    blocks, start, n, b = case
    if "raised" in want:
        expect_raised(got, "IndexError", "past the table's blocks, it")
        return
    if "raised" in got:
        raise CheckFailed(f"raised {got['raised'][0]}: {got.get('message')}")
    slots, right = got["returned"], want["returned"]
    first = blocks[start // b] * b + start % b
    if n and slots == list(range(first, first + n)) and slots != right:
        raise CheckFailed(f"returned {slots}, expected {right}: the slots run on past the end of block "
                          f"{blocks[start // b]}; the next position lives in the next block of the table")
    expect_equal(slots, right)
