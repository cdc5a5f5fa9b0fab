"""The chapter 06 exercise checks pass the model answer and another design, and catch the classic mistakes.

Exercise 06's pieces are holes in the learner's package (``minipaged/prefix_cache.py``, and
``BlockTable._copy_on_write`` in ``minipaged/blocks.py``), so the model answer is the package's own:
``block_keys``, ``PrefixCachingAllocator`` and ``BlockTable``. ``OtherPrefixCache`` and ``OtherCowTable`` below
are correct designs that differ from it where the lesson leaves the choice free (an entry that points at its
parent's entry instead of a serial, a free cached block taken back through the base class's ``allocate``, a
cache that keys every full block on each call); each must PASS. Each wrong implementation is one mistake,
written as a subclass that overrides one method; the check must FAIL on it, with a message that names the
step, the request or the block, and with the hint for that mistake (``WHY``). The ``Chapter*`` ones are what
a learner gets by copying what chapter 06 shows (a naive per-block hash): the chapter teaches the idea without
printing the answer, so those must FAIL too.
"""

import functools
from collections import OrderedDict, deque
from dataclasses import dataclass, replace

import pytest

from minipaged import checks
from minipaged.blocks import BlockAllocator, BlockTable, OutOfBlocks
from minipaged.checks import FAIL, PASS, TODO, ch06
from minipaged.checks.ch06 import WHY
from minipaged.prefix_cache import (
    PrefixCacheStats,
    PrefixCachingAllocator,
    PrefixMatch,
    block_keys,
    block_tokens,
    extra_keys,
    hash_block_tokens,
    sha256,
)

pytestmark = pytest.mark.ch06


@pytest.fixture(autouse=True, scope="module")
def _reference_runs_once():
    """Each check call runs the package's reference on the public cases; here once per check, not once per call."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checks, "expected", functools.cache(checks.expected))
        yield


# -- Task 6.1: block keys ------------------------------------------------------------


def other_block_keys(token_ids, block_size, cache_salt=None, hash_fn=sha256):  # right: walks by start offset
    keys, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        extra = (cache_salt,) if start == 0 and cache_salt else ()
        parent = hash_block_tokens(parent, tuple(token_ids[start : start + block_size]), extra, hash_fn)
        keys.append(parent)
    return keys


def keys_without_parent(token_ids, block_size, cache_salt=None, hash_fn=sha256):
    return [hash_block_tokens(None, block_tokens(token_ids, i, block_size), extra_keys(i, cache_salt), hash_fn)
            for i in range(len(token_ids) // block_size)]


def keys_with_partial_block(token_ids, block_size, cache_salt=None, hash_fn=sha256):
    keys, parent = [], None
    for i in range(0, len(token_ids), block_size):
        extra = (cache_salt,) if i == 0 and cache_salt is not None else ()
        parent = hash_block_tokens(parent, tuple(token_ids[i : i + block_size]), extra, hash_fn)
        keys.append(parent)
    return keys


def keys_empty_salt_is_a_salt(token_ids, block_size, cache_salt=None, hash_fn=sha256):  # "" is no salt
    keys, parent = [], None
    for i in range(len(token_ids) // block_size):
        extra = (cache_salt,) if i == 0 and cache_salt is not None else ()
        parent = hash_block_tokens(parent, block_tokens(token_ids, i, block_size), extra, hash_fn)
        keys.append(parent)
    return keys


def keys_salt_everywhere(token_ids, block_size, cache_salt=None, hash_fn=sha256):  # harmless for hits, not the key
    keys, parent = [], None
    for i in range(len(token_ids) // block_size):
        extra = (cache_salt,) if cache_salt else ()
        parent = hash_block_tokens(parent, block_tokens(token_ids, i, block_size), extra, hash_fn)
        keys.append(parent)
    return keys


def chapter_naive_keys(token_ids, block_size, cache_salt=None, hash_fn=sha256):  # the first idea the chapter refutes
    return [hash_block_tokens(None, tuple(token_ids[i : i + block_size]), (), hash_fn)
            for i in range(0, len(token_ids), block_size)]


def keys_own_hash(token_ids, block_size, cache_salt=None, hash_fn=sha256):  # ignores the hash_fn it is given
    return block_keys(token_ids, block_size, cache_salt)


def todo(*args, **kwargs):
    raise NotImplementedError("Task 6.1 is not implemented yet. Hint: one key per full block")


# -- Tasks 6.2 to 6.4: another correct prefix cache ----------------------------------


@dataclass(eq=False)
class Entry:
    """What the cache knows about a block with a key; ``eq=False``: an entry equals only itself (``is``)."""

    key: bytes
    token_ids: tuple
    extra: tuple
    parent: "Entry | None"  # the entry of the block before it, None for block 0


def cache_on(base):
    """A correct prefix cache on ``base`` that uses only exercise 02's interface (calls, hooks, ``emit``).

    Where it differs from the package: the parent is the parent's entry object (``is``), a free cached block
    comes back through the base's ``allocate`` (``_wanted`` tells ``_take_free_block`` which one), the counters
    are its own ``counters``, and ``cache_full_blocks`` walks every full block on each call.
    """

    class OtherPrefixCache(base):
        _step_containers = ("entries", "blocks_by_key", "evictable_block_ids", "counters")

        def __init__(self, num_blocks, block_size, hash_fn=sha256):
            super().__init__(num_blocks, block_size)
            self.hash_fn = hash_fn
            self.entries = [None] * self.num_blocks
            self.blocks_by_key = {}
            self.evictable_block_ids = OrderedDict()
            self.counters = PrefixCacheStats()
            self._wanted = None

        def block_key(self, block_id):
            entry = self.entries[block_id]
            return None if entry is None else entry.key

        def stats(self):
            return replace(self.counters)

        def num_free_among(self, block_ids):
            return sum(self.refcount(b) == 0 for b in block_ids)

        def block_tokens(self, token_ids, block_index):
            B = self.block_size
            return tuple(token_ids[block_index * B : (block_index + 1) * B])

        def extra_keys(self, block_index, cache_salt):
            return (cache_salt,) if block_index == 0 and cache_salt else ()

        @property
        def num_free(self):
            return super().num_free + len(self.evictable_block_ids)

        def _take_free_block(self, seq_id):
            if self._wanted is not None:
                block_id, self._wanted = self._wanted, None
                del self.evictable_block_ids[block_id]
                return block_id
            if super().num_free:
                return super()._take_free_block(seq_id)
            block_id, _ = self.evictable_block_ids.popitem(last=False)
            self._drop_key(block_id)
            self.counters.evictions += 1
            self.emit("evict", block_id, seq_id)
            return block_id

        def _put_free_block(self, block_id):
            if self.entries[block_id] is None:
                return super()._put_free_block(block_id)
            self.evictable_block_ids[block_id] = None
            return {"cached": True}

        def free_sequence(self, block_ids, seq_id=None):
            super().free_sequence(list(block_ids)[::-1], seq_id)

        def _drop_key(self, block_id):
            entry, self.entries[block_id] = self.entries[block_id], None
            holders = self.blocks_by_key[entry.key]
            holders.remove(block_id)
            if not holders:
                del self.blocks_by_key[entry.key]

        def cache_full_blocks(self, table, token_ids, num_tokens, cache_salt=None):
            keyed, parent = [], None
            for i in range(num_tokens // self.block_size):
                block_id = table.blocks[i]
                if self.entries[block_id] is None:
                    tokens, extra = self.block_tokens(token_ids, i), self.extra_keys(i, cache_salt)
                    key = hash_block_tokens(None if parent is None else parent.key, tokens, extra, self.hash_fn)
                    self.entries[block_id] = Entry(key, tokens, extra, parent)
                    self.blocks_by_key.setdefault(key, []).append(block_id)
                    keyed.append(block_id)
                parent = self.entries[block_id]
            for block_id in keyed:
                self.emit("cache", block_id, table.seq_id)
            return len(keyed)

        def match_prefix(self, token_ids, cache_salt=None):
            blocks, keys, parent, collisions = [], [], None, 0
            for i in range(max(len(token_ids) - 1, 0) // self.block_size):
                tokens, extra = self.block_tokens(token_ids, i), self.extra_keys(i, cache_salt)
                key = hash_block_tokens(None if parent is None else parent.key, tokens, extra, self.hash_fn)
                holders = [self.entries[b] for b in self.blocks_by_key.get(key, ())]
                found = next((b for b, e in zip(self.blocks_by_key.get(key, ()), holders)
                              if e.token_ids == tokens and e.extra == extra and e.parent is parent), None)
                if found is None:
                    collisions = int(any(e.token_ids != tokens or e.extra != extra for e in holders))
                    break
                blocks.append(found)
                keys.append(key)
                parent = self.entries[found]
            return PrefixMatch(blocks, keys, len(blocks) * self.block_size, len(token_ids), collisions)

        def share_prefix(self, table, match, *, preempted=False):
            for block_id in match.block_ids:
                if self.refcount(block_id) == 0:
                    self._wanted = block_id
                    self.allocate(table.seq_id)
                else:
                    self.incref(block_id, table.seq_id)
            table.blocks = list(match.block_ids)
            table.num_tokens = match.num_tokens
            self.counters.record(match.queries, match.num_tokens, preempted)
            self.counters.collisions += match.collisions
            for block_id in match.block_ids:
                self.emit("hit", block_id, table.seq_id)

    return OtherPrefixCache


OtherPrefixCache = cache_on(BlockAllocator)  # the mistakes below are each one change to it




class KeysPartialBlock(OtherPrefixCache):  # a key for the partly filled last block too
    def cache_full_blocks(self, table, token_ids, num_tokens, cache_salt=None):
        return super().cache_full_blocks(table, token_ids, num_tokens, cache_salt) + self._key_tail(
            table, token_ids, num_tokens, cache_salt)

    def _key_tail(self, table, token_ids, num_tokens, cache_salt):
        i, B = num_tokens // self.block_size, self.block_size
        if num_tokens % B == 0 or i >= len(table.blocks) or self.entries[table.blocks[i]] is not None:
            return 0
        parent = self.entries[table.blocks[i - 1]] if i else None
        tokens, extra = tuple(token_ids[i * B : num_tokens]), self.extra_keys(i, cache_salt)
        key = hash_block_tokens(None if parent is None else parent.key, tokens, extra, self.hash_fn)
        self.entries[table.blocks[i]] = Entry(key, tokens, extra, parent)
        self.blocks_by_key.setdefault(key, []).append(table.blocks[i])
        return 1


class HashesWithoutParent(OtherPrefixCache):  # every block hashed as if it were block 0
    def cache_full_blocks(self, table, token_ids, num_tokens, cache_salt=None):
        keyed = super().cache_full_blocks(table, token_ids, num_tokens, cache_salt)
        for i in range(num_tokens // self.block_size):
            entry = self.entries[table.blocks[i]]
            key = hash_block_tokens(None, entry.token_ids, entry.extra, self.hash_fn)
            if key != entry.key:
                self.blocks_by_key[entry.key].remove(table.blocks[i])
                self.entries[table.blocks[i]] = Entry(key, entry.token_ids, entry.extra, entry.parent)
                self.blocks_by_key.setdefault(key, []).append(table.blocks[i])
        return keyed


class IgnoresSalt(OtherPrefixCache):
    def extra_keys(self, block_index, cache_salt):
        return ()


class TrustsTheHash(OtherPrefixCache):  # a key found is taken as a hit, tokens and parent unchecked
    def match_prefix(self, token_ids, cache_salt=None):
        blocks, keys, parent = [], [], None
        for i in range(max(len(token_ids) - 1, 0) // self.block_size):
            key = hash_block_tokens(parent, self.block_tokens(token_ids, i), self.extra_keys(i, cache_salt),
                                    self.hash_fn)
            if key not in self.blocks_by_key:
                break
            blocks.append(self.blocks_by_key[key][0])
            keys.append(key)
            parent = key
        return PrefixMatch(blocks, keys, len(blocks) * self.block_size, len(token_ids), 0)


class VerifiesTokensNotParent(OtherPrefixCache):  # a block with the prompt's tokens behind another parent is a hit
    def match_prefix(self, token_ids, cache_salt=None):
        blocks, keys, parent = [], [], None
        for i in range(max(len(token_ids) - 1, 0) // self.block_size):
            tokens, extra = self.block_tokens(token_ids, i), self.extra_keys(i, cache_salt)
            key = hash_block_tokens(parent, tokens, extra, self.hash_fn)
            found = next((b for b in self.blocks_by_key.get(key, ()) if self.entries[b].token_ids == tokens
                          and self.entries[b].extra == extra), None)
            if found is None:
                return PrefixMatch(blocks, keys, len(blocks) * self.block_size, len(token_ids),
                                   int(key in self.blocks_by_key))  # a key found with other tokens: a collision
            blocks.append(found)
            keys.append(key)
            parent = key
        return PrefixMatch(blocks, keys, len(blocks) * self.block_size, len(token_ids), 0)


class MatchesWholePrompt(OtherPrefixCache):  # the block with the last prompt token hits too
    def match_prefix(self, token_ids, cache_salt=None):
        return replace(super().match_prefix(list(token_ids) + [0], cache_salt), queries=len(token_ids))


class EvictsMostRecent(OtherPrefixCache):
    def _take_free_block(self, seq_id):
        if self._wanted is None and not super(OtherPrefixCache, self).num_free and self.evictable_block_ids:
            self.evictable_block_ids.move_to_end(next(reversed(self.evictable_block_ids)), last=False)
        return super()._take_free_block(seq_id)


class EvictsBeforeKeyless(OtherPrefixCache):  # a cached block goes out while keyless ones are free
    def _take_free_block(self, seq_id):
        if self._wanted is None and self.evictable_block_ids:
            block_id, _ = self.evictable_block_ids.popitem(last=False)
            self._drop_key(block_id)
            self.counters.evictions += 1
            self.emit("evict", block_id, seq_id)
            return block_id
        return super()._take_free_block(seq_id)


class HitStaysInQueue(OtherPrefixCache):  # a free block shared by a hit is not taken out of the LRU queue
    def _take_free_block(self, seq_id):
        if self._wanted is not None:
            block_id, self._wanted = self._wanted, None
            return block_id
        return super()._take_free_block(seq_id)

    @property
    def num_free(self):
        return super(OtherPrefixCache, self).num_free + sum(self.refcount(b) == 0 for b in self.evictable_block_ids)


class ForgetsIncref(OtherPrefixCache):  # a held block is shared without one more reference
    def share_prefix(self, table, match, *, preempted=False):
        for block_id in match.block_ids:
            if self.refcount(block_id) == 0:
                self._wanted = block_id
                self.allocate(table.seq_id)
        table.blocks, table.num_tokens = list(match.block_ids), match.num_tokens
        self.counters.record(match.queries, match.num_tokens, preempted)
        self.counters.collisions += match.collisions
        for block_id in match.block_ids:
            self.emit("hit", block_id, table.seq_id)


class FreesHeadFirst(OtherPrefixCache):
    def free_sequence(self, block_ids, seq_id=None):
        super(OtherPrefixCache, self).free_sequence(list(block_ids), seq_id)


class KeepsKeyOnEviction(OtherPrefixCache):  # an evicted block keeps its entry: its next content never gets a key
    def _drop_key(self, block_id):
        pass


class ChapterDeque(OtherPrefixCache):  # chapter 02's allocator: every freed block joins one FIFO deque
    def _put_free_block(self, block_id):
        if self.entries[block_id] is not None:
            self._drop_key(block_id)
        return super()._put_free_block(block_id)


# -- Task 6.2's cost: each O(pool) somewhere the solution is O(1) -----------------


class LruList(OtherPrefixCache):  # a list as the LRU queue: pop(0) and remove() move every element after
    def __init__(self, num_blocks, block_size, hash_fn=None):
        super().__init__(num_blocks, block_size, *([hash_fn] if hash_fn else []))
        self.evictable_block_ids = []

    def _take_free_block(self, seq_id):
        if self._wanted is not None:
            block_id, self._wanted = self._wanted, None
            self.evictable_block_ids.remove(block_id)
            return block_id
        if super(OtherPrefixCache, self).num_free:
            return super(OtherPrefixCache, self)._take_free_block(seq_id)
        block_id = self._pop_oldest()
        self._drop_key(block_id)
        self.counters.evictions += 1
        self.emit("evict", block_id, seq_id)
        return block_id

    def _put_free_block(self, block_id):
        if self.entries[block_id] is None:
            return super(OtherPrefixCache, self)._put_free_block(block_id)
        self.evictable_block_ids.append(block_id)
        return {"cached": True}

    def _pop_oldest(self):
        return self.evictable_block_ids.pop(0)


class LruDequeRemove(LruList):  # a deque: popleft() is O(1), but a hit's remove() walks it
    def __init__(self, num_blocks, block_size, hash_fn=None):
        super().__init__(num_blocks, block_size, hash_fn)
        self.evictable_block_ids = deque()

    def _pop_oldest(self):
        return self.evictable_block_ids.popleft()


class ScansForTheOldest(OtherPrefixCache):  # a time stamp per cached block, and min() to evict
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.freed_at, self.tick = {}, 0

    def _put_free_block(self, block_id):
        self.tick += 1
        self.freed_at[block_id] = self.tick
        return super()._put_free_block(block_id)

    def _take_free_block(self, seq_id):
        if self._wanted is None and not super(OtherPrefixCache, self).num_free:
            oldest = min(self.freed_at, key=self.freed_at.get)
            self.evictable_block_ids.move_to_end(oldest, last=False)
        block_id = super()._take_free_block(seq_id)
        self.freed_at.pop(block_id, None)
        return block_id


class CountsTheQueue(OtherPrefixCache):  # num_free counts the LRU queue one block at a time
    @property
    def num_free(self):
        return super(OtherPrefixCache, self).num_free + sum(1 for _ in self.evictable_block_ids)


class DropsKeyByScanning(OtherPrefixCache):  # an eviction looks for the block under every key
    def _drop_key(self, block_id):
        self.entries[block_id] = None
        for key in list(self.blocks_by_key):
            if block_id in self.blocks_by_key[key]:
                self.blocks_by_key[key].remove(block_id)
                if not self.blocks_by_key[key]:
                    del self.blocks_by_key[key]
                return


class Todo(OtherPrefixCache):
    def match_prefix(self, token_ids, cache_salt=None):
        raise NotImplementedError("Task 6.4 is not implemented yet.")


class Silent(OtherPrefixCache):  # right cache, but the block map and the dashboards hear of no hit
    def emit(self, kind, block_id=None, seq_id=None, **info):
        if kind != "hit":
            super().emit(kind, block_id, seq_id, **info)


class CountsNoCollision(OtherPrefixCache):  # a refused collision is not counted
    def match_prefix(self, token_ids, cache_salt=None):
        return replace(super().match_prefix(token_ids, cache_salt), collisions=0)


# -- Task 6.5: copy-on-write (BlockTable._copy_on_write) ------------------------------


class OtherCowTable(BlockTable):  # right: takes the copy with allocate_many, drops the old block before the swap
    def _copy_on_write(self):
        old = self.blocks[-1]
        with self.allocator.hold_events():
            (new,) = self.allocator.allocate_many(1, self.seq_id)
            self.allocator.free(old, self.seq_id)
            self.blocks[-1] = new
            self.pending_copies.append((old, new))
            self.allocator.emit("cow", new, self.seq_id, src=old, dst=new, num_slots=self.num_tokens % self.block_size)


class NoCopy(BlockTable):  # the write lands in the block the other table still reads
    def _copy_on_write(self):
        pass


class AppendsTheCopy(BlockTable):  # the copy goes after the shared block instead of in its place
    def _copy_on_write(self):
        old, new = self.blocks[-1], self.allocator.allocate(self.seq_id)
        self.blocks.append(new)
        self.pending_copies.append((old, new))


class ForgetsTheCopyBlock(BlockTable):  # num_new_blocks does not count the copy
    def num_new_blocks(self, num_tokens):
        return super().num_new_blocks(num_tokens) - self._shares_last_block(num_tokens)


class CopiesReversed(BlockTable):  # (new, old): the engine copies the empty block over the shared one
    def _copy_on_write(self):
        super()._copy_on_write()
        self.pending_copies[-1] = self.pending_copies[-1][::-1]


class CopiesWithoutDecref(BlockTable):
    def _copy_on_write(self):
        self.allocator.incref(self.blocks[-1], self.seq_id)  # the copy's free() then leaves it as it was
        super()._copy_on_write()


class ForgetsToRecord(BlockTable):  # the table swaps blocks, but the engine never hears of a copy to make
    def _copy_on_write(self):
        super()._copy_on_write()
        self.pending_copies.pop()


class CopiesUnsharedBlocks(BlockTable):  # every write into a partly filled block copies it
    def _shares_last_block(self, num_tokens):
        return num_tokens > 0 and self.num_tokens % self.block_size != 0


class CopiesFullBlocks(BlockTable):  # a shared full last block is copied too, though nobody writes into it
    def _shares_last_block(self, num_tokens):
        return num_tokens > 0 and bool(self.blocks) and self.allocator.refcount(self.blocks[-1]) > 1


class TodoTable(BlockTable):
    def _copy_on_write(self):
        raise NotImplementedError("Task 6.5 is not implemented yet.")


# -- the verdicts --------------------------------------------------------------------


@pytest.mark.parametrize(
    "check, answer, status",
    [
        (ch06.check_block_keys, block_keys, PASS),  # the package's own: the model answer
        (ch06.check_block_keys, other_block_keys, PASS),
        (ch06.check_block_keys, keys_own_hash, FAIL),
        (ch06.check_block_keys, keys_without_parent, FAIL),
        (ch06.check_block_keys, keys_with_partial_block, FAIL),
        (ch06.check_block_keys, keys_salt_everywhere, FAIL),
        (ch06.check_block_keys, keys_empty_salt_is_a_salt, FAIL),
        (ch06.check_block_keys, chapter_naive_keys, FAIL),
        (ch06.check_block_keys, todo, TODO),
        (ch06.check_prefix_cache, PrefixCachingAllocator, PASS),
        (ch06.check_prefix_cache, OtherPrefixCache, PASS),
        (ch06.check_prefix_cache, Todo, TODO),
        (ch06.check_constant_time, PrefixCachingAllocator, PASS),
        (ch06.check_constant_time, OtherPrefixCache, PASS),
        (ch06.check_constant_time, Todo, TODO),
        (ch06.check_cow_table, BlockTable, PASS),
        (ch06.check_cow_table, OtherCowTable, PASS),
        (ch06.check_cow_table, TodoTable, TODO),
    ],
)
def test_check_status(check, answer, status, capsys):
    result = check(answer)
    assert result.status == status, result
    assert capsys.readouterr().out.count("\n") >= 1


# (wrong implementation, words the message must contain, the WHY hint it must print)
CACHE_MISTAKES = [
    (KeysPartialBlock, ["step 0", "request ('r0', 0)'s logical block 3", "the package's has none"], "partial"),
    (HashesWithoutParent, ["step 0", "logical block 1", "has key"], "parent"),
    (IgnoresSalt, ["request r2 was admitted with 8 cached tokens", "a salted request"], "salt"),
    (TrustsTheHash, ["colliding hash", "request r1 was admitted with 8 cached tokens"], "verify"),
    (VerifiesTokensNotParent, ["colliding hash", "request r2 was admitted with 8 cached tokens", "logical block 1"],
     "verify"),
    (MatchesWholePrompt, ["request r7 was not admitted"], "last"),
    (EvictsMostRecent, ["small pool", "logical block"], "lru"),
    (EvictsBeforeKeyless, ["step 4", "while keyless ones were free"], "lru"),
    (HitStaysInQueue, ["still in your LRU queue"], "held"),
    (ForgetsIncref, ["has refcount 0, the package's 1"], "incref"),
    (FreesHeadFirst, ["the LRU queue of free cached blocks"], "tail"),
    (KeepsKeyOnEviction, ["small pool", "before it was evicted"], "drop"),
    (ChapterDeque, ["step 2: the LRU queue of free cached blocks [block, key] is []"], "keep"),
    (Silent, ["step 6: event 0 of the step ([kind, block, sequence]) is ['cache', 16, 'r3'], the package's ['hit'"],
     "events"),
    (CountsNoCollision, ["colliding hash", "stats().collisions is 0"], "count"),
]


COW_MISTAKES = [
    (NoCopy, ["append_tokens(1)", "which another table still holds"], "cow_write"),
    (AppendsTheCopy, ["append_tokens(1)", "which another table still holds"], "cow_write"),
    (ForgetsTheCopyBlock, ["num_new_blocks(1) said 0, the package's 1"], "cow_need"),
    (CopiesReversed, ["recorded the copies [[10, 7]] (source, destination)"], "cow_pair"),
    (CopiesWithoutDecref, ["refcount"], "cow_decref"),
    (ForgetsToRecord, ["recorded the copies [] (source, destination)"], "cow_record"),
    (CopiesUnsharedBlocks, ["(refcount 1)", "said 1, the package's 0"], "cow_only"),
    (CopiesFullBlocks, ["said 2, the package's 1"], "cow_only"),
]


MISTAKES = [(ch06.check_prefix_cache, *m) for m in CACHE_MISTAKES] + [(ch06.check_cow_table, *m) for m in COW_MISTAKES]


@pytest.mark.parametrize("check, answer, words, why", MISTAKES, ids=[m[1].__name__ for m in MISTAKES])
def test_mistakes_fail_where_they_go_wrong_with_their_own_hint(check, answer, words, why, capsys):
    result = check(answer)
    assert result.status == FAIL, result
    for word in words:
        assert word in result.message, (word, result.message)
    assert "step " in result.message
    assert result.hint == WHY[why], (why, result.message, result.hint)
    assert f"hint: {WHY[why]}" in capsys.readouterr().out


# (wrong implementation, the call whose cost grows)
COST_MISTAKES = [
    (LruList, "allocate() that evicts"),
    (LruDequeRemove, "share_prefix of 2 free cached blocks"),
    (ScansForTheOldest, "allocate() that evicts"),
    (CountsTheQueue, "num_free"),
    (DropsKeyByScanning, "allocate() that evicts"),
]


@pytest.mark.parametrize("answer, call", COST_MISTAKES, ids=[m[0].__name__ for m in COST_MISTAKES])
def test_a_cache_whose_cost_grows_with_the_pool_fails(answer, call, capsys):
    assert ch06.check_prefix_cache(answer).status == PASS  # right in the engine: only its cost is wrong
    result = ch06.check_constant_time(answer)
    assert result.status == FAIL, result
    assert f"cached: {call}" in result.message and "grows with the pool" in result.message, result.message
    assert result.hint == WHY["cost"]


def test_the_checks_refuse_what_is_not_the_piece(capsys):
    assert "pass your class, BlockTable" in ch06.check_cow_table(block_keys).message
    assert "a subclass of BlockAllocator" in ch06.check_prefix_cache(block_keys).message


def test_block_keys_failures_name_the_mistake(capsys):
    assert "parent" in ch06.check_block_keys(keys_without_parent).message
    assert "partly filled" in ch06.check_block_keys(keys_with_partial_block).message
    assert "the hash_fn given" in ch06.check_block_keys(keys_own_hash).message
    assert "an empty salt is no salt" in ch06.check_block_keys(keys_empty_salt_is_a_salt).message
    assert "block 0's only extra key" in ch06.check_block_keys(keys_salt_everywhere).message


class RaisesOnMatch(OtherPrefixCache):
    def match_prefix(self, token_ids, cache_salt=None):
        if len(token_ids) > 12:
            raise KeyError("no such key")
        return super().match_prefix(token_ids, cache_salt)


def test_a_piece_that_raises_shows_the_step_and_its_inputs(capsys):
    result = ch06.check_prefix_cache(RaisesOnMatch)
    assert result.status == FAIL
    assert "step 0: your code raised KeyError" in result.message and "token_ids=" in result.message, result.message


def test_the_colliding_hash_collides():
    assert ch06.collide(b"a") == ch06.collide(b"b") and ch06.HASHES["sha256"](b"a") != ch06.HASHES["sha256"](b"b")
    first, second = (block_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, salt, ch06.transparent_hash) for salt in (None, "t"))
    assert ch06.read_key(first[1]) == [[None, [1, 2, 3, 4], []], [5, 6, 7, 8], []]  # the transparent hash reads back
    assert ch06.read_key(second[0]) == [None, [1, 2, 3, 4], ["t"]]
    assert ch06.read_key(b"\x01") == {"opaque": "b'\\x01'"} and "opaque" in ch06.read_key(sha256(b"x"))


def test_the_other_cache_uses_the_base_interface_only():
    pool = OtherPrefixCache(4, 2)
    assert isinstance(pool.evictable_block_ids, OrderedDict) and pool.num_free == 4
    with pytest.raises(OutOfBlocks):
        [pool.allocate() for _ in range(5)]


class OtherAllocator(BlockAllocator):
    """Exercise 02's contract written another way (a list, its own allocate and free), as a learner's may be.

    It keeps its counts where the base class does (``_refcounts``): the package's table checks a fork with them.
    """

    def __init__(self, num_blocks, block_size):
        super().__init__(num_blocks, block_size)
        self.free_block_ids, self._counts = list(range(self.num_blocks)), self._refcounts

    @property
    def num_free(self):
        return len(self.free_block_ids)

    def _take_free_block(self, seq_id):
        return self.free_block_ids.pop(0)

    def _put_free_block(self, block_id):
        self.free_block_ids.append(block_id)
        return {}

    def allocate(self, seq_id=None):
        if not self.num_free:
            raise OutOfBlocks("no free block")
        block_id = self._take_free_block(seq_id)
        self._counts[block_id] = 1
        return block_id

    def incref(self, block_id, seq_id=None):
        self._counts[block_id] += 1

    def free(self, block_id, seq_id=None):
        self._counts[block_id] -= 1
        if self._counts[block_id] == 0:
            self._put_free_block(block_id)

    def free_sequence(self, block_ids, seq_id=None):
        for block_id in block_ids:
            self.free(block_id, seq_id)

    def refcount(self, block_id):
        return self._counts[block_id]

    @property
    def refcounts(self):
        return list(self._counts)


def test_the_other_cache_runs_unchanged_on_another_allocator(capsys):
    """A prefix cache built on exercise 02's interface passes on another allocator that keeps that interface."""
    cache = cache_on(OtherAllocator)
    assert cache.__mro__[1] is OtherAllocator
    assert ch06.check_prefix_cache(cache).status == PASS
