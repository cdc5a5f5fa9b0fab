"""The serving loop: requests join and leave the batch at every step, over one paged KV cache.

One :meth:`Engine.step` is four calls, all or nothing (:mod:`minipaged.rollback` undoes a failed one):

1. ``scheduler.schedule()``: who runs, how many tokens each computes, and the slots their K/V goes to;
2. :meth:`Engine.execute`: the plan's K/V moves, then one forward pass over every scheduled token
   (:meth:`Engine.prepare_inputs` packs them);
3. :meth:`Engine.sample`: a token for every sequence whose chunk reached its end;
4. ``scheduler.postprocess()``: advance counters, finish sequences (:mod:`minipaged.stopping`), free blocks.

Each part is a seam (the constructor's arguments and ``EngineConfig.backend``). Public state, which
the live dashboard reads: ``scheduler.waiting`` and ``scheduler.running`` (of
:class:`~minipaged.sequence.Sequence`), ``cache.allocator`` (the pool and its event bus),
``metrics``, ``seqs`` (seq_id -> unfinished sequence), ``requests`` (request_id -> its sequences,
in sample order), ``swap_space`` (seq_id -> swapped-out K/V) and ``clock`` (virtual by default).
A request with ``SamplingParams.n`` samples is the sequences ``(request_id, 0) .. (request_id, n - 1)``
(with one sample, the seq_id is the request_id); they share the prompt's blocks by fork.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import count

import torch

from minipaged.attention import AttentionMetadata, get_backend
from minipaged.blocks import BlockAllocator, BlockTable
from minipaged.cache import PagedKVCache
from minipaged.clock import VirtualClock
from minipaged.engine_args import (
    SCHEDULER_METHODS,
    check_abort_args,
    check_built,
    check_engine_args,
    check_plan,
    check_request_args,
)
from minipaged.metrics import HISTORY_WINDOW, Metrics
from minipaged.model import LlamaConfig
from minipaged.outputs import RequestOutput, StepOutput
from minipaged.rollback import StepUndo
from minipaged.scheduler import EngineConfig, Scheduler, SchedulerOutput
from minipaged.sequence import SamplingParams, Sequence, SequenceStatus, sample
from minipaged.step_state import StepState
from minipaged.stopping import mask_stop_tokens
from minipaged.validation import errors_named


class NonFiniteLogits(RuntimeError):
    """A step's logits hold a NaN or an infinity (a broken backend or model); the step is undone."""


class Engine(StepState):
    """A continuous-batching engine over one paged KV cache.

    The allocator's event subscribers hear of a step once it is over (see :mod:`minipaged.events`),
    so they may call anything, :meth:`step` included.

    Args:
        model: a :class:`~minipaged.model.LlamaForCausalLM` (its config sizes the cache).
        config: the pool and the scheduler's knobs (:class:`EngineConfig` defaults if None).
        clock: a :class:`~minipaged.clock.VirtualClock` (the default) or a :class:`~minipaged.clock.WallClock`.
        allocator: the block allocator class, called as ``allocator(num_blocks, block_size)``:
            :class:`~minipaged.blocks.BlockAllocator`, or
            :class:`~minipaged.prefix_cache.PrefixCachingAllocator` for prefix caching (a hash of
            your own: ``functools.partial(PrefixCachingAllocator, hash_fn=...)``).
        block_table: the block table class, called as ``block_table(allocator, seq_id)``.
        scheduler: the scheduler class, called as ``scheduler(config, allocator, block_table, speculator)``.
        speculator: speculative decoding, e.g. :class:`~minipaged.speculative.NgramSpeculator` (None: off).
    """

    _step_containers = ("seqs", "requests", "swap_space")  # see minipaged.step_state

    def __init__(self, model, config: EngineConfig | None = None, clock=None, *, allocator=BlockAllocator,
                 block_table=BlockTable, scheduler=Scheduler, speculator=None):  # fmt: skip
        if not callable(model) or not isinstance(getattr(model, "config", None), LlamaConfig):
            raise TypeError(f"model must be a LlamaForCausalLM (a module with a LlamaConfig as .config), "
                            f"got {type(model).__name__}")  # fmt: skip
        check_engine_args(config, clock, allocator=allocator, block_table=block_table, scheduler=scheduler)
        self.model, self.config, mc = model, config or EngineConfig(), model.config
        with errors_named(f"EngineConfig(backend={self.config.backend!r}) cannot run this engine: "):
            get_backend(self.config.backend).check(self.config.block_size, mc.head_dim, model.dtype)  # not every step
        cfg = self.config
        self.cache = PagedKVCache(mc.num_hidden_layers, cfg.num_blocks, cfg.block_size, mc.num_key_value_heads,
                                  mc.head_dim, model.dtype, model.device, allocator)  # fmt: skip
        self.scheduler = check_built(scheduler(self.config, self.cache.allocator, block_table, speculator), "scheduler",
                                     scheduler, SCHEDULER_METHODS)  # fmt: skip
        self.speculator = speculator
        self.metrics = Metrics(self.config.num_blocks, self.config.block_size,
                               None if self.config.keep_finished else HISTORY_WINDOW)  # fmt: skip
        self.metrics.attach(self.cache.allocator)  # its prefix-cache counters; the step hands it its events
        self.clock = clock or VirtualClock()
        self.seqs: dict = {}  # seq_id -> Sequence
        self.requests: dict = {}  # request_id -> its sequences, in sample order
        self.swap_space: dict = {}  # seq_id -> per-layer (k, v) of its saved blocks, in CPU memory
        self._next_id = 0
        self._in_step = False  # during a step, an abort (from another thread, say) waits for the step's end
        self._deferred_aborts: list = []

    # -- requests ---------------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None,
                    request_id=None, arrival_time: float | None = None, cache_salt=None):  # fmt: skip
        """Queue a request and return its id. Errors (bad input, too big for the pool) change nothing.

        Args:
            prompt_token_ids: the prompt, token ids in ``[0, vocab_size)``.
            sampling_params: how to sample and when to stop (:class:`SamplingParams` defaults if None).
                With ``n > 1`` the request is ``n`` samples (at most ``max_num_seqs``), sample ``i``
                seeded with ``seed + i``. It stops at the model's EOS unless ``ignore_eos``, and at
                its ``stop_token_ids``; stop strings are the LLM front end's (:mod:`minipaged.llm`).
            request_id: any hashable id not in use yet; None picks the next free integer.
            arrival_time: when it arrived, in the engine's clock (None: now); a time later than
                ``clock.now()`` is refused (:class:`~minipaged.replay.Replay` adds a request once it arrives).
            cache_salt: str or bytes mixed into the prefix cache's first block key: only requests
                with the same salt share cached blocks (None or empty: no salt, as in vLLM).

        Raises:
            TypeError: a wrong type (an unhashable ``request_id`` included).
            ValueError: a bad value, an arrival in the future, an id in use, or a request the pool could never hold.
        """
        seqs = self.make_request(prompt_token_ids, sampling_params, request_id, arrival_time, cache_salt)
        self.scheduler.add(seqs[0])  # raises if the request could never fit the pool
        self.register(seqs)
        return seqs[0].request_id

    def make_request(self, prompt_token_ids, sampling_params=None, request_id=None, arrival_time=None,
                     cache_salt=None) -> list[Sequence]:  # fmt: skip
        """A request's sequences, every argument checked as :meth:`add_request` documents; changes nothing."""
        mc, now = self.model.config, self.clock.now()
        prompt_token_ids, params, cache_salt = check_request_args(mc, prompt_token_ids, sampling_params, arrival_time,
                                                                  now, request_id, cache_salt)  # fmt: skip
        if request_id is None:  # the next integer that names no request and no sample
            request_id = next(i for i in count(self._next_id) if i not in self.requests and i not in self.seqs)
        seq_ids = [request_id] if params.n == 1 else [(request_id, i) for i in range(params.n)]
        if request_id in self.requests or any(i in self.seqs for i in seq_ids):
            raise ValueError(f"request_id {request_id!r} is already in use")
        seqs = [Sequence(seq_id, prompt_token_ids, replace(params, n=1, seed=None if params.seed is None else
                                                             params.seed + i),
                         now if arrival_time is None else float(arrival_time), cache_salt, request_id, mc.eos_token_id)
                for i, seq_id in enumerate(seq_ids)]  # fmt: skip
        seqs[0].pending_forks = seqs[1:]  # they fork from sample 0 once its prompt is computed
        return seqs

    def register(self, seqs: list[Sequence]) -> None:
        """Know a request's sequences (made by :meth:`make_request`) by their ids, once the scheduler has them."""
        self.seqs.update((seq.seq_id, seq) for seq in seqs)
        self.requests[seqs[0].request_id] = seqs
        if seqs[0].request_id == self._next_id:  # an automatic id is never handed out again, even once forgotten
            self._next_id += 1

    def abort(self, request_id, sample_index: int | None = None) -> None:
        """Drop a waiting or running request (all its samples, or one); its blocks and swapped-out K/V are freed.

        Now, or at the end of the step when it is called during one. Unless
        ``keep_finished``, the engine then forgets the request once none of its samples is unfinished.

        Args:
            request_id: the request.
            sample_index: None: every sample; an index in ``[0, n)``: only that sample (the LLM front end stops
                one at a stop string; sample 0 before its prompt is computed takes its pending forks along).

        Raises:
            TypeError: ``request_id`` is not hashable, or ``sample_index`` is not an int.
            KeyError: no such request (a finished one is forgotten unless ``keep_finished``).
            IndexError: ``sample_index`` is not one of the request's samples.
            ValueError: the request (or that sample) has already finished or been aborted.
        """
        targets = check_abort_args(request_id, sample_index, self.requests)
        seqs = self.requests[request_id]
        if self._in_step:
            self._deferred_aborts.append((request_id, sample_index))
            return
        with self.cache.allocator.hold_events():  # subscribers hear of the frees once the request is aborted
            for seq in (s for s in targets if not s.is_finished):
                if seq.status is SequenceStatus.WAITING and seq in seqs[0].pending_forks:  # not forked yet: no blocks
                    seqs[0].pending_forks.remove(seq)
                    seq.abort()
                else:  # a pending sample is aborted with the sample it would fork from
                    self.scheduler.abort(seq)
                self.swap_space.pop(seq.seq_id, None)
        if not self.config.keep_finished and all(s.is_finished for s in seqs):
            self.forget(request_id)

    def forget(self, request_id) -> None:
        """Drop a request's sequences from :attr:`requests` and :attr:`seqs`."""
        for seq in self.requests.pop(request_id):
            del self.seqs[seq.seq_id]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step ---------------------------------------------------------

    def step(self) -> StepOutput:
        """Schedule, execute, sample, postprocess; record the step and hand over the requests it finished.

        All or nothing: if anything raises, :class:`~minipaged.rollback.StepUndo` puts the bookkeeping
        back as it was and the exception propagates; the next ``step()`` works. The allocator's
        subscribers hear of the step's events once it is over (of a failed step: one "rollback" event).
        """
        with self.cache.allocator.hold_events() as events, StepUndo(self, events) as undo:
            out = check_plan(self.scheduler.schedule())
            undo.protect_kv(out)
            logits = self.execute(out)
            sampled, accepted = self.sample(out, logits)
            finished = self.scheduler.postprocess(out, sampled, self.clock.now(), accepted)
            self.metrics.count_events(events[undo.num_events_before :])
            return self._record(out, sampled, accepted, finished)

    def _apply_deferred_aborts(self) -> None:
        """The aborts asked for during the step (from another thread, say), unless the step finished those requests."""
        aborts, self._deferred_aborts = self._deferred_aborts, []
        for request_id, sample_index in aborts:
            seqs = self.requests.get(request_id, ())
            if seqs and not all(s.is_finished for s in (seqs if sample_index is None else [seqs[sample_index]])):
                self.abort(request_id, sample_index)

    def prepare_inputs(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list]:
        """The forward pass's inputs for the plan ``out``: token ids, positions, attention metadata, logits rows.

        Every scheduled token is packed into one batch, sequence by sequence (vLLM's ``_prepare_inputs``).
        The logits rows (vLLM's ``logits_indices``) are the packed tokens to sample after: the last one
        of each sequence whose chunk reaches the end of its tokens. A speculator (chapter 08) adds the
        drafts it scheduled, and their rows.
        """
        input_ids, positions, rows, end = [], [], [], 0
        for seq, n, ends in zip(out.seqs, out.num_new_tokens, out.ends_sequence()):
            start, end = seq.num_computed_tokens, end + n
            input_ids += seq.token_ids[start : start + n]  # drafts are not among a sequence's tokens
            positions += range(start, start + n)
            rows += [end - 1] if ends else []
        if out.spec_token_ids:
            input_ids, rows = self.speculator.prepare_inputs(out, input_ids)
        tables = [s.block_table for s in out.seqs]  # the scheduler already appended this step's tokens to them
        metadata = AttentionMetadata.pack(tables, out.num_new_tokens, torch.cat(out.slot_mappings), self.cache.device)
        ids, pos = (torch.tensor(x, dtype=torch.int64, device=self.cache.device) for x in (input_ids, positions))
        return ids, pos, metadata, rows

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> torch.Tensor | None:
        """Carry out the plan ``out``'s K/V moves, then one forward pass; the clock advances by the step's cost.

        Returns the logits of the rows :meth:`prepare_inputs` picked (None: nothing ran).
        """
        moved = self.cache.move_kv(out, self.swap_space)  # before anything lands in the new blocks
        if not out.seqs:  # nothing to run (every sequence waits, or was preempted)
            return None
        ids, pos, metadata, rows = self.prepare_inputs(out)
        logits = self.model(ids, pos, self.cache, metadata, backend=self.config.backend, logits_rows=rows, check=False)
        context = sum(s.num_computed_tokens + n for s, n in zip(out.seqs, out.num_new_tokens))
        self.clock.step(out.num_batched_tokens, context, moved)
        return logits

    def sample(self, out: SchedulerOutput, logits: torch.Tensor | None) -> tuple[dict, dict]:
        """A token for every sequence whose chunk ended (and the samples about to fork from it); drafts verified.

        Stop tokens are masked first where a request is short of its ``min_tokens``. With drafts, the
        speculator's ``verify`` masks, keeps the drafts the model agrees with, and leaves one row per
        sequence. Takes the plan ``out`` and what :meth:`execute` returned; returns seq_id -> sampled
        token, and seq_id -> accepted drafts.
        """
        if logits is None:
            return {}, {}
        ending = [s for s, ends in zip(out.seqs, out.ends_sequence()) if ends]
        if not bool(logits.isfinite().all()):  # one reduction a step: a NaN would be sampled as token 0
            raise NonFiniteLogits(f"the forward pass (attention backend {self.config.backend!r}) gave NaN or inf "
                                  f"logits for the rows of {[s.seq_id for s in ending]}: nothing was sampled")
        accepted, decided = {}, {}  # decided: seq_id -> the token a sampled sequence's verification drew
        if out.spec_token_ids:
            logits, accepted, decided = self.speculator.verify(logits, ending, out.spec_token_ids)
        else:
            logits = mask_stop_tokens(logits, ending)
        # One row per sequence whose chunk ends; a sample about to fork shares its parent's row.
        rows = [(i, x) for i, s in enumerate(ending) for x in (s, *s.pending_forks) if x.seq_id not in decided]
        tokens = sample(logits[[i for i, _ in rows]], [x for _, x in rows])
        return {x.seq_id: t for (_, x), t in zip(rows, tokens)} | decided, accepted

    def _record(self, out: SchedulerOutput, sampled: dict, accepted: dict, finished: list[Sequence]) -> StepOutput:
        """Record the step in the metrics; hand over (and forget) the requests whose last sample finished."""
        now = self.clock.now()
        result = StepOutput(self.metrics.num_steps, now, dict(zip((s.seq_id for s in out.seqs), out.num_new_tokens)),
                            sampled, dict(out.spec_token_ids), accepted, [s.seq_id for s in out.admitted],
                            [s.seq_id for s in out.preempted], [s.seq_id for s in finished])  # fmt: skip
        self.metrics.record_step(now, self.scheduler.running, len(self.scheduler.waiting), out.num_new_tokens,
                                 out.num_prefill_tokens, len(finished))  # fmt: skip
        for request_id in dict.fromkeys(s.request_id for s in finished):
            seqs = self.requests[request_id]
            if all(s.is_finished for s in seqs):  # a sample aborted alone (abort(..., sample_index=i)) comes along
                result.outputs.append(RequestOutput(request_id, seqs))
                if not self.config.keep_finished:
                    self.forget(request_id)
        return result

    # -- whole workloads --------------------------------------------------

    def run(self, workload: list, progress: bool = True, seed: int = 0,
            prompts: list[list[int]] | None = None) -> list[Sequence]:  # fmt: skip
        """Replay a workload to the end: ``Replay(self, workload, seed, prompts).run(progress)``.

        Each request makes exactly its output length (``ignore_eos=True``), as in vLLM's benchmarks.
        Returns its sequences in the workload's order.
        """
        from minipaged.replay import Replay  # the replay drives the engine; the engine does not need it to step

        return Replay(self, workload, seed, prompts).run(progress)

    def generate(self, prompts: list[list[int]], sampling_params: SamplingParams | None = None) -> list[list[int]]:
        """Offline convenience: queue every prompt now, all or none, and step to the end.

        Returns the output tokens of every sample, flat, prompt by prompt (entry ``p * n + i`` is sample
        ``i`` of prompt ``p``). See :func:`minipaged.replay.generate`.
        """
        from minipaged.replay import generate  # the offline loop drives the engine; a step does not need it

        return generate(self, prompts, sampling_params)
