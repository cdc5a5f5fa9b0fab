"""Continuous batching: at every step, decide which sequences run and how many tokens each computes.

The rules, in the order :meth:`Scheduler.schedule` applies them:

1. **Running sequences first, decodes before prefill chunks.** A decode is one
   token and a user is waiting on it; a prefill chunk can absorb whatever
   budget is left.
2. **A token budget per step** (``max_num_batched_tokens``) bounds the work of
   one forward pass. A long prompt is cut into chunks across steps (chunked
   prefill), so it cannot stall the decodes of everyone else.
3. **Growth before admission.** A running sequence that needs a new block and
   finds the pool empty preempts the *youngest* running sequence (latest
   arrival): its blocks are freed, its tokens kept, and it goes back to the
   front of the waiting queue. Older requests therefore always make progress.
   By **recompute** (the default) its K/V is dropped and re-prefilled from
   prompt + generated tokens later; by **swap** the engine copies its K/V to
   CPU memory first and back into fresh blocks when it is readmitted.
4. **FCFS admission with a watermark.** The head of the waiting queue is
   admitted only if its first chunk's blocks are free *and* a watermark of
   blocks stays free afterwards, as headroom for the running sequences to
   grow into. If the head does not fit, nobody behind it jumps the queue.
5. **Prefix caching** (chapter 06; on when the allocator is a
   :class:`~minipaged.prefix_cache.PrefixCachingAllocator`). At admission the
   longest cached prefix of the sequence's tokens is shared into its table and
   ``num_computed_tokens`` starts at the hit length; a hit block that sat in
   the free queue stops being free, and admission counts it so. After every
   step, each scheduled sequence's full, computed blocks get their keys
   (generated tokens included). Finished, aborted and preempted sequences
   release their blocks; cached ones stay in the free queue, reusable, until
   evicted. A swapped-out sequence's K/V comes back by a cache hit where it can
   and by swap-in for the rest.
6. **Parallel sampling.** A request's pending samples take their seats at
   admission and fork the parent's table when its prompt is computed. A write
   into a shared, partly filled last block copies it first (copy-on-write, in
   :meth:`~minipaged.block_manager.BlockTable.append_tokens`); the step's
   copies are in ``SchedulerOutput.copies`` for the engine to carry out before
   the forward pass.
7. **Speculative decoding** (chapter 08; on with ``EngineConfig.speculative_config``).
   After the running sequences are planned, each decode may add up to
   ``num_speculative_tokens`` draft tokens from :class:`~minipaged.speculative.NgramProposer`,
   out of the budget and the free blocks that are left (a draft never preempts);
   they are in ``SchedulerOutput.spec_token_ids``. After verification,
   :meth:`Scheduler.postprocess` keeps the accepted drafts and rolls the counter
   back over the rejected ones before any block gets a key.

Public state that the engine, metrics and the dashboard read:
``waiting`` (deque of :class:`~minipaged.sequence.Sequence`, front = next to
admit), ``running`` (list, in admission order), ``allocator``, ``config``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from minipaged.accounting import blocks_needed
from minipaged.block_manager import BlockAllocator, BlockTable
from minipaged.sequence import Sequence, SequenceStatus
from minipaged.validation import check_bool, check_int

SCHEDULING_POLICIES = ("fcfs", "shortest_prompt_first")


@dataclass
class EngineConfig:
    """Everything the engine and scheduler are configured by; the defaults fit the tiny model on a CPU."""

    num_blocks: int = 64  # the KV pool: num_blocks blocks of block_size token slots
    block_size: int = 16
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256  # tokens computed in one forward pass, all sequences together
    watermark: float = 0.01  # fraction of blocks admission leaves free for running sequences to grow into
    chunked_prefill: bool = True
    preemption_mode: str = "recompute"  # or "swap": park the victim's K/V in CPU memory instead
    backend: str = "torch"  # attention backend of the model forward: "torch" or "triton"
    enable_prefix_caching: bool = True  # share cached full blocks between requests (chapter 06), as vLLM does
    # The order in which waiting requests are admitted: "fcfs" (arrival order) or "shortest_prompt_first"
    # (preempted sequences still first, then the shortest prompt; chapter 07's admission-order ablation).
    scheduling_policy: str = "fcfs"
    prefix_caching_hash_fn: Callable[[bytes], bytes] | None = None  # the block-key hash; None: SHA-256
    # Speculative decoding (chapter 08): None (off), or a minipaged.speculative.SpeculativeConfig or vLLM's dict
    # form, e.g. {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}.
    speculative_config: object = None
    # False: step() hands finished requests over and the engine forgets them, and metrics keep the latest
    # HISTORY_WINDOW step records (memory stays bounded). True: engine.requests and the history keep everything.
    keep_finished: bool = False

    def __post_init__(self):
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            setattr(self, name, check_int(getattr(self, name), f"EngineConfig.{name}", minimum=1))
        if isinstance(self.watermark, bool) or not isinstance(self.watermark, (int, float)):
            raise TypeError(f"EngineConfig.watermark must be a number, got {type(self.watermark).__name__}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"EngineConfig.watermark must be in [0, 1), got {self.watermark!r}")
        check_bool(self.chunked_prefill, "EngineConfig.chunked_prefill")
        check_bool(self.keep_finished, "EngineConfig.keep_finished")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(
                f"EngineConfig.preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}"
            )
        if not isinstance(self.enable_prefix_caching, bool):
            raise TypeError(
                f"EngineConfig.enable_prefix_caching must be a bool, got {type(self.enable_prefix_caching).__name__}"
            )
        if self.prefix_caching_hash_fn is not None and not callable(self.prefix_caching_hash_fn):
            raise TypeError("EngineConfig.prefix_caching_hash_fn must be callable (bytes -> bytes) or None")
        if self.speculative_config is not None:
            from minipaged.speculative import SpeculativeConfig  # chapter 08, reached by name only

            if isinstance(self.speculative_config, dict):
                self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
            elif not isinstance(self.speculative_config, SpeculativeConfig):
                raise TypeError("EngineConfig.speculative_config must be None, a dict or a SpeculativeConfig, got "
                                f"{type(self.speculative_config).__name__}")
        if not isinstance(self.scheduling_policy, str):
            raise TypeError(
                f"EngineConfig.scheduling_policy must be a str, got {type(self.scheduling_policy).__name__}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"EngineConfig.scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                             f"got {self.scheduling_policy!r}")
        if self.backend not in ("torch", "triton"):
            raise ValueError(f"EngineConfig.backend must be 'torch' or 'triton', got {self.backend!r}")

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

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


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


def pick_victim(running: list[Sequence]) -> Sequence:
    """The youngest running sequence (latest arrival; on a tie, the later admitted), so older ones always progress.

    Args:
        running: the running sequences, in admission order (not modified).
    """
    return max(reversed(running), key=lambda s: s.arrival_time)


class Scheduler:
    """Continuous batching over one block pool (the rules are in the module docstring).

    Args:
        config: the pool and the scheduler's knobs.
        allocator: the pool's allocator; a :class:`~minipaged.prefix_cache.PrefixCachingAllocator`
            turns prefix caching on.
    """

    def __init__(self, config: EngineConfig, allocator: BlockAllocator):
        self.config = config
        self.allocator = allocator
        self.prefix_caching = hasattr(allocator, "match_prefix")  # chapter 06's allocator, known by what it does
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.proposer = None  # speculative decoding's draft proposer (chapter 08), if configured
        if config.speculative_config is not None:
            from minipaged.speculative import NgramProposer  # chapter 08, reached by name only

            self.proposer = NgramProposer(config.speculative_config)

    def add(self, seq: Sequence) -> None:
        """Queue a new request, after checking that it could ever run alone.

        The most K/V a request holds is prompt + max_tokens - 1 tokens (the
        last sampled token is never fed back). If those blocks exceed the pool
        minus the watermark, it could never be admitted, even to an empty pool.
        """
        num_samples = 1 + len(seq.pending_forks)
        if num_samples > self.config.max_num_seqs:
            raise ValueError(
                f"request {seq.seq_id!r}: SamplingParams.n = {num_samples} samples must run together, but "
                f"max_num_seqs is {self.config.max_num_seqs}: lower n or raise max_num_seqs"
            )
        longest = seq.num_prompt_tokens + seq.sampling_params.max_tokens - 1
        need = blocks_needed(longest, self.config.block_size)
        room = self.config.num_blocks - self.config.watermark_blocks
        if need > room:
            raise ValueError(
                f"request {seq.seq_id!r} needs up to {need} blocks ({seq.num_prompt_tokens} prompt + "
                f"{seq.sampling_params.max_tokens} max_tokens, block_size {self.config.block_size}) but the pool has "
                f"{self.config.num_blocks} blocks, {room} after the watermark: raise num_blocks or lower max_tokens"
            )
        if not self.config.chunked_prefill and longest > self.config.max_num_batched_tokens:
            raise ValueError(
                f"request {seq.seq_id!r} may need to (re)compute {longest} tokens in one step, more than "
                f"max_num_batched_tokens={self.config.max_num_batched_tokens}: "
                "enable chunked_prefill or raise the budget"
            )
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_seats(self) -> int:
        """Seats taken (of ``max_num_seqs``): the running sequences and the samples they will fork."""
        return len(self.running) + sum(len(s.pending_forks) for s in self.running)

    def _chunk(self, seq: Sequence, budget: int, start: int | None = None) -> int:
        """How many of ``seq``'s tokens from ``start`` (default: its computed ones) fit this step (0: none)."""
        uncomputed = seq.num_tokens - (seq.num_computed_tokens if start is None else start)
        n = min(uncomputed, budget)
        if not self.config.chunked_prefill and n < uncomputed:
            return 0  # without chunking, a prefill runs whole or not at all
        return n

    def schedule(self) -> SchedulerOutput:
        """This step's plan (see the module docstring): blocks allocated, victims preempted, sequences admitted.

        The allocator's subscribers hear of the pass's events once the whole plan is made.
        """
        with self.allocator.hold_events():
            return self._schedule()

    def _schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        # 1. Running sequences: decodes first, then unfinished prefill chunks.
        pending = sorted(self.running, key=lambda s: s.is_prefill)  # stable: arrival order within each kind
        while pending:
            seq = pending.pop(0)
            n = self._chunk(seq, budget)
            if n == 0:
                continue
            # Make room by preempting the youngest running sequence (maybe seq itself, never an older one).
            while not self.allocator.can_allocate(seq.block_table.blocks_needed(n)):
                victim = pick_victim(self.running)
                if victim in out.seqs:  # scheduled earlier this step: take its tokens back
                    i = out.seqs.index(victim)
                    budget += out.num_new_tokens[i]
                    del out.seqs[i], out.num_new_tokens[i], out.slot_mappings[i]
                elif victim in pending:
                    pending.remove(victim)
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.seqs.append(seq)
                out.num_new_tokens.append(n)
                out.slot_mappings.append(seq.block_table.append_tokens(n))
                budget -= n

        if self.proposer is not None:
            budget = self._schedule_drafts(out, budget)

        # 2. Admission, in the scheduling policy's order. Not in a step that had to preempt: the pool is already short.
        if self.config.scheduling_policy == "shortest_prompt_first":  # preempted ones keep the front, then shortest
            order = sorted(self.waiting, key=lambda s: (s.status is not SequenceStatus.PREEMPTED, s.num_prompt_tokens))
            self.waiting.clear()
            self.waiting.extend(order)
        while self.waiting and budget > 0 and not out.preempted:
            seq = self.waiting[0]
            saved = seq.num_computed_tokens  # > 0 only for a swapped-out sequence: its K/V comes back first
            match = self.allocator.match_prefix(seq.token_ids, seq.cache_salt) if self.prefix_caching else None
            hit = match.num_tokens if match else 0
            start = max(hit, saved)
            n = self._chunk(seq, budget, start)
            num_hit_blocks = len(match.block_ids) if match else 0
            # Hit blocks that sit in the free queue leave it when shared: count them with the new blocks.
            touched = self.allocator.num_free_among(match.block_ids) if match else 0
            if n == 0 or not can_admit(
                self.allocator.num_free - touched,
                blocks_needed(start + n, self.config.block_size) - num_hit_blocks,
                self.config.watermark_blocks,
                self.num_seats + len(seq.pending_forks),  # its samples will need seats of their own
                self.config.max_num_seqs,
            ):
                break
            self.waiting.popleft()
            table = BlockTable(self.allocator, seq.seq_id)
            if match:
                self.allocator.share_prefix(table, match)
            if saved:
                table.append_tokens(start - hit)  # fresh blocks for the saved K/V that did not hit
                out.swap_in.append(seq)
                out.swap_in_hit_blocks.append(num_hit_blocks)
                swapped = max(0, blocks_needed(saved, self.config.block_size) - num_hit_blocks)
                self.allocator.emit("swap_in", None, seq.seq_id, swapped_blocks=swapped, hit_blocks=num_hit_blocks)
            seq.num_computed_tokens = start
            seq.block_table = table
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.admitted.append(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            out.slot_mappings.append(table.append_tokens(n))
            budget -= n
        out.copies = [c for s in out.seqs for c in s.block_table.take_pending_copies()]
        return out

    def _schedule_drafts(self, out: SchedulerOutput, budget: int) -> int:
        """Speculative decoding (chapter 08): extend this step's decodes with draft tokens; return the budget left.

        Drafts come last among the running sequences' work and never at anyone's expense: each
        decode gets at most the tokens of budget left and the blocks that are free now, and a
        draft never preempts. A sequence drafts never past ``max_tokens`` (``j`` accepted drafts
        plus the token sampled after them must fit), and not while samples are still to fork
        from its next token.
        """
        for i, seq in enumerate(out.seqs):
            if budget == 0 or out.num_new_tokens[i] != 1 or seq.num_uncomputed_tokens != 1 or seq.pending_forks:
                continue
            room = seq.sampling_params.max_tokens - seq.num_output_tokens - 1
            drafts = self.proposer.propose(seq.token_ids, min(budget, room)) if room > 0 else []
            table = seq.block_table
            while drafts and not self.allocator.can_allocate(table.blocks_needed(len(drafts))):
                drafts.pop()
            if drafts:
                out.spec_token_ids[seq.seq_id] = drafts
                out.num_new_tokens[i] += len(drafts)
                out.slot_mappings[i] = torch.cat([out.slot_mappings[i], table.append_tokens(len(drafts))])
                budget -= len(drafts)
        return budget

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Free the victim's blocks, keep its tokens, queue it at the front; swap mode saves its K/V first."""
        swap = self.config.preemption_mode == "swap" and seq.num_computed_tokens > 0
        # Only the blocks holding computed K/V are saved (a chunk reserved this step is not written yet).
        saved = seq.block_table.blocks[: blocks_needed(seq.num_computed_tokens, self.config.block_size)] if swap else []
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
        )
        self.running.remove(seq)
        self._release(seq)
        seq.num_preemptions += 1
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)

    def _release(self, seq: Sequence) -> None:
        """A request is done with its blocks (finished, aborted or preempted): free them now."""
        if seq.block_table is not None:
            seq.block_table.release()
            seq.block_table = None

    def postprocess(self, out: SchedulerOutput, sampled: dict, now: float,
                    accepted: dict | None = None) -> list[Sequence]:  # fmt: skip
        """Advance the sequences after the forward pass; return those that finished.

        ``sampled`` maps seq_id to the token sampled for every sequence whose
        chunk reached its last token (the others were mid-prefill). A sequence finishes at the
        first token its :class:`~minipaged.stopping.StopRules` stop it at (its ``finish_reason``
        and ``stop_reason`` then say why) and frees its blocks at once. With speculative
        decoding, ``accepted`` maps the seq_id of each sequence that verified drafts to the
        drafts it accepted: they are appended before its sampled token (up to the first stop
        among them: the tokens after it are dropped), and its counter rolls
        back over the rejected ones (:func:`minipaged.speculative.rollback_drafts`) before any
        block gets a key. The allocator's subscribers hear of the frees, forks and keys once
        every sequence has advanced.

        Args:
            out: this step's plan, as :meth:`schedule` made it.
            sampled: seq_id -> the token sampled for it this step.
            now: the time of the step's end, in the engine's clock (the tokens' and finishes' time).
            accepted: seq_id -> the drafts it accepted (speculative decoding; None: no drafts).
        """
        with self.allocator.hold_events():
            return self._postprocess(out, sampled, now, accepted or {})

    def _postprocess(self, out: SchedulerOutput, sampled: dict, now: float, accepted: dict) -> list[Sequence]:
        finished = []
        for seq, n in zip(out.seqs, out.num_new_tokens):
            drafts = out.spec_token_ids.get(seq.seq_id)
            if drafts:  # chapter 08: keep the verified prefix only; its slots beyond are overwritten next step
                from minipaged.speculative import rollback_drafts  # chapter 08, reached by name only

                seq.num_computed_tokens = rollback_drafts(seq.block_table, seq.num_computed_tokens, len(drafts),
                                                          len(accepted[seq.seq_id]))  # fmt: skip
            else:
                seq.num_computed_tokens += n
            if self.prefix_caching:  # full blocks, now computed, get their keys (before a finish releases them)
                tokens = seq.token_ids + accepted[seq.seq_id] if drafts else seq.token_ids  # verified, not yet appended
                self.allocator.cache_full_blocks(seq.block_table, tokens, seq.num_computed_tokens, seq.cache_salt)
            if seq.seq_id not in sampled:
                continue
            for sample in [seq, *self._fork(seq)]:
                for token in [*accepted.get(sample.seq_id, ()), sampled[sample.seq_id]]:
                    if sample.append_token(token, now):  # a stop among accepted drafts ends it there, the rest dropped
                        sample.status = SequenceStatus.FINISHED
                        sample.finish_time = now
                        sample.num_computed_tokens = min(sample.num_computed_tokens, sample.num_tokens)
                        self.running.remove(sample)
                        self._release(sample)
                        finished.append(sample)
                        break
        return finished

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
        with self.allocator.hold_events():  # subscribers hear of the frees once the sequence is aborted
            for child in seq.pending_forks:
                child.abort()
            seq.pending_forks = []
            seq.abort()
            self._release(seq)
