"""Checks for chapter 05 (continuous batching): admission and preemption against ``minipaged.scheduler``.

Each check first compares the learner's function with the reference on
hand-picked cases, then plugs it into the real :class:`Scheduler` and replays
a small workload that needs both, comparing the whole schedule step by step.
"""

from __future__ import annotations

from unittest import mock

from minipaged import scheduler as ref
from minipaged.block_manager import BlockAllocator
from minipaged.checks import CheckFailed, check, expect_equal
from minipaged.sequence import SamplingParams, Sequence

# (num_free_blocks, num_needed_blocks, watermark_blocks, num_running, max_num_seqs)
ADMIT_CASES = [
    (10, 3, 1, 0, 4),  # plenty of room
    (10, 9, 1, 0, 4),  # exactly the watermark left: allowed
    (10, 10, 1, 0, 4),  # would eat the watermark
    (10, 0, 0, 3, 4),  # needs no new block (e.g. a resumed chunk)
    (0, 0, 0, 0, 4),  # a full pool but nothing needed
    (5, 6, 0, 0, 4),  # more than is free
    (50, 1, 0, 4, 4),  # every seat taken
    (50, 1, 0, 5, 4),
    (3, 3, 0, 0, 1),
]


def _replay(steps: int = 80) -> list[tuple]:
    """A tight pool and staggered arrivals: admission, watermark and preemption all matter."""
    cfg = ref.EngineConfig(num_blocks=9, block_size=2, max_num_seqs=3, max_num_batched_tokens=6, watermark=0.1)
    sched = ref.Scheduler(cfg, BlockAllocator(cfg.num_blocks, cfg.block_size))
    # (arrival, prompt length, max_tokens)
    specs = [(0, 3, 9), (0, 5, 6), (1, 2, 9), (2, 4, 5), (3, 1, 10), (4, 6, 3), (6, 2, 8)]
    seqs = [Sequence(f"r{i}", [1 + i] * p, SamplingParams(max_tokens=m), float(t)) for i, (t, p, m) in enumerate(specs)]
    trace = []
    for tick in range(steps):
        for seq in seqs:
            if seq.arrival_time == tick:
                sched.add(seq)
        out = sched.schedule()
        scheduled = list(zip(out.seqs, out.num_new_tokens))
        trace.append(([(s.seq_id, n) for s, n in scheduled], [s.seq_id for s in out.preempted]))
        sampled = {s.seq_id: 0 for s, n in scheduled if s.num_computed_tokens + n == s.num_tokens}
        sched.postprocess(out, sampled, float(tick))
    return trace


def _compare_schedules(patch_name: str, fn) -> int:
    expected = _replay()
    with mock.patch.object(ref, patch_name, fn):
        got = _replay()
    for step, (g, e) in enumerate(zip(got, expected)):
        if g != e:
            raise CheckFailed(
                f"plugged into the scheduler, step {step} ran {g[0]} and preempted {g[1]}; "
                f"the reference ran {e[0]} and preempted {e[1]}"
            )
    return sum(len(p) for _, p in expected)


@check(
    "ch05.can_admit",
    hint="two conditions: a free seat (num_running < max_num_seqs) and, after taking num_needed_blocks, "
    "at least watermark_blocks still free",
)
def check_can_admit(fn):
    for case in ADMIT_CASES:
        got = fn(*case)
        if not isinstance(got, bool):
            raise CheckFailed(f"can_admit{case} returned {got!r}; return True or False")
        expect_equal(got, ref.can_admit(*case), f"can_admit{case}")
    _compare_schedules("can_admit", fn)
    return f"{len(ADMIT_CASES)} cases, and the same schedule as the reference in an 80-step replay"


@check(
    "ch05.pick_victim",
    hint="the youngest request is the one that arrived last (largest arrival_time); "
    "on a tie, the one admitted last (later in the list)",
)
def check_pick_victim(fn):
    cases = [[0.0], [0.0, 1.0, 2.0], [2.0, 0.0, 1.0], [1.0, 1.0], [0.0, 3.0, 3.0, 1.0], [5.0, 5.0, 5.0]]
    for times in cases:
        running = [Sequence(f"s{i}", [1], SamplingParams(), t) for i, t in enumerate(times)]
        snapshot = list(running)
        got = fn(running)
        if running != snapshot:
            raise CheckFailed(f"pick_victim changed the list it was given (arrivals {times}); only pick, don't remove")
        want = ref.pick_victim(snapshot)
        if got is not want:
            name = got.seq_id if isinstance(got, Sequence) else repr(got)
            raise CheckFailed(f"with arrivals {times} you picked {name}, expected {want.seq_id}")
    preemptions = _compare_schedules("pick_victim", fn)
    return f"{len(cases)} cases, and the same {preemptions} preemptions as the reference in an 80-step replay"
