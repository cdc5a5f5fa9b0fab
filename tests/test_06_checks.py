"""The chapter 06 exercise checks pass the model solution and catch the classic mistakes of prefix sharing.

The model solution's classes come from the solution notebook itself (its import and class cells), so the
classes checked here are the ones the exercise ships. Each wrong implementation below is one mistake,
written as a subclass that overrides one method; the check must FAIL on it, with a message that names the
step, the request or the block, and with the hint for that mistake (``WHY``). The ``Chapter*`` ones are what
a learner gets by copying what chapter 06 shows (a naive per-block hash, chapter 02's table): the chapter
teaches the idea without printing the answer, so those must FAIL too.
"""

import functools
from collections import OrderedDict, deque
from dataclasses import replace

import engine_helpers
import nbformat
import pytest

from minipaged import checks
from minipaged.blocks import BlockAllocator, BlockTable, OutOfBlocks
from minipaged.checks import FAIL, PASS, TODO, ch06
from minipaged.checks.ch06 import WHY, TableWithoutCow
from minipaged.prefix_cache import PrefixMatch, hash_block_tokens

pytestmark = pytest.mark.ch06


@pytest.fixture(autouse=True, scope="module")
def _reference_runs_once():
    """Each check call runs the package's reference on the public cases; here once per check, not once per call."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checks, "expected", functools.cache(checks.expected))
        yield

SOLUTION = engine_helpers.SOLUTIONS / "06_prefix_sharing_cow.ipynb"
CELLS = ("fb4b9e26", "e6c1a2b1", "e6c1a2b6")  # the imports, MyPrefixCache, MyCowTable

_NS = engine_helpers.solution_namespace(SOLUTION.name, CELLS)
MyPrefixCache, MyCowTable, Entry = _NS["MyPrefixCache"], _NS["MyCowTable"], _NS["Entry"]


# -- Task 6.1 (warm-up) ------------------------------------------------------------


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


def keys_salt_everywhere(token_ids, block_size, hash_fn, cache_salt=None):  # harmless for hits, not the key asked
    keys, parent = [], None
    for i in range(len(token_ids) // block_size):
        extra = (cache_salt,) if cache_salt else ()
        parent = hash_fn(parent, tuple(token_ids[i * block_size : (i + 1) * block_size]), extra)
        keys.append(parent)
    return keys


def chapter_naive_keys(token_ids, block_size, hash_fn, cache_salt=None):  # the first idea the chapter refutes
    return [hash_fn(None, tuple(token_ids[i : i + block_size]), ()) for i in range(0, len(token_ids), block_size)]


def todo(*args):
    raise NotImplementedError("Task 6.1 is not implemented yet. Hint: one key per full block")


# -- Tasks 6.2 to 6.4: the prefix cache, one mistake each --------------------------


class KeysPartialBlock(MyPrefixCache):  # a key for the partly filled last block too
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


class HashesWithoutParent(MyPrefixCache):  # every block hashed as if it were block 0
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


class IgnoresSalt(MyPrefixCache):
    def extra_keys(self, block_index, cache_salt):
        return ()


class TrustsTheHash(MyPrefixCache):  # a key found is taken as a hit, tokens and parent unchecked
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


class VerifiesTokensNotParent(MyPrefixCache):  # a block with the prompt's tokens behind another parent is a hit
    def match_prefix(self, token_ids, cache_salt=None):
        blocks, keys, parent = [], [], None
        for i in range(max(len(token_ids) - 1, 0) // self.block_size):
            tokens, extra = self.block_tokens(token_ids, i), self.extra_keys(i, cache_salt)
            key = hash_block_tokens(parent, tokens, extra, self.hash_fn)
            found = next((b for b in self.blocks_by_key.get(key, ()) if self.entries[b].token_ids == tokens
                          and self.entries[b].extra == extra), None)
            if found is None:
                break
            blocks.append(found)
            keys.append(key)
            parent = key
        return PrefixMatch(blocks, keys, len(blocks) * self.block_size, len(token_ids), 0)


class MatchesWholePrompt(MyPrefixCache):  # the block with the last prompt token hits too
    def match_prefix(self, token_ids, cache_salt=None):
        return replace(super().match_prefix(list(token_ids) + [0], cache_salt), queries=len(token_ids))


class EvictsMostRecent(MyPrefixCache):
    def _take_free_block(self, seq_id):
        if self._wanted is None and not super(MyPrefixCache, self).num_free and self.evictable_block_ids:
            self.evictable_block_ids.move_to_end(next(reversed(self.evictable_block_ids)), last=False)
        return super()._take_free_block(seq_id)


class EvictsBeforeKeyless(MyPrefixCache):  # a cached block goes out while keyless ones are free
    def _take_free_block(self, seq_id):
        if self._wanted is None and self.evictable_block_ids:
            block_id, _ = self.evictable_block_ids.popitem(last=False)
            self._drop_key(block_id)
            self.counters.evictions += 1
            return block_id
        return super()._take_free_block(seq_id)


class HitStaysInQueue(MyPrefixCache):  # a free block shared by a hit is not taken out of the LRU queue
    def _take_free_block(self, seq_id):
        if self._wanted is not None:
            block_id, self._wanted = self._wanted, None
            return block_id
        return super()._take_free_block(seq_id)

    @property
    def num_free(self):
        return super(MyPrefixCache, self).num_free + sum(self.refcount(b) == 0 for b in self.evictable_block_ids)


class ForgetsIncref(MyPrefixCache):  # a held block is shared without one more reference
    def share_prefix(self, table, match, *, preempted=False):
        for block_id in match.block_ids:
            if self.refcount(block_id) == 0:
                self._wanted = block_id
                self.allocate(table.seq_id)
        table.blocks, table.num_tokens = list(match.block_ids), match.num_tokens
        self.counters.record(match.queries, match.num_tokens, preempted)


class FreesHeadFirst(MyPrefixCache):
    def free_sequence(self, block_ids, seq_id=None):
        super(MyPrefixCache, self).free_sequence(list(block_ids), seq_id)


class KeepsKeyOnEviction(MyPrefixCache):  # an evicted block keeps its entry: its next content never gets a key
    def _drop_key(self, block_id):
        pass


class ChapterDeque(MyPrefixCache):  # chapter 02's allocator: every freed block joins one FIFO deque
    def _put_free_block(self, block_id):
        if self.entries[block_id] is not None:
            self._drop_key(block_id)
        return super()._put_free_block(block_id)


# -- Task 6.2's cost: each O(pool) somewhere the solution is O(1) -----------------


class LruList(MyPrefixCache):  # a list as the LRU queue: pop(0) and remove() move every element after
    def __init__(self, num_blocks, block_size, hash_fn=None):
        super().__init__(num_blocks, block_size, *([hash_fn] if hash_fn else []))
        self.evictable_block_ids = []

    def _take_free_block(self, seq_id):
        if self._wanted is not None:
            block_id, self._wanted = self._wanted, None
            self.evictable_block_ids.remove(block_id)
            return block_id
        if super(MyPrefixCache, self).num_free:
            return super(MyPrefixCache, self)._take_free_block(seq_id)
        block_id = self._pop_oldest()
        self._drop_key(block_id)
        self.counters.evictions += 1
        return block_id

    def _put_free_block(self, block_id):
        if self.entries[block_id] is None:
            return super(MyPrefixCache, self)._put_free_block(block_id)
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


class ScansForTheOldest(MyPrefixCache):  # a time stamp per cached block, and min() to evict
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.freed_at, self.tick = {}, 0

    def _put_free_block(self, block_id):
        self.tick += 1
        self.freed_at[block_id] = self.tick
        return super()._put_free_block(block_id)

    def _take_free_block(self, seq_id):
        if self._wanted is None and not super(MyPrefixCache, self).num_free:
            oldest = min(self.freed_at, key=self.freed_at.get)
            self.evictable_block_ids.move_to_end(oldest, last=False)
        block_id = super()._take_free_block(seq_id)
        self.freed_at.pop(block_id, None)
        return block_id


class CountsTheQueue(MyPrefixCache):  # num_free counts the LRU queue one block at a time
    @property
    def num_free(self):
        return super(MyPrefixCache, self).num_free + sum(1 for _ in self.evictable_block_ids)


class DropsKeyByScanning(MyPrefixCache):  # an eviction looks for the block under every key
    def _drop_key(self, block_id):
        self.entries[block_id] = None
        for key in list(self.blocks_by_key):
            if block_id in self.blocks_by_key[key]:
                self.blocks_by_key[key].remove(block_id)
                if not self.blocks_by_key[key]:
                    del self.blocks_by_key[key]
                return


class Todo(MyPrefixCache):
    def match_prefix(self, token_ids, cache_salt=None):
        raise NotImplementedError("Task 6.4 is not implemented yet.")


# -- Task 6.5: copy-on-write, one mistake each -------------------------------------


class WritesBeforeCopying(MyCowTable):  # the base hands out the slots first: they are in the shared block
    def append_tokens(self, num_tokens):
        copy = self.must_copy(num_tokens)
        slots = TableWithoutCow.append_tokens(self, num_tokens)
        if copy:
            last = -1 - (len(self.blocks) - 1 - (self.num_tokens - num_tokens) // self.block_size)
            old, new = self.blocks[last], self.allocator.allocate(self.seq_id)
            self.blocks[last] = new
            self.allocator.free(old, self.seq_id)
            self.pending_copies.append((old, new))
        return slots


class ForgetsTheCopyBlock(MyCowTable):  # num_new_blocks does not count the copy
    def num_new_blocks(self, num_tokens):
        return TableWithoutCow.num_new_blocks(self, num_tokens)


class CopiesReversed(MyCowTable):  # (new, old): the engine copies the empty block over the shared one
    def append_tokens(self, num_tokens):
        slots = super().append_tokens(num_tokens)
        self.pending_copies = [(dst, src) for src, dst in self.pending_copies]
        return slots


class CopiesWithoutDecref(MyCowTable):
    def append_tokens(self, num_tokens):
        if self.must_copy(num_tokens):
            self.allocator.incref(self.blocks[-1], self.seq_id)  # the copy's free() then leaves it as it was
        return super().append_tokens(num_tokens)


class CopiesUnsharedBlocks(MyCowTable):  # every write into a partly filled block copies it
    def must_copy(self, num_tokens):
        return num_tokens > 0 and self.num_tokens % self.block_size != 0


class CopiesFullBlocks(MyCowTable):  # a shared full last block is copied too, though nobody writes into it
    def must_copy(self, num_tokens):
        return num_tokens > 0 and bool(self.blocks) and self.allocator.refcount(self.blocks[-1]) > 1


class ChapterNoCow(TableWithoutCow):  # chapter 02's table as it is
    pass


class ThePackagesTable(BlockTable):  # delegation: the package's copy-on-write, under the learner's name
    pass


class TodoTable(MyCowTable):
    def must_copy(self, num_tokens):
        raise NotImplementedError("Task 6.5 is not implemented yet.")


# -- the verdicts --------------------------------------------------------------------


@pytest.mark.parametrize(
    "check, answer, status",
    [
        (ch06.check_block_keys, block_keys, PASS),
        (ch06.check_block_keys, keys_without_parent, FAIL),
        (ch06.check_block_keys, keys_with_partial_block, FAIL),
        (ch06.check_block_keys, keys_salt_everywhere, FAIL),
        (ch06.check_block_keys, chapter_naive_keys, FAIL),
        (ch06.check_block_keys, todo, TODO),
        (ch06.check_prefix_cache, MyPrefixCache, PASS),
        (ch06.check_prefix_cache, Todo, TODO),
        (ch06.check_constant_time, MyPrefixCache, PASS),
        (ch06.check_constant_time, Todo, TODO),
        (ch06.check_cow_table, MyCowTable, PASS),
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
]


COW_MISTAKES = [
    (WritesBeforeCopying, ["append_tokens(1)", "which another table still holds"], "cow_write"),
    (ChapterNoCow, ["num_new_blocks(1) said 0, the package's 1"], "cow_need"),
    (ForgetsTheCopyBlock, ["num_new_blocks(1) said 0, the package's 1"], "cow_need"),
    (CopiesReversed, ["recorded the copies [[10, 7]] (source, destination)"], "cow_pair"),
    (CopiesWithoutDecref, ["refcount"], "cow_decref"),
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
    assert "inherits the package's copy-on-write" in ch06.check_cow_table(ThePackagesTable).message
    assert "a subclass of BlockAllocator" in ch06.check_prefix_cache(block_keys).message


def test_block_keys_failures_name_the_mistake(capsys):
    assert "parent" in ch06.check_block_keys(keys_without_parent).message
    assert "partly filled" in ch06.check_block_keys(keys_with_partial_block).message


class RaisesOnMatch(MyPrefixCache):
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
    assert ch06.transparent_hash(None, [1, 2], ()) != ch06.transparent_hash(None, [2, 1], ())


def test_the_solution_runs_on_the_base_interface_only():
    """The capstone puts MyPrefixCache on the learner's exercise 02 allocator: it must not reach into the base."""
    source = {c.id: c for c in nbformat.read(SOLUTION, as_version=4).cells}["e6c1a2b1"].source
    for private in ("_refcounts", "free_block_ids", "_held_events", "_ever_allocated"):
        assert private not in source, private
    pool = MyPrefixCache(4, 2)
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


def test_the_model_cache_runs_unchanged_on_another_allocator(capsys):
    """The capstone's cut: the same class body on a learner's allocator (here OtherAllocator) passes the check."""
    cells = {c.id: c for c in nbformat.read(SOLUTION, as_version=4).cells}
    namespace = dict(_NS, BlockAllocator=OtherAllocator)
    exec(compile(cells["e6c1a2b1"].source, "solution cell", "exec"), namespace)
    assert namespace["MyPrefixCache"].__mro__[1] is OtherAllocator
    assert ch06.check_prefix_cache(namespace["MyPrefixCache"]).status == PASS
