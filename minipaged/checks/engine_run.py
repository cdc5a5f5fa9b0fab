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
                   "n": 1, "cache_salt": None}, ...]}
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from functools import cache

import torch

from minipaged.checks import CheckFailed

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


class PackageMethodOff(RuntimeError):
    """The learner's code reached the package's version of a method the exercise asks them to write."""


@contextlib.contextmanager
def package_methods_off(cls: type, names: tuple[str, ...]):
    """While it lasts, ``cls.<name>`` raises :class:`PackageMethodOff` for each of ``names``.

    A learner's class that inherits one of them, or calls it with ``super()``, then fails with a message
    that names it, instead of passing on the package's code.

    Args:
        cls: the package's class the learner's subclasses.
        names: the methods the exercise asks the learner to write.
    """
    originals = {name: cls.__dict__[name] for name in names}

    def refuse(name):
        def refused(self, *args, **kwargs):
            raise PackageMethodOff(f"the package's {cls.__name__}.{name} is switched off in this check: write your "
                                   "own (no super() call)")

        return refused

    for name in names:
        setattr(cls, name, refuse(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(cls, name, original)


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
