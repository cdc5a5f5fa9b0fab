"""The chapter 06 exercise checks pass the reference answers and catch the classic mistakes of prefix sharing.

Each wrong implementation below is one mistake; the check must FAIL on it. The
``Chapter*`` ones are what a learner would get by copying the code chapter 06
shows (a naive per-block hash, chapter 02's append and deque): the chapter
teaches the idea without printing the answer, so those must FAIL too.
"""


import pytest

from minipaged.checks import FAIL, PASS, TODO, ch06
from minipaged.checks.instructor.ch06 import PrefixPool  # the check's own reference; mutants break it one way each

pytestmark = pytest.mark.ch06


# -- Task 6.1 and 6.2 --------------------------------------------------------------


def block_keys(token_ids, block_size, hash_fn, cache_salt=None):
    keys, parent = [], None
    for i in range(len(token_ids) // block_size):
        extra = (cache_salt,) if i == 0 and cache_salt is not None else ()
        parent = hash_fn(parent, tuple(token_ids[i * block_size : (i + 1) * block_size]), extra)
        keys.append(parent)
    return keys


def keys_without_parent(token_ids, block_size, hash_fn, cache_salt=None):
    extra = (cache_salt,) if cache_salt is not None else ()
    return [hash_fn(None, tuple(token_ids[i * block_size : (i + 1) * block_size]), extra if i == 0 else ())
            for i in range(len(token_ids) // block_size)]


def keys_with_partial_block(token_ids, block_size, hash_fn, cache_salt=None):
    keys, parent = [], None
    for i in range(0, len(token_ids), block_size):
        extra = (cache_salt,) if i == 0 and cache_salt is not None else ()
        parent = hash_fn(parent, tuple(token_ids[i : i + block_size]), extra)
        keys.append(parent)
    return keys


# Harmless for hits, but not the key asked for.
def keys_salt_everywhere(token_ids, block_size, hash_fn, cache_salt=None):
    keys, parent = [], None
    for i in range(len(token_ids) // block_size):
        extra = (cache_salt,) if cache_salt else ()
        parent = hash_fn(parent, tuple(token_ids[i * block_size : (i + 1) * block_size]), extra)
        keys.append(parent)
    return keys


# The first idea the chapter shows, and refutes.
def chapter_naive_keys(token_ids, block_size, hash_fn, cache_salt=None):
    return [hash_fn(None, tuple(token_ids[i : i + block_size]), ()) for i in range(0, len(token_ids), block_size)]


def hit_tokens(token_ids, block_size, hash_fn, cached, cache_salt=None):
    hits = 0
    usable = (len(token_ids) - 1) // block_size
    for i, key in enumerate(block_keys(token_ids, block_size, hash_fn, cache_salt)[:usable]):
        if cached.get(key) != tuple(token_ids[i * block_size : (i + 1) * block_size]):
            break
        hits += 1
    return hits * block_size


def hits_unverified(token_ids, block_size, hash_fn, cached, cache_salt=None):
    hits = 0
    for key in block_keys(token_ids, block_size, hash_fn, cache_salt)[: (len(token_ids) - 1) // block_size]:
        if key not in cached:
            break
        hits += 1
    return hits * block_size


def hits_whole_prompt(token_ids, block_size, hash_fn, cached, cache_salt=None):
    hits = 0
    for i, key in enumerate(block_keys(token_ids, block_size, hash_fn, cache_salt)):
        if cached.get(key) != tuple(token_ids[i * block_size : (i + 1) * block_size]):
            break
        hits += 1
    return hits * block_size


def hits_counted_not_prefix(token_ids, block_size, hash_fn, cached, cache_salt=None):  # counts hits after a miss too
    keys = block_keys(token_ids, block_size, hash_fn, cache_salt)[: (len(token_ids) - 1) // block_size]
    return block_size * sum(cached.get(k) == tuple(token_ids[i * block_size : (i + 1) * block_size])
                            for i, k in enumerate(keys))


# -- Task 6.3 ----------------------------------------------------------------------


class CowTable:
    def __init__(self, allocator, data, seq_id=None):
        self.allocator, self.data, self.seq_id = allocator, data, seq_id
        self.blocks, self.num_tokens = [], 0

    def fork(self, seq_id=None):
        child = type(self)(self.allocator, self.data, seq_id)
        for b in self.blocks:
            self.allocator.incref(b, seq_id)
        child.blocks, child.num_tokens = list(self.blocks), self.num_tokens
        return child

    def append(self, value):
        B = self.allocator.block_size
        offset = self.num_tokens % B
        if offset == 0:
            self.blocks.append(self.allocator.allocate(self.seq_id))
        elif self.allocator.refcount(self.blocks[-1]) > 1:
            self._copy_tail(offset)
        slot = self.blocks[-1] * B + offset
        self.data[slot] = value
        self.num_tokens += 1
        return slot

    def _copy_tail(self, offset):
        B, old = self.allocator.block_size, self.blocks[-1]
        new = self.allocator.allocate(self.seq_id)
        self.data[new * B : new * B + offset] = self.data[old * B : old * B + offset]
        self.allocator.free(old, self.seq_id)
        self.blocks[-1] = new


class WritesBeforeCopying(CowTable):
    def append(self, value):
        B = self.allocator.block_size
        offset = self.num_tokens % B
        if offset == 0:
            self.blocks.append(self.allocator.allocate(self.seq_id))
        self.data[self.blocks[-1] * B + offset] = value  # into the shared block ...
        if offset and self.allocator.refcount(self.blocks[-1]) > 1:
            self._copy_tail(offset + 1)  # ... then copied, new token included
        self.num_tokens += 1
        return self.blocks[-1] * B + offset


class ChapterNoCow(CowTable):  # chapter 02's append_tokens, one token at a time: no copy at all
    def append(self, value):
        B = self.allocator.block_size
        if self.num_tokens % B == 0:
            self.blocks += self.allocator.allocate_many(1, self.seq_id)
        slot = self.blocks[-1] * B + self.num_tokens % B
        self.data[slot] = value
        self.num_tokens += 1
        return slot


class CopiesWithoutDecref(CowTable):
    def _copy_tail(self, offset):
        B, old = self.allocator.block_size, self.blocks[-1]
        new = self.allocator.allocate(self.seq_id)
        self.data[new * B : new * B + offset] = self.data[old * B : old * B + offset]
        self.blocks[-1] = new


class CopiesEveryPartialBlock(CowTable):
    def append(self, value):
        B = self.allocator.block_size
        if self.num_tokens % B:
            self._copy_tail(self.num_tokens % B)
        return super().append(value)


class FreesBeforeAllocating(CowTable):  # on a full pool the old reference is gone before OutOfBlocks
    def _copy_tail(self, offset):
        B, old = self.allocator.block_size, self.blocks[-1]
        self.allocator.free(old, self.seq_id)
        new = self.allocator.allocate(self.seq_id)
        self.data[new * B : new * B + offset] = self.data[old * B : old * B + offset]
        self.blocks[-1] = new


# -- Task 6.4 ----------------------------------------------------------------------




class EvictsReferencedBlocks(PrefixPool):  # a hit leaves the block in the free queue
    def hit(self, key):
        block_id = self.block_of.get(key)
        if block_id is not None:
            self.refcounts[block_id] += 1
        return block_id


class EvictsMostRecent(PrefixPool):
    def allocate(self):
        if not self.keyless_free and self.cached_free:
            block_id, _ = self.cached_free.popitem(last=True)
            self._evict(block_id)
            self.refcounts[block_id] = 1
            return block_id
        return super().allocate()


class EvictsBeforeKeyless(PrefixPool):
    def allocate(self):
        if self.cached_free:
            block_id, _ = self.cached_free.popitem(last=False)
            self._evict(block_id)
            self.refcounts[block_id] = 1
            return block_id
        return super().allocate()


class KeepsKeyOnEviction(PrefixPool):  # a stale key would hand out a block that now holds other tokens
    def _evict(self, block_id):
        self.evicted.append(block_id)


class ChapterDeque(PrefixPool):  # chapter 02's allocator: every freed block joins one FIFO deque
    def free(self, block_id):
        self.refcounts[block_id] -= 1
        if self.refcounts[block_id] == 0:
            self.keyless_free.append(block_id)


class Todo:
    def __init__(self, *args):
        pass

    def __getattr__(self, name):
        raise NotImplementedError("Task 6.4 is not implemented yet.")


def todo(*args):
    raise NotImplementedError("Task 6.1 is not implemented yet. Hint: one key per full block")


@pytest.mark.parametrize(
    "check, answer, status",
    [
        (ch06.check_block_keys, block_keys, PASS),
        (ch06.check_block_keys, keys_without_parent, FAIL),
        (ch06.check_block_keys, keys_with_partial_block, FAIL),
        (ch06.check_block_keys, keys_salt_everywhere, FAIL),
        (ch06.check_block_keys, chapter_naive_keys, FAIL),
        (ch06.check_block_keys, todo, TODO),
        (ch06.check_hit_tokens, hit_tokens, PASS),
        (ch06.check_hit_tokens, hits_unverified, FAIL),
        (ch06.check_hit_tokens, hits_whole_prompt, FAIL),
        (ch06.check_hit_tokens, hits_counted_not_prefix, FAIL),
        (ch06.check_hit_tokens, todo, TODO),
        (ch06.check_cow_append, CowTable, PASS),
        (ch06.check_cow_append, WritesBeforeCopying, FAIL),
        (ch06.check_cow_append, ChapterNoCow, FAIL),
        (ch06.check_cow_append, CopiesWithoutDecref, FAIL),
        (ch06.check_cow_append, CopiesEveryPartialBlock, FAIL),
        (ch06.check_cow_append, FreesBeforeAllocating, FAIL),
        (ch06.check_lru, PrefixPool, PASS),
        (ch06.check_lru, EvictsReferencedBlocks, FAIL),
        (ch06.check_lru, EvictsMostRecent, FAIL),
        (ch06.check_lru, EvictsBeforeKeyless, FAIL),
        (ch06.check_lru, KeepsKeyOnEviction, FAIL),
        (ch06.check_lru, ChapterDeque, FAIL),
        (ch06.check_lru, Todo, TODO),
    ],
)
def test_check_status(check, answer, status, capsys):
    result = check(answer)
    assert result.status == status, result
    assert capsys.readouterr().out.count("\n") >= 1


def test_failures_name_the_mistake(capsys):
    assert "parent" in ch06.check_block_keys(keys_without_parent).message
    assert "partly filled" in ch06.check_block_keys(keys_with_partial_block).message
    assert "shared block" in ch06.check_cow_append(WritesBeforeCopying).message
    assert "could evict it" in ch06.check_lru(EvictsReferencedBlocks).message


def test_weak_hash_collides_and_transparent_hash_does_not():
    a, d = [11, 12, 13, 14], [12, 11, 14, 13]
    assert ch06.weak_hash(None, a, ()) == ch06.weak_hash(None, d, ())
    assert ch06.transparent_hash(None, a, ()) != ch06.transparent_hash(None, d, ())
