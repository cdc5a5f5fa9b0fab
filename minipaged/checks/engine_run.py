"""The real engine on a check's workload, with the learner's piece in it, recorded as plain data.

A build exercise's probe calls :func:`run_engine` with the learner's piece passed through one of
:class:`~minipaged.engine.Engine`'s seams (``allocator=``, ``block_table=``, ``scheduler=``,
``speculator=``, or an attention ``backend=``). The reference side runs the same case with the
package's own piece, and the judge compares the two records: the tokens of every request, and one
observation per step (whatever the chapter's bookkeeping is: block ids, a schedule, keys), with
:func:`first_divergence` naming the first step where they part.

The model is :func:`check_model`, a small random Llama in float64: its greedy tokens do not depend
on the CPU, the thread count or the order of a sum, so a transcript recorded on the instructor's
machine (a handout's ``expected.json``) holds on a learner's.

A case is plain data::

    {"config": {"num_blocks": 12, "block_size": 4, ...},    # EngineConfig fields
     "requests": [{"id": "r0", "prompt": [5, 9, 2], "max_tokens": 6,
                   "arrive": 0,          # the step before which it is added
                   "abort": None,        # the step before which it is aborted (None: never)
                   "n": 1, "cache_salt": None}, ...],
     "script": {"0": [["start", "r0", 0], ["add", "r0", 3]], ...}}   # optional: see with_script

A check of an exercise that comes before the scheduler's (exercise 05) cannot run the learner's
scheduler: in a learner's package it is not built yet. Its cases carry the reference run's schedule
(:func:`with_script`), and :class:`ScriptedScheduler` makes those decisions again, call for call, so
that the learner's allocator, table or attention meet exactly the calls the package's met.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from functools import cache

import torch

from minipaged.checks import CheckFailed
from minipaged.scheduler import Scheduler

MODEL_SEED = 0
VOCAB_SIZE = 64
CHECK_BACKEND = "exercise-check"  # the registry name a learner's backend runs under
MAX_STEPS = 400  # a run that has not finished by then is cut off (a learner's piece that never finishes)


@cache
def check_model():
    """The checks' model: 2 layers, 4 query heads on 2 KV heads of 8 dims, random weights, float64."""
    from minipaged.model import LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(MODEL_SEED)
        config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8)
        model = LlamaForCausalLM(config).to(torch.float64).eval()
    # Random weights give near-uniform logits; a larger spread makes every greedy choice a clear one.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def seeded_requests(rng: random.Random, num_requests: int, prompt_len: tuple[int, int], max_tokens: tuple[int, int],
                    arrive_within: int = 0, abort_prob: float = 0.0, n: int = 1) -> list[dict]:
    """Requests for a case, drawn from ``rng``: random prompts, lengths and arrival steps.

    Args:
        rng: the generator (a seed the grader draws, for hidden cases).
        num_requests: how many.
        prompt_len: the prompt lengths' range, both ends included.
        max_tokens: the output lengths' range, both ends included.
        arrive_within: arrival steps are drawn from ``0 .. arrive_within`` (0: all at once).
        abort_prob: the chance that a request is aborted a few steps after it arrives.
        n: samples per request.
    """
    requests = []
    for i in range(num_requests):
        arrive = rng.randint(0, arrive_within)
        abort = arrive + rng.randint(1, 6) if rng.random() < abort_prob else None
        requests.append({"id": f"r{i}", "prompt": [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(*prompt_len))],
                         "max_tokens": rng.randint(*max_tokens), "arrive": arrive, "abort": abort, "n": n,
                         "cache_salt": None})
    return requests


@contextlib.contextmanager
def engine_with(model, config: dict, backend=None, **seams):
    """An :class:`~minipaged.engine.Engine` on ``model`` with ``config``'s fields, ``backend`` and ``seams`` in it.

    Inside the block a copy of ``backend`` is registered as :data:`CHECK_BACKEND` (under a name of its
    own, so that no registered backend is replaced); it is unregistered when the block ends.

    Args:
        model: the model to serve.
        config: :class:`~minipaged.scheduler.EngineConfig` fields.
        backend: an :class:`~minipaged.attention.AttentionBackend`, or None for the config's own.
        **seams: the engine's seams (``allocator``, ``block_table``, ``scheduler``, ``speculator``).
    """
    from minipaged import attention
    from minipaged.engine import Engine
    from minipaged.scheduler import EngineConfig

    if backend is not None:
        attention.register_backend(CHECK_BACKEND, dataclasses.replace(backend, name=CHECK_BACKEND), replace=True)
        config = dict(config, backend=CHECK_BACKEND)
    try:
        yield Engine(model, EngineConfig(**config), **seams)
    finally:
        attention._REGISTRY.pop(CHECK_BACKEND, None)  # the registry as it was (it has no public unregister)


def run_engine(case: dict, *, observe=None, backend=None, **seams) -> dict:
    """Serve ``case``'s requests on :func:`check_model`, greedily, and record what happened as plain data.

    Args:
        case: ``{"config": EngineConfig fields, "requests": [...]}`` (the module docstring's form).
        observe: ``observe(engine, step_output) -> plain data``, called after every step; its values
            make the record's ``"steps"`` (None: no per-step record).
        backend: an :class:`~minipaged.attention.AttentionBackend` to run the forward pass with (it is
            registered as :data:`CHECK_BACKEND`), or None for the config's own.
        **seams: :class:`~minipaged.engine.Engine`'s seams (``allocator``, ``block_table``, ``scheduler``,
            ``speculator``): the learner's piece.

    Returns:
        ``{"tokens": {str(seq_id): [generated ids]}, "steps": [observations], "finished": bool}``;
        ``finished`` is False when the run was cut off after :data:`MAX_STEPS` steps.
    """
    from minipaged.sequence import SamplingParams

    requests = sorted(case["requests"], key=lambda r: r["arrive"])
    steps, step = [], 0
    config = dict(case["config"], keep_finished=True)
    if "script" in case and "scheduler" not in seams:
        seams["scheduler"] = type("ScriptedScheduler", (ScriptedScheduler,), {"script": case["script"]})
    with engine_with(check_model(), config, backend, **seams) as engine, torch.no_grad(), one_thread():
        while (requests or engine.has_unfinished()) and step < MAX_STEPS:
            for r in case["requests"]:
                samples = engine.requests.get(r["id"], [])
                if r.get("abort") == step and not all(s.is_finished for s in samples):
                    engine.abort(r["id"])  # it has arrived and has not finished
            while requests and requests[0]["arrive"] <= step:
                r = requests.pop(0)
                params = SamplingParams(max_tokens=r["max_tokens"], n=r.get("n", 1), ignore_eos=True)
                engine.add_request(list(r["prompt"]), params, request_id=r["id"], cache_salt=r.get("cache_salt"))
            if engine.has_unfinished():
                out = engine.step()
                if observe is not None:
                    steps.append(observe(engine, out))
            step += 1
        finished = not (requests or engine.has_unfinished())
    tokens = {str(seq_id): list(seq.output_token_ids) for seq_id, seq in engine.seqs.items()}
    return {"tokens": tokens, "steps": steps, "finished": finished}


class ScriptedScheduler(Scheduler):
    """A scheduler that decides nothing: each step it makes the calls of :attr:`script`'s entry, in order.

    ``["start", seq_id, start]`` takes a waiting sequence off the queue and starts it at ``start``;
    ``["add", seq_id, tokens]`` plans that many of its tokens (its table takes their blocks);
    ``["preempt", seq_id]`` preempts it (a sequence planned earlier in the step is taken back first).
    """

    script: dict = {}

    def _schedule_running(self, out, budget):
        step = getattr(self, "_script_step", 0)
        self._script_step = step + 1
        replay(self, self.script.get(str(step), []), out)
        return budget

    def _admit(self, out, budget):
        return None  # the script's "start" entries are its admissions


def replay(scheduler, entries: list, out) -> None:
    """Make one step's script ``entries`` (:class:`ScriptedScheduler`'s form) on ``scheduler``, into its plan ``out``.

    Args:
        scheduler: the engine's scheduler (its queues, ``_start`` and ``_preempt`` are used).
        entries: ``[op, seq_id, *arg]`` lists, in the order the model answer's run made them.
        out: the step's :class:`~minipaged.scheduler.SchedulerOutput`.
    """
    for op, seq_id, *arg in entries:
        seq = next((s for s in [*scheduler.running, *scheduler.waiting] if str(s.seq_id) == seq_id), None)
        if seq is None:
            raise RuntimeError(f"{seq_id}, which the model answer's run meets here ({op}), is neither running nor "
                               "waiting")
        if op == "start":
            scheduler.waiting.remove(seq)
            scheduler._start(seq, None, arg[0], out)
        elif op == "add":
            out.add(seq, arg[0], seq.block_table.append_tokens(arg[0]))
        else:
            if seq in out.seqs:
                out.take_back(seq)
            scheduler._preempt(seq, out)


def with_script(case: dict) -> dict:
    """``case`` with ``"script"``: the package's scheduler's calls on it, step by step (the instructor's side).

    Args:
        case: a case without a script; the package's own pieces run it.
    """
    from minipaged.blocks import BlockTable

    script, step = {}, [0]

    def log(*entry):
        script.setdefault(str(step[0]), []).append(list(entry))

    class Recording(Scheduler):
        def schedule(self):
            out = super().schedule()
            step[0] += 1
            return out

        def _start(self, seq, match, start, out):
            log("start", str(seq.seq_id), start)
            return super()._start(seq, match, start, out)

        def _preempt(self, seq, out):
            log("preempt", str(seq.seq_id))
            return super()._preempt(seq, out)

    class Table(BlockTable):
        def append_tokens(self, num_tokens):
            log("add", str(self.seq_id), num_tokens)
            return super().append_tokens(num_tokens)

    run_engine(case, scheduler=Recording, block_table=Table)
    return dict(case, script=script)


@contextlib.contextmanager
def one_thread():
    """Run PyTorch on one thread inside the block: tiny matmuls are fastest so, above all on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def first_divergence(got: list, want: list, describe=None) -> None:
    """Raise :class:`CheckFailed` naming the first step where the per-step records ``got`` and ``want`` differ.

    Args:
        got: the learner's run, one observation per step.
        want: the reference's run on the same case.
        describe: ``describe(step, got_obs, want_obs) -> (message, hint)`` for that step (default: both shown).
    """
    if type(got) is not list:
        raise CheckFailed("the run's per-step record is missing")
    for step, (g, w) in enumerate(zip(got, want)):
        if g != w:
            message, hint = describe(step, g, w) if describe else (f"got {g!r}, expected {w!r}", "")
            raise CheckFailed(f"step {step}: {message}", hint)
    if len(got) != len(want):
        more = "more" if len(got) > len(want) else "fewer"
        raise CheckFailed(f"the run took {len(got)} steps, {more} than the reference's {len(want)}; the first "
                          f"{min(len(got), len(want))} agree")


def first_token_divergence(got: dict, want: dict) -> None:
    """Raise :class:`CheckFailed` naming the first request and position whose greedy token differs.

    Args:
        got: the learner's run's ``"tokens"`` (``{seq_id: [ids]}``).
        want: the reference's.
    """
    if type(got) is not dict:
        raise CheckFailed("the run's tokens are missing")
    for seq_id, right in want.items():
        mine = got.get(seq_id)
        if mine is None:
            raise CheckFailed(f"sequence {seq_id} produced no tokens (expected {len(right)})")
        for i, (a, b) in enumerate(zip(mine, right)):
            if a != b:
                raise CheckFailed(f"sequence {seq_id}: generated token {i} is {a}, expected {b} (the tokens before it "
                                  "agree)")
        if len(mine) != len(right):
            raise CheckFailed(f"sequence {seq_id} generated {len(mine)} tokens, expected {len(right)}")
    extra = sorted(set(got) - set(want))
    if extra:
        raise CheckFailed(f"sequences {extra} exist in your run but not in the reference's")
