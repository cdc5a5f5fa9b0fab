"""Exercise 05's references, public cases and hidden cases (the instructor's side of ``minipaged.checks.ch05``)."""

from __future__ import annotations

from minipaged.checks.instructor import Side

# (num_tokens, num_computed_tokens, token_budget, num_free_blocks, watermark_blocks, block_size)
CHUNK_CASES = [
    [10, 0, 32, 10, 1, 4],  # the whole prompt fits
    [10, 0, 6, 10, 1, 4],  # the token budget limits it
    [40, 0, 64, 5, 1, 4],  # the pool limits it: 4 usable blocks, 16 tokens
    [40, 6, 64, 2, 1, 4],  # holds 2 blocks with 2 free slots, plus 1 usable block
    [40, 8, 64, 1, 1, 4],  # holds 2 full blocks, nothing usable: 0
    [40, 7, 64, 1, 1, 4],  # nothing usable, but one free slot in the held block
    [9, 9, 8, 5, 0, 4],  # nothing left to prefill
    [30, 3, 100, 0, 2, 8],  # fewer free blocks than the watermark: only the held block's slots
    [2**60 + 5, 2**60 + 1, 2**61, 3, 1, 16],  # 2**60-scale positions
    [2**62, 0, 2**61 + 3, 2**57, 2, 16],
]


def prefill_chunk(num_tokens, num_computed, budget, num_free, watermark, block_size) -> int:
    held = -(-num_computed // block_size)
    room = (held + max(num_free - watermark, 0)) * block_size - num_computed
    return max(0, min(num_tokens - num_computed, budget, room))


def _hidden_chunk(rng):
    cases = []
    for _ in range(10):
        b = rng.choice([1, 4, 8, 16])
        scale = rng.choice([1, 2**58])
        computed = rng.randrange(0, 50) * scale + rng.randrange(0, b)
        cases.append([computed + rng.randrange(0, 80), computed, rng.randrange(1, 64), rng.randrange(0, 8),
                      rng.randrange(0, 3), b])
    return cases


# (running as (seq_id, arrival_time, num_blocks), requester, num_blocks_needed, num_free_blocks)
VICTIM_CASES = [
    [[["a", 0.0, 3], ["b", 1.0, 2], ["c", 2.0, 1]], "a", 1, 0],  # the youngest
    [[["a", 0.0, 3], ["b", 1.0, 2], ["c", 2.0, 1]], "a", 3, 0],  # two victims, youngest first
    [[["a", 0.0, 3], ["b", 1.0, 2], ["c", 2.0, 1]], "c", 1, 0],  # the requester is the youngest: skip it
    [[["a", 0.0, 3], ["b", 1.0, 2], ["c", 2.0, 1]], "a", 2, 1],  # free blocks count too
    [[["a", 0.0, 3], ["b", 1.0, 2]], "a", 1, 1],  # enough free already: nobody
    [[["a", 1.0, 1], ["b", 1.0, 1], ["c", 0.0, 1]], "c", 1, 0],  # a tie: the later in the list
    [[["a", 0.0, 1], ["b", 1.0, 1]], "b", 5, 0],  # not enough even with everyone: the requester goes too
    [[["x", 3.0, 2]], "x", 1, 0],  # alone: preempts itself
    [[["a", 5.0, 1], ["b", 0.0, 4], ["c", 9.0, 1], ["d", 2.0, 2]], "d", 3, 1],  # arrival order differs from list
]


def pick_victims(running, requester, num_blocks_needed, num_free_blocks) -> list[str]:
    order = sorted(range(len(running)), key=lambda i: (running[i][1], i), reverse=True)
    victims, free = [], num_free_blocks
    for i in order:
        if free >= num_blocks_needed:
            break
        seq_id, _, blocks = running[i]
        if seq_id != requester:
            victims.append(seq_id)
            free += blocks
    if free < num_blocks_needed:
        victims.append(requester)
    return victims


def _hidden_victims(rng):
    cases = []
    for _ in range(8):
        names = rng.sample("pqrstuvw", rng.randrange(1, 6))
        running = [[name, float(rng.randrange(0, 4)), rng.randrange(1, 5)] for name in names]
        cases.append([running, rng.choice(names), rng.randrange(1, 9), rng.randrange(0, 3)])
    return cases


SIDES = {
    "prefill_chunk": Side(lambda: CHUNK_CASES, _hidden_chunk, lambda: (prefill_chunk,)),
    "pick_victims": Side(lambda: VICTIM_CASES, _hidden_victims, lambda: (pick_victims,)),
}
