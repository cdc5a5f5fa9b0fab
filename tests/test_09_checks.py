"""The capstone's check: the package's own pieces pass; wrong ones fail where they first go wrong, with that hint.

The recorded (SmolLM2) case is expensive, so its judge is tested on transcripts edited from the
reference's; the solution notebook runs it for real under nbval. The preemption case runs for real
with each wrong scheduler.
"""

import copy
from functools import cache

import pytest

from minipaged.blocks import BlockTable
from minipaged.checks import FAIL, PASS, ch09
from minipaged.checks.instructor.ch09 import CASES, reference
from minipaged.prefix_cache import PrefixCachingAllocator
from minipaged.request_queue import FCFSQueue
from minipaged.scheduler import Scheduler

pytestmark = pytest.mark.exercises
CHECK = ch09.check_your_engine
RECORDED, COURSE, PREEMPTION = CASES  # SmolLM2's chats, the course model's prompts, the preemption run


@cache
def recorded_transcript(case_index: int = 0):
    return CHECK.transcript([CASES[case_index]], reference())


def verdict(case, transcript):
    want = CHECK.transcript([case], reference()) if case is PREEMPTION else recorded_transcript(CASES.index(case))
    return CHECK.verdict([case], transcript, want, 1)


def edited(edit, case_index: int = 0):
    transcript = copy.deepcopy(recorded_transcript(case_index))
    edit(transcript["observations"][0])
    return transcript


def test_the_package_passes_the_recorded_case_with_vllms_tokens_and_hits():
    result = verdict(RECORDED, recorded_transcript())
    assert result.status == PASS, result.message
    obs = recorded_transcript()["observations"][0]
    record = ch09.recorded(RECORDED["model"])["requests"]
    assert [r["cached"] for r in obs["mine"]] == [r["vllm_cached_tokens"] for r in record]
    assert any(r["cached"] for r in obs["mine"]) and set(obs) == {"model", "max_tokens", "mine"}
    assert any(len(r["tokens"]) < RECORDED["max_tokens"] for r in obs["mine"]), "some chat must stop at its EOS"
    course = recorded_transcript(1)["observations"][0]
    assert verdict(COURSE, recorded_transcript(1)).passed
    assert sum(r["cached"] for r in course["mine"]) == sum(r["vllm_cached_tokens"] for r in
                                                         ch09.recorded(COURSE["model"])["requests"]) > 0


def test_a_prefix_cache_that_never_hits_fails_on_the_first_request_vllm_served_from_cache():
    def no_hits(obs):
        for r in obs["mine"]:
            r["cached"] = 0

    result = verdict(RECORDED, edited(no_hits))
    first = next(i for i, r in enumerate(ch09.recorded(RECORDED["model"])["requests"]) if r["vllm_cached_tokens"])
    assert result.status == FAIL and f"request {first}: your prefix cache covered 0" in result.message
    assert result.hint == ch09.HINTS["9.1"][2]


def test_tokens_unlike_vllms_before_a_near_tie_fail():
    def both(obs):
        obs["mine"][0]["tokens"][0] += 1

    result = verdict(COURSE, edited(both, 1))
    assert result.status == FAIL and "request 0: token 0 differs from vLLM's recorded one" in result.message


class OldestFirst(FCFSQueue):
    @staticmethod
    def victim(running):
        return running[0]  # the oldest running sequence, not the youngest


class PreemptsOldest(Scheduler):
    def __init__(self, config, allocator, block_table, speculator=None):
        super().__init__(config, allocator, block_table, speculator)
        self.waiting = OldestFirst(self.waiting)


def test_a_scheduler_that_preempts_the_oldest_fails_at_the_first_preemption():
    allocator, table, backend, _ = reference()
    result = verdict(PREEMPTION, CHECK.transcript([PREEMPTION], (allocator, table, backend, PreemptsOldest)))
    assert result.status == FAIL and result.message.startswith(ch09._label(PREEMPTION) + ": step ")
    assert "preempted" in result.message and result.hint == ch09.HINTS["9.1"][1]


def test_a_cache_that_never_matches_fails_where_a_preempted_sequence_comes_back():
    class NeverMatches(PrefixCachingAllocator):
        def match_prefix(self, token_ids, cache_salt=None):
            return super().match_prefix([], cache_salt)

    _, table, backend, scheduler = reference()
    result = verdict(PREEMPTION, CHECK.transcript([PREEMPTION], (NeverMatches, table, backend, scheduler)))
    # The package's re-prefill of a preempted sequence hits its own cached blocks; this one recomputes them.
    assert result.status == FAIL and ": step " in result.message and "your engine ran" in result.message


def test_the_hidden_preemption_cases_are_plain_data_the_reference_passes():
    import random

    from minipaged.checks import plain
    from minipaged.checks.instructor.ch09 import SIDES

    side = SIDES["your_engine"]
    for seed in range(3):
        hidden = side.hidden(random.Random(seed))
        assert hidden == side.hidden(random.Random(seed)) and plain(hidden) == hidden
        want = CHECK.transcript(hidden, reference())
        assert want["end"] == {"kind": "done"} and CHECK.verdict(hidden, want, want, 0).passed
        assert any(step["preempted"] for step in want["observations"][0]["steps"]), "a hidden case must preempt"


class CountsCopies(BlockTable):
    copies: list = []

    def take_pending_copies(self):
        copies = super().take_pending_copies()
        CountsCopies.copies += copies
        return copies


class DropsCopies(BlockTable):
    def take_pending_copies(self):
        super().take_pending_copies()
        return []  # the copies copy-on-write asked for never happen


def test_the_preemption_case_forks_and_copies_and_a_table_that_loses_its_copies_fails():
    allocator, _, backend, scheduler = reference()
    CountsCopies.copies = []
    assert verdict(PREEMPTION, CHECK.transcript([PREEMPTION], (allocator, CountsCopies, backend, scheduler))).passed
    assert CountsCopies.copies, "the public preemption case must exercise copy-on-write"
    result = verdict(PREEMPTION, CHECK.transcript([PREEMPTION], (allocator, DropsCopies, backend, scheduler)))
    assert result.status == FAIL and "generated token" in result.message
