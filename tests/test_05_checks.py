"""Exercise 05's checks by mutation: the reference PASSes, every known wrong answer FAILs."""

import pytest

from minipaged.checks import FAIL, PASS, ch05
from minipaged.scheduler import can_admit

pytestmark = pytest.mark.ch05


def chunk(n, c, budget, free, wm, b):
    held = -(-c // b)
    return max(0, min(n - c, budget, (held + max(free - wm, 0)) * b - c))


CHUNK_MUTANTS = {
    "ignores the held block": lambda n, c, t, f, w, b: max(0, min(n - c, t, max(f - w, 0) * b)),
    "no watermark": lambda n, c, t, f, w, b: max(0, min(n - c, t, (-(-c // b) + f) * b - c)),
    "all or nothing": lambda n, c, t, f, w, b: min(n - c, t) if chunk(n, c, t, f, w, b) == min(n - c, t) else 0,
    "negative usable blocks": lambda n, c, t, f, w, b: max(0, min(n - c, t, (-(-c // b) + f - w) * b - c)),
    "float blocks": lambda n, c, t, f, w, b: max(0, min(n - c, t, int(-(-c / b) // 1 + max(f - w, 0)) * b - c)),
}


def victims(running, requester, needed, free):
    order = sorted(enumerate(running), key=lambda item: (item[1][1], item[0]), reverse=True)
    out = []
    for _, (seq_id, _, blocks) in order:
        if free >= needed:
            break
        if seq_id != requester:
            out.append(seq_id)
            free += blocks
    return out + [requester] if free < needed else out


def _greedy(order_key, spare_requester=True, count_free=True, stop=True):
    def pick(running, requester, needed, free):
        free = free if count_free else 0
        out = []
        for _, (seq_id, _, blocks) in sorted(enumerate(running), key=order_key, reverse=True):
            if stop and free >= needed:
                break
            if seq_id != requester or not spare_requester:
                out.append(seq_id)
                free += blocks
        return out + [requester] if free < needed and spare_requester else out
    return pick


def _sorts_in_place(running, requester, needed, free):
    running.sort(key=lambda r: r[1])
    return victims(running, requester, needed, free)


VICTIM_MUTANTS = {
    "oldest first": _greedy(lambda item: -item[1][1] + item[0] * 0),
    "tie to the earlier": _greedy(lambda item: (item[1][1], -item[0])),
    "requester not spared": _greedy(lambda item: (item[1][1], item[0]), spare_requester=False),
    "ignores free blocks": _greedy(lambda item: (item[1][1], item[0]), count_free=False),
    "never stops": _greedy(lambda item: (item[1][1], item[0]), stop=False),
    "sorts the list in place": _sorts_in_place,
}


@pytest.mark.parametrize(
    "check, reference, mutants",
    [(ch05.check_prefill_chunk, chunk, CHUNK_MUTANTS), (ch05.check_pick_victims, victims, VICTIM_MUTANTS)],
    ids=["prefill_chunk", "pick_victims"],
)
def test_reference_passes_and_mutants_fail(check, reference, mutants):
    assert check(reference).status == PASS
    for name, mutant in mutants.items():
        assert check(mutant).status == FAIL, name


def test_the_chapters_can_admit_does_not_answer_task_5_1():
    assert ch05.check_prefill_chunk(can_admit).status == FAIL


def test_sparing_the_requester_is_named():
    assert "the requester goes only after" in ch05.check_pick_victims(VICTIM_MUTANTS["requester not spared"]).message
