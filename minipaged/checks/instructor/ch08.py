"""Exercise 08's references, public cases and hidden cases (the instructor's side of ``minipaged.checks.ch08``)."""

from __future__ import annotations

import random

from minipaged.checks.instructor import Side
from minipaged.speculative import NgramSpeculator


# Task 8.1: the package's own speculator is the reference; its tokens equal plain decoding's (tests/test_08_checks.py).
# The check switches NgramSpeculator's two methods off for the learner's class, so the reference carries its own copies.
class Reference(NgramSpeculator):
    schedule_drafts = NgramSpeculator.__dict__["schedule_drafts"]
    rollback = NgramSpeculator.__dict__["rollback"]

SPEC_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def speculator_workload(rng: random.Random, num_requests: int = 5) -> list[dict]:
    """Requests whose prompts repeat a short motif (so ngram drafts are found), half of them behind a shared prefix.

    The first request arrives at step 0, the others a few steps apart, so that a later one can hit the
    blocks an earlier one filled (prefix caching) and drafts meet prefills in the same step.
    """
    shared = [rng.randrange(64) for _ in range(rng.randrange(5, 9))]
    requests, arrive = [], 0
    for i in range(num_requests):
        motif = [rng.randrange(64) for _ in range(rng.randrange(2, 5))]
        body = (motif * 8)[: rng.randrange(6, 13)]
        prompt = (shared if i % 2 else []) + body
        requests.append({"id": f"r{i}", "prompt": prompt, "max_tokens": rng.randrange(10, 19), "arrive": arrive,
                         "abort": None, "n": 1, "cache_salt": None})
        arrive += rng.randrange(1, 4)
    return requests


def _speculator_case(seed: int, prefix_caching: bool, num_blocks: int = 14) -> dict:
    """One engine run: blocks of 4, a budget that drafts can exhaust, a pool tight enough that drafts get cut."""
    requests = speculator_workload(random.Random(seed))
    return {"config": {"num_blocks": num_blocks, "block_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 10},
            "requests": requests, "speculative_config": dict(SPEC_CONFIG), "prefix_caching": prefix_caching}


SPECULATOR_CASES = [_speculator_case(0, False), _speculator_case(0, True)]


def _hidden_speculator(rng):
    return [_speculator_case(rng.randrange(1, 10**6), prefix_caching) for prefix_caching in (False, True)]


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
    "speculator": Side(lambda: SPECULATOR_CASES, _hidden_speculator, lambda: (Reference,)),
    "beam_step": Side(lambda: BEAM_CASES, _hidden_beams, lambda: (beam_step,)),
}
