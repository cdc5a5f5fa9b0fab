"""Exercise 02's references, public cases and hidden cases (the instructor's side of ``minipaged.checks.ch02``).

The references are the package's own :class:`~minipaged.blocks.BlockAllocator` and
:class:`~minipaged.blocks.BlockTable`: the learner's pieces must behave as they do.
"""

from __future__ import annotations

import random

from minipaged.block_math import blocks_needed
from minipaged.blocks import BlockAllocator, BlockTable
from minipaged.checks.ch02 import run_script
from minipaged.checks.engine_run import seeded_requests, with_script
from minipaged.checks.instructor import Side

# A pool of 6 blocks, driven call by call; the comments say what each call tests.
ALLOCATOR_SCRIPT = [
    ["allocate", "A"],  # block 0, refcount 1
    ["allocate_many", 3],  # blocks 1, 2, 3, in pool order
    ["incref", 1],  # block 1 has two holders now
    ["allocate_many", 3],  # only 2 are free: OutOfBlocks, and nothing taken
    ["allocate_many", 0],  # []
    ["free", 0],  # its last holder: back to the pool, on the right
    ["free", 0],  # a double free: BlockError
    ["incref", 0],  # a free block: BlockError
    ["free", 6],  # outside the pool: IndexError
    ["free", -1],  # outside the pool: IndexError
    ["free_sequence", [1, 2, 7]],  # 7 is outside the pool: IndexError, and blocks 1 and 2 keep their references
    ["free_sequence", [2, 2]],  # block 2 has one holder but appears twice: BlockError, nothing freed
    ["free_sequence", [3, 0]],  # block 0 is free: BlockError, block 3 not freed
    ["free", 1],  # block 1 had two holders: it stays held
    ["refcount", 1],  # 1
    ["free_sequence", [3, 1, 2]],  # every one back, in this order
    ["num_free"],  # 6
    ["allocate", "B"],  # the oldest free block: 4
    ["allocate_many", 4],  # 5, 0, 3, 1
    ["allocate", "C"],  # block 2, the last one
    ["allocate", "D"],  # none left: OutOfBlocks
    ["refcount", 6],  # outside the pool: IndexError
]
# The same script again under ch02.with_side_queue: chapter 06's prefix cache subclasses the allocator this way.
ALLOCATOR_CASES = [{"num_blocks": 6, "block_size": 4, "ops": ALLOCATOR_SCRIPT},
                   {"num_blocks": 6, "block_size": 4, "ops": ALLOCATOR_SCRIPT, "side_queue": True}]


def _hidden_allocator(rng: random.Random) -> list[dict]:
    """Random scripts whose calls are mostly legal, with the classic wrong ones mixed in."""
    cases = []
    for _ in range(3):
        n = rng.randrange(4, 12)
        held: list[int] = []  # one entry per reference (a shared block appears once per holder)
        ops = []
        for _ in range(30):
            kind = rng.random()
            if kind < 0.3:
                ops.append(["allocate_many", rng.randrange(0, 4)])
                continue
            if kind < 0.4:
                ops.append(["allocate", f"s{len(ops)}"])
                continue
            pick = rng.choice(held) if held else 0
            if kind < 0.5:
                ops.append(["incref", pick])
            elif kind < 0.65:
                ops.append(["free", pick if rng.random() < 0.8 else rng.choice([n, -1])])
            elif kind < 0.9:
                ids = rng.sample(held, min(len(held), rng.randrange(1, 4))) if held else [0]
                if rng.random() < 0.3:
                    ids.insert(rng.randrange(len(ids) + 1), rng.choice([n, ids[0], 0]))  # a bad or repeated id
                ops.append(["free_sequence", ids])
            else:
                ops.append(["refcount", rng.randrange(-1, n + 1)])
            held = _held_after(n, ops)
        cases.append({"num_blocks": n, "block_size": rng.choice([2, 4]), "ops": ops + [["num_free"]],
                      "side_queue": rng.random() < 0.5})  # fmt: skip
    return cases


def _held_after(num_blocks: int, ops: list) -> list[int]:
    """The references the reference allocator holds after ``ops`` (one entry per reference)."""
    alloc = BlockAllocator(num_blocks, 4)
    run_script(alloc, ops)
    return [b for b in range(num_blocks) for _ in range(alloc.refcount(b))]


CONSTANT_TIME_CASES = [{"sizes": [32, 1024], "block_size": 4}]


def _engine_case(seed: int, block_size: int) -> dict:
    """A pool too small for its workload (preemptions) with aborts, drawn from ``seed``.

    It runs where a learner of exercise 02 has nothing else built: the package's scheduling decisions
    replayed (:func:`~minipaged.checks.engine_run.with_script`) and chapter 03's block-by-block ``"loop"``
    attention, which no exercise builds.
    """
    rng = random.Random(seed)
    requests = seeded_requests(rng, 7, (2, 13), (3, 12), arrive_within=5, abort_prob=0.3)
    num_blocks = max(blocks_needed(len(r["prompt"]) + r["max_tokens"], block_size) for r in requests) + 1
    return with_script({"config": {"num_blocks": num_blocks, "block_size": block_size, "max_num_seqs": 4,
                                   "max_num_batched_tokens": 16, "watermark": 0.0, "backend": "loop"},
                        "requests": requests})  # fmt: skip


ENGINE_CASES = [_engine_case(3, 4), _engine_case(7, 3)]  # 6 and 4 preemptions; 1 and 2 aborts


def _hidden_engine(rng: random.Random) -> list[dict]:
    return [_engine_case(rng.randrange(10**6), rng.choice([2, 3, 4])) for _ in range(3)]


SIDES = {
    "allocator": Side(lambda: ALLOCATOR_CASES, _hidden_allocator, lambda: (BlockAllocator,)),
    "constant_time": Side(lambda: CONSTANT_TIME_CASES, lambda rng: [{"sizes": [rng.choice([16, 32]), 1024],
                                                                        "block_size": rng.choice([2, 4])}],
                          lambda: (BlockAllocator,)),  # fmt: skip
    "engine": Side(lambda: ENGINE_CASES, _hidden_engine, lambda: (BlockAllocator, BlockTable)),
}
