"""Checks for chapter 08: speculative decoding's draft bookkeeping and rollback in the real engine, and one beam step.

Task 8.1's probe runs :class:`~minipaged.engine.Engine` on the course's check model with ngram
speculation through a speculator class: the learner's :class:`~minipaged.speculative.NgramSpeculator`,
whose ``schedule_drafts`` and ``rollback`` (``rollback_drafts``) are holes in their copy of the
package (:mod:`minipaged.pieces`), or any subclass of it; with prefix caching on
(:class:`~minipaged.prefix_cache.PrefixCachingAllocator`) or off, on a seeded workload of
repetitive prompts, so that drafts are accepted, rejected, spill into new blocks and fill blocks.
After every step it records, per running request, what the chapter's bookkeeping says: the drafts
scheduled, ``num_computed_tokens``, the table's ``num_tokens`` and length, and each block's
prefix-cache key. The reference (``minipaged.checks.instructor.ch08``) is
the package's own speculator; its tokens equal plain decoding's, token for token (the tests check
it). The judge names the first step and request where the learner's run differs, and the hint for
that mistake: a rollback by one too few (the sampled token the step computed forgotten) or too many,
past the prompt, that frees the rejected drafts' blocks or leaves them counted in the table; drafts
that break the budget, ``max_tokens`` or pool rules; a key given to a block that unverified drafts
fill.

Task 8.2's probe runs the learner's beam step on real block tables over chapter 02's
:class:`~minipaged.blocks.BlockAllocator`, and the judge compares refcounts, events and what
every beam reads: a step that frees a table a new beam carries on in, or writes before it copies,
shows up as a wrong value.
"""

from __future__ import annotations

from collections import Counter

from minipaged.blocks import BlockAllocator, BlockTable
from minipaged.checks import CheckFailed, check, expect_equal
from minipaged.checks.engine_run import first_token_divergence, run_engine
from minipaged.prefix_cache import PrefixCachingAllocator

# The package modules this exercise rebuilds in a notebook cell, which the grader flags a learner's cell for
# importing, subclassing or calling (a flag for the instructor, not a verdict): none. Task 8.1's pieces are holes
# in the learner's own minipaged/speculative.py, which the exercise's cells import and check.
REBUILDS = ()

# Staged hints: the first names the idea (stubs carry it), later ones come closer to code on request,
# `hint("8.1", 2)`. None of them is the solution.
HINTS = {
    "8.1": [
        "drafts are tokens with slots but no verified K/V: reserve their slots out of what is left (budget, "
        "max_tokens, free blocks) without keying them, and after verification move the counters back to the end "
        "of the accepted prefix, freeing nothing",
        "a draft is for a plain decode only (one new token, nothing else uncomputed); the draft count is capped by "
        "the budget left and by max_tokens - num_output_tokens - 1, then shortened one draft at a time until the "
        "blocks it needs are free",
        "count from the state after the step: the table holds c + 1 + k tokens, and the verified ones are the c "
        "computed before it, the sampled token the step computed, and the j accepted drafts",
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

# The hint a FAIL prints for each diagnosis of Task 8.1 (none is the solution).
SPEC_HINTS = {
    "draft_where": "only a plain decode drafts: a sequence with exactly one new token this step and nothing else "
                   "uncomputed, and only while budget and max_tokens leave room for at least one draft",
    "draft_count": "the most drafts is min(k, budget left, max_tokens - num_output_tokens - 1); then drop the last "
                   "draft while the table's num_new_blocks(drafts) are not free (a draft never preempts)",
    "draft_tokens": "the drafts are the proposer's: self.proposer.propose(seq.token_ids, limit); take them as it "
                    "returns them and change nothing in the sequence's token ids",
    "budget": "drafts come out of the step's token budget: never more drafts than the budget left, and "
              "schedule_drafts returns what is left after them (the engine admits waiting requests with it)",
    "keys": "a prefix-cache key promises that the block's K/V is the K/V of its tokens; draft K/V is not verified "
            "and is overwritten next step, so schedule_drafts must never key a block (the scheduler keyed the "
            "verified tokens' blocks before drafts)",
    "past_prompt": "rollback counts from the state after the step (c + 1 + k tokens in the table), not from c: the "
                   "prompt's K/V and the tokens before the step are verified, and never rolled back",
    "bonus": "the verification step computed the last sampled token too: its K/V is verified, so the counter "
             "ends one past the j accepted drafts (the token sampled now is the next step's first)",
    "one_too_many": "the token sampled after the accepted drafts has no K/V yet: the next step computes it, so "
                    "num_computed_tokens must stop right before it",
    "table": "the table's num_tokens must move back with the counter: the next step appends its token right "
             "after the verified ones, into the first rejected slot",
    "freed": "rollback frees nothing: the next step writes its sampled token and new drafts into the rejected "
             "slots, so every block stays in the table",
    "tokens": "the drafts' K/V must land in the drafts' own slots, after the verified tokens': append them to the "
              "table first, and add the slots append_tokens returns to the step's slot mapping, in order",
    "bad_call": "check j (0 <= j <= k) and the table's num_tokens (c + 1 + k) first, and raise ValueError before "
                "anything changes: a wrong count here means the engine's books are already wrong",
    "running": "a rollback that leaves num_computed_tokens or the table wrong makes the engine lose or stall a "
               "request; compare your counters after each verification with c + 1 + j",
}

_FIELDS = ("computed", "table", "blocks", "keys")  # per running request, compared in this order


# ---------------------------------------------------------------------------
# Task 8.1: a speculator's draft bookkeeping and rollback, in the engine
# ---------------------------------------------------------------------------


def _key(allocator, block_id: int):
    key = allocator.block_key(block_id) if isinstance(allocator, PrefixCachingAllocator) else None
    return None if key is None else key.hex()[:12]


def _observe(engine, out) -> dict:
    """One step's record for :func:`run_engine`: what was scheduled and drafted, then each running request's state."""
    allocator = engine.scheduler.allocator
    seqs = {str(s.seq_id): {"computed": s.num_computed_tokens, "table": s.block_table.num_tokens,
                            "blocks": len(s.block_table.blocks),
                            "keys": [_key(allocator, b) for b in s.block_table.blocks]}
            for s in engine.scheduler.running}  # fmt: skip
    return {"step": out.step, "drafts": {str(i): list(d) for i, d in out.drafts.items()},
            "accepted": {str(i): len(a) for i, a in out.accepted.items()},
            "sampled": {str(i): t for i, t in out.sampled.items()},
            "scheduled": {str(i): n for i, n in out.scheduled.items()}, "seqs": seqs}  # fmt: skip


def _speculator_label(case) -> str:
    spec, config = case["speculative_config"], case["config"]
    return (f"{len(case['requests'])} requests of repetitive prompts, k = {spec['num_speculative_tokens']} ngram "
            f"drafts, {config['num_blocks']} blocks of {config['block_size']}, prefix caching "
            f"{'on' if case['prefix_caching'] else 'off'}")


@check("ch08.speculator", hint=HINTS["8.1"][0], label=_speculator_label,
       summary=lambda cases, seen: f"{len(cases)} engine runs ({sum(len(s['steps']) for s in seen)} steps, "
                                   f"{sum(len(d) for s in seen for st in s['steps'] for d in st['drafts'].values())} "
                                   "drafts): tokens equal plain decoding, bookkeeping equal the package's step by step")
def check_speculator(case, speculator_class):
    """``case`` = {"config", "requests" (as :func:`run_engine` takes them), "speculative_config", "prefix_caching"}.

    Runs the engine with ``speculator=speculator_class(speculative_config)`` and records every step;
    the tokens are None when the run was cut off unfinished.
    """
    allocator = PrefixCachingAllocator if case["prefix_caching"] else BlockAllocator
    speculator = speculator_class(dict(case["speculative_config"]))
    run = run_engine({"config": case["config"], "requests": case["requests"]}, observe=_observe,
                     allocator=allocator, speculator=speculator)
    bad = [_bad_rollback(speculator, *call) for call in BAD_ROLLBACKS]
    return {"tokens": run["tokens"] if run["finished"] else None, "steps": run["steps"], "bad_rollbacks": bad}


# rollback(table, c, k, j) on a table of `held` tokens: each is a ValueError, raised before anything changes
BAD_ROLLBACKS = [(5, 3, 4, 9), (5, 3, -1, 9), (5, 3, 1, 11), (5, 3, 1, 8)]
BAD_WHY = {(5, 3, 4, 9): "j = 4 accepted drafts of k = 3", (5, 3, -1, 9): "j = -1",
           (5, 3, 1, 11): "a table of 11 tokens where c + 1 + k = 9", (5, 3, 1, 8): "a table of 8 tokens where "
           "c + 1 + k = 9"}  # fmt: skip


def _bad_rollback(speculator, c: int, k: int, j: int, held: int) -> dict:
    """What ``speculator.rollback`` does with one bad call: the exception's name, and whether the table changed."""
    table = BlockTable(BlockAllocator(4, 4), "bad")
    table.append_tokens(held)
    before = (table.num_tokens, list(table.blocks))
    try:
        speculator.rollback(table, c, k, j)
        raised = None
    except NotImplementedError:
        raise
    except Exception as exc:  # the judge wants a ValueError: anything else is named in the FAIL
        raised = type(exc).__name__
    return {"raised": raised, "changed": (table.num_tokens, list(table.blocks)) != before}


def _diagnose_drafts(where: str, got: list, want: list, scheduled: int) -> CheckFailed:
    if want and got and len(got) == len(want):
        return CheckFailed(f"{where}: drafted {got}, the proposer's drafts are {want}", hint=SPEC_HINTS["draft_tokens"])
    if not want and got:
        why = "a prefill chunk" if scheduled - len(got) != 1 else "a decode with no room left for a draft"
        return CheckFailed(f"{where}: drafted {got}, expected no drafts ({why})", hint=SPEC_HINTS["draft_where"])
    return CheckFailed(f"{where}: drafted {got or 'nothing'}, expected {want or 'nothing'}",
                       hint=SPEC_HINTS["draft_count" if got or want else "draft_where"])


def _diagnose_seq(where: str, field: str, got: dict, want: dict, prompt_len: int, accepted: int | None) -> CheckFailed:
    g, w = got[field], want[field]
    if field == "computed":
        before = None if accepted is None else w - 1 - accepted  # c: what the step started from
        if g == w - 1:
            return CheckFailed(f"{where}: num_computed_tokens is {g}, expected {w} (one too few: the sampled token "
                               "the step computed is not counted)", hint=SPEC_HINTS["bonus"])  # fmt: skip
        if g == w + 1:
            return CheckFailed(f"{where}: num_computed_tokens is {g}, expected {w} (one too many: the token sampled "
                               "now has no K/V yet)", hint=SPEC_HINTS["one_too_many"])  # fmt: skip
        if g < prompt_len <= w or (before is not None and g <= before):
            past = (f"the prompt's {prompt_len} tokens" if g < prompt_len else
                    f"the tokens this step verified (it started from {before} computed tokens)")
            return CheckFailed(f"{where}: num_computed_tokens is {g}, expected {w}: that rolls back past {past}",
                               hint=SPEC_HINTS["past_prompt"])
        return CheckFailed(f"{where}: num_computed_tokens is {g}, expected {w} (the verified tokens end at c + 1 + j)",
                           hint=SPEC_HINTS["bonus" if g < w else "one_too_many"])
    if field == "table":
        return CheckFailed(f"{where}: the table holds {g} tokens, expected {w} (num_computed_tokens is right): the "
                           "rejected drafts are still counted in it", hint=SPEC_HINTS["table"])  # fmt: skip
    if field == "blocks":
        return CheckFailed(f"{where}: the table has {g} blocks, expected {w}: "
                           + ("a block the rejected drafts spilled into was given back" if g < w else
                              "it took blocks it does not need"), hint=SPEC_HINTS["freed"])  # fmt: skip
    bad = next(i for i, (a, b) in enumerate(zip(g, w)) if a != b)
    if g[bad] is not None and w[bad] is None:
        return CheckFailed(f"{where}: block {bad} of its table has a prefix-cache key, expected none yet: its slots "
                           "hold draft tokens that are not verified", hint=SPEC_HINTS["keys"])  # fmt: skip
    return CheckFailed(f"{where}: block {bad} of its table has key {g[bad]}, expected {w[bad]}",
                       hint=SPEC_HINTS["keys"])


def _compare_step(got: dict, want: dict, prompts: dict, budget: int) -> None:
    step = want["step"]
    total = sum(got["scheduled"].values())
    if total > budget:
        rid = next((r for r in sorted(got["drafts"]) if got["drafts"][r] != want["drafts"].get(r)), None)
        why = (f"request {rid}'s drafts {got['drafts'][rid]} do not fit what is left" if rid else
               "the budget schedule_drafts returned did not count its drafts, and admission used them again")
        raise CheckFailed(f"step {step}: the step computes {total} tokens, more than the budget "
                          f"(max_num_batched_tokens = {budget}): {why}", hint=SPEC_HINTS["budget"])  # fmt: skip
    for rid in sorted(set(got["drafts"]) | set(want["drafts"])):
        g, w = got["drafts"].get(rid, []), want["drafts"].get(rid, [])
        if g != w:
            raise _diagnose_drafts(f"step {step}, request {rid}", g, w, got["scheduled"].get(rid, 0))
    if got["scheduled"] != want["scheduled"]:
        rid = next(r for r in sorted(set(got["scheduled"]) | set(want["scheduled"]))
                   if got["scheduled"].get(r) != want["scheduled"].get(r))
        raise CheckFailed(f"step {step}, request {rid}: scheduled {got['scheduled'].get(rid, 0)} tokens, expected "
                          f"{want['scheduled'].get(rid, 0)} (the budget left after the drafts differs)",
                          hint=SPEC_HINTS["budget"])  # fmt: skip
    for rid in sorted(want["sampled"]):
        g = (got["accepted"].get(rid, 0), got["sampled"].get(rid))
        w = (want["accepted"].get(rid, 0), want["sampled"][rid])
        if g != w:
            raise CheckFailed(f"step {step}, request {rid}: verification kept {g[0]} drafts and then token {g[1]}, "
                              f"where plain decoding's tokens keep {w[0]} and then {w[1]}: the forward pass read K/V "
                              "that is not the verified tokens'", hint=SPEC_HINTS["tokens"])  # fmt: skip
    for rid, w in want["seqs"].items():
        where = f"after step {step}, request {rid}"
        g = got["seqs"].get(rid)
        if g is None:
            raise CheckFailed(f"{where} is no longer running; it should be", hint=SPEC_HINTS["running"])
        for field in _FIELDS:
            if g[field] != w[field]:
                raise _diagnose_seq(where, field, g, w, prompts[rid], want["accepted"].get(rid))
    extra = sorted(set(got["seqs"]) - set(want["seqs"]))
    if extra:
        raise CheckFailed(f"after step {step}, request {extra[0]} is still running; it should have finished",
                          hint=SPEC_HINTS["running"])


@check_speculator.judge
def _judge_speculator(case, got, want):
    prompts = {str(r["id"]): len(r["prompt"]) for r in case["requests"]}
    for g, w in zip(got["steps"], want["steps"]):
        _compare_step(g, w, prompts, case["config"]["max_num_batched_tokens"])
    if got["tokens"] is None:
        raise CheckFailed(f"the engine was stopped after {len(got['steps'])} steps with a request unfinished (the "
                          f"package's run takes {len(want['steps'])})", hint=SPEC_HINTS["running"])  # fmt: skip
    if len(got["steps"]) != len(want["steps"]):
        raise CheckFailed(f"the engine ran {len(got['steps'])} steps, expected {len(want['steps'])}",
                          hint=SPEC_HINTS["running"])
    try:
        first_token_divergence(got["tokens"], want["tokens"])
    except CheckFailed as exc:
        raise CheckFailed(f"{exc} (the package's speculative run gives plain decoding's tokens)",
                          hint=SPEC_HINTS["tokens"]) from None
    for (c, k, j, held), seen in zip(BAD_ROLLBACKS, got["bad_rollbacks"]):
        call = f"rollback(a table of {held} tokens, num_computed_tokens={c}, num_draft_tokens={k}, " \
               f"num_accepted_tokens={j})"
        if seen["raised"] != "ValueError":
            did = "returned" if seen["raised"] is None else f"raised {seen['raised']}"
            raise CheckFailed(f"{call} {did}; {BAD_WHY[c, k, j, held]} is a ValueError",
                              hint=SPEC_HINTS["bad_call"])
        if seen["changed"]:
            raise CheckFailed(f"{call} raised ValueError but changed the table first", hint=SPEC_HINTS["bad_call"])


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
