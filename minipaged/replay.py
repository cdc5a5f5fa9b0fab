"""A workload replayed through an engine: requests arrive on the engine's clock, one engine step at a time.

:meth:`minipaged.engine.Engine.run` steps a :class:`Replay` to the end; chapter 05's dashboard
steps one on every click, and chapter 08's disaggregated engine replays through the same class.
"""

from __future__ import annotations

from collections import deque

from tqdm.auto import tqdm

from minipaged.scheduler import check_fits_pool
from minipaged.sequence import SamplingParams, Sequence
from minipaged.validation import check_positions, check_prompt, check_real
from minipaged.workload import RequestSpec, prompt_token_ids


def check_workload(engine, workload: list[RequestSpec], prompts: list[list[int]] | None = None) -> None:
    """Check every request of a workload before any runs: arrival time, prompt, and that the pool could hold it.

    Args:
        engine: the engine (its model's positions and vocabulary, its pool) the workload will run on.
        workload: the requests.
        prompts: None, or each request's prompt token ids (``workload[i].num_prompt_tokens`` of them).

    Raises:
        TypeError: an entry is not a RequestSpec, or a prompt holds a non-int.
        ValueError: a bad arrival time, a prompt of the wrong length or outside the vocabulary, or a
            request that the model's positions or the engine's pool could never hold.
    """
    for i, r in enumerate(workload):
        if not isinstance(r, RequestSpec):
            raise TypeError(f"workload[{i}] must be a RequestSpec, got {type(r).__name__}")
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


class Replay:
    """A workload replayed through an engine, one engine step per :meth:`step`.

    Before each step, the requests whose arrival time has come are added, with
    the seeded prompts of :func:`minipaged.workload.prompt_token_ids`, each asking for exactly
    its ``num_output_tokens`` tokens (``ignore_eos=True``, as vLLM's benchmarks do); when
    nothing is queued or running, the clock first idles until the next arrival.
    :meth:`Engine.run` steps it to the end; the dashboard steps it on every click.

    Every request is checked when the replay is made, before any runs (:func:`check_workload`).

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
        """The engine's block pool (views subscribe to its events)."""
        return self.engine.cache.allocator

    @property
    def done(self) -> bool:
        return not self.arrivals and not self.engine.has_unfinished()

    def _add_arrivals(self) -> None:
        vocab = self.engine.model.config.vocab_size
        while self.arrivals and self.start + self.arrivals[0][1].arrival_time <= self.engine.clock.now():
            i, r = self.arrivals.popleft()
            prompt = self.prompts[i] if self.prompts else prompt_token_ids(i, r.num_prompt_tokens, vocab, self.seed)
            rid = self.engine.add_request(prompt, SamplingParams(max_tokens=r.num_output_tokens, ignore_eos=True),
                                          arrival_time=self.start + r.arrival_time)  # exactly that many tokens
            self.seqs[i] = self.engine.seqs[rid]

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
