"""Exercise 01's references, public cases and hidden cases (the instructor's side of ``minipaged.checks.ch01``)."""

from __future__ import annotations

from minipaged.checks.instructor import Side

# (budget_bytes, num_layers, num_kv_heads, head_dim, dtype_bytes, block_size)
FIT_CASES = [
    [0, 32, 8, 128, 2, 16],
    [2 * 32 * 8 * 128 * 2 * 16, 32, 8, 128, 2, 16],  # exactly one block
    [2 * 32 * 8 * 128 * 2 * 16 - 1, 32, 8, 128, 2, 16],  # one byte short of one block
    [80 * 2**30, 32, 8, 128, 2, 16],  # 80 GiB, Llama-3-8B
    [40 * 2**30, 40, 40, 128, 2, 16],  # OPT-13B (MHA)
    [10**9, 1, 1, 1, 1, 1],
    # 2**60-scale: one byte short of a whole number of blocks, where a float quotient rounds up
    [2 * 3 * 2**58 - 1, 1, 1, 1, 1, 3],
    [2**61 - 1, 1, 1, 1, 1, 1],
]


def fit(budget, num_layers, num_kv_heads, head_dim, dtype_bytes, block_size) -> int:
    return budget // (2 * num_layers * num_kv_heads * head_dim * dtype_bytes * block_size)


def _hidden_fit(rng):
    cases = []
    for _ in range(6):
        shape = [rng.choice([1, 2, 12, 32, 80]), rng.choice([1, 4, 8, 40]), rng.choice([64, 128]),
                 rng.choice([1, 2, 4]), rng.choice([1, 8, 16, 32])]
        per_block = 2 * shape[0] * shape[1] * shape[2] * shape[3] * shape[4]
        blocks = rng.randrange(2**52, 2**58)
        cases.append([blocks * per_block + rng.choice([-1, 0, 1, per_block - 1]), *shape])
    return cases


# (num_tokens, num_new_tokens, block_size)
NEW_BLOCK_CASES = [
    [0, 0, 16], [0, 1, 16], [0, 16, 16], [0, 17, 16],
    [5, 3, 16],  # fits in the partly filled block
    [5, 11, 16],  # fills it exactly
    [5, 12, 16],  # one past it
    [16, 1, 16],  # the last block is full
    [15, 34, 16], [37, 0, 16], [7, 7, 1], [3, 100, 64],
    [2**60, 1, 16],  # math.ceil((2**60 + 1) / 16) is 2**56 in floating point
    [2**60 - 1, 2, 2**10],
]


def new_blocks(n, k, b) -> int:
    return -(-(n + k) // b) - -(-n // b)


def _hidden_new(rng):
    cases = []
    for _ in range(10):
        b = rng.choice([1, 2, 8, 16, 32, 2**10])
        n = rng.choice([rng.randrange(0, 200), rng.randrange(2**59, 2**61)])
        cases.append([n, rng.choice([0, 1, b - n % b, rng.randrange(0, 3 * b + 1)]), b])
    for _ in range(3):  # tokens that always cross into a new block: an answer of 0 for everything never passes
        b = rng.choice([2, 8, 16, 2**10])
        n = rng.randrange(2**59, 2**61)
        cases.append([n, rng.randrange(b - n % b + 1, 3 * b + 1), b])
    return cases


# (lengths, candidates)
BEST_CASES = [
    [[37, 91, 128, 201, 511], [16, 32]],
    [[37, 91, 128, 201, 511], [8, 16, 32, 64]],
    [[32, 64, 96], [16, 32]],  # a tie at U = 1: the larger block wins
    [[64, 64], [32, 8, 16]],  # a tie, candidates out of order
    [[1, 1, 1], [16, 1, 4]],
    [[24, 24], [8, 16, 32]],  # 16 rounds each up to 32: 8 wins over the "total" answer
    [[17, 15], [16, 32]],  # the total (32) fits 16 or 32 exactly; per sequence, 16 holds 48 slots and 32 holds 64
    [[100], [7, 10, 25]],
]


def best_block_size(lengths, candidates) -> int:
    return min(candidates, key=lambda b: (sum(b * -(-n // b) for n in lengths), -b))


def _hidden_best(rng):
    cases = []
    for _ in range(6):
        candidates = rng.sample([1, 2, 4, 8, 16, 32, 64, 128], rng.randrange(2, 5))
        b = rng.choice(candidates)
        lengths = [rng.choice([b * rng.randrange(1, 9), rng.randrange(1, 600)]) for _ in range(rng.randrange(1, 7))]
        cases.append([lengths, candidates])
    return cases


SIDES = {
    "blocks_that_fit": Side(lambda: FIT_CASES, _hidden_fit, lambda: (fit,)),
    "new_blocks": Side(lambda: NEW_BLOCK_CASES, _hidden_new, lambda: (new_blocks,)),
    "best_block_size": Side(lambda: BEST_CASES, _hidden_best, lambda: (best_block_size,)),
}
