"""Exercise 06's references, public cases and hidden cases (the instructor's side of ``minipaged.checks.ch06``)."""

from __future__ import annotations

from collections import OrderedDict, deque

from minipaged.block_manager import OutOfBlocks
from minipaged.checks import plain
from minipaged.checks.ch06 import HASHES
from minipaged.checks.instructor import Side


def block_keys(token_ids, block_size, hash_fn, cache_salt=None):
    keys, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        extra = (cache_salt,) if start == 0 and cache_salt is not None else ()
        parent = hash_fn(parent, tuple(token_ids[start : start + block_size]), extra)
        keys.append(parent)
    return keys


def hit_tokens(token_ids, block_size, hash_fn, cached, cache_salt=None):
    limit = (len(token_ids) - 1) // block_size  # the last prompt token is always computed
    hits = 0
    for i, key in enumerate(block_keys(token_ids, block_size, hash_fn, cache_salt)[:limit]):
        if cached.get(key) != tuple(token_ids[i * block_size : (i + 1) * block_size]):
            break
        hits += 1
    return hits * block_size


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


def _cache(prompts, B, hash_name):
    """The cache after ``prompts`` ran: each full block's key and tokens, as [[key, tokens], ...]; first one kept."""
    cached = {}
    for prompt in prompts:
        for i, key in enumerate(block_keys(prompt, B, HASHES[hash_name])):
            cached.setdefault(key, tuple(prompt[i * B : (i + 1) * B]))
    return plain([[key, tokens] for key, tokens in cached.items()])


def _hits_cases():
    cached = _cache([PROMPTS["a"]], 4, "transparent")  # request a ran first and left its full blocks in the cache
    prompts = dict(PROMPTS, **{"exactly 3 blocks": _SYSTEM + [31, 32, 33, 34], "system prompt alone": _SYSTEM})
    cases = [{"name": name, "prompt": p, "block_size": 4, "hash": "transparent", "cached": cached, "cache_salt": None}
             for name, p in prompts.items()]
    # A weak hash: prompt d's first block has the same sum as a's, so the same weak key; its second block then
    # collides with a's first one, tokens and all. Only the tokens of the first block tell the two apart.
    cases.append({"name": "d", "prompt": [12, 11, 14, 13, 11, 12, 13, 14, 1], "block_size": 4, "hash": "weak",
                  "cached": _cache([PROMPTS["a"]], 4, "weak"), "cache_salt": None})
    cases.append({"name": "b", "prompt": PROMPTS["b"], "block_size": 4, "hash": "transparent", "cached": cached,
                  "cache_salt": "tenant-2"})
    return cases


def _hidden_hits(rng):
    cases = []
    for i in range(6):
        B = rng.choice([2, 4])
        first = [rng.randrange(1, 9) for _ in range(rng.randrange(B, 5 * B))]
        cut = rng.randrange(0, len(first) + 1)
        prompt = first[:cut] + [rng.randrange(1, 9) for _ in range(rng.randrange(1, 3 * B))]
        hash_name = rng.choice(["transparent", "weak"])
        cases.append({"name": f"h{i}", "prompt": prompt, "block_size": B, "hash": hash_name,
                      "cached": _cache([first], B, hash_name), "cache_salt": None})
    return cases


class CowTable:
    def __init__(self, allocator, data, seq_id=None):
        self.allocator, self.data, self.seq_id = allocator, data, seq_id
        self.blocks, self.num_tokens = [], 0

    def fork(self, seq_id=None):
        child = CowTable(self.allocator, self.data, seq_id)
        for b in self.blocks:
            self.allocator.incref(b, seq_id)
        child.blocks, child.num_tokens = list(self.blocks), self.num_tokens
        return child

    def append(self, value):
        B, offset = self.allocator.block_size, self.num_tokens % self.allocator.block_size
        if offset == 0:
            self.blocks.append(self.allocator.allocate(self.seq_id))
        elif self.allocator.refcount(self.blocks[-1]) > 1:
            old, new = self.blocks[-1], self.allocator.allocate(self.seq_id)
            self.data[new * B : new * B + offset] = self.data[old * B : old * B + offset]
            self.allocator.free(old, self.seq_id)
            self.blocks[-1] = new
        slot = self.blocks[-1] * B + offset
        self.data[slot] = value
        self.num_tokens += 1
        return slot


# p writes 6 tokens; c1 forks (block 1 is shared and half full); c1 and p each append once (the first copies,
# the second then owns block 1 alone and writes in place); c2 forks at a block boundary and appends
# (a new block, no copy); c3 forks c2 mid-block and copies the last free block; c4 forks c2 and finds the
# pool empty, as does c2 itself, whose tail block c4 now shares.
COW_CASES = [{"num_blocks": 6, "block_size": 4, "first_value": 100, "script": [
    ["p", "append", 6], ["p", "fork", "c1"], ["c1", "append", 1], ["p", "append", 1], ["c1", "append", 3],
    ["p", "append", 1], ["p", "fork", "c2"], ["c2", "append", 2], ["c2", "fork", "c3"], ["c3", "append", 1],
    ["c2", "append", 1], ["c2", "fork", "c4"], ["c4", "append", 1], ["c2", "append", 1]]}]


def _hidden_cow(rng):
    cases = []
    for _ in range(3):
        B = rng.choice([2, 3, 4])
        seqs, script = ["p"], [["p", "append", rng.randrange(1, 2 * B)]]
        for i in range(10):
            if rng.random() < 0.35:
                seqs.append(f"k{i}")
                script.append([rng.choice(seqs[:-1]), "fork", seqs[-1]])
            else:
                script.append([rng.choice(seqs), "append", rng.randrange(1, B + 1)])
        cases.append({"num_blocks": rng.randrange(5, 9), "block_size": B, "first_value": rng.randrange(200, 900),
                      "script": script})
    return cases


class PrefixPool:
    def __init__(self, num_blocks):
        self.refcounts = [0] * num_blocks
        self.key_of = [None] * num_blocks
        self.block_of = {}
        self.keyless_free = deque(range(num_blocks))
        self.cached_free = OrderedDict()
        self.evicted = []

    def cache(self, block_id, key):
        self.key_of[block_id], self.block_of[key] = key, block_id

    def allocate(self):
        if self.keyless_free:
            block_id = self.keyless_free.popleft()
        elif self.cached_free:
            block_id, _ = self.cached_free.popitem(last=False)
            self._evict(block_id)
        else:
            raise OutOfBlocks("every block is in use")
        self.refcounts[block_id] = 1
        return block_id

    def _evict(self, block_id):
        del self.block_of[self.key_of[block_id]]
        self.key_of[block_id] = None
        self.evicted.append(block_id)

    def free(self, block_id):
        self.refcounts[block_id] -= 1
        if self.refcounts[block_id] == 0:
            if self.key_of[block_id] is None:
                self.keyless_free.append(block_id)
            else:
                self.cached_free[block_id] = None

    def hit(self, key):
        block_id = self.block_of.get(key)
        if block_id is None:
            return None
        if self.refcounts[block_id] == 0:
            del self.cached_free[block_id]
        self.refcounts[block_id] += 1
        return block_id


# Two requests share a 2-block prefix (keys p0, p1); A also caches a0, B holds a partial block.
# They free tail first. Then C hits p0 and p1 again, and new blocks must come from elsewhere.
LRU_CASES = [{"num_blocks": 6, "script": [
    ["allocate", 4], ["cache", [0, "p0"]], ["cache", [1, "p1"]], ["cache", [2, "a0"]],  # A: 0 1 2, plus B's tail 3
    ["hit", "p0"], ["hit", "p1"],  # B shares A's prefix
    ["free", [3, 1, 0]],  # B finishes, tail first
    ["free", [2, 1, 0]],  # A finishes, tail first
    ["hit", "p0"], ["hit", "p1"],  # C finds the prefix, sitting in the free queue
    ["allocate", 4],  # keyless 4, 5, 3 first, then the least recently freed cached block: a0 is evicted
    ["hit", "a0"],  # gone
    ["allocate", 1],  # nothing is free: C holds p0 and p1, the rest are in use
    ["free", [1, 0]], ["allocate", 2],  # p1 was freed before p0: evict p1, then p0
]}]


def _hidden_lru(rng):
    cases = []
    for _ in range(3):
        n = rng.randrange(4, 8)
        pool, script, keys = PrefixPool(n), [], 0
        for _ in range(14):
            held = [b for b in range(n) if pool.refcounts[b] > 0]
            uncached = [b for b in held if pool.key_of[b] is None]
            choice = rng.random()
            if choice < 0.3 or not held:
                step = ["allocate", rng.randrange(1, 3)]
            elif choice < 0.5 and uncached:
                step, keys = ["cache", [rng.choice(uncached), f"k{keys}"]], keys + 1
            elif choice < 0.75:
                step = ["free", rng.sample(held, rng.randrange(1, len(held) + 1))]
            else:
                step = ["hit", f"k{rng.randrange(0, keys + 1)}"]
            script.append(step)
            _apply(pool, step)
        cases.append({"num_blocks": n, "script": script})
    return cases


def _apply(pool, step):
    op, arg = step
    if op == "cache":
        pool.cache(*arg)
    elif op == "free":
        for b in arg:
            pool.free(b)
    elif op == "hit":
        pool.hit(arg)
    else:
        for _ in range(arg):
            try:
                pool.allocate()
            except OutOfBlocks:
                pass


SIDES = {
    "block_keys": Side(_keys_cases, _hidden_keys, lambda: (block_keys,)),
    "hit_tokens": Side(_hits_cases, _hidden_hits, lambda: (hit_tokens,)),
    "cow_append": Side(lambda: COW_CASES, _hidden_cow, lambda: (CowTable,)),
    "lru": Side(lambda: LRU_CASES, _hidden_lru, lambda: (PrefixPool,)),
}
