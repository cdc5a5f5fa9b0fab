"""The chapter 08 exercise checks pass the reference answers and catch the classic mistakes.

Task 8.1's check runs the engine on a learner's speculator. Each wrong speculator below is one
mistake, and the check must FAIL on it with a message that names the first step and request where it
went wrong, and with the hint for that mistake: a rollback by one too few (the bonus token forgotten)
or one too many, past the prompt, freeing the rejected drafts' blocks, leaving them counted in the
table; drafts keyed, put before the sampled token's slot, drafted past max_tokens, for a prefill or
past the budget. Task 8.2's wrong beam steps free what a later step needs or write before they copy.
"""

import pytest
import torch

from minipaged.checks import FAIL, PASS, TODO, ch08, reference_transcript
from minipaged.checks.instructor import ch08 as instructor
from minipaged.checks.instructor.ch08 import beam_step as beam_step_reference
from minipaged.speculative import NgramSpeculator

pytestmark = pytest.mark.ch08


# -- Task 8.1 ----------------------------------------------------------------------


class MySpeculator(NgramSpeculator):
    """A learner's model solution: the drafts' slots reserved without keys, and the rollback."""

    def schedule_drafts(self, scheduler, out, budget):
        for i, seq in enumerate(out.seqs):
            if budget == 0 or out.num_new_tokens[i] != 1 or seq.num_uncomputed_tokens != 1 or seq.pending_forks:
                continue
            drafts = self.drafts(seq, budget)
            while drafts and not scheduler.allocator.can_allocate(seq.block_table.num_new_blocks(len(drafts))):
                drafts.pop()
            if drafts:
                self.reserve(out, i, seq, drafts)
                budget -= len(drafts)
        return budget

    def drafts(self, seq, budget):
        room = seq.sampling_params.max_tokens - seq.num_output_tokens - 1
        return self.proposer.propose(seq.token_ids, min(budget, room)) if room > 0 else []

    def reserve(self, out, i, seq, drafts):
        out.spec_token_ids[seq.seq_id] = drafts
        out.num_new_tokens[i] += len(drafts)
        out.slot_mappings[i] = torch.cat([out.slot_mappings[i], seq.block_table.append_tokens(len(drafts))])

    def rollback(self, table, num_computed_tokens, num_draft_tokens, num_accepted_tokens):
        if not 0 <= num_accepted_tokens <= num_draft_tokens:
            raise ValueError(f"num_accepted_tokens must be in 0..{num_draft_tokens}, got {num_accepted_tokens}")
        if table.num_tokens != num_computed_tokens + 1 + num_draft_tokens:
            raise ValueError(f"the table holds {table.num_tokens} tokens, not c + 1 + k")
        table.num_tokens = num_computed_tokens + 1 + num_accepted_tokens
        return table.num_tokens


class ForgetsTheBonusToken(MySpeculator):
    def rollback(self, table, c, k, j):
        table.num_tokens = c + j  # "the accepted drafts", without the sampled token the step computed
        return c + j


class CountsTheNewToken(MySpeculator):
    def rollback(self, table, c, k, j):
        table.num_tokens = c + 2 + j  # the token sampled now counted as computed: its K/V is not there
        return c + 2 + j


class RollsBackPastThePrompt(MySpeculator):
    def rollback(self, table, c, k, j):
        table.num_tokens = c - (k - j)  # "minus the rejected drafts", from the count before the step
        return c - (k - j)


class FreesTheRejectedBlocks(MySpeculator):
    def rollback(self, table, c, k, j):
        new = super().rollback(table, c, k, j)
        while len(table.blocks) * table.block_size - table.block_size >= table.num_tokens:
            table.allocator.free(table.blocks.pop(), table.seq_id)  # a block of rejected drafts only goes back
        return new


class LeavesTheTableLong(MySpeculator):
    def rollback(self, table, c, k, j):
        return c + 1 + j  # the counter moves, the table still counts the rejected drafts


class KeysTheDrafts(MySpeculator):
    def reserve(self, out, i, seq, drafts):
        super().reserve(out, i, seq, drafts)
        if hasattr(seq.block_table.allocator, "cache_full_blocks"):  # "the blocks the drafts fill are full now"
            seq.block_table.allocator.cache_full_blocks(seq.block_table, seq.token_ids + drafts,
                                                        seq.block_table.num_tokens, seq.cache_salt)


class PutsTheDraftSlotsFirst(MySpeculator):
    def reserve(self, out, i, seq, drafts):
        slots = seq.block_table.append_tokens(len(drafts))
        out.spec_token_ids[seq.seq_id] = drafts
        out.num_new_tokens[i] += len(drafts)
        out.slot_mappings[i] = torch.cat([slots, out.slot_mappings[i]])  # the sampled token's slot must come first


class DraftsPastMaxTokens(MySpeculator):
    def drafts(self, seq, budget):
        room = seq.sampling_params.max_tokens - seq.num_output_tokens  # forgets the token sampled after them
        return self.proposer.propose(seq.token_ids, min(budget, room)) if room > 0 else []


class DraftsDuringPrefill(MySpeculator):
    def schedule_drafts(self, scheduler, out, budget):
        for i, seq in enumerate(out.seqs):
            drafts = self.drafts(seq, budget) if budget else []  # a prefill chunk's last token is no decode
            while drafts and not scheduler.allocator.can_allocate(seq.block_table.num_new_blocks(len(drafts))):
                drafts.pop()
            if drafts:
                self.reserve(out, i, seq, drafts)
                budget -= len(drafts)
        return budget

    def rollback(self, table, c, k, j):  # without the table check, so that the step's record shows the mistake
        table.num_tokens = c + 1 + j
        return table.num_tokens


class IgnoresTheBudget(MySpeculator):
    def schedule_drafts(self, scheduler, out, budget):
        super().schedule_drafts(scheduler, out, 10**6)  # drafts as if the step's token budget were endless
        return budget


class PreemptsForDrafts(MySpeculator):
    def schedule_drafts(self, scheduler, out, budget):
        for i, seq in enumerate(out.seqs):
            if budget == 0 or out.num_new_tokens[i] != 1 or seq.num_uncomputed_tokens != 1:
                continue
            drafts = self.drafts(seq, budget)  # no check of the free blocks: append_tokens may run out
            if drafts:
                self.reserve(out, i, seq, drafts)
                budget -= len(drafts)
        return budget


# -- rollback's bad calls: each is right in the engine and wrong on a call the engine never makes --


class ChecksNothing(MySpeculator):
    def rollback(self, table, c, k, j):
        table.num_tokens = c + 1 + j
        return table.num_tokens


class ChecksOnlyTheCounts(MySpeculator):  # j is checked, the table is not
    def rollback(self, table, c, k, j):
        if not 0 <= j <= k:
            raise ValueError(f"num_accepted_tokens must be in 0..{k}, got {j}")
        return ChecksNothing.rollback(self, table, c, k, j)


class ChecksOnlyTheUpperBound(MySpeculator):  # j > k is refused, j < 0 is not
    def rollback(self, table, c, k, j):
        if j > k or table.num_tokens != c + 1 + k:
            raise ValueError("bad rollback")
        return ChecksNothing.rollback(self, table, c, k, j)


class AssertsInstead(MySpeculator):  # assert: an AssertionError, and gone under python -O
    def rollback(self, table, c, k, j):
        assert 0 <= j <= k and table.num_tokens == c + 1 + k
        return ChecksNothing.rollback(self, table, c, k, j)


class ChangesThenChecks(MySpeculator):  # the table moves back before the check raises
    def rollback(self, table, c, k, j):
        held = table.num_tokens
        ChecksNothing.rollback(self, table, c, k, j)
        if not 0 <= j <= k or held != c + 1 + k:
            raise ValueError("bad rollback")
        return table.num_tokens


BAD_CALL_MISTAKES = {  # class -> a phrase of its FAIL message
    ChecksNothing: "num_accepted_tokens=4) returned; j = 4 accepted drafts of k = 3 is a ValueError",
    ChecksOnlyTheCounts: "rollback(a table of 11 tokens, num_computed_tokens=5, num_draft_tokens=3, "
                         "num_accepted_tokens=1) returned",
    ChecksOnlyTheUpperBound: "num_accepted_tokens=-1) returned; j = -1 is a ValueError",
    AssertsInstead: "raised AssertionError",
    ChangesThenChecks: "raised ValueError but changed the table first",
}


@pytest.mark.parametrize("wrong", list(BAD_CALL_MISTAKES), ids=lambda c: c.__name__)
def test_a_rollback_that_takes_a_bad_call_fails(wrong, reference):
    result = verdict(wrong, 0, reference)
    assert result.status == FAIL, result
    assert BAD_CALL_MISTAKES[wrong] in result.message, result.message
    assert result.hint == ch08.SPEC_HINTS["bad_call"]


class NotASpeculator:
    def __init__(self, config):
        raise NotImplementedError("Task 8.1 is not implemented yet.")


WRONG_SPECULATORS = {  # class -> (the public case it fails on, a phrase of its FAIL message, its SPEC_HINTS entry)
    ForgetsTheBonusToken: (0, "one too few", "bonus"),
    CountsTheNewToken: (0, "one too many", "one_too_many"),
    RollsBackPastThePrompt: (0, "rolls back past the", "past_prompt"),
    FreesTheRejectedBlocks: (0, "was given back", "freed"),
    LeavesTheTableLong: (0, "rejected drafts are still counted", "table"),
    KeysTheDrafts: (1, "not verified", "keys"),  # only with prefix caching on: case 1
    PutsTheDraftSlotsFirst: (0, "read K/V that is not the verified tokens'", "tokens"),
    DraftsPastMaxTokens: (0, "drafted", "draft_count"),
    DraftsDuringPrefill: (0, "prefill chunk", "draft_where"),
    IgnoresTheBudget: (0, "budget", "budget"),
}


@pytest.fixture(scope="module")
def reference():
    """The package speculator's transcript of each public case, run once for the whole module."""
    return [reference_transcript("ch08.speculator", [case]) for case in instructor.SPECULATOR_CASES]


def verdict(speculator, index, want):
    """The check's verdict on public case ``index`` alone (the reference run once, in ``want``)."""
    cases = [instructor.SPECULATOR_CASES[index]]
    return ch08.check_speculator.verdict(cases, ch08.check_speculator.transcript(cases, (speculator,)), want[index], 1)


def test_a_model_solution_passes_and_the_line_says_what_was_compared(capsys):
    result = ch08.check_speculator(MySpeculator)
    assert result.status == PASS, result
    assert "tokens equal plain decoding" in capsys.readouterr().out


def test_the_reference_gives_plain_decodings_tokens_and_the_cases_exercise_every_rule(reference):
    """The judge compares with plain decoding's output (the package's speculative run equals it), and the public
    cases hold drafts accepted in full, in part and not at all, and prefix-cache keys only where caching is on."""
    from minipaged.blocks import BlockAllocator
    from minipaged.checks.engine_run import run_engine
    from minipaged.prefix_cache import PrefixCachingAllocator

    seen = [want["observations"][0] for want in reference]
    for case, obs in zip(instructor.SPECULATOR_CASES, seen):
        run = {"config": case["config"], "requests": case["requests"]}
        plain = run_engine(run, allocator=PrefixCachingAllocator if case["prefix_caching"] else BlockAllocator)
        assert obs["tokens"] == plain["tokens"]
    verifications = [(len(d), step["accepted"][r]) for obs in seen for step in obs["steps"]
                     for r, d in step["drafts"].items()]
    assert any(j == 0 for _, j in verifications) and any(j == k for k, j in verifications)
    assert any(0 < j < k for k, j in verifications)
    keys = [[k for step in obs["steps"] for s in step["seqs"].values() for k in s["keys"] if k] for obs in seen]
    assert not keys[0] and keys[1]


@pytest.mark.parametrize("wrong", list(WRONG_SPECULATORS), ids=lambda c: c.__name__)
def test_a_wrong_speculator_fails_naming_the_step_and_the_mistake(wrong, reference):
    index, phrase, hint = WRONG_SPECULATORS[wrong]
    result = verdict(wrong, index, reference)
    assert result.status == FAIL, result
    assert "step " in result.message, result.message
    assert phrase in result.message, result.message
    assert result.hint == ch08.SPEC_HINTS[hint], (result.message, result.hint)


def test_the_fail_line_prints_the_hint_for_that_failure(capsys):
    result = ch08.check_speculator(FreesTheRejectedBlocks)
    assert f"hint: {ch08.SPEC_HINTS['freed']}" in capsys.readouterr().out and result.status == FAIL


def test_a_speculator_that_raises_fails_with_the_error(reference):
    result = verdict(PreemptsForDrafts, 0, reference)
    assert result.status == FAIL and "OutOfBlocks" in result.message and "called with" in result.message, result
    assert verdict(NotASpeculator, 0, reference).status == TODO


# -- Task 8.2 ----------------------------------------------------------------------


# A beam step is three moves: release the dropped beams, make the children (a parent's first child
# carries on in its table, the others fork it), then per child copy-on-write before its write.
# The known-wrong answers below leave out or reorder one move.


def release_dropped(tables, parents):
    for i, table in enumerate(tables):
        if i not in parents:
            table.release()


def children(tables, parents):
    new, taken = [], set()
    for p in parents:
        new.append(tables[p].fork() if p in taken else tables[p])
        taken.add(p)
    return new


def copy_blocks(table, data):
    B = table.block_size
    for src, dst in table.take_pending_copies():
        data[dst * B : (dst + 1) * B] = data[src * B : (src + 1) * B]


def append_and_write(new, tokens, data):
    for table, token in zip(new, tokens):
        slot = int(table.append_tokens(1)[0])
        copy_blocks(table, data)
        data[slot] = token


def beam_step(tables, parents, tokens, data):
    release_dropped(tables, parents)
    new = children(tables, parents)
    append_and_write(new, tokens, data)
    return new


def forgets_the_copy(tables, parents, tokens, data):
    release_dropped(tables, parents)
    new = children(tables, parents)
    for table, token in zip(new, tokens):
        data[int(table.append_tokens(1)[0])] = token
        table.take_pending_copies()  # taken, never carried out
    return new


def copies_after_writing(tables, parents, tokens, data):
    release_dropped(tables, parents)
    new = children(tables, parents)
    for table, token in zip(new, tokens):
        data[int(table.append_tokens(1)[0])] = token
    for table in new:
        copy_blocks(table, data)
    return new


def releases_the_parent_a_child_carries_on_in(tables, parents, tokens, data):
    new = children(tables, parents)
    for table in tables:  # every old beam is "done" now: but the first children still use these tables
        table.release()
    append_and_write(new, tokens, data)
    return new


def never_frees_dropped_beams(tables, parents, tokens, data):
    new = children(tables, parents)
    append_and_write(new, tokens, data)
    return new


def forks_every_child(tables, parents, tokens, data):  # the same memory, but a fork per child and a release
    new = [tables[p].fork() for p in parents]
    for table in tables:
        table.release()
    append_and_write(new, tokens, data)
    return new


def todo(*args):
    raise NotImplementedError("Task 8.2 is not implemented yet.")


@pytest.mark.parametrize(
    "check, answer, status",
    [
        (ch08.check_beam_step, beam_step, PASS),
        (ch08.check_beam_step, forgets_the_copy, FAIL),
        (ch08.check_beam_step, copies_after_writing, FAIL),
        (ch08.check_beam_step, releases_the_parent_a_child_carries_on_in, FAIL),
        (ch08.check_beam_step, never_frees_dropped_beams, FAIL),
        (ch08.check_beam_step, forks_every_child, FAIL),
        (ch08.check_beam_step, todo, TODO),
    ],
)
def test_check_status(check, answer, status, capsys):
    result = check(answer)
    assert result.status == status, result
    assert capsys.readouterr().out.count("\n") >= 1


def test_failures_name_the_mistake(capsys):
    assert "before the new token is written" in ch08.check_beam_step(forgets_the_copy).message
    assert "before the new token is written" in ch08.check_beam_step(copies_after_writing).message
    assert "released" in ch08.check_beam_step(releases_the_parent_a_child_carries_on_in).message
    assert "refcounts" in ch08.check_beam_step(never_frees_dropped_beams).message


def test_the_reference_beam_step_matches_beam_search_events():
    """The check's script, replayed with the chapter's module: the same forks and copies per step."""
    from minipaged.blocks import BlockAllocator, BlockTable

    alloc = BlockAllocator(9, 4)
    kinds = []
    alloc.subscribe(lambda e: kinds.append(e.kind))
    tables, data = [BlockTable(alloc, "b0")], ["·"] * 36
    tables[0].append_tokens(6)
    tables = beam_step_reference(tables, [0, 0, 0], [1, 2, 3], data)
    assert kinds.count("fork") == 2 and kinds.count("cow") == 2  # the third holder writes in place
    assert alloc.num_used == 4


def test_the_packages_own_speculator_is_the_model_answer_and_passes(capsys):
    """Task 8.1's pieces are holes in the learner's minipaged/speculative.py: the repository's is the model answer.

    A learner's copy of the package has stubs there (tests/test_pieces.py runs the check on them).
    """
    assert ch08.check_speculator(NgramSpeculator).status == "PASS"
