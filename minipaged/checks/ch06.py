"""Checks for chapter 06: block keys, then the prefix cache and copy-on-write inside the real engine.

Exercise 06's pieces are holes in the learner's own package (``minipaged/prefix_cache.py`` and
``BlockTable._copy_on_write`` in ``minipaged/blocks.py``), so the notebook passes the package's own
function and classes; the tests pass other implementations, right and wrong, the same way.

``ch06.block_keys`` calls the learner's ``block_keys`` on prompts with a transparent hash (the
canonical encoding itself, which the probe reads back), so it sees what went into each key. The two
build checks run :func:`~minipaged.checks.engine_run.run_engine` with the learner's class in one of
the engine's seams and the model answer on the reference side:

- ``ch06.prefix_cache``: ``Engine(..., allocator=PrefixCachingAllocator)`` (the model answer's block table,
  copy-on-write included) on shared-system-prompt workloads with ``n = 1`` and ``n = 2`` samples, a salted
  tenant, a pool small enough to evict, and twice with a hash that returns the same key for every block. After
  every step the probe records each admission's hit (the blocks and tokens shared in), each running sequence's
  blocks and their keys, the refcounts, both free queues in order, the counters and the "hit", "evict" and
  "cache" events; the judge names the first step, request and block where the learner's run leaves the model
  answer's, with the hint for that mistake.
- ``ch06.cow_table``: ``Engine(..., block_table=BlockTable)`` (the model answer's pool, no prefix cache) on
  forking workloads: every ``append_tokens`` call (the blocks it says it needs, the slots it returns),
  the copies recorded, the tables and the refcounts, step by step; then the tokens.

Both compare the greedy tokens of every sample with the package's run, token for token.
"""

from __future__ import annotations

import struct
from functools import partial

from minipaged.blocks import BlockAllocator, BlockTable
from minipaged.checks import CheckFailed, _where, check
from minipaged.checks.engine_run import first_token_divergence, run_engine
from minipaged.checks.op_count import instrument, judge_growth, measured
from minipaged.prefix_cache import sha256

# The package modules this exercise rebuilds in a notebook cell: none. Its pieces are holes in the learner's own
# minipaged/prefix_cache.py and minipaged/blocks.py (see minipaged.pieces): the notebook checks the package's classes.
REBUILDS = ()

# Staged hints: the first names the idea (stubs carry it), later ones come closer to code on request,
# `hint("6.2", 2)`. None of them is the solution.
HINTS = {
    "6.1": [
        "a block's K/V depends on every token before it, so its key must too: each full block's key hashes its "
        "parent's key, its own tokens and the extra keys; a partly filled block gets no key",
        "how many full blocks does a prompt of n tokens have? Not chapter 01's blocks_needed, which counts a partly "
        "filled block too",
        "keep the last key in a variable as you walk the blocks: it is the next block's parent; each key is "
        "hash_block_tokens(parent key, the block's tokens, extra_keys(i, cache_salt), hash_fn)",
    ],
    "6.2": [
        "two free queues: keyless free blocks go out first (the base class's queue); free blocks that keep a key "
        "wait least recently used first, and taking one evicts it (its key is dropped everywhere)",
        "num_free counts both queues; _put_free_block decides by whether the block holds a key; a sequence frees "
        "its blocks tail first, so its deepest block is the first of them to be evicted",
        "OrderedDict.popitem(last=False) removes the oldest entry and del d[k] any entry, both O(1); call the base "
        "class's hooks with super() for keyless blocks; blocks_by_key[key] finds the blocks under a key without a scan",
    ],
    "6.3": [
        "keys at allocation: once a block's tokens are all scheduled (num_tokens covers it), it gets its key, "
        "chained from its parent's key, with the salt in block 0 only; a partly filled block gets none",
        "blocks 0 .. num_tokens // block_size - 1 are full; a block that already has a key (shared in, or keyed "
        "in an earlier step) keeps it and is the next one's parent",
        "store with each key what a hit must verify: a CachedBlock with the block's tokens, its extra keys and its "
        "parent's serial (a number given to one entry for its life, never reused)",
    ],
    "6.4": [
        "the match walks the prompt's blocks from block 0 and stops at the first miss; a key found is only a "
        "candidate until the cached block's tokens, extra keys and parent are the prompt's; the block with the "
        "last prompt token is always computed",
        "(len(token_ids) - 1) // block_size blocks may hit; share_prefix takes one more reference on each matched "
        "block, and a matched block that sits in the free queue must leave it",
        "a matched block with refcount 0 sits in evictable_block_ids: take it out there (del, O(1)) and give it "
        "refcount 1; a held one gets one more; the table then starts with the matched blocks and their tokens",
    ],
    "6.5": [
        "copy-on-write: a write into a partly filled last block that another table still holds goes to a fresh "
        "copy, and the table records (old, new) so the engine copies the K/V before the forward pass writes",
        "the copy takes a block: num_new_blocks must count it, and a short pool raises OutOfBlocks before anything "
        "changes",
        "_copy_on_write: allocate the copy, put it in place of the last block, drop one reference to the old "
        "block, record (old, new) in pending_copies and emit \"cow\", all inside the allocator's hold_events()",
    ],
}

# The hint for each diagnosis the build checks make (CheckFailed's hint, printed instead of the stage-1 one).
WHY = {
    "partial": "a partly filled block gets no key: its tokens are not final (keys only for blocks that "
               "num_tokens // block_size covers)",
    "salt": "the cache_salt is block 0's extra key, (cache_salt,), and no other block's; an empty salt is no salt",
    "parent": "a key chains through its parent: hash_block_tokens(parent key, tokens, extra) with the key of the "
              "block before it (None for block 0 only)",
    "late": "keys at allocation: a block gets its key in the step whose scheduled tokens fill it",
    "verify": "a key is only a hash (here every block has the same one): a hit must be checked against the cached "
              "block's tokens, its extra keys and its parent (the very entry matched before it), or it is a miss",
    "last": "the block that holds the last prompt token is always computed: its logits give the first token, so "
            "at most (len(token_ids) - 1) // block_size blocks can hit",
    "miss": "a block the package's cache still finds was not found in yours: was its key dropped, or the wrong "
            "block evicted (least recently used first, keyless free blocks before any cached one)?",
    "incref": "sharing a block is one more reference: incref a block that is held, take a free one back with "
              "refcount 1",
    "held": "a matched block that sat in the free queue must leave it when it is shared, or allocate() may evict a "
            "block a sequence holds",
    "lru": "free cached blocks leave least recently used first (popitem(last=False)), and only once no keyless "
           "block is free",
    "keep": "a freed block that holds a key keeps it and joins the LRU queue (the most recently used end); only an "
            "eviction drops the key",
    "tail": "a finished sequence frees its blocks tail first, so its deepest block joins the LRU queue first and "
            "a shared prefix stays cached longest",
    "drop": "an evicted block loses its key everywhere (its entry and its place under the key), or a later hit "
            "would read K/V that was overwritten",
    "count": "count every lookup once (share_prefix records it, preempted re-admissions apart), every eviction, and "
             "every lookup that found a key holding other tokens (collisions)",
    "events": "publish what the chapter's block map and the dashboards listen for: \"hit\" for each block shared in, "
              "\"evict\" when a cached block is taken for new use, \"cache\" when a block gets its key, each with "
              "the block and the sequence",
    "queue": "num_free counts both free queues; a keyless freed block goes back to the base class's queue",
    "cow_need": "num_new_blocks(n) counts the copy: one block more when the write lands in a shared, partly filled "
                "last block",
    "cow_write": "the new tokens must not land in a block another table still holds: copy first, then hand out "
                 "the slots (in the copy)",
    "cow_pair": "pending_copies holds (source, destination): the old shared block first, the fresh copy second",
    "cow_decref": "after the copy the table holds the new block only: drop one reference to the old one",
    "cow_record": "the table never touches K/V: record each copy as (old, new) in pending_copies, and the engine "
                  "copies the K/V before the forward pass writes",
    "cow_only": "copy only a partly filled last block whose refcount is above 1: an unshared block is written in "
                "place, and a full block is never written again (the next token starts a new block)",
    "cost": "an OrderedDict used as an ordered set does all the LRU queue needs in O(1): d[b] = None appends, "
            "del d[b] takes a block out of the middle, popitem(last=False) evicts the oldest; a list or deque "
            "walks for remove() and pop(0), and min() or a scan walks every block",
    "tokens": "the bookkeeping agreed but a sequence read other K/V: check what each table's blocks hold",
}


def collide(data: bytes) -> bytes:
    """A hash that gives every block the same key: only verification keeps the cache right."""
    return b"\x00"


HASHES = {"sha256": sha256, "collide": collide}


def transparent_hash(data: bytes) -> bytes:
    """A "hash" that keeps everything it was given: the key is the canonical encoding itself (see ``read_key``)."""
    return data


def _unpack(data: bytes, at: int) -> tuple[bytes, int]:
    (n,) = struct.unpack_from("<Q", data, at)
    if at + 8 + n > len(data):
        raise ValueError("a field runs past the key")
    return data[at + 8 : at + 8 + n], at + 8 + n


def read_key(key) -> list | dict:
    """A key made with :func:`transparent_hash`, read back as ``[parent, token ids, extra keys]`` (plain data).

    ``parent`` is the parent's key read the same way (None for block 0). A key that is not such an encoding (the
    learner hashed another way, or not with ``hash_fn``) reads as ``{"opaque": its repr}``.
    """
    try:
        if type(key) is not bytes:
            raise ValueError
        if key[:1] == b"\x00":
            parent, at = None, 1
        elif key[:1] == b"\x01":
            raw, at = _unpack(key, 1)
            parent = read_key(raw)
            if type(parent) is dict:
                raise ValueError
        else:
            raise ValueError
        packed, at = _unpack(key, at)
        tokens = list(struct.unpack(f"<{len(packed) // 8}q", packed))
        (count,), at = struct.unpack_from("<Q", key, at), at + 8
        extra = []
        for _ in range(count):
            tag, (raw, at) = key[at : at + 1], _unpack(key, at + 1)
            extra.append(raw.decode() if tag == b"s" else raw.hex())
        if at != len(key):
            raise ValueError
        return [parent, tokens, extra]
    except (ValueError, struct.error, UnicodeDecodeError):
        return {"opaque": repr(key)[:80]}


# ---------------------------------------------------------------------------
# Task 6.1 (a warm-up): block keys
# ---------------------------------------------------------------------------


def _keys_label(case) -> str:
    if "pair" in case:
        return "block_keys of two prompts that differ in block 0 only"
    return f"block_keys(prompt {case['name']} of {len(case['prompt'])} tokens, block_size={case['block_size']}, " \
           f"cache_salt={case['cache_salt']!r})"


@check("ch06.block_keys", hint=HINTS["6.1"][0], label=_keys_label,
       summary=lambda cases, seen: f"{sum('pair' not in c for c in cases)} prompts: one key per full block, chained "
                                   "through the parent, cache_salt in block 0")
def check_block_keys(case, block_keys):
    """``case`` = {"name", "prompt", "block_size", "cache_salt"}, or {"pair": [prompt, prompt]} (keys must not meet).

    ``block_keys`` has the package's signature, ``block_keys(token_ids, block_size, cache_salt, hash_fn)``.
    """
    if "pair" in case:
        return [[read_key(k) for k in block_keys(list(p), 4, cache_salt=None, hash_fn=transparent_hash)]
                for p in case["pair"]]
    keys = block_keys(list(case["prompt"]), case["block_size"], cache_salt=case["cache_salt"], hash_fn=transparent_hash)
    if not isinstance(keys, list | tuple):
        return {"not a list": repr(keys)[:200]}
    return [read_key(k) for k in keys]


@check_block_keys.judge
def _judge_keys(case, got, want):
    if type(got) is dict:
        raise CheckFailed(f"returned {got['not a list']}; return a list with one key per full block")
    if "pair" in case:
        first, second = ({repr(k) for k in keys} for keys in got)
        if first & second:
            raise CheckFailed("prompts a and c differ in block 0 but share a key: every key must chain through "
                              "its parent")
        return
    if len(got) != len(want):
        raise CheckFailed(
            f"gave {len(got)} keys for {len(want)} full blocks"
            + (" (a partly filled block has no key: its tokens are not final)" if len(got) > len(want) else ""))
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            if type(g) is dict:
                raise CheckFailed(f"key {i} is {g['opaque']}: make each key with hash_block_tokens(..., hash_fn), "
                                  "the hash_fn given")
            if type(g) is list and len(g) == 3 and g[0] != w[0]:
                raise CheckFailed(f"key {i} was hashed with parent {g[0]!r}, expected the key of block {i - 1} "
                                  "(block 0's parent is None)")
            if type(g) is list and len(g) == 3 and g[2] != w[2]:
                raise CheckFailed(f"key {i} has the extra keys {g[2]!r}, expected {w[2]!r}: the salt is block 0's "
                                  "only extra key, and an empty salt is no salt")
            raise CheckFailed(f"key {i} is {g!r}, expected {w!r}")


# ---------------------------------------------------------------------------
# The build checks: the engine with the learner's piece in a seam
# ---------------------------------------------------------------------------

STAT_FIELDS = ("requests", "queries", "hits", "preempted_requests", "preempted_queries", "preempted_hits",
               "evictions", "collisions")
EVENTS = ("hit", "evict", "cache")  # what the block map, the dashboards and bench vllm hear of the cache


def _engine_label(case) -> str:
    r = case["requests"]
    salts = sorted({q["cache_salt"] for q in r if q.get("cache_salt")})
    return (f"{case['name']}: {len(r)} requests (n up to {max(q.get('n', 1) for q in r)}"
            + (f", salts {salts}" if salts else "") + f") on {case['config']['num_blocks']} blocks of "
            f"{case['config']['block_size']}, {case['hash']} hash")


def _run(case, log: dict, observe, **seams) -> dict:
    """``run_engine`` on ``case``; a raise in the learner's code keeps the steps before it (and the step's log)."""
    steps = []

    def record(engine, out):
        steps.append(observe(engine, out))
        return steps[-1]

    try:
        return run_engine(case, observe=record, **seams)
    except NotImplementedError:
        raise
    except Exception as exc:
        return {"steps": steps, "raised": f"{type(exc).__name__}: {exc}{_where(exc)}", "partial": log}


def _key(key):
    if key is None:
        return None
    return key.hex()[:12] if type(key) is bytes else f"not bytes: {type(key).__name__}"


def _probed_cache(cls, log: dict):
    """``cls`` with its ``share_prefix`` calls recorded into ``log["shares"]`` (the hits each admission got) and its
    cache events into ``log["events"]``."""

    class Probed(cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.subscribe(lambda e: log["events"].append([e.kind, e.block_id, str(e.seq_id)])
                           if e.kind in EVENTS else None)

        def share_prefix(self, table, match, *args, **kwargs):
            result = super().share_prefix(table, match, *args, **kwargs)
            log["shares"].append([str(table.seq_id), list(table.blocks), table.num_tokens])
            return result

    return Probed


def _cache_state(engine, log: dict) -> dict:
    alloc = engine.cache.allocator
    stats = alloc.stats()
    state = {"shares": list(log["shares"]),
             "tables": [[str(s.seq_id), [[b, _key(alloc.block_key(b))] for b in s.block_table.blocks]]
                        for s in engine.scheduler.running],
             "refcounts": list(alloc.refcounts),
             "lru": [[b, _key(alloc.block_key(b))] for b in alloc.evictable_block_ids],
             "keyless": list(alloc.free_block_ids),
             "stats": {name: getattr(stats, name) for name in STAT_FIELDS},
             "events": list(log["events"])}
    log["shares"].clear()
    log["events"].clear()
    return state


@check("ch06.prefix_cache", hint=HINTS["6.4"][0], label=_engine_label,
       summary=lambda cases, seen: f"{len(cases)} engine runs ({sum(len(o['steps']) for o in seen)} steps, "
                                   f"{sum(o['steps'][-1]['stats']['hits'] for o in seen)} prompt tokens hit, "
                                   f"{sum(c['hash'] == 'collide' for c in cases)} with a hash that always collides): "
                                   "hits, keys, refcounts, free queues, events and tokens equal the model answer's")
def check_prefix_cache(case, cls):
    """``case`` = a ``run_engine`` case plus "name" and "hash" (``HASHES``); ``cls`` is the learner's allocator."""
    if not (isinstance(cls, type) and issubclass(cls, BlockAllocator)):
        return {"not a class": f"a {type(cls).__name__} {cls!r:.60}; pass your class, a subclass of BlockAllocator"}
    log = {"shares": [], "events": []}
    allocator = partial(_probed_cache(cls, log), hash_fn=HASHES[case["hash"]])
    return _run(case, log, lambda engine, out: _cache_state(engine, log), allocator=allocator)


def _request(case, seq_id: str) -> dict:
    """The case's request that sequence ``seq_id`` (``"r0"`` or ``"('r0', 1)"``) belongs to."""
    for r in case["requests"]:
        if seq_id == r["id"] or seq_id.startswith(f"('{r['id']}',"):
            return r
    return {"id": seq_id, "prompt": [], "cache_salt": None}


def _judge_run(case, got, want, diagnose) -> None:
    """The first step whose record differs (``diagnose(case, got, want, before)`` says how), then the tokens."""
    if type(got) is dict and "not a class" in got:
        raise CheckFailed(f"got {got['not a class']}")
    if type(got) is not dict or type(got.get("steps")) is not list:
        raise CheckFailed("the run's record is missing")
    before = None
    for step, (g, w) in enumerate(zip(got["steps"], want["steps"])):
        if g != w:
            message, why = diagnose(case, g, w, before)
            raise CheckFailed(f"step {step}: {message}", WHY[why])
        before = w
    if "raised" in got:
        step = len(got["steps"])
        problem = diagnose(case, got["partial"], want["steps"][step], before, partial=True) \
            if step < len(want["steps"]) else None
        if problem:
            raise CheckFailed(f"step {step}: {problem[0]}; then your code raised {got['raised']}", WHY[problem[1]])
        raise CheckFailed(f"step {step}: your code raised {got['raised']}")
    if len(got["steps"]) != len(want["steps"]):
        raise CheckFailed(f"the run took {len(got['steps'])} steps, the package's {len(want['steps'])}; the first "
                          f"{min(len(got['steps']), len(want['steps']))} agree", WHY["queue"])
    try:
        first_token_divergence(got["tokens"], want["tokens"])
    except CheckFailed as exc:
        raise CheckFailed(str(exc.args[0]), WHY["tokens"]) from None


def _diagnose_shares(case, g: list, w: list) -> tuple[str, str] | None:
    mine, right = {s[0]: s for s in g}, {s[0]: s for s in w}
    B = case["config"]["block_size"]
    for seq in [s[0] for s in w] + [s[0] for s in g if s[0] not in right]:
        if mine.get(seq) == right.get(seq):
            continue
        prompt = _request(case, seq)["prompt"]
        if seq not in mine:
            _, wb, wn = right[seq]
            why = "last" if len(prompt) % B == 0 else "queue"
            return f"request {seq} was not admitted; the package's engine admits it with {wn} cached tokens", why
        _, gb, gn = mine[seq]
        if seq not in right:
            return f"request {seq} was admitted with {gn} cached tokens, but the package's engine admits it later", \
                "queue"
        _, wb, wn = right[seq]
        first = next((i for i, (a, b) in enumerate(zip(gb, wb)) if a != b), min(len(gb), len(wb)))
        message = (f"request {seq} was admitted with {gn} cached tokens (blocks {gb}), the package's cache finds "
                   f"{wn} (blocks {wb}); they part at logical block {first}")
        if gn > (len(prompt) - 1) // B * B:
            return message, "last"
        if case["hash"] == "collide" and gn >= wn:
            return message, "verify"
        if gn > wn and _request(case, seq).get("cache_salt"):
            return message + " (a salted request)", "salt"
        return message, "drop" if gn > wn else "miss"
    return None


def _diagnose_tables(case, g: list, w: list, before) -> tuple[str, str] | None:
    mine = dict((seq, blocks) for seq, blocks in g)
    if [seq for seq, _ in g] != [seq for seq, _ in w]:
        return (f"the running sequences are {[seq for seq, _ in g]}, the package's engine runs "
                f"{[seq for seq, _ in w]}", "queue")
    for seq, blocks in w:
        for i, ((gb, _), (wb, _)) in enumerate(zip(mine[seq], blocks)):
            if gb != wb:
                why = "queue"
                if before is not None:
                    lru = [b for b, _ in before["lru"]]
                    if gb in lru and before["refcounts"][gb] > 0:
                        why = "held"
                    elif gb in lru and (wb in lru or wb in before["keyless"]):
                        why = "lru"
                return (f"request {seq}'s logical block {i} is block {gb}, the package's is block {wb}"
                        + (" (your allocator evicted a cached block while keyless ones were free)"
                           if why == "lru" and wb in before["keyless"] else ""), why)
        if len(mine[seq]) != len(blocks):
            return f"request {seq} holds {len(mine[seq])} blocks, the package's {len(blocks)}", "queue"
        for i, ((b, gk), (_, wk)) in enumerate(zip(mine[seq], blocks)):
            if gk != wk:
                where = f"request {seq}'s logical block {i} (block {b})"
                salted = bool(_request(case, seq).get("cache_salt"))
                if wk is None:
                    return f"{where} has key {gk}, the package's has none (its tokens are not all scheduled)", \
                        "partial"
                if gk is None:
                    return f"{where} has no key, the package's has {wk} (its tokens are all scheduled)", "late"
                message = f"{where} has key {gk}, the package's {wk}"
                if before is not None and [b, gk] in before["lru"]:
                    return message + " (the key it had before it was evicted)", "drop"
                return message, "salt" if i == 0 or salted else "parent"
    return None


def _diagnose_cache(case, g: dict, w: dict, before, partial: bool = False) -> tuple[str, str] | None:
    """What differs first in one step's record of ``ch06.prefix_cache`` (a message and a ``WHY`` key)."""
    problem = _diagnose_shares(case, g["shares"], w["shares"][: len(g["shares"])] if partial else w["shares"])
    if problem or partial:
        return problem
    problem = _diagnose_tables(case, g["tables"], w["tables"], before)
    if problem:
        return problem
    for b, (gr, wr) in enumerate(zip(g["refcounts"], w["refcounts"])):
        if gr != wr:
            holders = [seq for seq, blocks in w["tables"] if any(x == b for x, _ in blocks)]
            return f"block {b} has refcount {gr}, the package's {wr} (held by {holders})", "incref"
    held = [b for b, _ in g["lru"] if 0 <= b < len(g["refcounts"]) and g["refcounts"][b] > 0]
    if held:
        return (f"block {held[0]} is held (refcount {g['refcounts'][held[0]]}) but still in your LRU queue, so "
                "allocate() could evict it", "held")
    if g["lru"] != w["lru"]:
        mine, right = [b for b, _ in g["lru"]], [b for b, _ in w["lru"]]
        why = ("tail" if sorted(mine) == sorted(right) else "keep" if set(mine) < set(right) else "lru"
               if mine != right else "drop")
        return f"the LRU queue of free cached blocks [block, key] is {g['lru']}, the package's {w['lru']}", why
    if g["keyless"] != w["keyless"]:
        return f"the keyless free blocks are {g['keyless']}, the package's {w['keyless']}", "queue"
    for name in STAT_FIELDS:
        if g["stats"][name] != w["stats"][name]:
            return f"stats().{name} is {g['stats'][name]}, the package's {w['stats'][name]}", "count"
    if g["events"] != w["events"]:
        first = next((i for i, (a, b) in enumerate(zip(g["events"], w["events"])) if a != b),
                     min(len(g["events"]), len(w["events"])))
        mine, right = (e[first] if first < len(e) else None for e in (g["events"], w["events"]))
        return (f"event {first} of the step ([kind, block, sequence]) is {mine}, the package's {right} "
                f"(your cache published {len(g['events'])} hit/evict/cache events, the package's "
                f"{len(w['events'])})", "events")
    return f"the record differs: {g!r:.300}", "queue"


@check_prefix_cache.judge
def _judge_cache(case, got, want):
    _judge_run(case, got, want, _diagnose_cache)


# ---------------------------------------------------------------------------
# O(1): the free queues' operations counted on two pool sizes
# ---------------------------------------------------------------------------


def _count_cache_ops(cls, num_blocks: int, block_size: int) -> list[int]:
    """Operations of each measured call, on a pool whose free blocks all hold keys.

    Not measured: half as many two-block sequences as the pool has blocks fill it, get their keys and
    finish in order, so the LRU queue holds every block, the first sequence's least recently used. The
    calls then evict, match and share a sequence from the middle of the queue, and free again.
    """
    B, cache = block_size, cls(num_blocks, block_size)
    instrument(cache)
    prompts = [list(range(i * 2 * B, (i + 1) * 2 * B)) for i in range(num_blocks // 2)]
    tables = [BlockTable(cache, f"fill{i}") for i in range(len(prompts))]
    for table, prompt in zip(tables, prompts):
        table.append_tokens(len(prompt))
        cache.cache_full_blocks(table, prompt, len(prompt), None)
    for table in tables:
        table.release()
    counts = []

    def measure(fn, *args):
        result, ops = measured(fn, *args)
        counts.append(ops)
        return result

    measure(lambda: cache.num_free)
    evicted = measure(cache.allocate, "a")
    measure(cache.free, evicted, "a")
    prompt = prompts[len(prompts) // 2] + [0]
    match = measure(cache.match_prefix, prompt, None)
    table = BlockTable(cache, "b")
    measure(cache.share_prefix, table, match)
    table.append_tokens(1)
    measure(cache.cache_full_blocks, table, prompt, len(prompt), None)
    measure(table.release)
    measure(cache.allocate, "c")
    return counts


CACHE_CALLS = ["num_free", "allocate() that evicts", "free(block), keyless", "match_prefix of a 2-block prefix",
               "share_prefix of 2 free cached blocks from the middle of the LRU queue",
               "cache_full_blocks of a 3-block table", "free_sequence of 3 blocks, 2 with keys",
               "allocate() that evicts again"]  # fmt: skip


@check("ch06.constant_time", hint=HINTS["6.2"][0], formative=True,
       label=lambda c: f"pools of {c['sizes'][0]} and {c['sizes'][1]} blocks, every free block cached",
       summary=lambda cases, seen: f"{len(CACHE_CALLS)} calls cost the same on pools of {cases[0]['sizes'][0]} "
                                   f"and {cases[0]['sizes'][1]} blocks")
def check_constant_time(case, cls):
    """``case`` = {"sizes": [small, large], "block_size"}: the operations of each measured call, on each size."""
    if not (isinstance(cls, type) and issubclass(cls, BlockAllocator)):
        return {"not a class": f"a {type(cls).__name__} {cls!r:.60}; pass your class, a subclass of BlockAllocator"}
    return {"counts": [_count_cache_ops(cls, n, case["block_size"]) for n in case["sizes"]]}


@check_constant_time.judge
def _judge_cache_cost(case, got, want):
    if "not a class" in got:
        raise CheckFailed(got["not a class"])
    judge_growth(CACHE_CALLS, case["sizes"], got["counts"], lambda call: WHY["cost"])


def _probed_table(cls, log: dict):
    """``cls`` with each ``append_tokens`` (blocks needed, slots, the last block before) and copy put in ``log``."""

    class Probed(cls):
        def append_tokens(self, num_tokens):
            need = self.num_new_blocks(num_tokens)
            last = [self.blocks[-1], self.allocator.refcount(self.blocks[-1])] if self.blocks else None
            slots = super().append_tokens(num_tokens)
            log["appends"].append([str(self.seq_id), num_tokens, need, [int(s) for s in slots], last])
            return slots

        def take_pending_copies(self):
            copies = super().take_pending_copies()
            log["copies"] += [[str(self.seq_id), [int(b) for b in copy]] for copy in copies]
            return copies

    return Probed


def _table_state(engine, log: dict) -> dict:
    state = {"appends": list(log["appends"]), "copies": list(log["copies"]),
             "tables": [[str(s.seq_id), list(s.block_table.blocks)] for s in engine.scheduler.running],
             "refcounts": list(engine.cache.allocator.refcounts)}
    log["appends"].clear()
    log["copies"].clear()
    return state


@check("ch06.cow_table", hint=HINTS["6.5"][0], label=_engine_label,
       summary=lambda cases, seen: f"{len(cases)} engine runs with forks ("
                                   f"{sum(len(s['copies']) for o in seen for s in o['steps'])} copies on write): "
                                   "blocks needed, slots, copies, refcounts and tokens equal the model answer's")
def check_cow_table(case, cls):
    """``case`` = a ``run_engine`` case plus "name" and "hash"; ``cls`` is the learner's block table class."""
    if not (isinstance(cls, type) and issubclass(cls, BlockTable)):
        return {"not a class": f"a {type(cls).__name__} {cls!r:.60}; pass your class, BlockTable (or a subclass)"}
    log = {"appends": [], "copies": []}
    return _run(case, log, lambda engine, out: _table_state(engine, log), block_table=_probed_table(cls, log))


def _diagnose_appends(g: list, w: list, B: int) -> tuple[str, str] | None:
    for (seq, n, gneed, gslots, last), (_, _, wneed, wslots, wlast) in zip(g, w):
        what = f"request {seq}'s append_tokens({n})"
        if last != wlast:
            return f"before {what}, its last block is {last} [block, refcount], the package's {wlast}", "cow_decref"
        if last is not None:
            what += f" after block {last[0]} (refcount {last[1]})"
        if gneed != wneed:
            return f"{what}: num_new_blocks({n}) said {gneed}, the package's {wneed}", \
                "cow_only" if gneed > wneed else "cow_need"
        if gslots != wslots:
            shared = last is not None and last[1] > 1 and any(s // B == last[0] for s in gslots)
            return f"{what} returned slots {gslots}, the package's {wslots}" + (
                f": slots in block {last[0]}, which another table still holds" if shared else ""), \
                "cow_write" if shared else "cow_only"
    return None


def _diagnose_table(case, g: dict, w: dict, before, partial: bool = False) -> tuple[str, str] | None:
    """What differs first in one step's record of ``ch06.cow_table`` (a message and a ``WHY`` key)."""
    problem = _diagnose_appends(g["appends"], w["appends"], case["config"]["block_size"])
    if problem or partial:
        return problem
    if g["copies"] != w["copies"]:
        mine, right = g["copies"], w["copies"]
        seq = next((a[0] for a, b in zip(mine, right) if a != b), (mine + right)[min(len(mine), len(right))][0])
        why = ("cow_pair" if [[s, c[::-1]] for s, c in mine] == right else "cow_record" if len(mine) < len(right)
               else "cow_only")
        return (f"request {seq} recorded the copies {[c for s, c in mine if s == seq]} (source, destination), "
                f"the package's {[c for s, c in right if s == seq]}", why)
    if g["tables"] != w["tables"]:
        return f"the tables are {g['tables']}, the package's {w['tables']}", "cow_only"
    for b, (gr, wr) in enumerate(zip(g["refcounts"], w["refcounts"])):
        if gr != wr:
            return f"block {b} has refcount {gr}, the package's {wr}", "cow_decref"
    return f"the record differs: {g!r:.300}", "cow_only"


@check_cow_table.judge
def _judge_table(case, got, want):
    _judge_run(case, got, want, _diagnose_table)
