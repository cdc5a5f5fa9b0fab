"""Prefix caching: full blocks keyed by a hash chain, shared between requests, evicted LRU.

Many requests start with the same tokens (a system prompt, few-shot examples, the
earlier turns of a chat). Their K/V for those tokens are identical, so a block computed
for one request can serve the next. This module finds such blocks and keeps them alive
after their request ends, until the pool needs the room.

- A full block's **key** is a hash of its parent block's key, its own token ids and
  extra keys (the request's ``cache_salt``, in the first block). Chaining through the
  parent makes a key name the whole prefix up to the block's end, not just its B tokens.
- Only full blocks get keys: a partly filled block will still change.
- A hit is **verified**: the cached block's token ids, extra keys and parent must equal
  the request's, so a hash collision (likely with a weak hash, possible with any) is a
  miss, never a wrong answer.
- :class:`PrefixCachingAllocator` extends chapter 02's allocator: a freed block that
  holds a key keeps it and waits in an LRU queue; keyless free blocks are handed out
  first, then cached ones, least recently used first (taking one *evicts* it).
- An empty salt (``""``, ``b""``) is no salt, as in vLLM.

The keys follow vLLM V1's ``kv_cache_utils.hash_block_tokens``, the counters its
``PrefixCacheStats``. The free queue follows ``block_pool.BlockPool`` in which blocks
are evicted, not in the order keyless blocks are reused (see :class:`PrefixCachingAllocator`).
"""

from __future__ import annotations

import hashlib
import operator
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from minipaged.blocks import BlockAllocator, BlockTable
from minipaged.validation import check_bool, check_int, check_salt

HashFn = Callable[[bytes], bytes]


def sha256(data: bytes) -> bytes:
    """The default block hash: SHA-256 of the canonical encoding (32 bytes)."""
    return hashlib.sha256(data).digest()


def extra_keys(block_index: int, cache_salt: str | bytes | None = None) -> tuple:
    """The extra keys of logical block ``block_index``: the salt in block 0, nothing after.

    Block 0 is enough: every later key chains through it, so two salts part at block 0
    and never meet again. An empty salt is no salt (see :func:`~minipaged.validation.check_salt`).

    Args:
        block_index: the logical block.
        cache_salt: the request's salt (str or bytes), or None.
    """
    ### BEGIN SOLUTION (Exercise 06, Task 6.1)
    return (cache_salt,) if block_index == 0 and cache_salt else ()
    ### END SOLUTION


def block_tokens(token_ids: Sequence[int], block_index: int, block_size: int) -> tuple[int, ...]:
    """The token ids of logical block ``block_index``, as a tuple of Python ints (TypeError for non-ints)."""
    chunk = token_ids[block_index * block_size:(block_index + 1) * block_size]
    try:
        return tuple(map(operator.index, chunk))
    except TypeError:
        raise TypeError(f"token_ids must hold ints, got {[type(t).__name__ for t in chunk]}") from None


def _field(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def encode_block(parent_key: bytes | None, token_ids: Sequence[int], extra: tuple = ()) -> bytes:
    """The canonical bytes of a block, the input of the hash.

    Every field carries its length (and a str/bytes tag for extra keys), so two different
    blocks never encode to the same bytes: any collision is the hash function's.

    Args:
        parent_key: the key of the previous logical block, or None for block 0.
        token_ids: the block's token ids (ints).
        extra: the block's extra keys (str or bytes each).
    """
    parent = b"\x00" if parent_key is None else b"\x01" + _field(parent_key)
    tokens = _field(struct.pack(f"<{len(token_ids)}q", *block_tokens(token_ids, 0, len(token_ids))))
    parts = [struct.pack("<Q", len(extra))]
    for key in extra:
        parts.append(b"s" + _field(key.encode()) if isinstance(key, str) else b"b" + _field(key))
    return parent + tokens + b"".join(parts)


def hash_block_tokens(parent_key: bytes | None, token_ids: Sequence[int], extra: tuple = (),
                      hash_fn: HashFn = sha256) -> bytes:
    """The key of one full block: ``hash_fn`` of (parent key, token ids, extra keys).

    Args:
        parent_key: the key of the previous logical block, or None for block 0.
        token_ids: the block's token ids.
        extra: the block's extra keys, see :func:`extra_keys`.
        hash_fn: bytes -> bytes; :func:`sha256` unless a chapter plugs in a weak one.
    """
    key = hash_fn(encode_block(parent_key, token_ids, extra))
    if not isinstance(key, bytes):
        raise TypeError(f"hash_fn must return bytes, got {type(key).__name__}")
    return key


def check_hash_fn(hash_fn, name: str = "hash_fn") -> HashFn:
    """``hash_fn`` once it has returned bytes for a probe block, else a ``TypeError`` that names ``name``.

    A hash function that returns anything else would make every later step raise: refuse it up front.

    Args:
        hash_fn: the block-key hash to check, bytes -> bytes.
        name: the argument's name, as the caller's signature spells it.
    """
    if not callable(hash_fn):
        raise TypeError(f"{name} must be callable (bytes -> bytes), got {type(hash_fn).__name__}")
    key = hash_fn(encode_block(None, (0,)))
    if not isinstance(key, bytes):
        raise TypeError(f"{name} must return bytes, got {type(key).__name__} {key!r:.40} for a probe block")
    return hash_fn


def block_keys(token_ids: Sequence[int], block_size: int, cache_salt: str | bytes | None = None,
               hash_fn: HashFn = sha256) -> list[bytes]:
    """The keys of every full block of ``token_ids``, in order (a partly filled tail has none).

    Args:
        token_ids: a sequence's token ids.
        block_size: tokens per block.
        cache_salt: the request's salt (str or bytes), or None.
        hash_fn: see :func:`hash_block_tokens`.
    """
    ### BEGIN SOLUTION (Exercise 06, Task 6.1)
    cache_salt = check_salt(cache_salt)
    B = check_int(block_size, "block_size", minimum=1)
    keys, parent = [], None
    for i in range(len(token_ids) // B):
        parent = hash_block_tokens(parent, block_tokens(token_ids, i, B), extra_keys(i, cache_salt), hash_fn)
        keys.append(parent)
    return keys
    ### END SOLUTION


@dataclass(frozen=True)
class CachedBlock:
    """What the cache knows about a block that holds a key; a hit must match all of it.

    ``parent`` is the serial of the parent block's entry (None for block 0). A serial
    names one entry for its whole life and is never reused, so matching it proves the
    parent is the very block the lookup already verified, even when the hash collides.
    """

    key: bytes
    token_ids: tuple[int, ...]
    extra: tuple
    parent: int | None
    serial: int


@dataclass(frozen=True)
class PrefixMatch:
    """The result of :meth:`PrefixCachingAllocator.match_prefix`: the longest verified cached prefix.

    Attributes:
        block_ids: the cached blocks, logical block 0 first.
        keys: their keys, to check that the match is still valid when it is used.
        num_tokens: tokens they cover, ``len(block_ids) * block_size``: the hits this match records.
        queries: the tokens looked up, the prompt's length (with a preempted request's output).
        collisions: keys that were found but held other tokens (0 or 1: the lookup stops there).
    """

    block_ids: list[int]
    keys: list[bytes]
    num_tokens: int
    queries: int
    collisions: int


@dataclass
class PrefixCacheStats:
    """The prefix cache's counters, in tokens for queries and hits, as vLLM's ``PrefixCacheStats``.

    One owner: :class:`PrefixCachingAllocator` keeps one and counts into it;
    :meth:`PrefixCachingAllocator.stats` hands out a copy. A request re-admitted after
    preemption looks up its prompt and output again and hits its own freed blocks: it is
    counted apart (``preempted_*``, vLLM's issue 25780), so the hit rate is that of new requests.

    Attributes:
        requests: new requests looked up.
        queries: their tokens looked up.
        hits: their tokens found in the cache.
        preempted_requests: re-admissions of preempted requests looked up.
        preempted_queries: their tokens looked up.
        preempted_hits: their tokens found in the cache.
        evictions: cached blocks taken for new use (their keys dropped); minipaged's, not vLLM's.
        collisions: lookups that found a key holding other tokens (refused); minipaged's.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    evictions: int = 0
    collisions: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        """Count one request's lookup.

        Args:
            num_tokens: the tokens looked up.
            num_hits: the tokens found.
            preempted: whether the request was preempted before (its counts go to ``preempted_*``).
        """
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        """``hits / queries``, of new requests only (0.0 before any)."""
        return self.hits / self.queries if self.queries else 0.0


class PrefixCachingAllocator(BlockAllocator):
    """Chapter 02's allocator plus a prefix cache: freed blocks keep their keys until evicted.

    Free blocks wait in two queues. ``free_block_ids`` (chapter 02's deque) holds blocks
    with no key, handed out first in FIFO order. ``evictable_block_ids`` holds free blocks
    that still hold a key, least recently used first; one is taken only when the deque is
    empty, and taking it evicts it (its key is dropped). A hit on an evictable block takes
    it out of the queue in O(1): the queue is an ordered dict, not a deque. The base class
    keeps the refcounts, the checks and the events; this class overrides only which free
    block comes next (``_take_free_block``, ``_put_free_block``, ``num_free``).

    **Against vLLM** (vllm 0.32, ``block_pool.BlockPool.free_blocks``): vLLM has one free
    queue, always keyless blocks first and cached ones after, as here. It appends a freed
    cached block (LRU, as here) but *prepends* a freed keyless block, so keyless blocks
    are reused last in, first out (for GPU locality); minipaged reuses them first in,
    first out (chapter 02's deque). Which blocks are evicted, and when, agrees; the order
    in which keyless blocks come back, and so the block ids, differs. vLLM also reserves
    block 0 as a null block, so its ids start at 1. Both free a sequence tail first.

    The engine uses it in three steps (see :meth:`match_prefix`, :meth:`share_prefix`,
    :meth:`cache_full_blocks`): find the cached prefix of a prompt, share those blocks
    with the new sequence's table, and give keys to blocks as their tokens are scheduled.

    Args:
        num_blocks: blocks in the pool.
        block_size: token slots per block.
        hash_fn: bytes -> bytes for the block keys; :func:`sha256` by default.
    """

    _step_containers = ("evictable_block_ids", "entries", "blocks_by_key", "_stats")  # see minipaged.step_state

    def __init__(self, num_blocks: int, block_size: int, hash_fn: HashFn = sha256):
        check_hash_fn(hash_fn)
        super().__init__(num_blocks, block_size)
        self.hash_fn = hash_fn
        self.evictable_block_ids: OrderedDict[int, None] = OrderedDict()  # free and cached, LRU first
        self.entries: list[CachedBlock | None] = [None] * self.num_blocks  # by block id
        self.blocks_by_key: dict[bytes, tuple[int, ...]] = {}  # more than one only after a collision or a duplicate
        self._next_serial = 0
        self._stats = PrefixCacheStats()  # the one set of counters; stats() hands out copies

    # ---- the free queue ----

    @property
    def num_free(self) -> int:
        """Free blocks, both queues: the keyless ones and the cached ones waiting in the LRU queue."""
        ### BEGIN SOLUTION (Exercise 06, Task 6.2)
        return len(self.free_block_ids) + len(self.evictable_block_ids)
        ### END SOLUTION

    def free_queue(self) -> list[int]:
        """Every free block in the order :meth:`allocate` hands them out: keyless, then cached LRU."""
        return list(self.free_block_ids) + list(self.evictable_block_ids)

    def _take_free_block(self, seq_id) -> int:
        """A keyless free block if any, else the least recently used cached one, evicted ("evict" event)."""
        ### BEGIN SOLUTION (Exercise 06, Task 6.2)
        if self.free_block_ids:
            return super()._take_free_block(seq_id)
        block_id, _ = self.evictable_block_ids.popitem(last=False)
        evicted = self._drop_key(block_id)
        self._stats.evictions += 1
        self.emit("evict", block_id, seq_id, key=evicted.key)
        return block_id
        ### END SOLUTION

    def _put_free_block(self, block_id: int) -> dict:
        """A cached block joins the LRU end, a keyless one the deque; the "free" event says which (``cached``)."""
        ### BEGIN SOLUTION (Exercise 06, Task 6.2)
        if self.entries[block_id] is None:
            return {**super()._put_free_block(block_id), "cached": False}
        self.evictable_block_ids[block_id] = None
        return {"cached": True}
        ### END SOLUTION

    def free_sequence(self, block_ids: list[int], seq_id=None) -> None:
        """Drop one reference on each of a sequence's blocks, tail first (as vLLM).

        The last block joins the LRU queue first, so it is evicted first: a sequence's
        deepest blocks go before the prefix it may share with others. Subscribers hear of
        the frees once all are done, as in :meth:`BlockAllocator.free_sequence`.

        Args:
            block_ids: the sequence's blocks, logical block 0 first.
            seq_id: the sequence, for the events.

        Raises as :meth:`BlockAllocator.free_sequence` does, before any block is freed.
        """
        ### BEGIN SOLUTION (Exercise 06, Task 6.2)
        super().free_sequence(self._check_free_sequence(block_ids)[::-1], seq_id)
        ### END SOLUTION

    # ---- keys ----

    def block_key(self, block_id: int) -> bytes | None:
        """The key ``block_id`` holds, or None."""
        entry = self.entries[self._check_block_id(block_id, "read the key of")]
        return None if entry is None else entry.key

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that hold a key, in use or free."""
        return sum(entry is not None for entry in self.entries)

    def _drop_key(self, block_id: int) -> CachedBlock:
        """Forget ``block_id``'s key everywhere (its entry, its place under the key); return the entry it had."""
        ### BEGIN SOLUTION (Exercise 06, Task 6.2)
        entry = self.entries[block_id]
        self.entries[block_id] = None
        holders = tuple(b for b in self.blocks_by_key[entry.key] if b != block_id)
        if holders:
            self.blocks_by_key[entry.key] = holders
        else:
            del self.blocks_by_key[entry.key]
        return entry
        ### END SOLUTION

    def _lookup(self, key: bytes, token_ids: tuple, extra: tuple, parent: int | None) -> tuple[int | None, bool]:
        """The cached block that verifies for this key, and whether a holder of the key had other content."""
        ### BEGIN SOLUTION (Exercise 06, Task 6.4)
        collided = False
        for block_id in self.blocks_by_key.get(key, ()):
            entry = self.entries[block_id]
            if entry.token_ids != token_ids or entry.extra != extra:
                collided = True
            elif entry.parent == parent:
                return block_id, False
        return None, collided
        ### END SOLUTION

    def match_prefix(self, token_ids: Sequence[int], cache_salt: str | bytes | None = None) -> PrefixMatch:
        """The longest verified cached prefix of a prompt, in whole blocks. Changes nothing.

        The match never covers the last prompt token, whose logits the first decode step
        needs: a prompt of exactly k blocks matches at most k - 1 of them.

        Args:
            token_ids: the prompt's token ids.
            cache_salt: the request's salt (str or bytes): only requests with the same salt share;
                an empty one is no salt.
        """
        ### BEGIN SOLUTION (Exercise 06, Task 6.4)
        cache_salt = check_salt(cache_salt)
        B = self.block_size
        blocks, keys, parent_key, parent, collisions = [], [], None, None, 0
        for i in range((len(token_ids) - 1) // B if token_ids else 0):
            tokens, extra = block_tokens(token_ids, i, B), extra_keys(i, cache_salt)
            key = hash_block_tokens(parent_key, tokens, extra, self.hash_fn)
            block_id, collided = self._lookup(key, tokens, extra, parent)
            if block_id is None:
                collisions += collided
                break
            blocks.append(block_id)
            keys.append(key)
            parent_key, parent = key, self.entries[block_id].serial
        return PrefixMatch(blocks, keys, len(blocks) * B, len(token_ids), collisions)
        ### END SOLUTION

    def num_free_among(self, block_ids: Sequence[int]) -> int:
        """How many of ``block_ids`` sit in the free queue: sharing them takes them out of it.

        Admission must count them with the new blocks: after :meth:`share_prefix` the pool
        has ``num_free - num_free_among(match.block_ids)`` free blocks.
        """
        return sum(self._refcounts[self._check_block_id(b, "count")] == 0 for b in block_ids)

    def share_prefix(self, table: BlockTable, match: PrefixMatch, *, preempted: bool = False) -> None:
        """Start an empty table with the matched blocks (one more reference each) and count the lookup.

        Call it for every request admitted with caching on, even with an empty match, so
        that the counters count every lookup once. Then append the rest of the prompt
        with ``table.append_tokens``: the matched blocks are out of the free queue by then,
        so the new blocks can never evict them. Emits one "hit" per matched block.

        Args:
            table: the new sequence's table, empty and on this allocator.
            match: from :meth:`match_prefix` in this same state (no allocation in between).
            preempted: whether the request was preempted before (``seq.num_preemptions > 0``):
                its lookup counts into the ``preempted_*`` counters, not the hit rate's
                (see :class:`PrefixCacheStats`).

        Raises (before anything changes):
            ValueError: the table is not empty or belongs to another allocator, or the match
                is stale (one of its blocks lost its key since).
            TypeError: ``preempted`` is not a bool.
        """
        ### BEGIN SOLUTION (Exercise 06, Task 6.4)
        preempted = check_bool(preempted, "preempted")
        if table.allocator is not self:
            raise ValueError("table belongs to another allocator")
        if table.blocks or table.num_tokens:
            raise ValueError(f"table of sequence {table.seq_id!r} is not empty: share_prefix starts a new table")
        for block_id, key in zip(match.block_ids, match.keys):
            entry = self.entries[self._check_block_id(block_id, "share")]
            if entry is None or entry.key != key:
                raise ValueError(f"match is stale: block {block_id} no longer holds its key; match again")
        was_free = []
        for block_id in match.block_ids:
            was_free.append(self._refcounts[block_id] == 0)
            if was_free[-1]:
                del self.evictable_block_ids[block_id]
            self._refcounts[block_id] += 1
        table.blocks = list(match.block_ids)
        table.num_tokens = match.num_tokens
        table.released = False
        self._stats.record(match.queries, match.num_tokens, preempted)
        self._stats.collisions += match.collisions
        for block_id, free in zip(match.block_ids, was_free):
            self.emit("hit", block_id, table.seq_id, refcount=self._refcounts[block_id], was_free=free)
        ### END SOLUTION

    def cache_full_blocks(self, table: BlockTable, token_ids: Sequence[int], num_tokens: int,
                          cache_salt: str | bytes | None = None) -> int:
        """Give a key to each of the table's blocks whose tokens are all scheduled and that has none yet.

        The contract (vLLM's, "keys at allocation"): call it right after ``table.append_tokens(n)``
        while scheduling, with ``num_tokens = seq.num_computed_tokens + n``, the tokens whose K/V
        this step *will* write (drafts excluded). A block gets its key once its tokens are all
        scheduled, before its K/V is written, so a request admitted later in the same step can
        hit it. That is safe: within one forward pass every sequence's K/V of a layer is written
        before that layer's attention reads. A key given for K/V that the step then does not
        write (a victim preempted later in the same pass, a step that fails) must not survive
        it: that is the scheduler's to undo. Returns how many blocks got a key. Emits "cache"
        for each.

        Args:
            table: the sequence's table, on this allocator.
            token_ids: every token of the sequence so far (prompt, then output; drafts excluded).
            num_tokens: tokens whose K/V are in the cache or written this step (at most
                ``len(token_ids)`` and ``table.num_tokens``).
            cache_salt: the request's salt, the same one given to :meth:`match_prefix`.
        """
        ### BEGIN SOLUTION (Exercise 06, Task 6.3)
        cache_salt = check_salt(cache_salt)
        if table.allocator is not self:
            raise ValueError("table belongs to another allocator")
        limit = min(len(token_ids), table.num_tokens)
        n = check_int(num_tokens, "num_tokens")
        if n > limit:
            raise ValueError(f"num_tokens {n} is more than the sequence's {limit} tokens with slots")
        B, blocks = self.block_size, table.blocks
        first = n // B  # blocks 0..first-1 are full and computed; keys are given in order, so scan back
        while first > 0 and self.entries[blocks[first - 1]] is None:
            first -= 1
        new = []  # (block id, entry), all computed before any is stored: a bad token id changes nothing
        parent = self.entries[blocks[first - 1]] if first else None
        for i in range(first, n // B):
            parent_key, parent_serial = (None, None) if parent is None else (parent.key, parent.serial)
            tokens, extra = block_tokens(token_ids, i, B), extra_keys(i, cache_salt)
            key = hash_block_tokens(parent_key, tokens, extra, self.hash_fn)
            parent = CachedBlock(key, tokens, extra, parent_serial, self._next_serial + len(new))
            new.append((blocks[i], parent))
        for block_id, entry in new:
            self.entries[block_id] = entry
            self.blocks_by_key[entry.key] = (*self.blocks_by_key.get(entry.key, ()), block_id)
        self._next_serial += len(new)
        for block_id, _ in new:
            self.emit("cache", block_id, table.seq_id)
        return len(new)
        ### END SOLUTION

    def reset_prefix_cache(self) -> int:
        """Drop every key, once no sequence holds a block: the cached blocks become keyless (in LRU order).

        For new weights, say, when every cached K/V is stale. Returns how many keys it dropped.

        Raises (before anything changes):
            ValueError: some blocks are still held. Their keys would survive the reset (a
                held block cannot lose its key: its holder may be shared into), so new requests
                would still hit K/V of the old state. vLLM refuses too (it returns False).
        """
        if self.num_used:
            raise ValueError(f"cannot reset the prefix cache: {self.num_used} blocks are still held by sequences, "
                             "and their keys would survive the reset; finish or abort them first")
        dropped = list(self.evictable_block_ids)  # no block is held: every key is a free cached block's
        for block_id in dropped:
            self.entries[block_id] = None
            self.free_block_ids.append(block_id)
        self.blocks_by_key.clear()
        self.evictable_block_ids.clear()
        self.emit("reset", None, None, num_dropped=len(dropped))
        return len(dropped)

    # ---- metrics ----

    def stats(self) -> PrefixCacheStats:
        """A copy of the counters now (see :class:`PrefixCacheStats`); cached blocks: :attr:`num_cached_blocks`."""
        return replace(self._stats)

    def __repr__(self) -> str:
        return (f"PrefixCachingAllocator(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"free={self.num_free}, cached={self.num_cached_blocks})")
