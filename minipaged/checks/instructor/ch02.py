"""Exercise 02's references, public cases and hidden cases (the instructor's side of ``minipaged.checks.ch02``)."""

from __future__ import annotations

from collections import Counter, deque

from minipaged.block_manager import BlockError, OutOfBlocks
from minipaged.checks.instructor import Side


class Allocator:
    """The exercise's allocator as the checks expect it to behave."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.free_block_ids = deque(range(num_blocks))
        self.refcounts = [0] * num_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self.free_block_ids):
            raise OutOfBlocks(f"{num_blocks} blocks asked, {len(self.free_block_ids)} free")
        ids = [self.free_block_ids.popleft() for _ in range(num_blocks)]
        for b in ids:
            self.refcounts[b] = 1
        return ids

    def free(self, block_ids: list[int]) -> None:
        outside = [b for b in block_ids if not 0 <= b < len(self.refcounts)]
        if outside:
            raise IndexError(f"block {outside[0]} is not in a pool of {len(self.refcounts)}")
        for b, count in Counter(block_ids).items():
            if count > self.refcounts[b]:
                raise BlockError(f"block {b} freed {count} times with {self.refcounts[b]} holder(s)")
        for b in block_ids:
            self.refcounts[b] -= 1
            if self.refcounts[b] == 0:
                self.free_block_ids.append(b)


ALLOCATE_CASES = [{"num_blocks": 6, "requests": [2, 0, 3, 2, 1]}]


def _hidden_allocate(rng):
    cases = []
    for _ in range(3):
        num_blocks = rng.randrange(3, 12)
        requests, left = [], num_blocks
        while left > 0:
            n = rng.randrange(0, left + 1)
            requests.append(n)
            left -= n
        requests += [rng.randrange(1, 4), 0]
        cases.append({"num_blocks": num_blocks, "requests": requests})
    return cases


# Allocates num_blocks - 1 blocks (0, 1, ...), gives the shared ones a second holder, then frees the lists.
FREE_CASES = [{
    "num_blocks": 5, "shared": [1, 2],
    "frees": [[1], [3, 0], [2, 2], [1, 1], [0], [1, 5], [-1], [1]],
    "why": {"[1, 1]": "block 1 twice while it has one holder", "[0]": "block 0, already free",
            "[1, 5]": "block 5 in a 5-block pool", "[-1]": "block -1", "[2, 2]": "both holders of block 2 at once"},
}]


def _hidden_free(rng):
    cases = []
    for _ in range(3):
        num_blocks = rng.randrange(4, 10)
        held = list(range(num_blocks - 1))
        shared = rng.sample(held, 2)
        frees = [rng.sample(held, rng.randrange(1, 3)) for _ in range(5)]
        frees += [[shared[0], shared[0]], [num_blocks], [-rng.randrange(1, 3)], [shared[1]] * 3]
        rng.shuffle(frees)
        cases.append({"num_blocks": num_blocks, "shared": shared, "frees": frees})
    return cases


# (blocks, start, num_tokens, block_size); the last three run past the table's blocks.
SLOT_CASES = [
    [[7, 2, 9], 0, 4, 4],
    [[7, 2, 9], 2, 5, 4],  # starts mid-block, crosses into the next block
    [[7, 2, 9], 3, 6, 4],  # crosses two boundaries
    [[5, 0], 5, 1, 4],
    [[3, 8, 1], 4, 0, 4],  # an empty chunk
    [[4, 1, 6, 0], 6, 6, 3],
    [[11], 3, 1, 16],
    [[2**40, 3], 1, 2, 2**20],  # large block ids and block size
    [[7, 2], 6, 3, 4], [[7], 0, 5, 4], [[], 0, 1, 4],
]


def chunk_slots(blocks, start, num_tokens, block_size) -> list[int]:
    if start + num_tokens > len(blocks) * block_size:
        raise IndexError(f"position {start + num_tokens - 1} is past the table's {len(blocks)} blocks")
    return [blocks[p // block_size] * block_size + p % block_size for p in range(start, start + num_tokens)]


def _hidden_slots(rng):
    cases = []
    for _ in range(8):
        b = rng.choice([1, 2, 3, 4, 16])
        blocks = rng.sample(range(64), rng.randrange(1, 6))
        start = rng.randrange(0, len(blocks) * b)
        cases.append([blocks, start, rng.randrange(0, len(blocks) * b - start + 2), b])
    return cases


SIDES = {
    "allocate_many": Side(lambda: ALLOCATE_CASES, _hidden_allocate, lambda: (Allocator,)),
    "free_many": Side(lambda: FREE_CASES, _hidden_free, lambda: (Allocator,)),
    "chunk_slots": Side(lambda: SLOT_CASES, _hidden_slots, lambda: (chunk_slots,)),
}
