"""The serving loop: requests join and leave the batch at every step, over one paged KV cache.

One :meth:`Engine.step` is

1. ``scheduler.schedule()``: who runs, how many tokens each computes, and the
   cache slots those tokens' K/V go to (allocating blocks, maybe preempting;
   in swap mode the engine then copies K/V between the pool and ``swap_space``);
2. one forward pass of the model over all scheduled tokens packed together,
   addressed through the block tables (:meth:`Engine.execute`);
3. sampling a token for every sequence whose chunk reached its end (a request short of its
   ``min_tokens`` has its stop tokens masked first, :func:`mask_stop_tokens`; with
   speculative decoding, :meth:`Engine.verify` then keeps the drafts the model agrees with);
4. ``scheduler.postprocess()``: advance counters, finish sequences (at a stop token, EOS or
   ``max_tokens``: :mod:`minipaged.stopping`), free blocks;
5. one :class:`~minipaged.metrics.StepRecord` in ``engine.metrics.history``;
6. the requests that finished are handed over in ``StepOutput.outputs`` (and,
   unless ``EngineConfig(keep_finished=True)``, forgotten: a long-running
   engine's memory stays bounded).

Public state (the live dashboard reads it; keep these names stable):

* ``engine.scheduler.waiting`` (deque) and ``engine.scheduler.running`` (list)
  of :class:`~minipaged.sequence.Sequence`; each running one has a ``block_table``.
* ``engine.cache.allocator``: the block pool and its event bus ("allocate",
  "free", ..., and "preempt" with the victim's seq_id).
* ``engine.metrics``: step ``history`` (the latest :data:`~minipaged.metrics.HISTORY_WINDOW`
  steps, or all with ``keep_finished``), ``num_steps``, ``num_finished``, ``num_preemptions``, ``max_running``.
* ``engine.requests``: every unfinished sequence by its seq_id (with one sample, a
  request's seq_id is its request_id); finished and aborted ones too with ``keep_finished``.
* ``engine.samples``: the same requests' sequences by request_id, ``n`` of them, in sample order.
* ``engine.swap_space``: swap mode's CPU copies of preempted sequences' K/V, by id.
* ``engine.step()`` returns a :class:`StepOutput` saying what happened.

Time comes from ``engine.clock``, virtual by default (deterministic, see
:mod:`minipaged.clock`) or wall-clock for benchmarks.

A workload (requests with arrival times) is replayed by :class:`Replay`, one
step at a time: :meth:`Engine.run` drives it to the end, the chapter's
dashboard steps it on every click. A workload's ``output_len`` means exactly that many
tokens, as in vLLM's benchmarks: its requests are sent with ``ignore_eos=True``. Everything
else (:meth:`Engine.generate`, :meth:`Engine.add_request` by default) stops at the model's EOS.

Vocabulary: the engine's API speaks of requests (``request_id``); with one
sample per request, a request is one :class:`~minipaged.sequence.Sequence`
and its ``request_id`` is the sequence's ``seq_id``. With ``SamplingParams.n``
samples, it is ``n`` sequences with seq_ids ``(request_id, 0) .. (request_id, n-1)``;
they share the prompt's blocks by fork (see :mod:`minipaged.sequence`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

import torch
from tqdm.auto import tqdm

from minipaged.attention import AttentionMetadata
from minipaged.block_manager import ReentrantCallError
from minipaged.cache import PagedKVCache
from minipaged.clock import VirtualClock
from minipaged.metrics import HISTORY_WINDOW, Metrics
from minipaged.model import LlamaConfig
from minipaged.scheduler import EngineConfig, Scheduler, SchedulerOutput, check_fits_pool
from minipaged.sequence import SamplingParams, Sequence, SequenceStatus
from minipaged.validation import check_hashable, check_int, check_positions, check_prompt, check_real
from minipaged.workload import RequestSpec, prompt_token_ids


@dataclass
class RequestOutput:
    """A request that finished, as :meth:`Engine.step` hands it over.

    Attributes:
        request_id: the request's id.
        seqs: its samples (finished :class:`~minipaged.sequence.Sequence`, with their timings), in sample order;
            per sample, :attr:`output_token_ids`, :attr:`finish_reason` and :attr:`stop_reason` list theirs.
    """

    request_id: object
    seqs: list[Sequence]

    @property
    def output_token_ids(self) -> list[list[int]]:
        """Each sample's generated tokens (a stop token that ended it included), in sample order."""
        return [s.output_token_ids for s in self.seqs]

    @property
    def finish_reason(self) -> list[str]:
        """Each sample's ``finish_reason`` (``"stop"``, ``"length"``, or ``"abort"`` for one aborted alone)."""
        return [s.finish_reason for s in self.seqs]

    @property
    def stop_reason(self) -> list[int | None]:
        """Each sample's ``stop_reason``: the stop token that ended it, None for the EOS or a length."""
        return [s.stop_reason for s in self.seqs]


@dataclass
class StepOutput:
    """What one step did, by seq_id (= request id with one sample); ``outputs``: the requests it finished."""

    step: int
    time: float
    scheduled: dict = field(default_factory=dict)  # seq_id -> tokens computed this step
    new_tokens: dict = field(default_factory=dict)  # seq_id -> token sampled this step
    drafts: dict = field(default_factory=dict)  # seq_id -> draft tokens it verified this step (speculative decoding)
    accepted: dict = field(default_factory=dict)  # seq_id -> the drafts it accepted, which come before its new token
    admitted: list = field(default_factory=list)
    preempted: list = field(default_factory=list)
    finished: list = field(default_factory=list)
    outputs: list[RequestOutput] = field(default_factory=list)


def mask_stop_tokens(logits: torch.Tensor, seqs: list[Sequence], spec: dict) -> torch.Tensor:
    """``logits`` with every stop token masked where a request has fewer than ``min_tokens`` outputs.

    The rule is :meth:`minipaged.stopping.StopRules.mask`'s; this applies it to a step's rows:
    one per sequence, or ``k + 1`` for one that verifies ``k`` drafts (row ``r`` then picks its
    output token number ``num_output_tokens + r``, so the mask holds at every verified position).
    Returns ``logits`` itself when nothing is masked.

    Args:
        logits: what :meth:`Engine.execute` returned, the rows of ``seqs`` in order.
        seqs: the sequences whose chunk ends this step.
        spec: seq_id -> drafts it verifies (``SchedulerOutput.spec_token_ids``).
    """
    if all(s.stop_rules.min_tokens <= s.num_output_tokens for s in seqs):
        return logits
    blocks, start = [], 0
    for seq in seqs:
        n = 1 + len(spec.get(seq.seq_id, ()))
        blocks.append(seq.stop_rules.mask(logits[start : start + n], seq.num_output_tokens))
        start += n
    return torch.cat(blocks)


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

    Memory is bounded over a long run: unless ``keep_finished``, each finished request is forgotten
    as :meth:`step` hands it over, and the metrics keep the latest
    :data:`~minipaged.metrics.HISTORY_WINDOW` step records. Once warmed up (the window full), the
    process's RSS grows by less than 1 MiB over 10,000 requests (``python -m minipaged.bench memory``
    measures it; CI checks 1,000 requests).

    An event subscriber called during a step may read everything and call :meth:`abort`, which
    waits for the step's end; any call that would change the engine, its scheduler, its pool or
    a table raises :class:`~minipaged.block_manager.ReentrantCallError` and changes nothing.

    Args:
        model: a :class:`~minipaged.model.LlamaForCausalLM` (its config sizes the cache).
        config: the pool and the scheduler's knobs (:class:`EngineConfig` defaults if None).
        clock: a :class:`~minipaged.clock.VirtualClock` (the default) or a :class:`~minipaged.clock.WallClock`.
    """

    def __init__(self, model, config: EngineConfig | None = None, clock=None):
        if not callable(model) or not isinstance(getattr(model, "config", None), LlamaConfig):
            raise TypeError(f"model must be a LlamaForCausalLM (a module with a LlamaConfig as .config), "
                            f"got {type(model).__name__}")  # fmt: skip
        if config is not None and not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        if clock is not None and not all(callable(getattr(clock, m, None)) for m in ("now", "step", "wait_until")):
            raise TypeError(f"clock must be a VirtualClock, a WallClock or None (an object with now(), step() and "
                            f"wait_until()), got {type(clock).__name__} {clock!r:.40}")  # fmt: skip
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
        if self.config.enable_prefix_caching:  # the same pool, with a free queue that keeps cached blocks' keys
            from minipaged.prefix_cache import PrefixCachingAllocator, sha256  # chapter 06, reached by name only

            self.cache.allocator = PrefixCachingAllocator(self.config.num_blocks, self.config.block_size,
                                                          self.config.prefix_caching_hash_fn or sha256)  # fmt: skip
        self.scheduler = Scheduler(self.config, self.cache.allocator)
        window = None if self.config.keep_finished else HISTORY_WINDOW
        self.metrics = Metrics(self.config.num_blocks, self.config.block_size, window)
        self.metrics.attach(self.cache.allocator)
        self.clock = clock or VirtualClock()
        self.requests: dict = {}  # seq_id -> Sequence
        self.samples: dict = {}  # request_id -> its sequences, in sample order
        self.swap_space: dict = {}  # seq_id -> per-layer (k, v) of its saved blocks, in CPU memory
        self._next_id = 0
        self._in_step = False  # during a step: abort waits for its end, other changes raise ReentrantCallError
        self._deferred_aborts: list = []

    def _refuse_during_step(self, call: str) -> None:
        """A :class:`ReentrantCallError` naming ``call`` if a step is running (a subscriber called back in)."""
        if self._in_step:
            raise ReentrantCallError(f"{call}: not during a step (an event subscriber called it); a subscriber may "
                                     "read the engine and call abort(), which waits for the step's end")  # fmt: skip

    # -- requests ---------------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None,
                    request_id=None, arrival_time: float | None = None,
                    cache_salt: str | bytes | None = None):  # fmt: skip
        """Queue a request and return its id. Errors (bad input, too big for the pool) change nothing.

        Args:
            prompt_token_ids: the prompt, token ids in ``[0, vocab_size)``.
            sampling_params: how to sample and when to stop (:class:`SamplingParams` defaults if None).
                With ``n > 1`` the request is ``n`` samples of the prompt (at most ``max_num_seqs``),
                sample ``i`` seeded with ``seed + i``; their seq_ids are ``(request_id, i)``. The
                request stops at the model's EOS (``model.config.eos_token_id``) unless ``ignore_eos``,
                and at its ``stop_token_ids`` (ids of the vocabulary).
            request_id: any hashable id not in use yet; None picks the next free integer.
            arrival_time: when the request arrived, in the engine's clock (None: now). A time in the
                past counts toward its latencies; a time later than ``clock.now()`` is refused (a
                ``ValueError``): a request from the future is added once the clock gets there, as
                :class:`Replay` does, so every latency is >= 0.
            cache_salt: str or bytes mixed into the prefix cache's first block key, so that only
                requests with the same salt share cached blocks (None: no salt).

        Raises:
            TypeError: a wrong type (an unhashable ``request_id`` included).
            ValueError: a bad value, an arrival in the future, an id in use, or a request the pool could never hold.
            ReentrantCallError: called during a step (by an event subscriber).
        """
        self._refuse_during_step("add_request")
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        params = sampling_params or SamplingParams()
        if params.stop:
            raise ValueError(f"sampling_params.stop={params.stop!r}: the engine sees token ids, never text, so it "
                             "cannot match stop strings; use the LLM front end (minipaged.llm.LLM), which matches "
                             "them on the detokenized text and aborts the request here")  # fmt: skip
        mc = self.model.config
        prompt_token_ids = check_prompt(mc, prompt_token_ids, params.max_tokens, "prompt_token_ids")
        params.stop_rules(mc.eos_token_id, mc.vocab_size)  # refuses a stop token outside the vocabulary
        if arrival_time is not None:
            arrival_time = check_real(arrival_time, "arrival_time")
            if arrival_time > self.clock.now():
                raise ValueError(f"arrival_time {arrival_time!r} is later than the engine clock's now "
                                 f"({self.clock.now()!r}): add a request once it arrives (Replay does)")  # fmt: skip
        check_hashable(request_id, "request_id")
        if cache_salt is not None and not isinstance(cache_salt, (str, bytes)):
            raise TypeError(f"cache_salt must be str, bytes or None, got {type(cache_salt).__name__} {cache_salt!r}")
        if request_id is None:
            while self._next_id in self.samples or self._next_id in self.requests:
                self._next_id += 1
            request_id = self._next_id
        seq_ids = [request_id] if params.n == 1 else [(request_id, i) for i in range(params.n)]
        if request_id in self.samples or any(i in self.requests for i in seq_ids):
            raise ValueError(f"request_id {request_id!r} is already in use")
        now = self.clock.now() if arrival_time is None else arrival_time
        seqs = []
        for i, seq_id in enumerate(seq_ids):
            seed = None if params.seed is None else params.seed + i
            seqs.append(Sequence(seq_id, prompt_token_ids, replace(params, n=1, seed=seed), now, cache_salt,
                                 request_id, mc.eos_token_id))  # fmt: skip
        seqs[0].pending_forks = seqs[1:]  # they fork from sample 0 once its prompt is computed
        self.scheduler.add(seqs[0])  # raises if the request could never fit the pool
        for seq in seqs:
            self.requests[seq.seq_id] = seq
        self.samples[request_id] = seqs
        if request_id == self._next_id:  # an automatic id is never handed out again, even once forgotten
            self._next_id += 1
        return request_id

    def abort(self, request_id, sample: int | None = None) -> None:
        """Drop a waiting or running request (all its samples, or one); its blocks and swapped-out K/V are freed.

        Now, or, when called during a step (by an event subscriber), at the end of that step: a
        step never loses a sequence it is running. Unless ``keep_finished``, the engine then
        forgets the request, once none of its samples is left unfinished.

        Args:
            request_id: the request.
            sample: None: every sample; an index in ``[0, n)``: only that sample of the request, the
                others run on (the LLM front end stops one sample at a stop string this way; sample 0
                before its prompt is computed takes the samples waiting to fork from it along). A request
                whose last unfinished sample ends in a step is handed over by that step, aborted samples
                included; one whose last unfinished sample is aborted is not handed over.

        Raises:
            TypeError: ``request_id`` is not hashable.
            KeyError: no such request (a finished one is forgotten unless ``keep_finished``).
            TypeError: ``sample`` is not an int.
            IndexError: ``sample`` is not one of the request's samples.
            ValueError: the request (or that sample) has already finished or been aborted.
        """
        check_hashable(request_id, "request_id")
        if request_id not in self.samples:
            raise KeyError(f"abort: no request with id {request_id!r} (a finished request is handed over by step() "
                           "and forgotten, unless EngineConfig(keep_finished=True))")
        seqs = self.samples[request_id]
        if sample is not None:
            sample = check_int(sample, "sample")
            if not 0 <= sample < len(seqs):
                raise IndexError(f"abort: sample must be in [0, {len(seqs)}) for request {request_id!r}, got {sample}")
        targets = seqs if sample is None else [seqs[sample]]
        if all(s.is_finished for s in targets):
            which = "" if sample is None else f" sample {sample}"
            raise ValueError(f"abort: request {request_id!r}{which} has already {targets[0].status.value}")
        if self._in_step:
            self._deferred_aborts.append((request_id, sample))
            return
        for seq in targets:
            if seq.is_finished:
                continue
            if seq.status is SequenceStatus.WAITING and seq in seqs[0].pending_forks:  # not forked yet: no blocks
                seqs[0].pending_forks.remove(seq)
                seq.abort()
            else:  # a pending sample is aborted with the sample it would fork from
                self.scheduler.abort(seq)
            self.swap_space.pop(seq.seq_id, None)
        if not self.config.keep_finished and all(s.is_finished for s in seqs):
            self._forget(request_id)

    def _forget(self, request_id) -> None:
        for seq in self.samples.pop(request_id):
            del self.requests[seq.seq_id]

    def _apply_deferred_aborts(self) -> None:
        aborts, self._deferred_aborts = self._deferred_aborts, []
        for request_id, sample in aborts:
            seqs = self.samples.get(request_id, ())
            targets = seqs if sample is None or not seqs else [seqs[sample]]
            if targets and not all(s.is_finished for s in targets):  # it may have finished in the step
                self.abort(request_id, sample)

    # -- handing a prefilled request between engines (chapter 08, minipaged.disagg) ------------

    def take_prefilled(self, request_id) -> Sequence:
        """Take a request whose prompt is computed and whose first token is sampled out of this engine.

        The engine forgets it (it is no longer running here); its block table still holds its
        blocks in this engine's pool, so their K/V stays put until the caller, who now owns the
        table, has copied it elsewhere and calls ``seq.block_table.release()``. Between steps only;
        all checks come first, so an error changes nothing.

        Args:
            request_id: a running request of one sample whose next token to compute is its first output.

        Raises:
            TypeError: ``request_id`` is not hashable.
            KeyError: no such request.
            ValueError: it has several samples, or is not in that state (waiting, mid-prefill, decoding).
            ReentrantCallError: called during a step (by an event subscriber).
        """
        self._refuse_during_step("take_prefilled")
        check_hashable(request_id, "request_id")
        if request_id not in self.samples:
            raise KeyError(f"take_prefilled: no request with id {request_id!r}")
        seqs = self.samples[request_id]
        if len(seqs) != 1:
            raise ValueError(f"take_prefilled: request {request_id!r} has {len(seqs)} samples; only one can move")
        seq = seqs[0]
        if seq not in self.scheduler.running or seq.num_output_tokens != 1 or seq.num_uncomputed_tokens != 1:
            raise ValueError(f"take_prefilled: request {request_id!r} must be running with its prompt computed and "
                             f"exactly its first token sampled, got {seq!r}")  # fmt: skip
        self.scheduler.running.remove(seq)
        self._forget(request_id)
        return seq

    def add_prefilled(self, seq: Sequence) -> None:
        """Run a request whose K/V another engine computed: it joins ``scheduler.running`` as it is.

        ``seq.block_table`` must already hold its computed tokens' K/V in *this* engine's pool
        (see :func:`minipaged.disagg.transfer_kv`); its next step computes the token after them.
        Between steps only; all checks come first, so an error changes nothing.

        Args:
            seq: a running, unfinished :class:`~minipaged.sequence.Sequence` of one sample, whose one
                uncomputed token is its latest output, with a table of this pool holding exactly its
                computed tokens.

        Raises:
            TypeError: ``seq`` is not a Sequence.
            ValueError: its state or table does not fit (another pool, wrong length, released), its id
                is in use, no seat is free (``max_num_seqs``), or it could never fit this pool.
            ReentrantCallError: called during a step (by an event subscriber).
        """
        self._refuse_during_step("add_prefilled")
        if not isinstance(seq, Sequence):
            raise TypeError(f"seq must be a Sequence, got {type(seq).__name__}")
        table = seq.block_table
        if (seq.status is not SequenceStatus.RUNNING or seq.pending_forks or seq.num_output_tokens < 1
                or seq.num_uncomputed_tokens != 1):  # fmt: skip
            raise ValueError(f"add_prefilled: seq must be running, one sample, with its latest token uncomputed, "
                             f"got {seq!r}")  # fmt: skip
        if table is None or table.allocator is not self.cache.allocator or table.released or table.pending_copies:
            raise ValueError(f"add_prefilled: seq {seq.seq_id!r}'s block table must be a live table of this "
                             "engine's pool (transfer its K/V here first)")  # fmt: skip
        if table.num_tokens != seq.num_computed_tokens:
            raise ValueError(f"add_prefilled: seq {seq.seq_id!r}'s table holds {table.num_tokens} tokens but "
                             f"{seq.num_computed_tokens} are computed")  # fmt: skip
        if seq.request_id in self.samples or seq.seq_id in self.requests:
            raise ValueError(f"add_prefilled: request_id {seq.request_id!r} is already in use")
        if self.scheduler.num_seats >= self.config.max_num_seqs:
            raise ValueError(f"add_prefilled: no free seat ({self.config.max_num_seqs} sequences run already)")
        check_fits_pool(self.config, seq.num_prompt_tokens, seq.sampling_params.max_tokens,
                        f"add_prefilled: request {seq.request_id!r}", "this engine's pool")  # fmt: skip
        self.scheduler.running.append(seq)
        self.requests[seq.seq_id] = seq
        self.samples[seq.request_id] = [seq]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step ---------------------------------------------------------

    def step(self) -> StepOutput:
        """Schedule, run one forward pass, sample, and record the step (see the module docstring).

        All or nothing: if anything raises inside the step (the scheduler, a swap, the model, a
        kernel, sampling, a ``KeyboardInterrupt``), the bookkeeping is put back as it was before
        the step (block tables, reference counts, the free queue, prefix-cache keys, the queues,
        the sequences, swap space, the clock and the metrics), a ``"rollback"`` event tells the
        allocator's subscribers, and the exception propagates; the next ``step()`` works. Only K/V
        in slots that no sequence counts as computed may differ: blocks that change hands in the
        step (a victim's, a cached free one's) have their K/V saved first and put back.

        Returns:
            What the step did; its ``outputs`` are the requests that finished in it, which the
            engine forgets unless ``EngineConfig(keep_finished=True)``.

        Raises:
            ReentrantCallError: called during a step (by an event subscriber); the running step goes on.
        """
        self._refuse_during_step("step")
        undo = _StepUndo(self)
        self._in_step = True
        self.cache.allocator.subscriber_guard = "Engine.step"  # a subscriber's change to the pool raises now
        try:
            return self._step(undo)
        except BaseException:
            undo.restore()
            raise
        finally:
            self.cache.allocator.subscriber_guard = None
            self._in_step = False
            self._apply_deferred_aborts()

    def _step(self, undo: _StepUndo) -> StepOutput:
        out = self.scheduler.schedule()
        undo.protect_kv(out)  # from here on K/V moves: swaps, copy-on-write, the forward pass
        result = StepOutput(step=self.metrics.num_steps, time=self.clock.now())
        result.admitted = [s.seq_id for s in out.admitted]
        result.preempted = [s.seq_id for s in out.preempted]
        swapped = self.swap(out)
        sampled, accepted = {}, {}
        if not out.is_empty:
            spec = out.spec_token_ids  # chapter 08: drafts are computed but not (yet) in token_ids
            last = [s.num_computed_tokens + n - len(spec.get(s.seq_id, ())) == s.num_tokens
                    for s, n in zip(out.seqs, out.num_new_tokens)]  # fmt: skip
            logits = self.execute(out, last)
            to_sample = [s for s, ends in zip(out.seqs, last) if ends]
            logits = mask_stop_tokens(logits, to_sample, spec)  # min_tokens: before verification and sampling
            decided = {}  # seq_id -> the token a sampled sequence's verification already drew
            if spec:  # a sequence with k drafts has k + 1 rows: keep the row after its accepted drafts
                logits, accepted, decided = self.verify(logits, to_sample, spec)
            # One row of logits per sequence whose chunk ends; a sample about to fork shares its parent's row.
            rows = [(i, x) for i, s in enumerate(to_sample) for x in (s, *s.pending_forks) if x.seq_id not in decided]
            tokens = sample(logits[[i for i, _ in rows]], [x for _, x in rows])
            sampled = {x.seq_id: t for (_, x), t in zip(rows, tokens)} | decided
            context = sum(s.num_computed_tokens + n for s, n in zip(out.seqs, out.num_new_tokens))
            self.clock.step(out.num_batched_tokens, context, swapped)
        result.time = self.clock.now()
        prefill = sum(n for s, n in zip(out.seqs, out.num_new_tokens) if s.is_prefill)
        finished = self.scheduler.postprocess(out, sampled, result.time, accepted)
        result.scheduled = {s.seq_id: n for s, n in zip(out.seqs, out.num_new_tokens)}
        result.new_tokens = sampled
        result.drafts = dict(out.spec_token_ids)
        result.accepted = accepted
        result.finished = [s.seq_id for s in finished]
        self.metrics.record_step(result.time, self.scheduler.running, len(self.scheduler.waiting),
                                 out.num_new_tokens, prefill, len(finished))
        result.outputs = self._hand_over(finished)
        return result

    def _hand_over(self, finished: list[Sequence]) -> list[RequestOutput]:
        """The requests whose last sample just finished; forgotten here unless ``keep_finished``."""
        outputs = []
        for request_id in dict.fromkeys(s.request_id for s in finished):
            seqs = self.samples[request_id]
            if all(s.is_finished for s in seqs):  # a sample aborted alone (abort(..., sample=i)) comes along
                outputs.append(RequestOutput(request_id, seqs))
                if not self.config.keep_finished:
                    self._forget(request_id)
        return outputs

    def swap(self, out: SchedulerOutput) -> int:
        """Move K/V as the plan says: save victims' to CPU memory, copy-on-write, restore readmitted ones'.

        Returns the tokens moved between GPU and CPU memory. The scheduler decided what
        moves; the cache copies (:meth:`PagedKVCache.swap_out`, :meth:`~PagedKVCache.copy_blocks`,
        :meth:`~PagedKVCache.swap_in`). It must run before the forward pass, reads before
        writes: a victim's freed blocks, or a copy's source, may already belong to someone
        else this step, who is about to write into them.

        Args:
            out: this step's plan; its ``swap_out`` and ``swap_in`` lists say what moves.
        """
        moved = 0
        for seq, block_ids in out.swap_out:
            self.swap_space[seq.seq_id] = self.cache.swap_out(block_ids)
            moved += seq.num_computed_tokens
        if out.copies:  # copy-on-write, after the victims' K/V is saved and before anything lands in new blocks
            self.cache.copy_blocks([src for src, _ in out.copies], [dst for _, dst in out.copies])
        for seq, num_hit_blocks in zip(out.swap_in, out.swap_in_hit_blocks):
            saved = self.swap_space.pop(seq.seq_id)
            num_saved_blocks = len(saved[0][0])
            if num_hit_blocks < num_saved_blocks:  # the blocks a prefix hit did not restore come back from CPU
                rest = [(k[num_hit_blocks:], v[num_hit_blocks:]) for k, v in saved]
                self.cache.swap_in(seq.block_table.blocks[num_hit_blocks:num_saved_blocks], rest)
                moved += seq.num_computed_tokens - num_hit_blocks * self.config.block_size
        return moved

    def verify(self, logits: torch.Tensor, seqs: list[Sequence], spec: dict) -> tuple[torch.Tensor, dict, dict]:
        """Speculative decoding (chapter 08): check each sequence's drafts against the target's own tokens.

        A sequence that verified ``k`` drafts owns ``k + 1`` rows of ``logits``. Greedy acceptance
        (:func:`minipaged.speculative.accept_greedy`) keeps the ``j`` drafts that equal the
        target's argmax, and the row after them is the one to sample the step's new token from
        (the correction at the first mismatch, or the bonus token after ``k`` accepted drafts).
        A sampled sequence (``temperature > 0``) goes through
        :func:`minipaged.speculative.accept_sampled`, which draws its new token itself.
        Records the counts in ``engine.metrics``.

        Args:
            logits: what :meth:`execute` returned (stop tokens masked before ``min_tokens`` by
                :func:`mask_stop_tokens`): per sequence whose chunk ends, ``1 + k`` rows.
            seqs: those sequences, in order.
            spec: seq_id -> drafts (``SchedulerOutput.spec_token_ids``).

        Returns:
            One row per sequence (the one to sample from), seq_id -> accepted drafts, and
            seq_id -> new token for the sampled sequences whose token verification drew.
        """
        from minipaged.speculative import accept_greedy, accept_sampled  # chapter 08, reached by name only

        rows, accepted, decided, start = [], {}, {}, 0
        for seq in seqs:
            drafts = spec.get(seq.seq_id, [])
            block = logits[start : start + len(drafts) + 1]
            j, t = 0, seq.sampling_params.temperature
            if drafts and t > 0:
                probs = torch.softmax(block.float() / t, dim=-1)
                j, decided[seq.seq_id] = accept_sampled(drafts, probs, seq.generator)
            elif drafts:
                j = accept_greedy(drafts, block.argmax(dim=-1).tolist())
            if drafts:
                accepted[seq.seq_id] = drafts[:j]
                self.metrics.record_spec_decode(len(drafts), j)
            rows.append(start + j)
            start += len(drafts) + 1
        return logits[rows], accepted, decided

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, last: list[bool]) -> torch.Tensor:
        """One forward pass over every scheduled token; logits of the chunks that end a sequence.

        Args:
            out: this step's plan (sequences, their ``num_new_tokens`` and slot mappings).
            last: per scheduled sequence, whether its chunk reaches its last token (then it is sampled).

        Returns one row per sequence whose chunk ends, or, for one that verifies ``k`` drafts
        (``out.spec_token_ids``), its last ``k + 1`` rows: the logits at every drafted position.
        """
        device = self.cache.device
        input_ids, positions = [], []
        for seq, n in zip(out.seqs, out.num_new_tokens):
            start = seq.num_computed_tokens
            input_ids += seq.token_ids[start : start + n] + out.spec_token_ids.get(seq.seq_id, [])
            positions += range(start, start + n)
        # The scheduler already appended this step's tokens to the block tables.
        tables = [s.block_table for s in out.seqs]
        metadata = AttentionMetadata.pack(tables, out.num_new_tokens, torch.cat(out.slot_mappings), device)
        spec = out.spec_token_ids
        logits = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            self.cache,
            metadata,
            backend=self.config.backend,
            all_logits=bool(spec),
        )  # [num_seqs, vocab]: each sequence's last token this step (with drafts: every token's)
        if not spec:
            return logits[torch.tensor(last, device=device)]
        # Speculative decoding (chapter 08): a sequence with k drafts needs its last k + 1 rows.
        rows, end = [], 0
        for seq, n, ends in zip(out.seqs, out.num_new_tokens, last):
            end += n
            if ends:
                rows += range(end - 1 - len(spec.get(seq.seq_id, ())), end)
        return logits[rows]

    # -- whole workloads --------------------------------------------------

    def run(self, workload: list[RequestSpec], progress: bool = True, seed: int = 0,
            prompts: list[list[int]] | None = None) -> list[Sequence]:  # fmt: skip
        """Replay a workload to the end (see :class:`Replay`); returns the sequences in the workload's order.

        Each request makes exactly its ``output_len`` tokens (``ignore_eos=True``), as in vLLM's benchmarks.

        Args:
            workload: the requests, with arrival times relative to the start of the run.
            progress: show a progress bar of finished requests.
            seed: the seed of the prompts' token ids.
            prompts: each request's prompt token ids instead of seeded random ones (as for :class:`Replay`).

        Every request is checked before any runs (see :class:`Replay`); a :class:`ReentrantCallError` during a step.
        """
        self._refuse_during_step("run")
        replay = Replay(self, workload, seed, prompts)
        with tqdm(total=len(workload), desc="requests", disable=not progress) as bar:
            while not replay.done:
                replay.step()
                bar.update(self.metrics.history[-1].finished)
        return replay.seqs

    def generate(self, prompts: list[list[int]], sampling_params: SamplingParams | None = None) -> list[list[int]]:
        """Offline convenience: every prompt arrives now; returns the output tokens of every sample.

        The list is flat, prompt by prompt: with ``n`` samples per prompt, entry ``p * n + i``
        is sample ``i`` of prompt ``p`` (with ``n == 1``, one output per prompt, in order).

        It steps until nothing is unfinished: requests queued before with :meth:`add_request`
        finish too, and are forgotten (unless ``keep_finished``) as :meth:`step` hands them over.
        An output ends at the model's EOS (kept in it) unless ``sampling_params.ignore_eos``, at a
        stop token, or at ``max_tokens``.

        Args:
            prompts: the prompts' token ids.
            sampling_params: the same for every prompt (:class:`SamplingParams` defaults if None).

        Raises a :class:`ReentrantCallError` during a step (by an event subscriber), before queueing anything.
        """
        self._refuse_during_step("generate")
        for i, p in enumerate(prompts):  # every prompt checked before any is queued, each error naming its prompt
            check_prompt(self.model.config, p, (sampling_params or SamplingParams()).max_tokens, f"prompts[{i}]")
        ids, next_id = [], self._next_id
        try:  # all or none: a bad prompt in the middle leaves none of the earlier ones queued
            for p in prompts:
                ids.append(self.add_request(p, sampling_params))
        except BaseException:
            for i in ids:
                seqs = self.samples.pop(i)
                self.scheduler.abort(seqs[0])  # the other samples are not queued yet (they fork from it)
                for seq in seqs:
                    del self.requests[seq.seq_id]
            self._next_id = next_id
            raise
        mine = {i: self.samples[i] for i in ids}  # their sequences; step() may forget them once finished
        while self.has_unfinished():
            self.step()
        return [s.output_token_ids for i in ids for s in mine[i]]


def _copy_state(obj, skip: tuple = ()) -> dict:
    """``obj``'s attributes, containers copied one level deep (and the lists a dict holds)."""
    state = {}
    for name, value in vars(obj).items():
        if name in skip:
            continue
        if isinstance(value, dict):
            value = type(value)((k, list(v) if isinstance(v, list) else v) for k, v in value.items())
        elif isinstance(value, (list, deque, set, bytearray)):
            value = type(value)(value)
        state[name] = value
    return state


def _restore_state(obj, state: dict) -> None:
    """Put back what :func:`_copy_state` saved, refilling containers in place (views may hold them)."""
    for name, saved in state.items():
        value = getattr(obj, name)
        if value is saved or type(value) is not type(saved):
            setattr(obj, name, saved)
        elif isinstance(value, (list, bytearray)):
            value[:] = saved
        elif isinstance(value, (dict, set, deque)):
            value.clear()
            (value.extend if isinstance(value, deque) else value.update)(saved)
        else:
            setattr(obj, name, saved)


class _StepUndo:
    """What :meth:`Engine.step` changes, saved before it starts, so that a failed step can be undone.

    Everything a step touches is bookkeeping of a fixed size (the pool's lists, the queues) or
    grows by appending (tokens, token times, history), so saving it costs O(num_blocks + num_seqs).
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.saved_kv = None  # (block ids, their K/V) that the step may overwrite although they hold K/V
        allocator, scheduler = engine.cache.allocator, engine.scheduler
        self.allocator = _copy_state(allocator, skip=("_subscribers", "_held_events", "subscriber_errors",
                                                      "num_subscriber_errors", "subscriber_guard",
                                                      "_delivering"))  # fmt: skip
        self.scheduler = _copy_state(scheduler)
        history = engine.metrics.history  # a window or all: keep its length and the record a step may drop
        self.metrics = _copy_state(engine.metrics, skip=("history",))
        self.history = (len(history), history[0] if history else None)
        self.clock = _copy_state(engine.clock)
        self.engine_state = {"swap_space": dict(engine.swap_space), "requests": dict(engine.requests),
                             "samples": dict(engine.samples)}  # fmt: skip
        seqs = [*scheduler.running, *scheduler.waiting]
        seqs += [child for s in seqs for child in s.pending_forks]
        self.seqs = [(s, s.status, s.num_computed_tokens, s.num_tokens, len(s.token_times), s.finish_time,
                      s.finish_reason, s.stop_reason, s.num_preemptions, list(s.pending_forks), s.block_table,
                      None if s.generator is None else s.generator.get_state()) for s in seqs]  # fmt: skip
        self.tables = [(t, _copy_state(t)) for t in {id(s.block_table): s.block_table for s in seqs
                                                         if s.block_table is not None}.values()]  # fmt: skip

    def protect_kv(self, out: SchedulerOutput) -> None:
        """Save the K/V of blocks this step will write although they held K/V before it (a victim's, a cached one's).

        Writes into a sequence's own blocks land in slots it does not count as computed, which
        a rollback may leave as they are. A block that changed hands this step is different:
        after a rollback its old holder (or the prefix cache) counts on its K/V again.
        """
        block_size = self.engine.config.block_size
        owned = {id(table): set(state["blocks"]) for table, state in self.tables}
        targets = set()
        for seq, slots in zip(out.seqs, out.slot_mappings):
            own = owned.get(id(seq.block_table), set())
            targets |= {b for b in (slots // block_size).tolist() if b not in own}
        targets |= {dst for _, dst in out.copies}
        for seq in out.swap_in:
            targets |= set(seq.block_table.blocks)
        refcounts, entries = self.allocator["_refcounts"], self.allocator.get("entries")
        held = sorted(b for b in targets if refcounts[b] > 0 or (entries is not None and entries[b] is not None))
        if held:
            self.saved_kv = (held, self.engine.cache.swap_out(held))

    def restore(self) -> None:
        engine = self.engine
        allocator = engine.cache.allocator
        if self.saved_kv is not None:
            engine.cache.swap_in(*self.saved_kv)
        _restore_state(allocator, self.allocator)
        _restore_state(engine.scheduler, self.scheduler)
        history, (length, oldest) = engine.metrics.history, self.history
        for _ in range(engine.metrics.num_steps - self.metrics["num_steps"]):
            history.pop()
        if len(history) < length:  # the window dropped its oldest record for the step's one
            history.insert(0, oldest)
        _restore_state(engine.metrics, self.metrics)
        _restore_state(engine.clock, self.clock)
        _restore_state(engine, self.engine_state)
        for table, state in self.tables:
            _restore_state(table, state)
        for (seq, status, computed, num_tokens, num_times, finish, reason, stop, preemptions, forks, table,
             rng) in self.seqs:  # fmt: skip
            seq.status, seq.num_computed_tokens, seq.finish_time = status, computed, finish
            seq.finish_reason, seq.stop_reason = reason, stop
            seq.num_preemptions, seq.pending_forks, seq.block_table = preemptions, forks, table
            del seq.token_ids[num_tokens:], seq.token_times[num_times:]
            if rng is not None:
                seq.generator.set_state(rng)
        allocator.emit("rollback")


class Replay:
    """A workload replayed through an engine, one engine step per :meth:`step`.

    Before each step, the requests whose arrival time has come are added, with
    the seeded prompts of :func:`minipaged.workload.prompt_token_ids`, each asking for exactly
    its ``output_len`` tokens (``ignore_eos=True``, as vLLM's benchmarks do); when
    nothing is queued or running, the clock first idles until the next arrival.
    :meth:`Engine.run` steps it to the end; the dashboard steps it on every click.

    Every request is checked when the replay is made, before any runs: its arrival time, its
    prompt, and whether the engine's pool and the model's positions could ever hold it.

    Args:
        engine: the engine to drive; arrival times count from its clock's time now.
        workload: the requests, with arrival times relative to the start of the replay.
        seed: the seed of the prompts' token ids (request ``i`` gets ``prompt_token_ids(i, ..., seed)``).
        prompts: None (seeded random prompts), or request ``i``'s prompt token ids as ``prompts[i]``,
            ``workload[i].prompt_len`` of them (a workload whose prompts share prefixes, say).
    """

    def __init__(self, engine: Engine, workload: list[RequestSpec], seed: int = 0,
                 prompts: list[list[int]] | None = None):  # fmt: skip
        for i, r in enumerate(workload):
            if not isinstance(r, RequestSpec):
                raise TypeError(f"workload[{i}] must be a RequestSpec, got {type(r).__name__}")
            check_real(r.arrival_time, f"workload[{i}].arrival_time", minimum=0)  # NaN would never arrive
            check_positions(engine.model.config, r.prompt_len, r.output_len, f"workload[{i}]'s prompt")
            check_fits_pool(engine.config, r.prompt_len, r.output_len, f"workload[{i}]")  # not mid-run
        if prompts is not None:
            if len(prompts) != len(workload):
                raise ValueError(f"prompts must hold one prompt per request: {len(workload)}, got {len(prompts)}")
            for i, (p, r) in enumerate(zip(prompts, workload)):
                check_prompt(engine.model.config, p, r.output_len, f"prompts[{i}]")
                if len(p) != r.prompt_len:
                    raise ValueError(f"prompts[{i}] has {len(p)} tokens but workload[{i}].prompt_len is {r.prompt_len}")
        self.engine = engine
        self.seed = seed
        self.prompts = prompts
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
            prompt = prompt_token_ids(i, r.prompt_len, vocab, self.seed) if self.prompts is None else self.prompts[i]
            rid = self.engine.add_request(prompt, SamplingParams(max_tokens=r.output_len, ignore_eos=True),
                                          arrival_time=self.start + r.arrival_time)  # exactly output_len tokens
            self.seqs[i] = self.engine.requests[rid]

    def step(self) -> bool:
        """Add the arrivals that are due, idle to the next one if there is nothing to run, take one engine step.

        Returns False once every request has finished (then nothing happens), True while work remains.
        A :class:`ReentrantCallError` during an engine step (by an event subscriber), before anything changes.
        """
        self.engine._refuse_during_step("Replay.step")
        if self.done:
            return False
        self._add_arrivals()
        if not self.engine.has_unfinished():
            self.engine.clock.wait_until(self.start + self.arrivals[0][1].arrival_time)  # idle until the next arrival
            self._add_arrivals()
        self.engine.step()
        return not self.done
