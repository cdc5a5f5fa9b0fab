"""The baseline before vLLM: static batches, each member reserving K/V for the maximum length.

How serving systems batched before paging:

* Every request reserves room for ``max_model_len`` tokens when it starts,
  because its final length is unknown and its K/V must be contiguous.
* So a batch holds as many requests as max-length reservations fit in the
  KV memory (capped by ``max_num_seqs``).
* The batch prefills all its prompts together, then decodes until its
  *longest* member is done. A member that finishes early keeps its
  reservation, and the queue waits for the whole batch.

To isolate scheduling and memory, everything else is the same as the paged
engine: the same :class:`~minipaged.engine.Engine` loop, model forward and
KV pool. A reservation is a block table whose blocks are all allocated up
front, and a finished member simply stops computing (real static batching
kept computing padding; skipping it flatters the baseline).
"""

from __future__ import annotations

from functools import partial

from minipaged.block_math import blocks_needed
from minipaged.blocks import BlockTable
from minipaged.engine import Engine
from minipaged.scheduler import EngineConfig, Scheduler, SchedulerOutput
from minipaged.sequence import Sequence, SequenceStatus
from minipaged.validation import check_int


class StaticBatchScheduler(Scheduler):
    """Static batches of max-length reservations.

    Args:
        config: the engine's configuration (pool size, ``max_num_seqs``; the token budget is ignored).
        allocator: the pool's allocator.
        block_table: the block table class.
        speculator: must be None (a static batch verifies no drafts).
        max_model_len: the tokens each request reserves, prompt and output together.
    """

    _step_containers = ("batch",)  # see minipaged.step_state

    def __init__(self, config: EngineConfig, allocator, block_table=BlockTable, speculator=None, *,
                 max_model_len: int):  # fmt: skip
        if speculator is not None:
            raise ValueError("static batching runs no speculative decoding: speculator must be None")
        super().__init__(config, allocator, block_table)
        self.max_model_len = check_int(max_model_len, "max_model_len", minimum=1)
        self.blocks_per_reservation = blocks_needed(max_model_len, config.block_size)
        self.batch_size = min(config.max_num_seqs, config.num_blocks // self.blocks_per_reservation)
        if self.batch_size == 0:
            raise ValueError(
                f"one reservation of max_model_len={max_model_len} tokens needs {self.blocks_per_reservation} blocks "
                f"but the pool has {config.num_blocks}"
            )
        self.batch: list[Sequence] = []  # the current batch, finished members included

    def add(self, seq: Sequence) -> None:
        if seq.pending_forks:
            raise ValueError(f"request {seq.seq_id!r}: static batching takes one sample per request (SamplingParams.n)")
        longest = seq.num_prompt_tokens + seq.sampling_params.max_tokens - 1
        if longest > self.max_model_len:
            raise ValueError(
                f"request {seq.seq_id!r} may reach {longest} tokens, past max_model_len={self.max_model_len}"
            )
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        """Start the next batch if the last one is over; every running member computes all it has uncomputed."""
        out = SchedulerOutput()
        if not self.batch:  # the previous batch is over: start the next
            while self.waiting and len(self.batch) < self.batch_size:
                seq = self.waiting.popleft()
                seq.block_table = self.block_table(self.allocator, seq.seq_id)
                seq.block_table.blocks = self.allocator.allocate_many(self.blocks_per_reservation, seq.seq_id)
                seq.status = SequenceStatus.RUNNING
                self.batch.append(seq)
                self.running.append(seq)
                out.admitted.append(seq)
        for seq in self.running:  # whole prompts at once, then one token each: no budget, no chunks
            n = seq.num_uncomputed_tokens
            out.add(seq, n, seq.block_table.append_tokens(n))  # inside the reservation: allocates nothing
        return out

    def sequences(self) -> list[Sequence]:
        """Every sequence a step may change: the batch's finished members too, whose reservations it may free."""
        return [*super().sequences(), *(s for s in self.batch if s.is_finished)]

    def _release(self, seq: Sequence) -> None:
        # A member that finishes or is aborted stops computing, but its reservation
        # stays: every reservation of the batch goes back at once, when none is left running.
        if not self.running:
            for member in self.batch:
                if member.block_table is not None:
                    member.block_table.release()
                    member.block_table = None
            self.batch = []


def static_engine(model, config: EngineConfig, max_model_len: int, clock=None) -> Engine:
    """An :class:`Engine` whose scheduler batches statically with max-length reservations.

    Args:
        model: the model, as for :class:`Engine`.
        config: the engine's configuration.
        max_model_len: the tokens each request reserves.
        clock: as for :class:`Engine` (virtual by default).
    """
    # Chapter 05's baseline shares nothing (the plain allocator): its reservations are never cached or hit.
    return Engine(model, config, clock, scheduler=partial(StaticBatchScheduler, max_model_len=max_model_len))
