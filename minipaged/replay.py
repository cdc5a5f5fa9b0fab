"""A workload replayed through an engine: requests arrive on the engine's clock, one engine step at a time.

:meth:`minipaged.engine.Engine.run` steps a :class:`Replay` to the end, and chapter 05's dashboard
steps one on every click. Chapter 08's disaggregated engine, which schedules arrivals as events of
its own, shares the checks (:func:`check_workload`), the requests as sent
(:func:`workload_request`) and the all-or-none adding (:func:`add_all`).
"""

from __future__ import annotations

from collections import deque

from tqdm.auto import tqdm

from minipaged.model import check_positions, check_prompt
from minipaged.scheduler import check_fits_pool
from minipaged.sequence import SamplingParams, Sequence
from minipaged.validation import check_instance, check_real
from minipaged.workload import RequestSpec, prompt_token_ids


def workload_request(i: int, spec: RequestSpec, vocab_size: int, seed: int = 0,
                     prompts: list[list[int]] | None = None) -> tuple[list[int], SamplingParams]:
    """Request ``i`` of a workload as it is sent: its prompt and exactly ``num_output_tokens`` (``ignore_eos``).

    Args:
        i: its index in the workload.
        spec: its :class:`~minipaged.workload.RequestSpec`.
        vocab_size: the model's vocabulary (seeded prompts draw from it).
        seed: the seed of the prompts (request ``i`` gets ``prompt_token_ids(i, ..., seed)``).
        prompts: None, or every request's prompt token ids.
    """
    prompt = prompt_token_ids(i, spec.num_prompt_tokens, vocab_size, seed) if prompts is None else prompts[i]
    return prompt, SamplingParams(max_tokens=spec.num_output_tokens, ignore_eos=True)


def add_all(add, items, undo) -> list:
    """``[add(item) for item in items]``, all or none: if one raises, ``undo`` takes the ones added back.

    Args:
        add: queues one item and returns its request id.
        items: what to queue, in order.
        undo: called with the ids added so far when an ``add`` raises (the exception then propagates).
    """
    ids = []
    try:
        for item in items:
            ids.append(add(item))
    except BaseException:
        undo(ids)
        raise
    return ids


def generate(engine, prompts: list[list[int]], sampling_params: SamplingParams | None = None) -> list[list[int]]:
    """Queue every prompt now, all or none, and step ``engine`` until nothing is unfinished (``Engine.generate``).

    Returns the output tokens of every sample, flat, prompt by prompt: with ``n`` samples, entry
    ``p * n + i`` is sample ``i`` of prompt ``p``. Requests queued earlier finish too.

    Args:
        engine: the :class:`~minipaged.engine.Engine`.
        prompts: the prompts' token ids; every one is checked before any is queued.
        sampling_params: the same for every prompt (:class:`SamplingParams` defaults if None).
    """
    max_tokens = (sampling_params or SamplingParams()).max_tokens
    for i, p in enumerate(prompts):  # every prompt checked before any is queued, each error naming prompts[i]
        check_prompt(engine.model.config, p, max_tokens, f"prompts[{i}]")
    next_id = engine._next_id

    def undo(ids):  # a request the pool can never hold leaves none of the earlier ones queued
        for i in ids:
            engine.scheduler.abort(engine.requests[i][0])  # the other samples are not queued yet (they fork)
            engine.forget(i)
        engine._next_id = next_id

    ids = add_all(lambda p: engine.add_request(p, sampling_params), prompts, undo)
    mine = {i: engine.requests[i] for i in ids}  # their sequences; step() may forget them once finished
    while engine.has_unfinished():
        engine.step()
    return [s.output_token_ids for i in ids for s in mine[i]]


class Replay:
    """A workload replayed through an engine, one engine step per :meth:`step`.

    Before each step, the requests whose arrival time has come are added, with
    the seeded prompts of :func:`minipaged.workload.prompt_token_ids`, each asking for exactly
    its ``num_output_tokens`` tokens (``ignore_eos=True``, as vLLM's benchmarks do); when
    nothing is queued or running, the clock first idles until the next arrival.
    :meth:`Engine.run` steps it to the end; the dashboard steps it on every click.

    Every request is checked when the replay is made, before any runs (:func:`minipaged.validation.check_workload`).

    Args:
        engine: the engine to drive; arrival times count from its clock's time now.
        workload: the requests, with arrival times relative to the start of the replay.
        seed: the seed of the prompts' token ids (request ``i`` gets ``prompt_token_ids(i, ..., seed)``).
        prompts: None (seeded random prompts), or request ``i``'s prompt token ids as ``prompts[i]``,
            ``workload[i].num_prompt_tokens`` of them (a workload whose prompts share prefixes, say).
    """

    def __init__(self, engine, workload: list[RequestSpec], seed: int = 0,
                 prompts: list[list[int]] | None = None):  # fmt: skip
        check_workload(engine, workload, prompts)
        self.engine = engine
        self.seed = seed
        self.prompts = prompts
        self.arrivals = deque(sorted(enumerate(workload), key=lambda item: item[1].arrival_time))
        self.start = engine.clock.now()
        self.seqs: list[Sequence | None] = [None] * len(workload)  # in the workload's order, once added

    @property
    def allocator(self):
        """The engine's block pool: a view driving the replay subscribes to its events (``BlockMapView``)."""
        return self.engine.cache.allocator

    @property
    def done(self) -> bool:
        return not self.arrivals and not self.engine.has_unfinished()

    def _add_arrivals(self) -> None:
        vocab = self.engine.model.config.vocab_size
        while self.arrivals and self.start + self.arrivals[0][1].arrival_time <= self.engine.clock.now():
            i, r = self.arrivals.popleft()
            prompt, params = workload_request(i, r, vocab, self.seed, self.prompts)
            rid = self.engine.add_request(prompt, params, arrival_time=self.start + r.arrival_time)
            self.seqs[i] = self.engine.seqs[rid]

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

    def run(self, progress: bool = True) -> list[Sequence]:
        """Step to the end; the workload's sequences, in its order (finished, with their timings).

        Args:
            progress: show a progress bar of finished requests.
        """
        with tqdm(total=len(self.seqs), desc="requests", disable=not progress) as bar:
            while not self.done:
                self.step()
                bar.update(self.engine.metrics.history[-1].finished)
        return self.seqs


def check_workload(engine, workload: list, prompts: list[list[int]] | None = None) -> None:
    """Check every request of a workload before any runs: arrival time, prompt, and that the pool could hold it.

    Args:
        engine: the engine (its model's positions and vocabulary, its pool) the workload will run on.
        workload: the requests, :class:`~minipaged.workload.RequestSpec` s.
        prompts: None, or each request's prompt token ids (``workload[i].num_prompt_tokens`` of them).

    Raises:
        TypeError: an entry is not a RequestSpec, or a prompt holds a non-int.
        ValueError: a bad arrival time, a prompt of the wrong length or outside the vocabulary, or a
            request that the model's positions or the engine's pool could never hold.
    """
    for i, r in enumerate(workload):
        check_instance(r, f"workload[{i}]", RequestSpec, "a RequestSpec")
        check_real(r.arrival_time, f"workload[{i}].arrival_time", minimum=0)  # NaN would never arrive
        check_positions(engine.model.config, r.num_prompt_tokens, r.num_output_tokens, f"workload[{i}]'s prompt")
        check_fits_pool(engine.config, r.num_prompt_tokens, r.num_output_tokens, f"workload[{i}]")  # not mid-run
    if prompts is not None:
        if len(prompts) != len(workload):
            raise ValueError(f"prompts must hold one prompt per request: {len(workload)}, got {len(prompts)}")
        for i, (p, r) in enumerate(zip(prompts, workload)):
            check_prompt(engine.model.config, p, r.num_output_tokens, f"prompts[{i}]")
            if len(p) != r.num_prompt_tokens:
                raise ValueError(f"prompts[{i}] has {len(p)} tokens but workload[{i}].num_prompt_tokens is "
                                 f"{r.num_prompt_tokens}")
