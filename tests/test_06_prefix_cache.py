"""The prefix cache: exact block ids and free-queue order over a scripted run, collisions, isolation, bad input.

The exact-id test is written in the style of vLLM's own prefix-caching tests: a small pool
(block size 4, 10 blocks), a scripted sequence of requests, and after each step the block
ids each request holds and the free queue's order, written out by hand. The order is
minipaged's, not vllm 0.32's: freed keyless blocks are reused first in, first out, where
vLLM prepends them to its queue (last in, first out) and reserves block 0 as a null block
(see PrefixCachingAllocator's docstring and test_keyless_blocks_are_reused_fifo_where_vllm_reuses_them_lifo).
"""

import pytest

from minipaged.blocks import BlockTable, OutOfBlocks
from minipaged.prefix_cache import (
    PrefixCacheStats,
    PrefixCachingAllocator,
    block_keys,
    encode_block,
    extra_keys,
    hash_block_tokens,
)
from minipaged.validation import check_salt

pytestmark = pytest.mark.ch06


def admit(alloc, seq_id, prompt, salt=None):
    """What the engine does on admission: match, share, allocate the rest, key the full blocks."""
    match = alloc.match_prefix(prompt, salt)
    table = BlockTable(alloc, seq_id)
    alloc.share_prefix(table, match)
    table.append_tokens(len(prompt) - table.num_tokens)
    alloc.cache_full_blocks(table, prompt, len(prompt), salt)  # keys at allocation: before the K/V is written
    return table


def test_scripted_requests_exact_block_ids_and_minipaged_free_queue_order():
    alloc = PrefixCachingAllocator(10, 4)
    events = []
    alloc.subscribe(lambda e: events.append((e.kind, e.block_id)) if e.kind in ("hit", "evict") else None)
    prompt_a = list(range(14))  # 3 full blocks and 2 tokens

    a = admit(alloc, "A", prompt_a)
    assert a.blocks == [0, 1, 2, 3]
    assert alloc.free_queue() == [4, 5, 6, 7, 8, 9]
    assert [alloc.block_key(b) is not None for b in range(4)] == [True, True, True, False]  # the tail is partial

    b = admit(alloc, "B", list(range(8)) + [100, 101, 102, 103, 104, 105])  # shares A's first two blocks
    assert b.blocks == [0, 1, 4, 5]
    assert [alloc.refcount(i) for i in range(6)] == [2, 2, 1, 1, 1, 1]
    assert alloc.free_queue() == [6, 7, 8, 9]
    assert events == [("hit", 0), ("hit", 1)]

    a.release()  # tail first: 3 has no key (deque), 2 keeps its key (LRU queue), 1 and 0 are still B's
    assert list(alloc.free_block_ids) == [6, 7, 8, 9, 3]
    assert list(alloc.evictable_block_ids) == [2]
    assert alloc.free_queue() == [6, 7, 8, 9, 3, 2]

    c = admit(alloc, "C", list(range(12)))  # exactly 3 blocks: the last one is recomputed, in a new block
    assert c.blocks == [0, 1, 6]
    assert alloc.free_queue() == [7, 8, 9, 3, 2]
    assert alloc.block_key(6) == alloc.block_key(2)  # a duplicate of block 2, computed again

    prompt_d = list(range(12)) + [50]
    match = alloc.match_prefix(prompt_d)
    assert match.block_ids == [0, 1, 2] and match.num_tokens == 12
    assert alloc.num_free_among(match.block_ids) == 1  # block 2 waits in the free queue
    d = BlockTable(alloc, "D")
    alloc.share_prefix(d, match)
    assert alloc.num_free == 4 and alloc.free_queue() == [7, 8, 9, 3]  # the hit took 2 out, in O(1)
    d.append_tokens(1)
    assert d.blocks == [0, 1, 2, 7]
    assert alloc.free_queue() == [8, 9, 3]

    events.clear()
    b.release()
    c.release()
    d.release()
    assert list(alloc.free_block_ids) == [8, 9, 3, 5, 7]
    assert list(alloc.evictable_block_ids) == [4, 6, 2, 1, 0]  # each sequence tail first: deepest blocks go first
    assert alloc.free_queue() == [8, 9, 3, 5, 7, 4, 6, 2, 1, 0]
    assert alloc.refcounts == [0] * 10

    e = admit(alloc, "E", list(range(200, 220)))  # 5 blocks: the keyless ones, no eviction
    assert e.blocks == [8, 9, 3, 5, 7]
    assert alloc.stats().evictions == 0 and alloc.free_queue() == [4, 6, 2, 1, 0]

    f = admit(alloc, "F", list(range(300, 308)))  # 2 blocks: the two least recently used cached ones
    assert f.blocks == [4, 6]
    assert events == [("evict", 4), ("evict", 6)]
    assert alloc.stats().evictions == 2 and alloc.free_queue() == [2, 1, 0]
    assert alloc.block_key(4) != alloc.block_key(2)  # F's own keys replaced the evicted ones

    e.release()  # all five hold keys: they join the LRU queue behind A's prefix, tail first
    assert alloc.free_queue() == [2, 1, 0, 7, 5, 3, 9, 8]
    g = admit(alloc, "G", prompt_a)  # A's prefix survived; its tail takes E's least recently used block
    assert g.blocks == [0, 1, 2, 7]
    stats = alloc.stats()
    assert alloc.free_queue() == [5, 3, 9, 8] and stats.evictions == 3
    assert stats.requests == 7 and stats.preempted_requests == stats.preempted_queries == stats.preempted_hits == 0
    assert stats.queries == 14 + 14 + 12 + 13 + 20 + 8 + 14
    assert stats.hits == 0 + 8 + 8 + 12 + 0 + 0 + 12
    assert stats.hit_rate == pytest.approx(40 / 95)


def test_exactly_full_prompt_recomputes_its_last_block():
    alloc = PrefixCachingAllocator(10, 4)
    admit(alloc, "a", list(range(8)))
    assert alloc.match_prefix(list(range(8))).block_ids == [0]  # 2 blocks cached, 1 usable
    assert alloc.match_prefix(list(range(9))).block_ids == [0, 1]
    assert alloc.match_prefix(list(range(4))).block_ids == []
    assert alloc.match_prefix([]).block_ids == []


def test_keys_chain_through_the_parent():
    # Same block tokens after different parents: different keys.
    k1 = block_keys([1, 2, 3, 4, 9, 9, 9, 9], 4)
    k2 = block_keys([5, 6, 7, 8, 9, 9, 9, 9], 4)
    assert k1[1] != k2[1]
    assert k1[1] == hash_block_tokens(k1[0], [9, 9, 9, 9])
    assert len(block_keys(list(range(11)), 4)) == 2  # no key for the partial tail
    # The encoding is unambiguous: a str and a bytes salt, or a moved boundary, never encode alike.
    assert encode_block(None, [1], ("a",)) != encode_block(None, [1], (b"a",))
    assert encode_block(None, [1, 2], ()) != encode_block(None, [1], ())
    assert extra_keys(0, "s") == ("s",) and extra_keys(1, "s") == () and extra_keys(0) == ()


def constant_hash(data: bytes) -> bytes:
    return b"\x00"  # every block collides with every other


def test_collision_is_refused_by_the_token_check_and_counted():
    alloc = PrefixCachingAllocator(10, 4, hash_fn=constant_hash)
    admit(alloc, "a", [1, 1, 1, 1, 5])
    t = admit(alloc, "b", [2, 2, 2, 2, 5])
    assert t.blocks == [2, 3]  # block 0 of "a" has the same key but other tokens: a miss
    assert alloc.stats().collisions == 1 and alloc.stats().hits == 0
    t2 = admit(alloc, "c", [2, 2, 2, 2, 7])  # the genuine block among the colliding ones is found
    assert t2.blocks[0] == 2 and alloc.stats().hits == 4


def test_collision_through_the_parent_is_refused():
    """An attacker's block with the victim's tokens under a colliding parent: the parent check refuses it."""
    alloc = PrefixCachingAllocator(12, 4, hash_fn=constant_hash)
    admit(alloc, "attacker", [1, 1, 1, 1, 2, 2, 2, 2, 0])  # blocks 0, 1 (and 2)
    admit(alloc, "victim-1", [3, 3, 3, 3, 0])  # block 3: the victim's first block is cached
    match = alloc.match_prefix([3, 3, 3, 3, 2, 2, 2, 2, 0])
    assert match.block_ids == [3]  # not [3, 1]: block 1's tokens match but its parent is block 0


def test_salts_isolate_and_the_same_salt_shares():
    alloc = PrefixCachingAllocator(20, 4)
    prompt = list(range(9))
    alice = admit(alloc, "alice", prompt, salt="alice")
    bob = admit(alloc, "bob", prompt, salt="bob")
    nobody = admit(alloc, "none", prompt)
    as_bytes = admit(alloc, "bytes", prompt, salt=b"alice")
    held = [set(t.blocks) for t in (alice, bob, nobody, as_bytes)]
    assert all(not (x & y) for i, x in enumerate(held) for y in held[i + 1:]), "different salts shared a block"
    alice2 = admit(alloc, "alice-2", prompt, salt="alice")
    assert alice2.blocks[:2] == alice.blocks[:2]


@pytest.mark.parametrize("salt", [1, 1.5, ["a"], bytearray(b"a"), True])
def test_bad_salt_is_named_and_changes_nothing(salt):
    alloc = PrefixCachingAllocator(6, 4)
    t = admit(alloc, "a", list(range(9)))
    before = (alloc.free_queue(), alloc.refcounts, list(alloc.entries), t.blocks)
    with pytest.raises(TypeError, match="cache_salt"):
        alloc.match_prefix(list(range(9)), salt)
    with pytest.raises(TypeError, match="cache_salt"):
        alloc.cache_full_blocks(t, list(range(9)), 9, salt)
    with pytest.raises(TypeError, match="cache_salt"):
        block_keys([1, 2, 3, 4], 4, salt)
    assert (alloc.free_queue(), alloc.refcounts, list(alloc.entries), t.blocks) == before


def test_bad_input_to_share_and_cache_is_named():
    alloc = PrefixCachingAllocator(6, 4)
    t = admit(alloc, "a", list(range(9)))
    match = alloc.match_prefix(list(range(9)))
    with pytest.raises(ValueError, match="not empty"):
        alloc.share_prefix(t, match)
    with pytest.raises(ValueError, match="num_tokens 10 is more than the sequence's 9 tokens with slots"):
        alloc.cache_full_blocks(t, list(range(10)), 10)
    with pytest.raises(TypeError, match="num_tokens"):
        alloc.cache_full_blocks(t, list(range(9)), 8.0)
    other = PrefixCachingAllocator(6, 4)
    with pytest.raises(ValueError, match="another allocator"):
        other.share_prefix(BlockTable(alloc), match)
    fresh = BlockTable(alloc, "fresh")
    fresh.append_tokens(8)
    before = (list(alloc.entries), alloc.free_queue())
    with pytest.raises(TypeError, match="token_ids must hold ints"):
        alloc.cache_full_blocks(fresh, [7, 7, 7, 7, 4.0, 5, 6, 7], 8)  # block 1 is bad, block 0 fine
    with pytest.raises(TypeError, match="token_ids must hold ints"):
        alloc.match_prefix([0.0, 1, 2, 3, 4])
    assert (list(alloc.entries), alloc.free_queue()) == before
    with pytest.raises(TypeError, match="hash_fn"):
        PrefixCachingAllocator(6, 4, hash_fn="sha256")
    with pytest.raises(TypeError, match="hash_fn must return bytes"):
        PrefixCachingAllocator(6, 4, hash_fn=hash).match_prefix(list(range(9)))
    # A match goes stale when a block it names is evicted before it is used.
    fresh.release()
    t.release()
    stale = alloc.match_prefix(list(range(9)))
    assert stale.block_ids == [0, 1]
    BlockTable(alloc).append_tokens(24)  # takes every block, evicting the cached ones
    before = (alloc.free_queue(), alloc.refcounts)
    with pytest.raises(ValueError, match="stale"):
        alloc.share_prefix(BlockTable(alloc), stale)
    assert (alloc.free_queue(), alloc.refcounts) == before


def test_reset_is_refused_while_blocks_are_held_and_changes_nothing():
    """As vLLM (it returns False): a held block keeps its key, so a reset would leave stale K/V to hit."""
    alloc = PrefixCachingAllocator(10, 4)
    a = admit(alloc, "a", list(range(9)))
    b = admit(alloc, "b", list(range(100, 109)))
    b.release()
    assert alloc.num_cached_blocks == 4
    before = (alloc.free_queue(), list(alloc.entries), dict(alloc.blocks_by_key))
    events = []
    alloc.subscribe(events.append)
    with pytest.raises(ValueError, match="3 blocks are still held by sequences"):  # a's three blocks
        alloc.reset_prefix_cache()
    assert (alloc.free_queue(), list(alloc.entries), dict(alloc.blocks_by_key)) == before and events == []
    assert alloc.match_prefix(list(range(100, 109))).block_ids == [3, 4]
    a.release()
    assert alloc.reset_prefix_cache() == 4  # every key, in LRU order: b's tail first, then a's tail first
    assert alloc.num_cached_blocks == 0 and alloc.blocks_by_key == {} and list(alloc.evictable_block_ids) == []
    assert alloc.free_queue() == [6, 7, 8, 9, 5, 2, 4, 3, 1, 0]
    assert [e.kind for e in events] == ["free"] * 3 + ["reset"] and events[-1].info == {"num_dropped": 4}
    assert alloc.match_prefix(list(range(9))).block_ids == []


def test_out_of_blocks_when_everything_is_held():
    alloc = PrefixCachingAllocator(2, 4)
    t = admit(alloc, "a", list(range(8)))
    with pytest.raises(OutOfBlocks):
        alloc.allocate()
    assert t.blocks == [0, 1] and alloc.num_free == 0


def test_events_come_after_their_state_change():
    alloc = PrefixCachingAllocator(4, 2)
    seen = []

    def on_event(e):  # what a widget sees when it reads the allocator from inside the callback
        seen.append((e.kind, e.block_id, alloc.refcount(e.block_id), alloc.block_key(e.block_id) is not None))

    a = admit(alloc, "a", [1, 2, 3, 4, 5])
    alloc.subscribe(on_event)
    a.release()
    assert seen == [("free", 2, 0, False), ("free", 1, 0, True), ("free", 0, 0, True)]
    seen.clear()
    b = admit(alloc, "b", [1, 2, 3, 4, 9])  # hits 0 and 1, then takes the oldest keyless block
    assert seen == [("hit", 0, 1, True), ("hit", 1, 1, True), ("allocate", 3, 1, False)]
    b.release()
    assert alloc.free_queue() == [2, 3, 1, 0]
    seen.clear()
    admit(alloc, "c", [7] * 6)  # two keyless blocks, then the least recently used cached one
    assert seen == [("allocate", 2, 1, False), ("allocate", 3, 1, False), ("evict", 1, 1, False),
                    ("allocate", 1, 1, False), ("cache", 2, 1, True), ("cache", 3, 1, True), ("cache", 1, 1, True)]


def test_free_sequence_of_the_prefix_cache_checks_every_block_before_freeing_any():
    alloc = PrefixCachingAllocator(6, 4)
    table = admit(alloc, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # two keyed blocks and a partial one
    before = (alloc.free_queue(), alloc.refcounts, [alloc.block_key(b) for b in range(6)])
    for bad, error in [(table.blocks + [-1], IndexError), (table.blocks + table.blocks[:1], ValueError)]:
        with pytest.raises(error, match="block"):  # was: the tail blocks freed (tail first), then the error
            alloc.free_sequence(bad, "a")
        assert (alloc.free_queue(), alloc.refcounts, [alloc.block_key(b) for b in range(6)]) == before
    table.release()
    assert alloc.num_free == 6


@pytest.mark.parametrize("hash_fn, match", [
    (lambda b: "x", "must return bytes, got str"),
    (lambda b: 7, "must return bytes, got int"),
    ("sha256", "must be callable"),
])  # fmt: skip
def test_a_hash_function_that_cannot_make_keys_is_refused_at_construction(hash_fn, match):
    from functools import partial

    from minipaged.engine import Engine
    from minipaged.model import LlamaForCausalLM

    model = LlamaForCausalLM()

    with pytest.raises(TypeError, match="hash_fn " + match):
        PrefixCachingAllocator(4, 4, hash_fn=hash_fn)
    with pytest.raises(TypeError, match="hash_fn " + match):  # was: every step raised; now the engine never starts
        Engine(model, allocator=partial(PrefixCachingAllocator, hash_fn=hash_fn))


def test_keyless_blocks_are_reused_fifo_where_vllm_reuses_them_lifo():
    """minipaged's free queue: keyless blocks first in, first out, then cached ones LRU.

    vllm 0.32 (block_pool.free_blocks) prepends a freed keyless block, so it would hand out 5
    then 4 here; it appends a freed cached block, as minipaged does. Which blocks get
    evicted, and when, is the same; only the reuse order of keyless blocks differs.
    """
    alloc = PrefixCachingAllocator(6, 4)
    a = admit(alloc, "a", list(range(6)))  # blocks 0 (keyed) and 1 (partial, keyless)
    b = admit(alloc, "b", list(range(50, 56)))  # blocks 2 (keyed) and 3 (keyless)
    a.release()
    b.release()
    assert list(alloc.free_block_ids) == [4, 5, 1, 3]  # never used first, then freed keyless ones, oldest first
    assert list(alloc.evictable_block_ids) == [0, 2]  # cached, least recently freed first
    taken = BlockTable(alloc, "c")
    taken.append_tokens(4 * 5)
    assert taken.blocks == [4, 5, 1, 3, 0] and alloc.stats().evictions == 1  # the LRU cached block is evicted last


def test_an_empty_salt_is_no_salt_as_in_vllm():
    alloc = PrefixCachingAllocator(20, 4)
    prompt = list(range(9))
    nobody = admit(alloc, "none", prompt)
    for salt in ("", b""):
        shared = admit(alloc, f"empty {salt!r}", prompt, salt=salt)
        assert shared.blocks[:2] == nobody.blocks[:2], f"salt {salt!r} did not share with no salt"
        assert block_keys(prompt, 4, salt) == block_keys(prompt, 4)
        assert extra_keys(0, salt) == ()
    salted = admit(alloc, "salted", prompt, salt="x")
    assert not set(salted.blocks) & set(nobody.blocks)
    assert check_salt("") is None and check_salt(b"") is None and check_salt(None) is None
    assert check_salt("x") == "x" and check_salt(b"x") == b"x"
    with pytest.raises(TypeError, match="salt must be a str, bytes or None, got int"):
        check_salt(3, "salt")


def test_preempted_requests_are_counted_apart_as_in_vllm():
    alloc = PrefixCachingAllocator(10, 4)
    first = admit(alloc, "a", list(range(10)))
    first.release()
    again = BlockTable(alloc, "a")  # "a" re-admitted after a preemption: prompt and output looked up again
    alloc.share_prefix(again, alloc.match_prefix(list(range(13))), preempted=True)
    fresh = BlockTable(alloc, "b")
    alloc.share_prefix(fresh, alloc.match_prefix(list(range(6))))
    stats = alloc.stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 10 + 6, 0 + 4)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 13, 8)
    assert stats.hit_rate == pytest.approx(4 / 16)  # the preempted hits do not inflate it
    stats.hits = 99  # a copy: the allocator's counters have one owner
    assert alloc.stats().hits == 4
    before = (alloc.free_queue(), alloc.refcounts, alloc.stats())
    with pytest.raises(TypeError, match="preempted must be True or False, got int"):
        alloc.share_prefix(BlockTable(alloc, "c"), alloc.match_prefix(list(range(6))), preempted=1)
    assert (alloc.free_queue(), alloc.refcounts, alloc.stats()) == before
    assert PrefixCacheStats().hit_rate == 0.0


def test_a_block_keyed_at_allocation_is_hit_in_the_same_step():
    """Keys at allocation: a request admitted later in the same step shares blocks whose K/V is not written yet.

    Within one forward pass every sequence's K/V of a layer is written before that layer's
    attention reads, so the second request reads the first one's K/V of its prefix.
    """
    alloc = PrefixCachingAllocator(10, 4)
    prompt = list(range(11))
    a = BlockTable(alloc, "a")
    alloc.share_prefix(a, alloc.match_prefix(prompt))
    a.append_tokens(len(prompt))  # scheduled: no K/V written yet
    assert alloc.cache_full_blocks(a, prompt, len(prompt)) == 2
    match = alloc.match_prefix(prompt)
    assert match.block_ids == a.blocks[:2] and match.num_tokens == 8  # b computes 3 tokens, not 11
    chunk = BlockTable(alloc, "c")  # a chunked prefill: only the blocks its scheduled tokens fill get keys
    chunk.append_tokens(6)
    assert alloc.cache_full_blocks(chunk, list(range(100, 111)), 6) == 1
    assert [alloc.block_key(b) is not None for b in chunk.blocks] == [True, False]
    with pytest.raises(ValueError, match="num_tokens 7 is more than the sequence's 6 tokens with slots"):
        alloc.cache_full_blocks(chunk, list(range(100, 111)), 7)  # tokens without a slot are not scheduled


def test_free_sequence_delivers_its_events_once_every_block_is_free():
    alloc = PrefixCachingAllocator(6, 4)
    table = admit(alloc, "a", list(range(9)))
    seen = []
    alloc.subscribe(lambda e: seen.append((e.kind, e.block_id, e.info.get("cached"), alloc.num_free)))
    alloc.free_sequence(table.blocks, "a")
    assert seen == [("free", 2, False, 6), ("free", 1, True, 6), ("free", 0, True, 6)]  # tail first, all done
