"""The serving loop: requests join and leave the batch at every step, over one paged KV cache.

One :meth:`Engine.step` is

1. ``scheduler.schedule()``: who runs, how many tokens each computes, and the
   cache slots those tokens' K/V go to (allocating blocks, maybe preempting;
   in swap mode the engine then copies K/V between the pool and ``swap_space``);
2. one forward pass of the model over all scheduled tokens packed together,
   addressed through the block tables (:meth:`Engine.execute`);
3. sampling a token for every sequence whose chunk reached its end;
4. ``scheduler.postprocess()``: advance counters, finish sequences, free blocks;
5. one :class:`~minipaged.metrics.StepRecord` in ``engine.metrics.history``.

Public state (the live dashboard reads it; keep these names stable):

* ``engine.scheduler.waiting`` (deque) and ``engine.scheduler.running`` (list)
  of :class:`~minipaged.sequence.Sequence`; each running one has a ``block_table``.
* ``engine.cache.allocator``: the block pool and its event bus ("allocate",
  "free", ..., and "preempt" with the victim's seq_id).
* ``engine.metrics``: step ``history``, ``num_preemptions``, ``max_running``.
* ``engine.requests``: every request by id, finished ones included.
* ``engine.swap_space``: swap mode's CPU copies of preempted sequences' K/V, by id.
* ``engine.step()`` returns a :class:`StepOutput` saying what happened.

Time comes from ``engine.clock``, virtual by default (deterministic, see
:mod:`minipaged.workload`) or wall-clock for benchmarks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from minipaged.cache import PagedKVCache
from minipaged.metrics import Metrics
from minipaged.model import AttentionMetadata
from minipaged.scheduler import EngineConfig, Scheduler, SchedulerOutput
from minipaged.sequence import SamplingParams, Sequence
from minipaged.workload import TraceRequest, VirtualClock, prompt_token_ids


@dataclass
class StepOutput:
    """What one step did, by request id."""

    step: int
    time: float
    scheduled: dict = field(default_factory=dict)  # seq_id -> tokens computed this step
    new_tokens: dict = field(default_factory=dict)  # seq_id -> token sampled this step
    admitted: list = field(default_factory=list)
    preempted: list = field(default_factory=list)
    finished: list = field(default_factory=list)


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """One token per row: argmax for greedy requests, else a draw from softmax(logits / T)."""
    tokens = logits.argmax(dim=-1).tolist()
    for i, seq in enumerate(seqs):
        t = seq.sampling_params.temperature
        if t > 0:
            probs = torch.softmax(logits[i].float() / t, dim=-1)
            tokens[i] = int(torch.multinomial(probs, 1, generator=seq.generator))
    return tokens


class Engine:
    def __init__(self, model, config: EngineConfig | None = None, clock=None):
        self.model = model
        self.config = config or EngineConfig()
        mc = model.config
        self.cache = PagedKVCache(
            mc.num_hidden_layers,
            self.config.num_blocks,
            self.config.block_size,
            mc.num_key_value_heads,
            mc.head_dim,
            dtype=model.dtype,
            device=model.device,
        )
        self.scheduler = Scheduler(self.config, self.cache.allocator)
        self.metrics = Metrics(self.config.num_blocks)
        self.metrics.attach(self.cache.allocator)
        self.clock = clock or VirtualClock()
        self.requests: dict = {}
        self.swap_space: dict = {}  # seq_id -> per-layer (k, v) of its saved blocks, in CPU memory
        self._next_id = 0

    # -- requests ---------------------------------------------------------

    def add_request(self, prompt_ids, sampling_params: SamplingParams | None = None, request_id=None, arrival_time=None):
        """Queue a request; returns its id. Errors (bad input, too big for the pool) change nothing."""
        prompt_ids = [int(t) for t in prompt_ids]
        vocab = self.model.config.vocab_size
        if not all(0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt_ids must be token ids in [0, {vocab}), got {prompt_ids!r}")
        if request_id is None:
            while self._next_id in self.requests:
                self._next_id += 1
            request_id = self._next_id
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        seq = Sequence(request_id, prompt_ids, sampling_params or SamplingParams(),
                       self.clock.now() if arrival_time is None else arrival_time)
        self.scheduler.add(seq)  # raises if the request could never fit the pool
        self.requests[request_id] = seq
        return request_id

    def abort(self, request_id) -> None:
        if request_id not in self.requests:
            raise KeyError(f"abort: no request with id {request_id!r}")
        seq = self.requests[request_id]
        if seq.is_finished:
            raise ValueError(f"abort: request {request_id!r} has already {seq.status.value}")
        self.scheduler.abort(seq)
        self.swap_space.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step ---------------------------------------------------------

    def step(self) -> StepOutput:
        out = self.scheduler.schedule()
        result = StepOutput(step=len(self.metrics.history), time=self.clock.now())
        result.admitted = [s.seq_id for s in out.admitted]
        result.preempted = [s.seq_id for s in out.preempted]
        swapped = self.swap(out)
        sampled = {}
        if not out.is_empty:
            last = [s.num_computed_tokens + n == s.num_tokens for s, n in zip(out.seqs, out.num_new_tokens)]
            logits = self.execute(out, last)
            to_sample = [s for s, ends in zip(out.seqs, last) if ends]
            sampled = dict(zip((s.seq_id for s in to_sample), sample(logits, to_sample)))
            context = sum(s.num_computed_tokens + n for s, n in zip(out.seqs, out.num_new_tokens))
            self.clock.step(out.num_batched_tokens, context, swapped)
        result.time = self.clock.now()
        prefill = sum(n for s, n in zip(out.seqs, out.num_new_tokens) if s.is_prefill)
        finished = self.scheduler.postprocess(out, sampled, result.time)
        result.scheduled = {s.seq_id: n for s, n in zip(out.seqs, out.num_new_tokens)}
        result.new_tokens = sampled
        result.finished = [s.seq_id for s in finished]
        self.metrics.record_step(result.time, self.scheduler.running, len(self.scheduler.waiting),
                                 out.num_new_tokens, prefill, len(finished))
        return result

    @torch.inference_mode()
    def swap(self, out: SchedulerOutput) -> int:
        """Swap mode: save victims' K/V to CPU memory, restore readmitted ones'. Returns tokens moved.

        It must run before the forward pass: a victim's freed blocks may already
        belong to someone else this step, who is about to write into them.
        """
        moved = 0
        for seq, block_ids in out.swap_out:
            ids = torch.tensor(block_ids, device=self.cache.device)
            self.swap_space[seq.seq_id] = [
                (k.index_select(0, ids).cpu(), v.index_select(0, ids).cpu()) for k, v in zip(self.cache.k_caches, self.cache.v_caches)
            ]
            moved += seq.num_computed_tokens
        for seq in out.swap_in:
            saved = self.swap_space.pop(seq.seq_id)
            ids = torch.tensor(seq.block_table.blocks[: len(saved[0][0])], device=self.cache.device)
            for k, v, (k_saved, v_saved) in zip(self.cache.k_caches, self.cache.v_caches, saved):
                k.index_copy_(0, ids, k_saved.to(self.cache.device))
                v.index_copy_(0, ids, v_saved.to(self.cache.device))
            moved += seq.num_computed_tokens
        return moved

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, last: list[bool]) -> torch.Tensor:
        """One forward pass over every scheduled token; logits of the chunks that end a sequence."""
        device = self.cache.device
        input_ids, positions = [], []
        for seq, n in zip(out.seqs, out.num_new_tokens):
            start = seq.num_computed_tokens
            input_ids += seq.token_ids[start : start + n]
            positions += range(start, start + n)
        # The scheduler already appended this step's tokens to the block tables.
        tables = [s.block_table for s in out.seqs]
        metadata = AttentionMetadata.pack(tables, out.num_new_tokens, torch.cat(out.slot_mappings), device)
        logits = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            self.cache,
            metadata,
            backend=self.config.backend,
        )  # [num_seqs, vocab]: each sequence's last token this step
        return logits[torch.tensor(last, device=device)]

    # -- whole workloads --------------------------------------------------

    def run(self, workload: list[TraceRequest], progress: bool = True, seed: int = 0) -> list[Sequence]:
        """Replay a workload: each request is added when its arrival time comes.

        Arrival times are relative to the start of the run. Prompts are the
        seeded ids of :func:`minipaged.workload.prompt_token_ids`. Returns the
        sequences in the workload's order.
        """
        arrivals = deque(sorted(enumerate(workload), key=lambda item: item[1].arrival_time))
        vocab = self.model.config.vocab_size
        start = self.clock.now()
        seqs = [None] * len(workload)
        bar = tqdm(total=len(workload), desc="requests", disable=not progress)
        while arrivals or self.has_unfinished():
            while arrivals and start + arrivals[0][1].arrival_time <= self.clock.now():
                i, r = arrivals.popleft()
                rid = self.add_request(prompt_token_ids(i, r.prompt_len, vocab, seed), SamplingParams(max_tokens=r.output_len),
                                       arrival_time=start + r.arrival_time)
                seqs[i] = self.requests[rid]
            if not self.has_unfinished():
                self.clock.wait_until(start + arrivals[0][1].arrival_time)  # idle until the next arrival
                continue
            bar.update(len(self.step().finished))
        bar.close()
        return seqs

    def generate(self, prompts: list[list[int]], sampling_params: SamplingParams | None = None) -> list[list[int]]:
        """Offline convenience: every prompt arrives now; returns each one's output tokens."""
        ids = [self.add_request(p, sampling_params) for p in prompts]
        while self.has_unfinished():
            self.step()
        return [self.requests[i].output_token_ids for i in ids]
