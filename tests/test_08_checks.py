"""The chapter 08 exercise checks pass the reference answers and catch the classic mistakes.

Each wrong implementation below is one mistake; the check must FAIL on it: freeing blocks that a
later step needs, rolling back past the prompt, forgetting the copy before a diverging write.
"""

import pytest

from minipaged.checks import FAIL, PASS, TODO, ch08
from minipaged.checks.instructor.ch08 import beam_step as beam_step_reference

pytestmark = pytest.mark.ch08


# -- Task 8.1 ----------------------------------------------------------------------


def rollback(table, num_computed_tokens, num_draft_tokens, num_accepted_tokens):
    c, k, j = num_computed_tokens, num_draft_tokens, num_accepted_tokens
    if not 0 <= j <= k:
        raise ValueError(f"num_accepted_tokens must be in 0..{k}, got {j}")
    stale = [table.slot(p) for p in range(c + 1 + j, c + 1 + k)]
    table.num_tokens = c + 1 + j
    return c + 1 + j, stale


def rolls_back_from_the_count_before_the_step(table, num_computed_tokens, num_draft_tokens, num_accepted_tokens):
    c, k, j = num_computed_tokens, num_draft_tokens, num_accepted_tokens
    if not 0 <= j <= k:
        raise ValueError("bad j")
    new = c - (k - j)  # "minus the rejected drafts", from the count before the step: past the prompt
    stale = [table.slot(p) for p in range(c + 1 + j, c + 1 + k)]
    table.num_tokens = c + 1 + j
    return new, stale


def frees_the_rejected_blocks(table, num_computed_tokens, num_draft_tokens, num_accepted_tokens):
    new, stale = rollback(table, num_computed_tokens, num_draft_tokens, num_accepted_tokens)
    B = table.block_size
    while len(table.blocks) * B - B >= table.num_tokens:  # a block holding only rejected drafts goes back
        table.allocator.free(table.blocks.pop(), table.seq_id)
    return new, stale


def forgets_the_bonus_token(table, num_computed_tokens, num_draft_tokens, num_accepted_tokens):
    c, k, j = num_computed_tokens, num_draft_tokens, num_accepted_tokens
    if not 0 <= j <= k:
        raise ValueError("bad j")
    stale = [table.slot(p) for p in range(c + j, c + 1 + k)]
    table.num_tokens = c + j
    return c + j, stale


def slots_after_moving_the_count(table, num_computed_tokens, num_draft_tokens, num_accepted_tokens):
    c, k, j = num_computed_tokens, num_draft_tokens, num_accepted_tokens
    if not 0 <= j <= k:
        raise ValueError("bad j")
    table.num_tokens = c + 1 + j
    stale = [p for p in range(c + 1 + j, c + 1 + k)]  # positions, not slots
    return c + 1 + j, stale


def no_check_of_accepted(table, num_computed_tokens, num_draft_tokens, num_accepted_tokens):
    c, j = num_computed_tokens, min(num_accepted_tokens, num_draft_tokens)  # clamps instead of refusing
    table.num_tokens = c + 1 + j
    return c + 1 + j, []


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
    raise NotImplementedError("Task 8.1 is not implemented yet.")


@pytest.mark.parametrize(
    "check, answer, status",
    [
        (ch08.check_rollback, rollback, PASS),
        (ch08.check_rollback, rolls_back_from_the_count_before_the_step, FAIL),
        (ch08.check_rollback, frees_the_rejected_blocks, FAIL),
        (ch08.check_rollback, forgets_the_bonus_token, FAIL),
        (ch08.check_rollback, slots_after_moving_the_count, FAIL),
        (ch08.check_rollback, no_check_of_accepted, FAIL),
        (ch08.check_rollback, todo, TODO),
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
    assert "past the prompt" in ch08.check_rollback(rolls_back_from_the_count_before_the_step).message
    assert "frees nothing" in ch08.check_rollback(frees_the_rejected_blocks).message
    assert "before the new token is written" in ch08.check_beam_step(forgets_the_copy).message
    assert "before the new token is written" in ch08.check_beam_step(copies_after_writing).message
    assert "released" in ch08.check_beam_step(releases_the_parent_a_child_carries_on_in).message
    assert "refcounts" in ch08.check_beam_step(never_frees_dropped_beams).message


def test_the_reference_beam_step_matches_beam_search_events():
    """The check's script, replayed with the chapter's module: the same forks and copies per step."""
    from minipaged.block_manager import BlockAllocator, BlockTable

    alloc = BlockAllocator(9, 4)
    kinds = []
    alloc.subscribe(lambda e: kinds.append(e.kind))
    tables, data = [BlockTable(alloc, "b0")], ["·"] * 36
    tables[0].append_tokens(6)
    tables = beam_step_reference(tables, [0, 0, 0], [1, 2, 3], data)
    assert kinds.count("fork") == 2 and kinds.count("cow") == 2  # the third holder writes in place
    assert alloc.num_used == 4
