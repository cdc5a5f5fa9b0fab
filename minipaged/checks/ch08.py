"""Checks for chapter 08: the rollback arithmetic of speculative decoding, and one step of beam search.

Each check runs the learner's code and a small reference (private to this module) on real block
tables over chapter 02's :class:`~minipaged.block_manager.BlockAllocator`, and compares them. The
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
from functools import partial

from minipaged.block_manager import BlockAllocator, BlockTable
from minipaged.checks import CheckFailed, check, expect_equal, expect_raises

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


def _ref_rollback(table, num_computed_tokens, num_draft_tokens, num_accepted_tokens):
    c, k, j = num_computed_tokens, num_draft_tokens, num_accepted_tokens
    if not 0 <= j <= k:
        raise ValueError(f"num_accepted_tokens must be in 0..{k}, got {j}")
    if table.num_tokens != c + 1 + k:
        raise ValueError(f"the table holds {table.num_tokens} tokens, expected c + 1 + k = {c + 1 + k}")
    stale = [table.slot(p) for p in range(c + 1 + j, c + 1 + k)]
    table.num_tokens = c + 1 + j
    return c + 1 + j, stale


def _pool_state(allocator, table) -> tuple:
    return list(allocator.refcounts), list(allocator.free_block_ids), list(table.blocks)


# (prompt_len, computed before the step, drafts k, accepted j, block_size): each case is one verification step.
_ROLLBACK_CASES = [
    (6, 6, 4, 0, 4),  # right after the prompt, every draft rejected: the prompt's K/V must stay computed
    (6, 6, 4, 2, 4),
    (6, 9, 4, 4, 4),  # everything accepted: nothing is stale
    (5, 7, 3, 1, 4),  # the drafts spilled into a third block, which the next step writes into
    (3, 3, 5, 0, 2),  # small blocks: the rejected drafts fill two whole blocks
    (8, 11, 4, 3, 8),
]


@check("ch08.rollback", hint=HINTS["8.1"][0])
def check_rollback(rollback):
    for prompt_len, c, k, j, B in _ROLLBACK_CASES:
        mine_alloc, ref_alloc = BlockAllocator(16, B), BlockAllocator(16, B)
        mine, ref = BlockTable(mine_alloc, "s"), BlockTable(ref_alloc, "s")
        for table in (mine, ref):  # another sequence holds blocks in between, so a slot is not its position
            table.allocator.allocate("other")
            table.append_tokens(c)  # the computed tokens (the prompt, and output tokens after it)
            table.allocator.allocate("other")
            table.append_tokens(1 + k)  # the verification step: the last sampled token and the k drafts
        what = f"rollback(table of {c + 1 + k} tokens, num_computed_tokens={c}, num_draft_tokens={k}, " \
               f"num_accepted_tokens={j}) with a {prompt_len}-token prompt, block_size={B}"
        before = _pool_state(mine_alloc, mine)
        got = rollback(mine, c, k, j)
        want = _ref_rollback(ref, c, k, j)
        if not isinstance(got, tuple) or len(got) != 2:
            raise CheckFailed(f"{what} returned {got!r}; return (new num_computed_tokens, list of stale slots)")
        new_computed, stale = got
        if isinstance(new_computed, int) and new_computed < prompt_len:
            raise CheckFailed(f"{what} returned num_computed_tokens={new_computed}: that rolls back past the "
                              f"prompt's {prompt_len} tokens, whose K/V the step did not touch. The count before "
                              "the step was c; the step computed 1 + k more")
        expect_equal(new_computed, want[0], f"{what}: the new num_computed_tokens")
        if _pool_state(mine_alloc, mine)[2] != before[2] or _pool_state(mine_alloc, mine)[:2] != before[:2]:
            gone = [b for b in before[2] if b not in mine.blocks or mine_alloc.refcount(b) == 0]
            raise CheckFailed(f"{what} changed the block table or the pool (blocks {before[2]} -> {mine.blocks}, "
                              f"given back: {gone}): the next step writes its sampled token and new drafts into "
                              "those slots, so a rollback frees nothing")
        expect_equal(mine.num_tokens, ref.num_tokens, f"the table's num_tokens after {what}")
        expect_equal(list(stale), want[1], f"{what}: the stale slots (the rejected drafts', in position order)")
    # A bad request changes nothing: more accepted than drafted.
    alloc = BlockAllocator(8, 4)
    table = BlockTable(alloc, "s")
    table.append_tokens(10)
    before = (_pool_state(alloc, table), table.num_tokens)
    expect_raises(ValueError, partial(rollback, table, 6, 3, 4), "rollback(..., num_draft_tokens=3, "
                  "num_accepted_tokens=4)")
    if (_pool_state(alloc, table), table.num_tokens) != before:
        raise CheckFailed("rollback with num_accepted_tokens > num_draft_tokens raised but changed the table first")
    return (f"{len(_ROLLBACK_CASES)} verification steps: the counter ends after the accepted drafts, the rejected "
            "slots are reported, no block is freed")


# ---------------------------------------------------------------------------
# Task 8.2: one beam step on fork and copy-on-write
# ---------------------------------------------------------------------------


def _ref_beam_step(tables, parents, tokens, data):
    B = tables[0].block_size
    for i, table in enumerate(tables):
        if i not in parents:
            table.release()
    new, taken = [], set()
    for p in parents:
        if p in taken:
            new.append(tables[p].fork(seq_id=f"{tables[p].seq_id}+"))
        else:
            taken.add(p)
            new.append(tables[p])
    for table, token in zip(new, tokens):
        slot = int(table.append_tokens(1)[0])
        for src, dst in table.take_pending_copies():
            data[dst * B : (dst + 1) * B] = data[src * B : (src + 1) * B]
        data[slot] = token
    return new


def _reads(table, data) -> list:
    return [data[table.slot(p)] for p in range(table.num_tokens)]


# A 6-token prompt in blocks of 4 (its second block half full), then four beam steps, each a list of parents.
_BEAM_STEPS = [
    [0, 0, 0],  # the prompt splits in three: two forks, and copies of the shared half-full block
    [0, 0, 2],  # beam 1 is dropped, beam 0 splits again
    [2, 2, 1],  # beam 0 is dropped; the beams now write at a block boundary: new blocks, no copy
    [0, 1, 1],  # beam 2 is dropped; beam 1 splits mid-block: its first child copies the block the second shares
]


@check("ch08.beam_step", hint=HINTS["8.2"][0])
def check_beam_step(beam_step):
    B, num_blocks = 4, 9  # small, so that the free queue's order (which dropped blocks come back first) shows
    mine_alloc, ref_alloc = BlockAllocator(num_blocks, B), BlockAllocator(num_blocks, B)
    mine_data, ref_data = [_EMPTY] * (num_blocks * B), [_EMPTY] * (num_blocks * B)
    events = {"mine": Counter(), "ref": Counter()}
    mine_alloc.subscribe(lambda e: events["mine"].update([e.kind]))
    ref_alloc.subscribe(lambda e: events["ref"].update([e.kind]))
    mine, ref = [BlockTable(mine_alloc, "b0")], [BlockTable(ref_alloc, "b0")]
    for table, data in ((mine[0], mine_data), (ref[0], ref_data)):
        for p, slot in enumerate(table.append_tokens(6).tolist()):
            data[slot] = f"p{p}"
    counter = iter(range(100, 1000))
    for step, parents in enumerate(_BEAM_STEPS, 1):
        tokens = [next(counter) for _ in parents]
        what = f"step {step}, parents {parents}"
        events["mine"].clear()
        events["ref"].clear()
        ref = _ref_beam_step(ref, parents, tokens, ref_data)
        got = beam_step(list(mine), list(parents), list(tokens), mine_data)
        if not isinstance(got, list) or len(got) != len(parents):
            raise CheckFailed(f"{what}: beam_step returned {got!r}; return the new beams' tables, one per parent")
        for i, (g, r) in enumerate(zip(got, ref)):
            if g.num_tokens != r.num_tokens:
                raise CheckFailed(f"{what}: new beam {i} holds {g.num_tokens} tokens, expected {r.num_tokens}: was "
                                  "the table it carries on in released (a later step still needs its blocks)?")
            reads, want = _reads(g, mine_data), _reads(r, ref_data)
            if reads != want:
                bad = next(p for p, (a, b) in enumerate(zip(reads, want)) if a != b)
                raise CheckFailed(f"{what}: new beam {i} reads {reads[bad]!r} at position {bad}, expected "
                                  f"{want[bad]!r}: a block that copy-on-write gave it must get the old block's K/V "
                                  "(every pending copy) before the new token is written")
        expect_equal(list(mine_alloc.refcounts), ref_alloc.refcounts,
                     f"the refcounts after {what} (a dropped beam's blocks go back; shared ones keep a holder)")
        expect_equal([list(g.blocks) for g in got], [r.blocks for r in ref], f"the new beams' blocks after {what}")
        for kind in ("fork", "cow", "free"):
            expect_equal(events["mine"][kind], events["ref"][kind], f"the number of {kind!r} events in {what}")
        mine = got
    return (f"{len(_BEAM_STEPS)} beam steps: dropped beams freed, splits forked, shared half-full blocks copied "
            "before the write")
