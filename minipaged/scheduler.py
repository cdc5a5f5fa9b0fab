"""Continuous batching: at every step, decide which sequences run and how many tokens each computes.

The rules, in the order :meth:`Scheduler.schedule` applies them:

1. **Running sequences first, decodes before prefill chunks.** A decode is one
   token and a user is waiting on it; a prefill chunk can absorb whatever
   budget is left.
2. **A token budget per step** (``max_num_batched_tokens``) bounds the work of
   one forward pass. A long prompt is cut into chunks across steps (chunked
   prefill), so it cannot stall the decodes of everyone else.
3. **Growth before admission.** A running sequence that needs a new block and
   finds the pool empty preempts a running sequence, the one the scheduling
   policy picks (FCFS: the *youngest*, latest arrival, maybe the requester itself and never an
   older one): its blocks are freed, its tokens kept, and it goes back to the
   front of the waiting queue. Older requests therefore always make progress.
   By **recompute** (the default) its K/V is dropped and re-prefilled from
   prompt + generated tokens later; by **swap** the engine copies its K/V to
   CPU memory first and back into fresh blocks when it is readmitted.
4. **Admission in the policy's order, with a watermark** (:mod:`minipaged.request_queue`).
   The head of the waiting queue is admitted only if its first chunk's blocks are free
   *and* a watermark of blocks stays free afterwards, as headroom for the running
   sequences to grow into. If the head does not fit, nobody behind it jumps the queue.
   Nobody is admitted in a step that had to preempt: the pool is already short.
5. **Prefix caching** (chapter 06; on when the allocator has ``match_prefix``, as
   :class:`~minipaged.prefix_cache.PrefixCachingAllocator` does). At admission the
   longest cached prefix of the sequence's tokens is shared into its table and
   ``num_computed_tokens`` starts at the hit length; a hit block that sat in
   the free queue stops being free, and admission counts it so. A block gets its key
   **when it is allocated**, as vLLM and nano-vllm key it: once this step's scheduled
   tokens fill it (drafts excluded). A request admitted later in the same step can hit it:
   within one forward pass every sequence's K/V of a layer is written before that layer's
   attention reads. The running sequences' blocks are keyed once every preemption of the
   step is decided, so a victim never leaves a key for K/V that was never written (and a
   step that fails rolls the keys back with everything else). Finished, aborted and
   preempted sequences release their blocks; cached ones stay in the free queue,
   reusable, until evicted. A swapped-out sequence's K/V comes back by a cache hit
   where it can and by swap-in for the rest.
6. **Parallel sampling.** A request's pending samples take their seats at
   admission and fork the parent's table when its prompt is computed. A write
   into a shared, partly filled last block copies it first (copy-on-write, in
   :meth:`~minipaged.blocks.BlockTable.append_tokens`); the step's
   copies are in ``SchedulerOutput.copies`` for the engine to carry out before
   the forward pass.
7. **Speculative decoding** (chapter 08; on when the scheduler has a ``speculator``, such as
   :class:`~minipaged.speculative.NgramSpeculator`). After the running sequences are planned,
   ``speculator.schedule_drafts`` may extend each decode with draft tokens out of the budget
   and the free blocks left; after verification :meth:`Scheduler.postprocess` rolls the
   counter back over the rejected ones with ``speculator.rollback``.

Public state that the engine, metrics and the dashboard read:
``waiting`` (the policy's deque of :class:`~minipaged.sequence.Sequence`, front = next to
admit), ``running`` (list, in admission order), ``allocator``, ``config``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minipaged.attention import get_backend
from minipaged.block_math import ceil_div  # the step's own counts, already checked: no check per call
from minipaged.blocks import BlockTable
from minipaged.request_queue import SCHEDULING_POLICIES, create_request_queue
from minipaged.sequence import Sequence, SequenceStatus
from minipaged.step_state import StepState
from minipaged.validation import check_bool, check_choice, check_fields, check_in_interval, check_int, errors_named

PREEMPTION_MODES = ("recompute", "swap")


@dataclass
class EngineConfig:
    """The pool and the scheduler's knobs; the defaults fit the tiny model on a CPU.

    The engine's other parts are seams, given to :class:`~minipaged.engine.Engine` itself:
    the allocator (prefix caching is an allocator), the block table class, the scheduler and
    the speculator.

    Attributes:
        num_blocks: blocks in the KV pool.
        block_size: token slots per block.
        max_num_seqs: the most sequences running at once (a request's samples each count).
        max_num_batched_tokens: tokens computed in one forward pass, all sequences together.
        watermark: the fraction of blocks admission leaves free for running sequences to grow into.
        chunked_prefill: cut a prompt that does not fit the step's budget into chunks (False: whole or not at all).
        preemption_mode: ``"recompute"`` (drop a victim's K/V, re-prefill it later) or ``"swap"``
            (park it in CPU memory, copy it back on readmission).
        backend: the attention backend of the forward pass (a name of
            :mod:`minipaged.attention`'s registry: ``"torch"``, ``"triton"``, ``"loop"``).
        scheduling_policy: the waiting queue's order, a name of
            :data:`minipaged.request_queue.SCHEDULING_POLICIES` (``"fcfs"``, ``"shortest_prompt_first"``).
        keep_finished: False: ``step()`` hands finished requests over and the engine forgets them,
            and the metrics keep the latest ``HISTORY_WINDOW`` step records (memory stays bounded).
            True: the engine and the history keep everything.
    """

    num_blocks: int = 64
    block_size: int = 16
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    watermark: float = 0.01
    chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    backend: str = "torch"
    scheduling_policy: str = "fcfs"
    keep_finished: bool = False

    def __post_init__(self):
        check_engine_config(self)

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.num_blocks)


@dataclass
class SchedulerOutput:
    """One step's plan: which sequences compute how many tokens, and where their K/V goes."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # tokens each sequence computes this step
    slot_mappings: list[torch.Tensor] = field(default_factory=list)  # int64 cache slots of those tokens
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # K/V the engine must move before the forward pass, in this order: swap mode's copies out of freed
    # blocks, copy-on-write inside the pool, swap mode's copies into new blocks.
    swap_out: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # (victim, its old block ids)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write: (src, dst) block ids
    swap_in: list[Sequence] = field(default_factory=list)  # readmitted; saved K/V goes to its first blocks ...
    swap_in_hit_blocks: list[int] = field(default_factory=list)  # ... except those a prefix hit restored
    # Speculative decoding (chapter 08): seq_id -> the draft tokens it verifies this step. They are not in its
    # token_ids; its num_new_tokens counts them (the last sampled token plus the drafts).
    spec_token_ids: dict = field(default_factory=dict)
    prefill: list[bool] = field(default_factory=list)  # per planned sequence: a prefill chunk (else a decode)

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def add(self, seq: Sequence, num_new_tokens: int, slot_mapping: torch.Tensor) -> None:
        """Plan ``num_new_tokens`` of ``seq``'s tokens, whose K/V goes to ``slot_mapping``."""
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)
        self.slot_mappings.append(slot_mapping)
        self.prefill.append(seq.is_prefill)

    def take_back(self, seq: Sequence) -> int:
        """Unplan ``seq`` (a victim planned earlier in the step); return the tokens it had."""
        i = self.seqs.index(seq)
        del self.seqs[i], self.slot_mappings[i], self.prefill[i]
        return self.num_new_tokens.pop(i)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens of this step's prefill chunks (the rest are decodes, with their drafts)."""
        return sum(n for n, prefill in zip(self.num_new_tokens, self.prefill) if prefill)

    def ends_sequence(self) -> list[bool]:
        """Per planned sequence, whether its chunk reaches its last token (then it samples); before postprocess."""
        return [s.num_computed_tokens + n - len(self.spec_token_ids.get(s.seq_id, ())) == s.num_tokens
                for s, n in zip(self.seqs, self.num_new_tokens)]  # fmt: skip


def can_admit(num_free_blocks: int, num_needed_blocks: int, watermark_blocks: int, num_running: int,
              max_num_seqs: int) -> bool:  # fmt: skip
    """May a waiting request whose first chunk needs ``num_needed_blocks`` new blocks start now?

    It must fit a free seat (``max_num_seqs``) and leave ``watermark_blocks``
    free afterwards: admitting right up to the last block would make the next
    decode step of the running sequences preempt someone at once.

    Args:
        num_free_blocks: free blocks in the pool now.
        num_needed_blocks: new blocks the request's first chunk needs.
        watermark_blocks: blocks that must stay free after admission.
        num_running: sequences running now.
        max_num_seqs: the most sequences that may run at once.
    """
    return num_running < max_num_seqs and num_free_blocks - num_needed_blocks >= watermark_blocks


class Scheduler(StepState):
    """Continuous batching over one block pool (the rules are in the module docstring).

    Args:
        config: the pool and the scheduler's knobs.
        allocator: the pool's allocator (a :class:`~minipaged.blocks.BlockAllocator`, or
            one with ``match_prefix``, ``share_prefix`` and ``cache_full_blocks``: prefix caching).
        block_table: the block table class, called as ``block_table(allocator, seq_id)``.
        speculator: speculative decoding (chapter 08), with ``schedule_drafts(scheduler, out, budget)``
            and ``rollback(table, num_computed_tokens, num_draft_tokens, num_accepted_tokens)``; None: off.
    """

    _step_containers = ("waiting", "running")  # see minipaged.step_state

    def __init__(self, config: EngineConfig, allocator, block_table=BlockTable, speculator=None):
        self.config = config
        self.allocator = allocator
        self.block_table = block_table
        self.speculator = speculator
        self.prefix_caching = hasattr(allocator, "match_prefix")  # chapter 06's allocator, known by what it does
        self.waiting = create_request_queue(config.scheduling_policy)
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        """Queue a new request, after checking that it could ever run alone (see :func:`check_fits_pool`)."""
        check_num_samples(1 + len(seq.pending_forks), self.config.max_num_seqs, f"request {seq.seq_id!r}")
        check_fits_pool(self.config, seq.num_prompt_tokens, seq.sampling_params.max_tokens, f"request {seq.seq_id!r}")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def sequences(self) -> list[Sequence]:
        """Every sequence a step may change: the waiting and running ones, and the samples they will fork."""
        seqs = [*self.waiting, *self.running]
        return seqs + [child for seq in seqs for child in seq.pending_forks]

    @property
    def num_seats(self) -> int:
        """Seats taken (of ``max_num_seqs``): the running sequences and the samples they will fork."""
        return len(self.running) + sum(len(s.pending_forks) for s in self.running)

    def _chunk(self, seq: Sequence, budget: int, start: int | None = None) -> int:
        """How many of ``seq``'s tokens from ``start`` (default: its computed ones) fit this step (0: none).

        Args:
            seq: a running or waiting sequence.
            budget: the step's tokens left.
            start: the position its chunk starts at (None: ``seq.num_computed_tokens``).
        """
        ### BEGIN SOLUTION (Exercise 05, Task 5.1)
        uncomputed = seq.num_tokens - (seq.num_computed_tokens if start is None else start)
        n = min(uncomputed, budget)
        if not self.config.chunked_prefill and n < uncomputed:
            return 0  # without chunking, a prefill runs whole or not at all
        return n
        ### END SOLUTION

    def schedule(self) -> SchedulerOutput:
        """This step's plan (see the module docstring): blocks allocated, victims preempted, sequences admitted."""
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        for seq, n in zip(out.seqs, out.num_new_tokens):  # no victim can be taken back from here on
            self._cache_blocks(seq, seq.num_computed_tokens + n)
        if self.speculator is not None:
            budget = self.speculator.schedule_drafts(self, out, budget)
        if not out.preempted:
            self._admit(out, budget)
        out.copies = [c for s in out.seqs for c in s.block_table.take_pending_copies()]
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Plan the running sequences, decodes first, preempting where the pool runs out; return the budget left.

        Args:
            out: the step's plan so far (empty: the running sequences come first).
            budget: the step's token budget, ``max_num_batched_tokens``.
        """
        ### BEGIN SOLUTION (Exercise 05, Task 5.1)
        pending = sorted(self.running, key=lambda s: s.is_prefill)  # stable: admission order within each kind
        while pending:
            seq = pending.pop(0)
            n = self._chunk(seq, budget)
            if n == 0:
                continue
            # Make room by preempting the policy's victim (FCFS: the youngest, maybe seq itself, never an older one).
            while not self.allocator.can_allocate(seq.block_table.num_new_blocks(n)):
                victim = self.waiting.victim(self.running)
                if victim in out.seqs:  # planned earlier this step: take its tokens back
                    budget += out.take_back(victim)
                elif victim in pending:
                    pending.remove(victim)
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.add(seq, n, seq.block_table.append_tokens(n))
                budget -= n
        return budget
        ### END SOLUTION

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting sequences in the policy's order while the head fits (see :meth:`fits`).

        Args:
            out: the step's plan, the running sequences' chunks in it.
            budget: the tokens :meth:`_schedule_running` left.
        """
        ### BEGIN SOLUTION (Exercise 05, Task 5.2)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            match = self.match_prefix(seq)
            # A swapped-out sequence (num_computed_tokens > 0) gets its K/V back first.
            start = max(len(match.block_ids) * self.config.block_size if match else 0, seq.num_computed_tokens)
            n = self._chunk(seq, budget, start)
            if n == 0 or not self.fits(seq, start + n, match):
                break
            self.waiting.popleft()
            self._start(seq, match, start, out)
            out.add(seq, n, seq.block_table.append_tokens(n))
            self._cache_blocks(seq, start + n)
            budget -= n
        ### END SOLUTION

    def match_prefix(self, seq: Sequence):
        """The longest cached prefix of ``seq``'s tokens in this pool (None without prefix caching)."""
        return self.allocator.match_prefix(seq.token_ids, seq.cache_salt) if self.prefix_caching else None

    def fits(self, seq: Sequence, num_tokens: int, match=None, num_other_seats: int = 0) -> bool:
        """May ``seq`` start now with its first ``num_tokens`` tokens in blocks, ``match`` shared (:func:`can_admit`)?

        Args:
            seq: the waiting sequence (its pending samples need seats too).
            num_tokens: the tokens its table will hold after this step.
            match: its prefix hit from :meth:`match_prefix` (hit blocks in the free queue count as taken).
            num_other_seats: seats taken outside the scheduler (a disaggregated decode engine's transfers).
        """
        hit_blocks = match.block_ids if match else []
        touched = self.allocator.num_free_among(hit_blocks) if match else 0
        return can_admit(self.allocator.num_free - touched,
                         ceil_div(num_tokens, self.config.block_size) - len(hit_blocks),
                         self.config.watermark_blocks, self.num_seats + len(seq.pending_forks) + num_other_seats,
                         self.config.max_num_seqs)  # fmt: skip

    def _start(self, seq: Sequence, match, start: int, out: SchedulerOutput) -> None:
        """Give an admitted sequence its table (a prefix hit shared into it, room for swapped-out K/V) and run it."""
        table = self.block_table(self.allocator, seq.seq_id)
        if match is not None:
            self.allocator.share_prefix(table, match, preempted=seq.num_preemptions > 0)
        if seq.num_computed_tokens:  # swap mode: fresh blocks for the saved K/V that did not hit
            hit_blocks = len(match.block_ids) if match else 0
            table.append_tokens(start - hit_blocks * self.config.block_size)
            out.swap_in.append(seq)
            out.swap_in_hit_blocks.append(hit_blocks)
            swapped = max(0, ceil_div(seq.num_computed_tokens, self.config.block_size) - hit_blocks)
            self.allocator.emit("swap_in", None, seq.seq_id, swapped_blocks=swapped, hit_blocks=hit_blocks)
        seq.num_computed_tokens = start
        seq.block_table = table
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        out.admitted.append(seq)

    def _cache_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Prefix caching: key ``seq``'s blocks that its first ``num_tokens`` tokens fill (this step's included)."""
        if self.prefix_caching:
            self.allocator.cache_full_blocks(seq.block_table, seq.token_ids, num_tokens, seq.cache_salt)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Free the victim's blocks, keep its tokens, queue it at the front; swap mode saves its K/V first."""
        swap = self.config.preemption_mode == "swap" and seq.num_computed_tokens > 0
        # Only the blocks holding computed K/V are saved (a chunk reserved this step is not written yet).
        saved = seq.block_table.blocks[: ceil_div(seq.num_computed_tokens, self.config.block_size)] if swap else []
        # A copy-on-write made this step has not been carried out: its source still holds the K/V to save.
        sources = {dst: src for src, dst in seq.block_table.take_pending_copies()}
        saved = [sources.get(b, b) for b in saved]
        if swap:
            out.swap_out.append((seq, saved))
        else:
            seq.num_computed_tokens = 0
        self.allocator.emit(
            "preempt", None, seq.seq_id, mode="swap" if swap else "recompute",
            num_blocks=seq.block_table.num_blocks, num_tokens=seq.num_tokens, swapped_blocks=len(saved),
        )  # fmt: skip
        self.running.remove(seq)
        self._release(seq)
        seq.num_preemptions += 1
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _release(self, seq: Sequence) -> None:
        """A request is done with its blocks (finished, aborted or preempted): free them now."""
        if seq.block_table is not None:
            seq.block_table.release()
            seq.block_table = None

    def postprocess(self, out: SchedulerOutput, sampled: dict, now: float,
                    accepted: dict | None = None) -> list[Sequence]:  # fmt: skip
        """Advance the sequences after the forward pass; return those that finished.

        A sequence finishes at the first token its :class:`~minipaged.stopping.StopRules` stop it
        at (its ``finish_reason`` and ``stop_reason`` then say why) and frees its blocks at once.
        With speculative decoding, the accepted drafts are appended before the sampled token (up
        to the first stop among them: the tokens after it are dropped), and the counter rolls back
        over the rejected ones (``speculator.rollback``).

        Args:
            out: this step's plan, as :meth:`schedule` made it.
            sampled: seq_id -> the token sampled for every sequence whose chunk reached its last
                token (the others were mid-prefill).
            now: the time of the step's end, in the engine's clock (the tokens' and finishes' time).
            accepted: seq_id -> the drafts it accepted, for each sequence that verified drafts (None: no drafts).
        """
        accepted, finished = accepted or {}, []
        for seq, n in zip(out.seqs, out.num_new_tokens):
            drafts = out.spec_token_ids.get(seq.seq_id)
            if drafts:  # chapter 08: keep the verified prefix only; its slots beyond are overwritten next step
                j = len(accepted[seq.seq_id])
                seq.num_computed_tokens = self.speculator.rollback(seq.block_table, seq.num_computed_tokens,
                                                                   len(drafts), j)  # fmt: skip
            else:
                seq.num_computed_tokens += n
            if seq.seq_id in sampled:
                for sample in [seq, *self._fork(seq)]:
                    if self._append(sample, [*accepted.get(sample.seq_id, ()), sampled[sample.seq_id]], now):
                        finished.append(sample)
        return finished

    def _append(self, seq: Sequence, tokens: list[int], now: float) -> bool:
        """Append ``tokens`` to ``seq`` until one stops it (the rest dropped); a finished one frees its blocks."""
        for token in tokens:
            if seq.append_token(token, now):
                seq.status = SequenceStatus.FINISHED
                seq.finish_time = now
                seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
                self.running.remove(seq)
                self._release(seq)
                return True
        return False

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """Parallel sampling: ``seq``'s prompt is computed, so its pending samples start now, sharing its blocks.

        Returns the samples that started (none if ``seq`` had none pending).
        """
        children, seq.pending_forks = seq.pending_forks, []
        for child in children:
            child.block_table = seq.block_table.fork(child.seq_id)
            child.num_computed_tokens = seq.num_computed_tokens
            child.status = SequenceStatus.RUNNING
        i = self.running.index(seq)
        self.running[i + 1 : i + 1] = children  # next to their parent, in sample order
        return children

    def abort(self, seq: Sequence) -> None:
        """Drop a waiting or running sequence now (with the samples it has yet to fork); its blocks return at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:
            raise ValueError(f"request {seq.seq_id!r} is neither waiting nor running ({seq.status.value})")
        for child in seq.pending_forks:
            child.abort()
        seq.pending_forks = []
        seq.abort()
        self._release(seq)


def check_engine_config(config) -> None:
    """Check an :class:`~minipaged.scheduler.EngineConfig`'s fields in place (sizes as ints, the watermark as a float).

    The sizes must be ints >= 1, the watermark a fraction in ``[0, 1)``, the flags bools, and the
    preemption mode, scheduling policy and attention backend registered names.

    Args:
        config: the config, just constructed; its fields are replaced by their checked values.
    """
    check_fields(config, "EngineConfig", ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"),
                 check_int, minimum=1)  # fmt: skip
    config.watermark = check_in_interval(config.watermark, "EngineConfig.watermark", 0, 1)
    check_bool(config.chunked_prefill, "EngineConfig.chunked_prefill")
    check_bool(config.keep_finished, "EngineConfig.keep_finished")
    check_choice(config.preemption_mode, "EngineConfig.preemption_mode", PREEMPTION_MODES)
    check_choice(config.scheduling_policy, "EngineConfig.scheduling_policy", tuple(SCHEDULING_POLICIES))
    with errors_named("EngineConfig."):
        get_backend(config.backend)  # a name of the attention registry (loaded on first use)


def check_fits_pool(config, num_prompt_tokens: int, max_tokens: int, request: str, pool: str = "the pool") -> None:
    """A ``ValueError`` for a request that could never run, even alone in an empty pool.

    The most K/V a request holds is prompt + max_tokens - 1 tokens (the last sampled token is
    never fed back). If those blocks exceed the pool minus the watermark, it could never be
    admitted; without chunked prefill, a recompute of all of them must also fit one step's budget.

    Args:
        config: the pool and the scheduler's knobs (an :class:`~minipaged.scheduler.EngineConfig`).
        num_prompt_tokens: the request's prompt length.
        max_tokens: the most tokens it may generate.
        request: the request, for the message (``"request 'a'"``).
        pool: the pool, for the message.
    """
    longest = num_prompt_tokens + max_tokens - 1
    need = ceil_div(longest, config.block_size)
    room = config.num_blocks - config.watermark_blocks
    if need > room:
        raise ValueError(
            f"{request} needs up to {need} blocks ({num_prompt_tokens} prompt + {max_tokens} max_tokens, block_size "
            f"{config.block_size}) but {pool} has {config.num_blocks} blocks, {room} after the watermark: raise "
            "num_blocks or lower max_tokens"
        )
    if not config.chunked_prefill and longest > config.max_num_batched_tokens:
        raise ValueError(
            f"{request} may need to (re)compute {longest} tokens in one step, more than "
            f"max_num_batched_tokens={config.max_num_batched_tokens}: enable chunked_prefill or raise the budget"
        )


def check_num_samples(num_samples: int, max_num_seqs: int, request: str) -> None:
    """A ``ValueError`` for a request whose samples, which run together, could never all have a seat.

    Args:
        num_samples: the request's samples (its ``SamplingParams.n``).
        max_num_seqs: the most sequences the engine runs at once.
        request: the request, for the message (``"request 'a'"``).
    """
    if num_samples > max_num_seqs:
        raise ValueError(f"{request}: SamplingParams.n = {num_samples} samples must run together, but "
                         f"max_num_seqs is {max_num_seqs}: lower n or raise max_num_seqs")  # fmt: skip
