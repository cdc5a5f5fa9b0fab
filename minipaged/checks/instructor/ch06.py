"""Exercise 06's references, public cases and hidden cases (the instructor's side of ``minipaged.checks.ch06``).

The references are the package's own pieces (the model answer: the instructor's package has no holes),
:func:`~minipaged.prefix_cache.block_keys` for ``ch06.block_keys``,
:class:`~minipaged.prefix_cache.PrefixCachingAllocator` for ``ch06.prefix_cache`` and ``ch06.constant_time``, and
:class:`~minipaged.blocks.BlockTable` (its ``_copy_on_write``) for ``ch06.cow_table``; the build checks' cases are
``run_engine`` workloads of block size 4 on the checks' tiny model.
"""

from __future__ import annotations

import random

from minipaged.blocks import BlockTable
from minipaged.checks.engine_run import VOCAB_SIZE
from minipaged.checks.instructor import Side
from minipaged.prefix_cache import PrefixCachingAllocator, block_keys

# Prompts of block size 4. a and b share two blocks; c differs from a in its first block only, so
# its later blocks hold the same tokens as a's but sit behind a different parent.
_SYSTEM = [11, 12, 13, 14, 21, 22, 23, 24]
PROMPTS = {
    "a": _SYSTEM + [31, 32, 33, 34, 41, 42],
    "b": _SYSTEM + [51, 52, 53, 54, 61, 62, 63, 64],
    "c": [99, 12, 13, 14, 21, 22, 23, 24, 31, 32, 33, 34],
    "short": [11, 12, 13],
}


def _keys_cases():
    cases = [{"name": name, "prompt": p, "block_size": 4, "cache_salt": None} for name, p in PROMPTS.items()]
    cases += [{"name": "a", "prompt": PROMPTS["a"], "block_size": 8, "cache_salt": None},
              {"name": "a", "prompt": PROMPTS["a"], "block_size": 4, "cache_salt": "tenant-1"},
              {"name": "a", "prompt": PROMPTS["a"], "block_size": 4, "cache_salt": ""},  # an empty salt is no salt
              {"name": "empty", "prompt": [], "block_size": 4, "cache_salt": None}]
    return cases + [{"pair": [PROMPTS["a"], PROMPTS["c"]]}]


def _hidden_keys(rng):
    cases = []
    for i in range(5):
        B = rng.choice([2, 3, 4, 8])
        prompt = [rng.randrange(1, 50) for _ in range(rng.randrange(0, 5 * B))]
        cases.append({"name": f"h{i}", "prompt": prompt, "block_size": B, "cache_salt": rng.choice([None, f"t{i}"])})
    first = [rng.randrange(1, 50) for _ in range(4)]
    rest = [rng.randrange(1, 50) for _ in range(8)]
    return cases + [{"pair": [first + rest, [first[0] + 50] + first[1:] + rest]}]



# ---------------------------------------------------------------------------
# The build checks' workloads
# ---------------------------------------------------------------------------


def _request(rid, prompt, max_tokens, arrive, n=1, cache_salt=None):
    return {"id": rid, "prompt": prompt, "max_tokens": max_tokens, "arrive": arrive, "abort": None, "n": n,
            "cache_salt": cache_salt}


def _config(num_blocks, max_num_seqs=4, max_num_batched_tokens=24):
    return {"num_blocks": num_blocks, "block_size": 4, "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens}


def _tokens(rng, n):
    return [rng.randrange(VOCAB_SIZE) for _ in range(n)]


def shared_prompt_case(rng, name, hash_name="sha256", num_requests=7, num_blocks=18):
    """Requests that start with one of two system prompts (2 and 3 blocks), with samples, salts and a small pool.

    One request repeats an earlier prompt cut to whole blocks (its last block is computed again), and
    one tenant's salt keeps its requests apart from the same system prompt unsalted.
    """
    systems = [_tokens(rng, 8), _tokens(rng, 12)]
    requests, arrive = [], 0
    for i in range(num_requests):
        salt = "tenant-b" if i in (2, 4) else None
        prompt = systems[i % 2] + _tokens(rng, rng.randint(1, 6))
        requests.append(_request(f"r{i}", prompt, rng.randint(2, 6), arrive, n=rng.choice([1, 2]), cache_salt=salt))
        arrive += rng.randint(1, 3)
    whole = requests[0]["prompt"][: len(requests[0]["prompt"]) // 4 * 4]
    requests.append(_request(f"r{num_requests}", whole, 3, arrive))
    return {"name": name, "hash": hash_name, "config": _config(num_blocks), "requests": requests}


def collision_case(rng, name):
    """With a hash that always collides: prompts b+x then b+c, after a+c (block c behind another parent)."""
    a, b, c, x = (_tokens(rng, 4) for _ in range(4))
    requests = [_request("r0", a + c + _tokens(rng, 3), 4, 0, n=2), _request("r1", b + x + _tokens(rng, 2), 3, 2),
                _request("r2", b + c + _tokens(rng, 2), 3, 5), _request("r3", a + c + _tokens(rng, 1), 3, 6),
                _request("r4", c + a + _tokens(rng, 2), 2, 7, cache_salt="tenant-b"),
                _request("r5", c + a + _tokens(rng, 3), 2, 9)]
    return {"name": name, "hash": "collide", "config": _config(14), "requests": requests}


def _cache_cases():
    return [shared_prompt_case(random.Random(f"ch06.cache:{seed}"), name, num_blocks=blocks)
            for seed, name, blocks in ((0, "system prompts", 24), (1, "system prompts, small pool", 12))] + [
        collision_case(random.Random("ch06.collide"), "colliding hash"),
        shared_prompt_case(random.Random("ch06.cache:2"), "system prompts, colliding hash", "collide", num_blocks=16)]


def _hidden_cache(rng):
    return [shared_prompt_case(rng, "hidden", rng.choice(["sha256", "collide"]), num_blocks=rng.randint(12, 20)),
            collision_case(rng, "hidden, colliding hash")]


def fork_case(rng, name, num_blocks, num_requests=4):
    """Requests with 2 or 3 samples each, prompts ending mid-block and at a block boundary, on a tight pool."""
    requests, arrive = [], 0
    for i in range(num_requests):
        length = 8 if i == 1 else rng.randint(3, 10)  # request 1 forks at a block boundary: nothing to copy
        requests.append(_request(f"r{i}", _tokens(rng, length), rng.randint(3, 7), arrive, n=rng.choice([2, 3])))
        arrive += rng.randint(0, 3)
    return {"name": name, "hash": "sha256", "config": _config(num_blocks, max_num_seqs=6), "requests": requests}


def _cow_cases():
    return [fork_case(random.Random("ch06.cow:0"), "forks", 32), fork_case(random.Random("ch06.cow:1"),
                                                                            "forks, tight pool", 11)]


def _hidden_cow(rng):
    return [fork_case(rng, "hidden", rng.randint(11, 24))]


SIDES = {
    "block_keys": Side(_keys_cases, _hidden_keys, lambda: (block_keys,)),
    "prefix_cache": Side(_cache_cases, _hidden_cache, lambda: (PrefixCachingAllocator,)),
    "constant_time": Side(lambda: [{"sizes": [32, 1024], "block_size": 4}],
                          lambda rng: [{"sizes": [rng.choice([16, 32]), 1024], "block_size": rng.choice([2, 4])}],
                          lambda: (PrefixCachingAllocator,)),
    "cow_table": Side(_cow_cases, _hidden_cow, lambda: (BlockTable,)),
}
