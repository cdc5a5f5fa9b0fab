"""The capstone's cases and reference (the instructor's side of ``minipaged.checks.ch09``): the package's own pieces."""

from __future__ import annotations

import random

from minipaged.checks.engine_run import seeded_requests
from minipaged.checks.instructor import Side

# Blocks of 4 in a 10-block pool, 4 seats and a 16-token budget: long prompts are chunked, and growing
# sequences preempt the youngest running one; some requests are aborted on the way, and two take two samples.
POOL = {"num_blocks": 10, "block_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 16}


def _preemption(seed: int) -> dict:
    rng = random.Random(seed)
    requests = seeded_requests(rng, 8, (3, 20), (4, 16), arrive_within=8, abort_prob=0.2)
    # The two shortest take two samples each: forks share their blocks, and copy-on-write splits the last one.
    for r in sorted(requests, key=lambda r: len(r["prompt"]) + r["max_tokens"])[:2]:
        r["n"] = 2
    return {"kind": "preemption", "seed": seed, "workload": {"config": POOL, "requests": requests}}


# SmolLM2's chats as vLLM served them, up to 16 tokens each (some stop at the EOS before that); the course
# model's prompts, up to 32; then the checks' model under preemption.
CASES = [{"kind": "recorded", "model": "SmolLM2-135M-Instruct", "max_tokens": 16},
         {"kind": "recorded", "model": "course model", "max_tokens": 32},
         _preemption(0)]


def reference():
    from minipaged.blocks import BlockTable
    from minipaged.prefix_cache import PrefixCachingAllocator
    from minipaged.scheduler import Scheduler

    return PrefixCachingAllocator, BlockTable, None, Scheduler  # None: the package's torch backend


SIDES = {"your_engine": Side(lambda: CASES, lambda rng: [_preemption(rng.randrange(1, 10**6))], reference)}
