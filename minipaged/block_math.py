"""Block arithmetic every chapter shares: the blocks a sequence needs, and the two fractions of a pool in use.

Chapter 01 teaches them (:mod:`minipaged.accounting` builds its accounting on them); the engine's
scheduler and metrics use them at every step. They live apart from the accounting so that the
engine loads four small functions, not chapter 01's whole toolkit and numpy.
"""

from __future__ import annotations

from minipaged.validation import check_int


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for ints, exact at any size (``math.ceil(a / b)`` rounds through a float)."""
    return -(-a // b)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """ceil(n / B): a partly filled last block is still a whole block. 0 tokens need 0 blocks."""
    n = check_int(num_tokens, "num_tokens")
    b = check_int(block_size, "block_size", minimum=1)
    return ceil_div(n, b)


def kv_usage(used_blocks: int, num_blocks: int) -> float:
    """KV usage: blocks in use / blocks in the pool (vLLM's ``kv_cache_usage_perc``).

    Args:
        used_blocks: blocks the pool has handed out.
        num_blocks: blocks in the pool (>= 1).
    """
    return check_int(used_blocks, "used_blocks") / check_int(num_blocks, "num_blocks", minimum=1)


def token_occupancy(num_tokens: int, pool_slots: int) -> float:
    """Token occupancy: tokens held / token slots in the pool (``kv_usage`` × utilisation).

    Args:
        num_tokens: tokens the sequences hold.
        pool_slots: slots in the pool, ``num_blocks * block_size`` (>= 1).
    """
    return check_int(num_tokens, "num_tokens") / check_int(pool_slots, "pool_slots", minimum=1)
