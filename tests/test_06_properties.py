"""Random runs of admissions with hits, appends (with copy-on-write), forks, releases and resets.

The K/V of a token depend on every token before it, so the model writes into each slot
the whole prefix up to that token. A wrong hit (even one with the right block tokens
after another prefix), a missed copy or a write into a shared block then shows up as a
sequence that reads back other contents.
"""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.blocks import BlockTable, OutOfBlocks
from minipaged.prefix_cache import PrefixCachingAllocator

pytestmark = pytest.mark.ch06

# The second and third share every block but the first (for block sizes 2, 3 and 4): under a weak
# hash, their later blocks collide through a colliding parent with the same tokens.
PREFIXES = [[], [1, 2, 3], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 3, 4, 5, 6, 7, 8]]

ops = st.lists(
    st.one_of(
        # a new request: a shared prefix, a short suffix, a salt ("" is no salt), preempted before or not
        st.tuples(st.just("new"), st.sampled_from(range(len(PREFIXES))), st.lists(st.integers(0, 3), max_size=6),
                  st.sampled_from([None, "", "s"]), st.booleans()),
        st.tuples(st.just("append"), st.integers(0, 7), st.lists(st.integers(0, 3), min_size=1, max_size=5)),
        st.tuples(st.just("fork"), st.integers(0, 7)),
        st.tuples(st.just("release"), st.integers(0, 7)),
        st.tuples(st.just("reset"),),
    ),
    max_size=30,
)


def weak_hash(data: bytes) -> bytes:
    return bytes([sum(data) % 3])  # collides all the time: the verification must carry correctness


def prefixes(tokens):
    return [tuple(tokens[:i + 1]) for i in range(len(tokens))]


class Model:
    """Tables with their tokens and salts, and the 'K/V' of every slot (the token prefix written there)."""

    def __init__(self, alloc):
        self.alloc = alloc
        self.kv = [None] * (alloc.num_blocks * alloc.block_size)
        self.live = []  # (table, tokens, salt)

    def write(self, table, tokens, new, salt):
        """Schedule ``new`` tokens, key the blocks they fill (keys at allocation), then write their K/V."""
        slots = table.append_tokens(len(new))
        self.alloc.cache_full_blocks(table, tokens + new, len(tokens) + len(new), salt)
        B = self.alloc.block_size
        for src, dst in table.take_pending_copies():  # before the write, as the engine does
            self.kv[dst * B:(dst + 1) * B] = self.kv[src * B:(src + 1) * B]
        for slot, token in zip(slots.tolist(), new):
            tokens.append(token)
            self.kv[slot] = tuple(tokens)

    def check(self):
        alloc, B = self.alloc, self.alloc.block_size
        holders = Counter(b for t, _, _ in self.live for b in t.blocks)
        assert alloc.refcounts == [holders[b] for b in range(alloc.num_blocks)]
        free = alloc.free_queue()
        assert len(free) == len(set(free)) == alloc.num_free
        assert set(free) == {b for b in range(alloc.num_blocks) if holders[b] == 0}, "a block leaked or is double-held"
        assert all(alloc.entries[b] is None for b in alloc.free_block_ids)
        assert all(alloc.entries[b] is not None for b in alloc.evictable_block_ids)
        assert sorted(b for bs in alloc.blocks_by_key.values() for b in bs) == [
            b for b in range(alloc.num_blocks) if alloc.entries[b] is not None]
        for b, entry in enumerate(alloc.entries):  # a key is only ever on a full block holding its tokens
            if entry is not None:
                assert tuple(kv[-1] for kv in self.kv[b * B:(b + 1) * B]) == entry.token_ids
        for table, tokens, _ in self.live:
            assert [self.kv[s] for s in table.slots().tolist()] == prefixes(tokens), "a sequence reads other K/V"


@settings(max_examples=500, deadline=None)
@given(st.integers(3, 12), st.sampled_from([2, 3, 4]), st.booleans(), ops)
def test_random_runs_keep_refcounts_contents_and_queues_consistent(num_blocks, block_size, weak, operations):
    alloc = PrefixCachingAllocator(num_blocks, block_size, **({"hash_fn": weak_hash} if weak else {}))
    model = Model(alloc)
    counted = {"requests": 0, "queries": 0, "hits": 0, "preempted_requests": 0, "preempted_queries": 0,
               "preempted_hits": 0}
    for op in operations:
        kind = op[0]
        if kind == "new":
            prompt, salt, preempted = PREFIXES[op[1]] + op[2] or [0], op[3], op[4]
            match = alloc.match_prefix(prompt, salt)
            assert match.num_tokens < len(prompt)
            need = BlockTable(alloc).num_new_blocks(len(prompt)) - len(match.block_ids)
            if need + alloc.num_free_among(match.block_ids) > alloc.num_free:
                continue  # the engine would wait: admission counts hits that sit in the free queue
            table = BlockTable(alloc, len(model.live))
            alloc.share_prefix(table, match, preempted=preempted)
            prefix = "preempted_" if preempted else ""
            counted[prefix + "requests"] += 1
            counted[prefix + "queries"] += len(prompt)
            counted[prefix + "hits"] += match.num_tokens
            tokens = list(prompt[:match.num_tokens])
            assert [model.kv[s] for s in table.slots().tolist()] == prefixes(tokens), "a hit returned other K/V"
            model.write(table, tokens, prompt[match.num_tokens:], salt)
            model.live.append((table, tokens, salt))
        elif kind == "reset":
            if alloc.num_used:  # refused, as vLLM refuses: nothing changes
                before = (alloc.free_queue(), list(alloc.entries))
                with pytest.raises(ValueError, match=f"{alloc.num_used} blocks are still held"):
                    alloc.reset_prefix_cache()
                assert (alloc.free_queue(), list(alloc.entries)) == before
            else:
                cached = alloc.num_cached_blocks
                assert alloc.reset_prefix_cache() == cached and alloc.num_cached_blocks == 0
        elif model.live:
            i = op[1] % len(model.live)
            table, tokens, salt = model.live[i]
            if kind == "append":
                before = (alloc.free_queue(), alloc.refcounts, list(table.blocks), table.num_tokens)
                try:
                    model.write(table, tokens, op[2], salt)
                except OutOfBlocks:
                    assert (alloc.free_queue(), alloc.refcounts, list(table.blocks), table.num_tokens) == before
            elif kind == "fork":
                model.live.append((table.fork(len(model.live)), list(tokens), salt))
            elif kind == "release":
                table.release()
                del model.live[i]
        model.check()
        stats = alloc.stats()
        assert {name: getattr(stats, name) for name in counted} == counted
    for table, _, _ in model.live:
        table.release()
    assert alloc.refcounts == [0] * num_blocks and alloc.num_free == num_blocks
