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
:mod:`minipaged.clock`) or wall-clock for benchmarks.

A workload (requests with arrival times) is replayed by :class:`Replay`, one
step at a time: :meth:`Engine.run` drives it to the end, the chapter's
dashboard steps it on every click.

Vocabulary: the engine's API speaks of requests (``request_id``); with one
sample per request, a request is one :class:`~minipaged.sequence.Sequence`
and its ``request_id`` is the sequence's ``seq_id``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from minipaged.attention import AttentionMetadata
from minipaged.cache import PagedKVCache
from minipaged.clock import VirtualClock
from minipaged.generate import check_prompt
from minipaged.metrics import Metrics
from minipaged.scheduler import EngineConfig, Scheduler, SchedulerOutput
from minipaged.sequence import SamplingParams, Sequence
from minipaged.validation import check_real
from minipaged.workload import RequestSpec, prompt_token_ids


@dataclass
class StepOutput:
    """What one step did, by request id (= seq_id)."""

    step: int
    time: float
    scheduled: dict = field(default_factory=dict)  # seq_id -> tokens computed this step
    new_tokens: dict = field(default_factory=dict)  # seq_id -> token sampled this step
    admitted: list = field(default_factory=list)
    preempted: list = field(default_factory=list)
    finished: list = field(default_factory=list)


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """One token per row: argmax for greedy requests, else a draw from softmax(logits / T).

    Args:
        logits: ``[len(seqs), vocab_size]``, one row per sequence to sample for.
        seqs: those sequences (their sampling parameters and generators).
    """
    tokens = logits.argmax(dim=-1).tolist()
    for i, seq in enumerate(seqs):
        t = seq.sampling_params.temperature
        if t > 0:
            probs = torch.softmax(logits[i].float() / t, dim=-1)
            tokens[i] = int(torch.multinomial(probs, 1, generator=seq.generator))
    return tokens


class Engine:
    """A continuous-batching engine over one paged KV cache.

    Args:
        model: a :class:`~minipaged.model.LlamaForCausalLM` (its config sizes the cache).
        config: the pool and the scheduler's knobs (:class:`EngineConfig` defaults if None).
        clock: a :class:`~minipaged.clock.VirtualClock` (the default) or a :class:`~minipaged.clock.WallClock`.
    """

    def __init__(self, model, config: EngineConfig | None = None, clock=None):
        if config is not None and not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        self.model = model
        self.config = config or EngineConfig()
        mc = model.config
        if self.config.backend == "triton":  # refuse now a backend that would fail at every step
            from minipaged.kernels import check_supported  # chapter 04, reached by name only

            try:
                check_supported(self.config.block_size, mc.head_dim, model.dtype)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"EngineConfig(backend='triton') cannot run this engine: {exc}") from None
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
        self.metrics = Metrics(self.config.num_blocks, self.config.block_size)
        self.metrics.attach(self.cache.allocator)
        self.clock = clock or VirtualClock()
        self.requests: dict = {}
        self.swap_space: dict = {}  # seq_id -> per-layer (k, v) of its saved blocks, in CPU memory
        self._next_id = 0

    # -- requests ---------------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None,
                    request_id=None, arrival_time: float | None = None):  # fmt: skip
        """Queue a request and return its id. Errors (bad input, too big for the pool) change nothing.

        Args:
            prompt_token_ids: the prompt, token ids in ``[0, vocab_size)``.
            sampling_params: how to sample and when to stop (:class:`SamplingParams` defaults if None).
            request_id: any hashable id not in use yet; None picks the next free integer.
            arrival_time: when the request arrived, in the engine's clock (None: now).
        """
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        sampling_params = sampling_params or SamplingParams()
        prompt_token_ids = check_prompt(self.model.config, prompt_token_ids, sampling_params.max_tokens,
                                        "prompt_token_ids")  # fmt: skip
        if arrival_time is not None:
            arrival_time = check_real(arrival_time, "arrival_time")
        if request_id is None:
            while self._next_id in self.requests:
                self._next_id += 1
            request_id = self._next_id
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        seq = Sequence(request_id, prompt_token_ids, sampling_params,
                       self.clock.now() if arrival_time is None else arrival_time)
        self.scheduler.add(seq)  # raises if the request could never fit the pool
        self.requests[request_id] = seq
        return request_id

    def abort(self, request_id) -> None:
        """Drop a waiting or running request now; its blocks (and swapped-out K/V) are freed at once."""
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
        """Schedule, run one forward pass, sample, and record the step (see the module docstring)."""
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

    def swap(self, out: SchedulerOutput) -> int:
        """Swap mode: save victims' K/V to CPU memory, restore readmitted ones'. Returns the tokens moved.

        The scheduler decided who moves; the cache copies (:meth:`PagedKVCache.swap_out`
        and :meth:`~PagedKVCache.swap_in`). It must run before the forward pass: a
        victim's freed blocks may already belong to someone else this step, who is
        about to write into them.

        Args:
            out: this step's plan; its ``swap_out`` and ``swap_in`` lists say what moves.
        """
        moved = 0
        for seq, block_ids in out.swap_out:
            self.swap_space[seq.seq_id] = self.cache.swap_out(block_ids)
            moved += seq.num_computed_tokens
        for seq in out.swap_in:
            saved = self.swap_space.pop(seq.seq_id)
            num_saved_blocks = len(saved[0][0])
            self.cache.swap_in(seq.block_table.blocks[:num_saved_blocks], saved)  # its first blocks, new ids
            moved += seq.num_computed_tokens
        return moved

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, last: list[bool]) -> torch.Tensor:
        """One forward pass over every scheduled token; logits of the chunks that end a sequence.

        Args:
            out: this step's plan (sequences, their ``num_new_tokens`` and slot mappings).
            last: per scheduled sequence, whether its chunk reaches its last token (then it is sampled).
        """
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

    def run(self, workload: list[RequestSpec], progress: bool = True, seed: int = 0) -> list[Sequence]:
        """Replay a workload to the end (see :class:`Replay`); returns the sequences in the workload's order.

        Args:
            workload: the requests, with arrival times relative to the start of the run.
            progress: show a progress bar of finished requests.
            seed: the seed of the prompts' token ids.
        """
        replay = Replay(self, workload, seed)
        with tqdm(total=len(workload), desc="requests", disable=not progress) as bar:
            while not replay.done:
                replay.step()
                bar.update(self.metrics.history[-1].finished)
        return replay.seqs

    def generate(self, prompts: list[list[int]], sampling_params: SamplingParams | None = None) -> list[list[int]]:
        """Offline convenience: every prompt arrives now; returns each one's output tokens.

        Args:
            prompts: the prompts' token ids.
            sampling_params: the same for every prompt (:class:`SamplingParams` defaults if None).
        """
        for i, p in enumerate(prompts):  # every prompt checked before any is queued, each error naming its prompt
            check_prompt(self.model.config, p, (sampling_params or SamplingParams()).max_tokens, f"prompts[{i}]")
        ids, next_id = [], self._next_id
        try:  # all or none: a bad prompt in the middle leaves none of the earlier ones queued
            for p in prompts:
                ids.append(self.add_request(p, sampling_params))
        except BaseException:
            for i in ids:
                self.scheduler.abort(self.requests.pop(i))
            self._next_id = next_id
            raise
        while self.has_unfinished():
            self.step()
        return [self.requests[i].output_token_ids for i in ids]


class Replay:
    """A workload replayed through an engine, one engine step per :meth:`step`.

    Before each step, the requests whose arrival time has come are added, with
    the seeded prompts of :func:`minipaged.workload.prompt_token_ids`; when
    nothing is queued or running, the clock first idles until the next arrival.
    :meth:`Engine.run` steps it to the end; the dashboard steps it on every click.

    Args:
        engine: the engine to drive; arrival times count from its clock's time now.
        workload: the requests, with arrival times relative to the start of the replay.
        seed: the seed of the prompts' token ids (request ``i`` gets ``prompt_token_ids(i, ..., seed)``).
    """

    def __init__(self, engine: Engine, workload: list[RequestSpec], seed: int = 0):
        for i, r in enumerate(workload):
            if not isinstance(r, RequestSpec):
                raise TypeError(f"workload[{i}] must be a RequestSpec, got {type(r).__name__}")
            check_real(r.arrival_time, f"workload[{i}].arrival_time", minimum=0)  # NaN would never arrive
        self.engine = engine
        self.seed = seed
        self.arrivals = deque(sorted(enumerate(workload), key=lambda item: item[1].arrival_time))
        self.start = engine.clock.now()
        self.seqs: list[Sequence | None] = [None] * len(workload)  # in the workload's order, once added

    @property
    def allocator(self):
        """The engine's block pool (views subscribe to its events)."""
        return self.engine.cache.allocator

    @property
    def done(self) -> bool:
        return not self.arrivals and not self.engine.has_unfinished()

    def _add_arrivals(self) -> None:
        vocab = self.engine.model.config.vocab_size
        while self.arrivals and self.start + self.arrivals[0][1].arrival_time <= self.engine.clock.now():
            i, r = self.arrivals.popleft()
            prompt = prompt_token_ids(i, r.prompt_len, vocab, self.seed)
            rid = self.engine.add_request(prompt, SamplingParams(max_tokens=r.output_len),
                                          arrival_time=self.start + r.arrival_time)  # fmt: skip
            self.seqs[i] = self.engine.requests[rid]

    def step(self) -> bool:
        """Add the arrivals that are due, idle to the next one if there is nothing to run, take one engine step.

        Returns False once every request has finished (then nothing happens), True while work remains.
        """
        if self.done:
            return False
        self._add_arrivals()
        if not self.engine.has_unfinished():
            self.engine.clock.wait_until(self.start + self.arrivals[0][1].arrival_time)  # idle until the next arrival
            self._add_arrivals()
        self.engine.step()
        return not self.done
