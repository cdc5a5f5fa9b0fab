"""Checks for chapter 06: block keys and prefix hits, copy-on-write on append, LRU eviction.

Each check runs the learner's code and a small reference (private to this
module) through the same script and compares them step by step. The scripts
are built so that the classic mistakes of prefix sharing show up as a wrong
value, not as a crash:

- hashing a block without its parent's key (two prompts that differ early but
  share a later block get the same key);
- caching a partly filled block (a key for the tail of a prompt);
- evicting a block that a sequence holds again after a hit;
- writing the new token into a shared block before copying it.

The hash function is passed in, so the checks can use a transparent one (the
key *is* the tuple ``(parent, tokens, extra)``) and a deliberately weak one
that collides.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from functools import partial

from minipaged.block_manager import BlockAllocator, OutOfBlocks
from minipaged.checks import CheckFailed, check, expect_equal

# Staged hints: the first names the idea (stubs carry it), later ones come closer to code on request,
# `hint("6.1", 2)`. None of them is the solution.
HINTS = {
    "6.1": [
        "a block's K/V depends on every token before it, so its key must too: each full block's key hashes its "
        "parent's key, its own tokens and the extra keys; a partly filled block gets no key",
        "how many full blocks does a prompt of n tokens have? Not chapter 01's blocks_needed, which counts a partly "
        "filled block too",
        "keep the last key in a variable as you walk the blocks: it is the next block's parent; the salt goes into "
        "block 0's extra keys only",
    ],
    "6.2": [
        "a hit is a leading run of blocks whose key is cached and whose cached tokens equal the prompt's; the block "
        "that holds the last prompt token is always computed",
        "your block_keys from Task 6.1 does half the work; a key found with different tokens is a collision, a miss",
        "the last prompt token (position n - 1) lives in block (n - 1) // block_size: only blocks before it can hit, "
        "and the run stops at the first miss",
    ],
    "6.3": [
        "copy-on-write: a write into a last block that another table still holds must go to a private copy, and a "
        "short pool must leave everything as it was",
        "the new token's offset in its block is num_tokens % block_size: what does an offset of 0 tell you, and what "
        "does a refcount above 1 tell you?",
        "order matters twice: allocate before you let go of anything (so a full pool changes nothing), and copy the "
        "slots written so far before you write the new token",
    ],
    "6.4": [
        "free blocks without a key go out first, oldest first; cached free blocks are evicted least recently freed "
        "first; a hit on a free cached block takes it out of the free queue",
        "OrderedDict.popitem(last=False) removes the oldest entry; del d[k] removes any entry in O(1)",
        "what goes wrong if a block that a sequence holds again is still in cached_free? An evicted block's key must "
        "disappear from both maps",
    ],
}


def transparent_hash(parent, token_ids, extra):
    """A "hash" that keeps everything it was given, so a check can see what went into a key."""
    return (parent, tuple(token_ids), tuple(extra))


def weak_hash(parent, token_ids, extra):
    """A deliberately bad hash: the sum of the tokens mod 5, chained. Many different blocks collide."""
    return ((parent or 0) * 7 + sum(token_ids) + len(extra)) % 5


def _expect_raises(exc_type, fn, what: str) -> None:
    try:
        fn()
    except exc_type:
        return
    except NotImplementedError:
        raise
    except Exception as exc:
        raise CheckFailed(f"{what} raised {type(exc).__name__}: {exc}; expected {exc_type.__name__}") from None
    raise CheckFailed(f"{what} returned normally; expected it to raise {exc_type.__name__}")


# ---------------------------------------------------------------------------
# Task 6.1 and 6.2: block keys and hits
# ---------------------------------------------------------------------------


def _ref_block_keys(token_ids, block_size, hash_fn, salt=None):
    keys, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        extra = (salt,) if start == 0 and salt is not None else ()
        parent = hash_fn(parent, tuple(token_ids[start : start + block_size]), extra)
        keys.append(parent)
    return keys


def _ref_hit_tokens(token_ids, block_size, hash_fn, cached, salt=None):
    limit = (len(token_ids) - 1) // block_size  # the last prompt token is always computed
    hits = 0
    for i, key in enumerate(_ref_block_keys(token_ids, block_size, hash_fn, salt)[:limit]):
        if cached.get(key) != tuple(token_ids[i * block_size : (i + 1) * block_size]):
            break
        hits += 1
    return hits * block_size


def _keys(result, what: str) -> list:
    if not isinstance(result, list | tuple):
        raise CheckFailed(f"{what} returned {result!r}; return a list with one key per full block")
    return list(result)


# Prompts of block size 4. a and b share two blocks; c differs from a in its first block only, so
# its later blocks hold the same tokens as a's but sit behind a different parent.
_SYSTEM = [11, 12, 13, 14, 21, 22, 23, 24]
_PROMPTS = {
    "a": _SYSTEM + [31, 32, 33, 34, 41, 42],
    "b": _SYSTEM + [51, 52, 53, 54, 61, 62, 63, 64],
    "c": [99, 12, 13, 14, 21, 22, 23, 24, 31, 32, 33, 34],
    "short": [11, 12, 13],
}


@check("ch06.block_keys", hint=HINTS["6.1"][0])
def check_block_keys(block_keys):
    cases = [(name, p, 4, None) for name, p in _PROMPTS.items()]
    cases += [("a", _PROMPTS["a"], 8, None), ("a", _PROMPTS["a"], 4, "tenant-1"), ("empty", [], 4, None)]
    for name, prompt, B, salt in cases:
        what = f"block_keys(prompt {name} of {len(prompt)} tokens, block_size={B}, salt={salt!r})"
        got = _keys(block_keys(list(prompt), B, transparent_hash, salt), what)
        want = _ref_block_keys(prompt, B, transparent_hash, salt)
        if len(got) != len(want):
            raise CheckFailed(
                f"{what} gave {len(got)} keys for {len(prompt) // B} full blocks"
                + (" (a partly filled block has no key: its tokens are not final)" if len(got) > len(want) else "")
            )
        for i, (g, w) in enumerate(zip(got, want)):
            if g != w:
                if isinstance(g, tuple) and len(g) == 3 and g[0] != w[0]:
                    raise CheckFailed(f"{what}: key {i} was hashed with parent {g[0]!r}, expected the key of block "
                                      f"{i - 1} (block 0's parent is None)")
                raise CheckFailed(f"{what}: key {i} is {g!r}, expected {w!r}")
    # Same later blocks, different first block: with the parent in the key, nothing after block 0 agrees.
    ka = block_keys(list(_PROMPTS["a"]), 4, transparent_hash, None)
    kc = block_keys(list(_PROMPTS["c"]), 4, transparent_hash, None)
    if set(ka) & set(kc):
        raise CheckFailed("prompts a and c differ in block 0 but share a key: every key must chain through its parent")
    return f"{len(cases)} prompts: one key per full block, chained through the parent, salt in block 0"


@check("ch06.hit_tokens", hint=HINTS["6.2"][0])
def check_hit_tokens(hit_tokens):
    B = 4
    cached = {}
    for name in ("a",):  # request a ran first and left its full blocks in the cache
        prompt = _PROMPTS[name]
        for i, key in enumerate(_ref_block_keys(prompt, B, transparent_hash)):
            cached[key] = tuple(prompt[i * B : (i + 1) * B])
    exact = _SYSTEM + [31, 32, 33, 34]  # exactly three blocks, all cached: the third is recomputed
    cases = [("a", _PROMPTS["a"]), ("b", _PROMPTS["b"]), ("c", _PROMPTS["c"]), ("short", _PROMPTS["short"]),
             ("exactly 3 blocks", exact), ("system prompt alone", _SYSTEM)]
    for name, prompt in cases:
        what = f"hit_tokens(prompt {name} of {len(prompt)} tokens, block_size=4)"
        got = hit_tokens(list(prompt), B, transparent_hash, dict(cached))
        expect_equal(got, _ref_hit_tokens(prompt, B, transparent_hash, cached), what)
    # A weak hash: prompt d's first block collides with a's, but its tokens differ. The token check refuses it.
    weak = {}
    for i, key in enumerate(_ref_block_keys(_PROMPTS["a"], B, weak_hash)):
        weak.setdefault(key, tuple(_PROMPTS["a"][i * B : (i + 1) * B]))
    # d's first block has the same sum as a's, so the same weak key; its second block then collides with a's
    # first one, tokens and all. Only the tokens of the first block tell the two apart, and a miss ends the prefix.
    d = [12, 11, 14, 13, 11, 12, 13, 14, 1]
    expect_equal(hit_tokens(list(d), B, weak_hash, dict(weak)), _ref_hit_tokens(d, B, weak_hash, weak),
                 "hit_tokens with a weak hash whose first key collides (a hit must compare the tokens)")
    salted = hit_tokens(list(_PROMPTS["b"]), B, transparent_hash, dict(cached), "tenant-2")
    expect_equal(salted, 0, "hit_tokens(prompt b, salt='tenant-2') against blocks cached without a salt")
    return f"{len(cases) + 2} prompts: hits stop at the first miss, collisions refused, last token always computed"


# ---------------------------------------------------------------------------
# Task 6.3: copy-on-write on append
# ---------------------------------------------------------------------------

_EMPTY = "·"


class _RefCowTable:
    def __init__(self, allocator, data, seq_id=None):
        self.allocator, self.data, self.seq_id = allocator, data, seq_id
        self.blocks, self.num_tokens = [], 0

    def fork(self, seq_id=None):
        child = _RefCowTable(self.allocator, self.data, seq_id)
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


def _tokens(table, data, B) -> list:
    return [data[table.blocks[p // B] * B + p % B] for p in range(table.num_tokens)]


@check("ch06.cow_append", hint=HINTS["6.3"][0])
def check_cow_append(cls):
    B, num_blocks = 4, 6
    mine_alloc, ref_alloc = BlockAllocator(num_blocks, B), BlockAllocator(num_blocks, B)
    mine_data, ref_data = [_EMPTY] * (num_blocks * B), [_EMPTY] * (num_blocks * B)
    mine = {"p": cls(mine_alloc, mine_data, "p")}
    ref = {"p": _RefCowTable(ref_alloc, ref_data, "p")}
    # p writes 6 tokens; c1 forks (block 1 is shared and half full); c1 and p each append once (the first copies,
    # the second then owns block 1 alone and writes in place); c2 forks at a block boundary and appends
    # (a new block, no copy); c3 forks c2 mid-block and copies the last free block; c4 forks c2 and finds the
    # pool empty, as does c2 itself, whose tail block c4 now shares.
    script = [("p", "append", 6), ("p", "fork", "c1"), ("c1", "append", 1), ("p", "append", 1),
              ("c1", "append", 3), ("p", "append", 1), ("p", "fork", "c2"), ("c2", "append", 2),
              ("c2", "fork", "c3"), ("c3", "append", 1), ("c2", "append", 1), ("c2", "fork", "c4"),
              ("c4", "append", 1), ("c2", "append", 1)]
    counter = iter(range(100, 1000))
    for seq, op, arg in script:
        if op == "fork":
            mine[arg], ref[arg] = mine[seq].fork(arg), ref[seq].fork(arg)
            continue
        for _ in range(arg):
            value = next(counter)
            what = f"{seq}.append({value}) with {ref[seq].num_tokens} tokens in blocks {ref[seq].blocks}"
            last = ref[seq].blocks[-1] if ref[seq].blocks else None
            shared = last is not None and ref_alloc.refcount(last) > 1 and ref[seq].num_tokens % B
            before = list(mine_data[last * B : last * B + B]) if last is not None else None
            if ref_alloc.num_free == 0 and (shared or ref[seq].num_tokens % B == 0):
                state = (list(mine[seq].blocks), mine[seq].num_tokens, list(mine_alloc.refcounts), list(mine_data))
                _expect_raises(OutOfBlocks, partial(mine[seq].append, value), what + " on a full pool")
                if (list(mine[seq].blocks), mine[seq].num_tokens, list(mine_alloc.refcounts), list(mine_data)) != state:
                    raise CheckFailed(f"{what} on a full pool raised OutOfBlocks but changed the table, refcounts "
                                      "or the cache first")
                continue
            want = ref[seq].append(value)
            got = mine[seq].append(value)
            if shared and mine_data[last * B : last * B + B] != before:
                raise CheckFailed(f"{what}: the shared block {last} changed (was {before}, now "
                                  f"{mine_data[last * B:last * B + B]}); its other holders read it, so copy it "
                                  "and write into the copy")
            expect_equal(got, want, what)
            expect_equal(list(mine[seq].blocks), ref[seq].blocks, f"blocks after {what}")
            expect_equal(mine[seq].num_tokens, ref[seq].num_tokens, f"num_tokens after {what}")
            expect_equal(list(mine_alloc.refcounts), ref_alloc.refcounts, f"the pool's refcounts after {what}")
    for seq, table in ref.items():
        expect_equal(_tokens(mine[seq], mine_data, B), _tokens(table, ref_data, B), f"the tokens sequence {seq} reads")
    return (f"{len(script)} appends and forks: a shared tail block is copied before the write, unshared and "
            "full ones are not, OutOfBlocks leaves everything as it was")


# ---------------------------------------------------------------------------
# Task 6.4: LRU eviction of unreferenced cached blocks
# ---------------------------------------------------------------------------


class _RefPrefixPool:
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
            del self.block_of[self.key_of[block_id]]
            self.key_of[block_id] = None
            self.evicted.append(block_id)
        else:
            raise OutOfBlocks("every block is in use")
        self.refcounts[block_id] = 1
        return block_id

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


def _lru_state(pool) -> tuple:
    return (list(pool.refcounts), list(pool.keyless_free), list(pool.cached_free), list(pool.evicted))


@check("ch06.lru", hint=HINTS["6.4"][0])
def check_lru(cls):
    mine, ref = cls(6), _RefPrefixPool(6)
    # Two requests share a 2-block prefix (keys p0, p1); A also caches a0, B holds a partial block.
    # They free tail first. Then C hits p0 and p1 again, and new blocks must come from elsewhere.
    script = [
        ("allocate", 4), ("cache", (0, "p0")), ("cache", (1, "p1")), ("cache", (2, "a0")),  # A: 0 1 2, plus B's tail 3
        ("hit", "p0"), ("hit", "p1"),  # B shares A's prefix
        ("free", [3, 1, 0]),  # B finishes, tail first
        ("free", [2, 1, 0]),  # A finishes, tail first
        ("hit", "p0"), ("hit", "p1"),  # C finds the prefix, sitting in the free queue
        ("allocate", 4),  # keyless 4, 5, 3 first, then the least recently freed cached block: a0 is evicted
        ("hit", "a0"),  # gone
        ("allocate", 1),  # nothing is free: C holds p0 and p1, the rest are in use
        ("free", [1, 0]), ("allocate", 2),  # p1 was freed before p0: evict p1, then p0
    ]
    for step, (op, arg) in enumerate(script, 1):
        what = f"step {step}, {op}({arg!r})"
        if op == "cache":
            mine.cache(*arg)
            ref.cache(*arg)
        elif op == "free":
            for b in arg:
                mine.free(b)
                ref.free(b)
        elif op == "hit":
            expect_equal(mine.hit(arg), ref.hit(arg), f"hit({arg!r})")
        else:
            for _ in range(arg):
                if not ref.keyless_free and not ref.cached_free:
                    before = _lru_state(mine)
                    _expect_raises(OutOfBlocks, mine.allocate, "allocate() with every block held")
                    if _lru_state(mine) != before:
                        raise CheckFailed("allocate() with every block held raised OutOfBlocks but changed the state")
                    continue
                want = ref.allocate()
                got = mine.allocate()
                if got != want and mine.refcounts[got] > 1:
                    raise CheckFailed(f"allocate() returned block {got}, which a sequence still holds "
                                      f"(refcount {mine.refcounts[got]}): a hit must take it out of the free queue")
                expect_equal(got, want, f"allocate() ({'keyless' if want not in ref.evicted else 'evicting'})")
        held = [b for b in mine.cached_free if mine.refcounts[b] > 0]
        if held:
            raise CheckFailed(f"after {what}, block {held[0]} is held (refcount {mine.refcounts[held[0]]}) but "
                              "still in cached_free, so allocate() could evict it: a hit must take it out of the "
                              "free queue")
        expect_equal(_lru_state(mine)[0], _lru_state(ref)[0], f"refcounts after {what}")
        expect_equal(list(mine.keyless_free), list(ref.keyless_free), f"keyless_free after {what}")
        expect_equal(list(mine.cached_free), list(ref.cached_free), f"cached_free (LRU first) after {what}")
        expect_equal(list(mine.evicted), list(ref.evicted), f"the eviction order after {what}")
        expect_equal(dict(mine.block_of), dict(ref.block_of), f"block_of (the keys still cached) after {what}")
    return f"{len(script)} steps: keyless blocks first, then LRU; hits leave the queue; eviction order {ref.evicted}"
