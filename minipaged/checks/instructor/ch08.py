"""Exercise 08's references, public cases and hidden cases (the instructor's side of ``minipaged.checks.ch08``)."""

from __future__ import annotations

from minipaged.checks.instructor import Side


def rollback(table, num_computed_tokens, num_draft_tokens, num_accepted_tokens):
    c, k, j = num_computed_tokens, num_draft_tokens, num_accepted_tokens
    if not 0 <= j <= k:
        raise ValueError(f"num_accepted_tokens must be in 0..{k}, got {j}")
    if table.num_tokens != c + 1 + k:
        raise ValueError(f"the table holds {table.num_tokens} tokens, expected c + 1 + k = {c + 1 + k}")
    stale = [table.slot(p) for p in range(c + 1 + j, c + 1 + k)]
    table.num_tokens = c + 1 + j
    return c + 1 + j, stale


def _rollback(prompt_len, c, k, j, B) -> dict:
    return {"prompt_len": prompt_len, "computed": c, "drafts": k, "accepted": j, "block_size": B}


# (prompt_len, computed before the step, drafts k, accepted j, block_size): each case is one verification step.
ROLLBACK_CASES = [
    _rollback(6, 6, 4, 0, 4),  # right after the prompt, every draft rejected: the prompt's K/V must stay computed
    _rollback(6, 6, 4, 2, 4),
    _rollback(6, 9, 4, 4, 4),  # everything accepted: nothing is stale
    _rollback(5, 7, 3, 1, 4),  # the drafts spilled into a third block, which the next step writes into
    _rollback(3, 3, 5, 0, 2),  # small blocks: the rejected drafts fill two whole blocks
    _rollback(8, 11, 4, 3, 8),
    {"bad": True},
]


def _hidden_rollback(rng):
    cases = []
    for _ in range(5):
        B = rng.choice([2, 4, 8])
        prompt_len = rng.randrange(1, 12)
        k = rng.randrange(1, 6)
        cases.append(_rollback(prompt_len, prompt_len + rng.randrange(0, 6), k, rng.randrange(0, k + 1), B))
    return cases


def beam_step(tables, parents, tokens, data):
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


# A 6-token prompt in blocks of 4 (its second block half full), then four beam steps, each a list of parents:
# the prompt splits in three (two forks, and copies of the shared half-full block); beam 1 is dropped and beam 0
# splits again; beam 0 is dropped and the beams write at a block boundary (new blocks, no copy); beam 2 is dropped
# and beam 1 splits mid-block (its first child copies the block the second shares). The pool is small, so that
# the free queue's order (which dropped blocks come back first) shows.
BEAM_CASES = [{"num_blocks": 9, "block_size": 4, "prompt_len": 6, "first_value": 100,
               "steps": [[0, 0, 0], [0, 0, 2], [2, 2, 1], [0, 1, 1]]}]


def _hidden_beams(rng):
    cases = []
    for _ in range(2):
        width, steps = 3, [[0, 0, 0]]  # the prompt is the only beam at first
        for _ in range(rng.randrange(2, 5)):
            steps.append(sorted(rng.choice(range(width)) for _ in range(width)))
        cases.append({"num_blocks": 40, "block_size": rng.choice([2, 4]), "prompt_len": rng.randrange(2, 9),
                      "first_value": rng.randrange(200, 900), "steps": steps})
    return cases


SIDES = {
    "rollback": Side(lambda: ROLLBACK_CASES, _hidden_rollback, lambda: (rollback,)),
    "beam_step": Side(lambda: BEAM_CASES, _hidden_beams, lambda: (beam_step,)),
}
