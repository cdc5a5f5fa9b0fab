"""Checks for chapter 06: block keys and prefix hits, copy-on-write on append, LRU eviction.

Each probe runs the learner's code through a script and records what it returned and the state
after each step; the reference (``minipaged.checks.instructor.ch06``) runs the same script, and the
judge compares the two step by step. The scripts
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

from minipaged.block_manager import BlockAllocator
from minipaged.checks import CheckFailed, check, expect_equal, expect_raised, outcome, to_tuples

# The package modules this exercise rebuilds: the grader flags a learner's cell that imports, subclasses or
# calls them (a flag for the instructor, not a verdict).
REBUILDS = ("minipaged.prefix_cache",)

# Staged hints: the first names the idea (stubs carry it), later ones come closer to code on request,
# `hint("6.1", 2)`. None of them is the solution.
HINTS = {
    "6.1": [
        "a block's K/V depends on every token before it, so its key must too: each full block's key hashes its "
        "parent's key, its own tokens and the extra keys; a partly filled block gets no key",
        "how many full blocks does a prompt of n tokens have? Not chapter 01's blocks_needed, which counts a partly "
        "filled block too",
        "keep the last key in a variable as you walk the blocks: it is the next block's parent; the cache_salt goes "
        "into block 0's extra keys only",
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


HASHES = {"transparent": transparent_hash, "weak": weak_hash}


# ---------------------------------------------------------------------------
# Task 6.1 and 6.2: block keys and hits
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
    """``case`` = {"name", "prompt", "block_size", "cache_salt"}, or {"pair": [prompt, prompt]} (keys must not meet)."""
    if "pair" in case:
        return [block_keys(list(p), 4, transparent_hash, None) for p in case["pair"]]
    keys = block_keys(list(case["prompt"]), case["block_size"], transparent_hash, case["cache_salt"])
    if not isinstance(keys, list | tuple):
        return {"not a list": repr(keys)[:200]}
    return list(keys)


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
            if type(g) is list and len(g) == 3 and g[0] != w[0]:
                raise CheckFailed(f"key {i} was hashed with parent {g[0]!r}, expected the key of block {i - 1} "
                                  "(block 0's parent is None)")
            raise CheckFailed(f"key {i} is {g!r}, expected {w!r}")


def _hits_label(case) -> str:
    extra = f", cache_salt={case['cache_salt']!r}" if case["cache_salt"] is not None else ""
    return f"hit_tokens(prompt {case['name']} of {len(case['prompt'])} tokens, block_size={case['block_size']}, " \
           f"{case['hash']} hash{extra})"


@check("ch06.hit_tokens", hint=HINTS["6.2"][0], label=_hits_label,
       summary="{n} prompts: hits stop at the first miss, collisions refused, last token always computed")
def check_hit_tokens(case, hit_tokens):
    """``case`` = {"name", "prompt", "block_size", "hash", "cached": [[key, tokens], ...], "cache_salt"}."""
    cached = {to_tuples(key): tuple(tokens) for key, tokens in case["cached"]}
    return hit_tokens(list(case["prompt"]), case["block_size"], HASHES[case["hash"]], cached, case["cache_salt"])


# ---------------------------------------------------------------------------
# Task 6.3: copy-on-write on append
# ---------------------------------------------------------------------------

_EMPTY = "·"


def _cow_state(table, alloc, data) -> dict:
    return {"blocks": list(table.blocks), "num_tokens": table.num_tokens, "refcounts": list(alloc.refcounts),
            "data": list(data)}


def _tokens(table, data, B) -> list:
    return [data[table.blocks[p // B] * B + p % B] for p in range(table.num_tokens)]


@check("ch06.cow_append", hint=HINTS["6.3"][0], label=lambda c: f"a script of {len(c['script'])} appends and forks "
       f"on a pool of {c['num_blocks']} blocks of {c['block_size']}",
       summary=lambda cases, seen: f"{sum(len(c['script']) for c in cases)} appends and forks: a shared tail block is "
                                   "copied before the write, unshared and full ones are not, OutOfBlocks leaves "
                                   "everything as it was")
def check_cow_append(case, cls):
    """``case`` = {"num_blocks", "block_size", "first_value", "script"}; a step is [seq, "append" | "fork", arg]."""
    B = case["block_size"]
    alloc, data = BlockAllocator(case["num_blocks"], B), [_EMPTY] * (case["num_blocks"] * B)
    tables, steps, value = {"p": cls(alloc, data, "p")}, [], case["first_value"]
    for seq, op, arg in case["script"]:
        if seq not in tables:
            steps.append({"missing": seq})
            continue
        if op == "fork":
            try:
                tables[arg] = tables[seq].fork(arg)
            except NotImplementedError:
                raise
            except Exception as exc:
                steps.append({"fork": arg, "raised": f"{type(exc).__name__}: {exc}"})
            else:
                steps.append({"fork": arg})
            continue
        for _ in range(arg):
            table, before = tables[seq], _cow_state(tables[seq], alloc, data)
            steps.append({"seq": seq, "append": value, "before": before, "outcome": outcome(table.append, value),
                          "after": _cow_state(table, alloc, data)})
            value += 1
    steps.append({"reads": {seq: _tokens(table, data, B) for seq, table in tables.items()}})
    return steps


@check_cow_append.judge
def _judge_cow(case, got, want):
    B = case["block_size"]
    if len(got) != len(want):
        raise CheckFailed(f"the script ran {len(got)} steps, expected {len(want)}")
    for step, right in zip(got, want):
        if "missing" in step or "raised" in step:
            raise CheckFailed(f"fork({right.get('fork')!r}) raised {step.get('raised')}" if "raised" in step
                              else f"sequence {step['missing']} was never forked")
        if "fork" in right or "reads" in right:
            expect_equal(step, right, "the tokens each sequence reads:" if "reads" in right else "fork")
            continue
        before, value = right["before"], right["append"]
        what = f"{right['seq']}.append({value}) with {before['num_tokens']} tokens in blocks {before['blocks']}"
        mine = step["before"]
        if "raised" in right["outcome"]:
            expect_raised(step["outcome"], "OutOfBlocks", what + " on a full pool")
            if step["after"] != mine:
                raise CheckFailed(f"{what} on a full pool raised OutOfBlocks but changed the table, refcounts or "
                                  "the cache first")
            continue
        if "raised" in step["outcome"]:
            raise CheckFailed(f"{what} raised {step['outcome']['raised'][0]}: {step['outcome'].get('message')}")
        last = before["blocks"][-1] if before["blocks"] else None
        shared = last is not None and before["refcounts"][last] > 1 and before["num_tokens"] % B
        if shared and step["after"]["data"][last * B : last * B + B] != mine["data"][last * B : last * B + B]:
            raise CheckFailed(f"{what}: the shared block {last} changed (was {mine['data'][last * B:last * B + B]}, "
                              f"now {step['after']['data'][last * B:last * B + B]}); its other holders read it, so "
                              "copy it and write into the copy")
        expect_equal(step["outcome"], right["outcome"], f"{what}:")
        for key in ("blocks", "num_tokens", "refcounts"):
            expect_equal(step["after"][key], right["after"][key], f"{what}: then {key}")


# ---------------------------------------------------------------------------
# Task 6.4: LRU eviction of unreferenced cached blocks
# ---------------------------------------------------------------------------


def _lru_state(pool) -> dict:
    return {"refcounts": list(pool.refcounts), "keyless_free": list(pool.keyless_free),
            "cached_free": list(pool.cached_free), "evicted": list(pool.evicted),
            "block_of": {str(k): v for k, v in dict(pool.block_of).items()}}


@check("ch06.lru", hint=HINTS["6.4"][0], label=lambda c: f"a script of {len(c['script'])} steps on a pool of "
       f"{c['num_blocks']} blocks",
       summary=lambda cases, seen: f"{sum(len(c['script']) for c in cases)} steps: keyless blocks first, then LRU; "
                                   f"hits leave the queue; eviction order {seen[-1][-1]['after']['evicted']}")
def check_lru(case, cls):
    """``case`` = {"num_blocks", "script": [[op, arg], ...]}; ops: allocate (a count), cache, hit, free (a list)."""
    pool, steps = cls(case["num_blocks"]), []
    for op, arg in case["script"]:
        if op == "cache":
            results = [outcome(pool.cache, *arg)]
        elif op == "free":
            results = [outcome(pool.free, b) for b in arg]
        elif op == "hit":
            results = [outcome(pool.hit, arg)]
        else:
            results = [outcome(pool.allocate) for _ in range(arg)]
        steps.append({"results": results, "after": _lru_state(pool)})
    return steps


@check_lru.judge
def _judge_lru(case, got, want):
    if len(got) != len(want):
        raise CheckFailed(f"the script ran {len(got)} steps, expected {len(want)}")
    for index, (step, right, (op, arg)) in enumerate(zip(got, want, case["script"]), 1):
        what = f"step {index}, {op}({arg!r})"
        mine = step["after"]
        for result, expected in zip(step["results"], right["results"]):
            if "raised" in expected:
                expect_raised(result, "OutOfBlocks", f"{what}: allocate() with every block held")
                continue
            if "raised" in result:
                raise CheckFailed(f"{what} raised {result['raised'][0]}: {result.get('message')}")
            got_id, want_id = result["returned"], expected["returned"]
            if op == "allocate" and got_id != want_id and type(got_id) is int and 0 <= got_id < len(
                    mine["refcounts"]) and mine["refcounts"][got_id] > 1:
                raise CheckFailed(f"{what}: allocate() returned block {got_id}, which a sequence still holds "
                                  f"(refcount {mine['refcounts'][got_id]}): a hit must take it out of the free queue")
            expect_equal(got_id, want_id, f"{what}:")
        held = [b for b in mine["cached_free"] if type(b) is int and 0 <= b < len(mine["refcounts"])
                and mine["refcounts"][b] > 0]
        if held:
            raise CheckFailed(f"after {what}, block {held[0]} is held (refcount {mine['refcounts'][held[0]]}) but "
                              "still in cached_free, so allocate() could evict it: a hit must take it out of the free "
                              "queue")
        for key in ("refcounts", "keyless_free", "cached_free", "evicted", "block_of"):
            expect_equal(mine[key], right["after"][key], f"{key} after {what}:")
