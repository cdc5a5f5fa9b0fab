"""Checks for chapter 08: the rollback arithmetic of speculative decoding, and one step of beam search.

Each probe runs the learner's code on real block tables over chapter 02's
:class:`~minipaged.block_manager.BlockAllocator` and records what it saw; the reference
(``minipaged.checks.instructor.ch08``) runs the same script, and the judge compares them. The
scripts are built so that the classic mistakes show up as a wrong value, not as a crash:

- freeing blocks that a later step needs (a rollback that gives back the block the rejected
  drafts spilled into; a beam step that releases a table one of the new beams carries on in);
- rolling back past the prompt (moving the counter back from its value *before* the
  verification step);
- forgetting the copy before a diverging write (a beam writes into a copied block whose K/V was
  never copied, or copies after writing).
"""

from __future__ import annotations

from collections import Counter

from minipaged.block_manager import BlockAllocator, BlockTable
from minipaged.checks import CheckFailed, check, expect_equal, expect_raised, outcome

# The package modules this exercise rebuilds: the grader flags a learner's cell that imports, subclasses or
# calls them (a flag for the instructor, not a verdict).
REBUILDS = ("minipaged.speculative",)

# Staged hints: the first names the idea (stubs carry it), later ones come closer to code on request,
# `hint("8.1", 2)`. None of them is the solution.
HINTS = {
    "8.1": [
        "the verification step computed the last sampled token and all k drafts; only that token and the j "
        "accepted drafts are real, and the counter must end right after them. No block is freed",
        "count from the state after the step, not before it: the table holds c + 1 + k tokens; which positions "
        "hold verified K/V, and which hold K/V of rejected drafts?",
        "a stale slot is the slot of a position from the new count up to (not including) c + 1 + k; table.slot(p) "
        "gives it, as long as table.num_tokens still covers p, so read the slots before you move the count",
    ],
    "8.2": [
        "drop first, then split: a beam with no child releases its table; a beam's first child carries on in its "
        "table, every later child forks it; then each new beam appends its token, copy-on-write included",
        "append_tokens(1) returns the slot, and take_pending_copies() the (src, dst) blocks copy-on-write asked for; "
        "a copy moves all block_size slots of src to dst",
        "order matters: release before you fork (the pool is tight), and copy every pending block before you write "
        "a token into its slot; never release a table a new beam still uses",
    ],
}

_EMPTY = "·"


# ---------------------------------------------------------------------------
# Task 8.1: the rollback arithmetic
# ---------------------------------------------------------------------------


def _pool_state(allocator, table) -> list:
    return [list(allocator.refcounts), list(allocator.free_block_ids), list(table.blocks)]


def _rollback_label(case) -> str:
    if "bad" in case:
        return "rollback(..., num_draft_tokens=3, num_accepted_tokens=4)"
    c, k, j = case["computed"], case["drafts"], case["accepted"]
    return (f"rollback(table of {c + 1 + k} tokens, num_computed_tokens={c}, num_draft_tokens={k}, "
            f"num_accepted_tokens={j}) with a {case['prompt_len']}-token prompt, block_size={case['block_size']}")


@check("ch08.rollback", hint=HINTS["8.1"][0], label=_rollback_label,
       summary=lambda cases, seen: f"{sum('bad' not in c for c in cases)} verification steps: the counter ends after "
                                   "the accepted drafts, the rejected slots are reported, no block is freed")
def check_rollback(case, rollback):
    """``case`` = {"prompt_len", "computed", "drafts", "accepted", "block_size"}, or {"bad": true}."""
    if "bad" in case:  # more accepted than drafted: must raise ValueError and change nothing
        alloc = BlockAllocator(8, 4)
        table = BlockTable(alloc, "s")
        table.append_tokens(10)
        before = [_pool_state(alloc, table), table.num_tokens]
        result = outcome(rollback, table, 6, 3, 4)
        return {"outcome": result, "unchanged": [_pool_state(alloc, table), table.num_tokens] == before}
    c, k, j, B = case["computed"], case["drafts"], case["accepted"], case["block_size"]
    alloc = BlockAllocator(16, B)
    table = BlockTable(alloc, "s")
    alloc.allocate("other")  # another sequence holds blocks in between, so a slot is not its position
    table.append_tokens(c)  # the computed tokens (the prompt, and output tokens after it)
    alloc.allocate("other")
    table.append_tokens(1 + k)  # the verification step: the last sampled token and the k drafts
    before = _pool_state(alloc, table)
    got = rollback(table, c, k, j)
    return {"returned": list(got) if isinstance(got, tuple) else {"not a pair": repr(got)[:200]},
            "before": before, "after": _pool_state(alloc, table), "num_tokens": table.num_tokens}


@check_rollback.judge
def _judge_rollback(case, got, want):
    if "bad" in case:
        expect_raised(got["outcome"], "ValueError", "")
        if not got["unchanged"]:
            raise CheckFailed("raised but changed the table first")
        return
    returned = got["returned"]
    if type(returned) is not list or len(returned) != 2:
        raise CheckFailed(f"returned {returned}; return (new num_computed_tokens, list of stale slots)")
    new_computed, stale = returned
    if type(new_computed) is int and new_computed < case["prompt_len"]:
        raise CheckFailed(f"returned num_computed_tokens={new_computed}: that rolls back past the prompt's "
                          f"{case['prompt_len']} tokens, whose K/V the step did not touch. The count before the "
                          "step was c; the step computed 1 + k more")
    expect_equal(new_computed, want["returned"][0], "the new num_computed_tokens:")
    before, after = got["before"], got["after"]
    if after != before:
        gone = [b for b in before[2] if b not in after[2] or after[0][b] == 0]
        raise CheckFailed(f"changed the block table or the pool (blocks {before[2]} -> {after[2]}, given back: "
                          f"{gone}): the next step writes its sampled token and new drafts into those slots, so a "
                          "rollback frees nothing")
    expect_equal(got["num_tokens"], want["num_tokens"], "then the table's num_tokens:")
    expect_equal(stale, want["returned"][1], "the stale slots (the rejected drafts', in position order):")


# ---------------------------------------------------------------------------
# Task 8.2: one beam step on fork and copy-on-write
# ---------------------------------------------------------------------------


def _reads(table, data) -> list:
    return [data[table.slot(p)] for p in range(table.num_tokens)]


@check("ch08.beam_step", hint=HINTS["8.2"][0], label=lambda c: f"a {c['prompt_len']}-token prompt in blocks of "
       f"{c['block_size']}, then beam steps with parents {c['steps']}",
       summary=lambda cases, seen: f"{sum(len(c['steps']) for c in cases)} beam steps: dropped beams freed, splits "
                                   "forked, shared half-full blocks copied before the write")
def check_beam_step(case, beam_step):
    """``case`` = {"num_blocks", "block_size", "prompt_len", "first_value", "steps": [parents, ...]}."""
    B, num_blocks = case["block_size"], case["num_blocks"]
    alloc, data, events = BlockAllocator(num_blocks, B), ["·"] * (num_blocks * B), Counter()
    alloc.subscribe(lambda e: events.update([e.kind]))
    beams = [BlockTable(alloc, "b0")]
    for p, slot in enumerate(beams[0].append_tokens(case["prompt_len"]).tolist()):
        data[slot] = f"p{p}"
    value, steps = case["first_value"], []
    for parents in case["steps"]:
        tokens = list(range(value, value + len(parents)))
        value += len(parents)
        events.clear()
        got = beam_step(list(beams), list(parents), list(tokens), data)
        if not isinstance(got, list) or len(got) != len(parents):
            steps.append({"returned": repr(got)[:200]})
            break
        steps.append({"beams": [{"num_tokens": g.num_tokens, "reads": _reads(g, data), "blocks": list(g.blocks)}
                                for g in got],
                      "refcounts": list(alloc.refcounts), "events": {k: events[k] for k in ("fork", "cow", "free")}})
        beams = got
    return steps


@check_beam_step.judge
def _judge_beam(case, got, want):
    for index, (step, right, parents) in enumerate(zip(got, want, case["steps"]), 1):
        what = f"step {index}, parents {parents}"
        if "returned" in step:
            raise CheckFailed(f"{what}: beam_step returned {step['returned']}; return the new beams' tables, one per "
                              "parent")
        for i, (g, r) in enumerate(zip(step["beams"], right["beams"])):
            if g["num_tokens"] != r["num_tokens"]:
                raise CheckFailed(f"{what}: new beam {i} holds {g['num_tokens']} tokens, expected {r['num_tokens']}: "
                                  "was the table it carries on in released (a later step still needs its blocks)?")
            if g["reads"] != r["reads"]:
                bad = next((p for p, (a, b) in enumerate(zip(g["reads"], r["reads"])) if a != b), 0)
                raise CheckFailed(f"{what}: new beam {i} reads {g['reads'][bad]!r} at position {bad}, expected "
                                  f"{r['reads'][bad]!r}: a block that copy-on-write gave it must get the old block's "
                                  "K/V (every pending copy) before the new token is written")
        expect_equal(step["refcounts"], right["refcounts"],
                     f"the refcounts after {what} (a dropped beam's blocks go back; shared ones keep a holder):")
        expect_equal([g["blocks"] for g in step["beams"]], [r["blocks"] for r in right["beams"]],
                     f"the new beams' blocks after {what}:")
        for kind in ("fork", "cow", "free"):
            expect_equal(step["events"][kind], right["events"][kind], f"the number of {kind!r} events in {what}:")
    if len(got) != len(want):
        raise CheckFailed(f"the script ran {len(got)} beam steps, expected {len(want)}")
