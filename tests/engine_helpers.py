"""Engine test helpers shared by chapters 05, 06 and 08.

:func:`drive` runs requests through an engine as they arrive, with random aborts;
:func:`snapshot` is every piece of bookkeeping a failed step must leave as it was.
Stop tokens: :func:`with_eos` gives a model a checkpoint EOS, :func:`stop_params` draws stopping
rules that fire (stop ids taken from what the request generates without them),
:func:`reference` is contiguous generation under the same rules, and :func:`check_finished`
checks a finished sequence's ``finish_reason`` and ``stop_reason`` against its output.
"""

import copy
import dataclasses
import functools
import types
from collections import deque
from dataclasses import replace
from enum import Enum
from pathlib import Path

import nbformat
import torch
from hypothesis import strategies as st

from minipaged.engine import Engine
from minipaged.generate import generate_contiguous
from minipaged.sequence import SamplingParams, SequenceStatus


def snapshot(engine: Engine) -> dict:
    """Every piece of bookkeeping a step may change, as plain values."""
    alloc, sched = engine.cache.allocator, engine.scheduler
    seqs = sorted(engine.seqs.values(), key=lambda s: str(s.seq_id))
    return {
        "free_queue": alloc.free_queue() if hasattr(alloc, "free_queue") else list(alloc.free_block_ids),
        "refcounts": list(alloc._refcounts),  # the seam's name (a learner's allocator has no .refcounts)
        "keys": [alloc.block_key(b) for b in range(alloc.num_blocks)] if hasattr(alloc, "block_key") else None,
        "waiting": [s.seq_id for s in sched.waiting],
        "running": [s.seq_id for s in sched.running],
        "seqs": [(s.seq_id, s.status, s.num_computed_tokens, list(s.token_ids), list(s.token_times), s.finish_time,
                  s.finish_reason, s.stop_reason, s.num_preemptions, [c.seq_id for c in s.pending_forks],
                  None if s.block_table is None else (list(s.block_table.blocks), s.block_table.num_tokens))
                 for s in seqs],
        "swap_space": sorted(map(str, engine.swap_space)),
        "clock": engine.clock.now(),
        "metrics": {k: v for k, v in vars(engine.metrics).items()
                    if k not in ("history", "_allocator") and not callable(v)},
        "history": list(engine.metrics.history),
    }


_LEAVES = (torch.Tensor, torch.nn.Module, types.FunctionType, types.MethodType, types.BuiltinFunctionType,
           types.ModuleType, type, functools.partial)  # fmt: skip


def object_graph(root) -> list:
    """Everything reachable from ``root`` as plain values, to compare before and after a failed step.

    Each object becomes its type and contents, in the order a breadth-first walk meets it; an object
    met again is its first index. Tensors, modules and functions are leaves, compared by identity
    (the K/V pools are :meth:`~minipaged.rollback.StepUndo.protect_kv`'s). This is the generic walk
    the explicit step state (``_step_containers``) replaced: a field a class forgets to name shows
    up here as a difference.
    """
    index, order = {}, [root]

    def ref(x):
        if isinstance(x, (int, float, str, bytes, bool, type(None), Enum, torch.dtype, torch.device)):
            return x
        if isinstance(x, _LEAVES):
            return ("leaf", id(x))
        if dataclasses.is_dataclass(x) and x.__dataclass_params__.frozen:
            return ("frozen", repr(x))
        if id(x) not in index:
            index[id(x)] = len(order)
            order.append(x)
        return ("object", index[id(x)])

    index[id(root)], described, i = 0, [], 0
    while i < len(order):
        obj, i = order[i], i + 1
        if isinstance(obj, (list, tuple, deque)):
            described.append((type(obj).__name__, [ref(x) for x in obj]))
        elif isinstance(obj, dict):
            described.append((type(obj).__name__, [(ref(k), ref(v)) for k, v in obj.items()]))
        elif isinstance(obj, (set, frozenset)):
            described.append((type(obj).__name__, sorted(repr(ref(x)) for x in obj)))
        elif isinstance(obj, bytearray):
            described.append(bytes(obj))
        elif isinstance(obj, torch.Generator):
            described.append(obj.get_state().tolist())
        elif hasattr(obj, "__dict__"):
            described.append((type(obj).__name__, [(k, ref(v)) for k, v in sorted(vars(obj).items())]))
        else:
            described.append(("leaf", id(obj)))
    return described


SOLUTIONS = Path(__file__).resolve().parent.parent / "solutions"


def solution_namespace(notebook: str, cell_ids: tuple[str, ...]) -> dict:
    """What the given code cells of a solution notebook define (the model solution's classes), run in order."""
    namespace, cells = {}, {c.id: c for c in nbformat.read(SOLUTIONS / notebook, as_version=4).cells}
    for cell_id in cell_ids:
        exec(compile(cells[cell_id].source, f"{notebook} cell {cell_id}", "exec"), namespace)
    return namespace


def drive(engine: Engine, requests: list, rng, add, abort_prob: float = 0.0, step=None, arrivals_per_step: int = 2):
    """Add requests a few per step, abort some at random, step until done; return the aborted request ids.

    Args:
        engine: the engine under test.
        requests: whatever ``add`` takes, one item per request.
        rng: a ``random.Random``, which picks the aborts.
        add: ``add(engine, i, request)`` queues request ``i``.
        abort_prob: the chance, per step, of aborting one unfinished request.
        step: what one step is (default ``engine.step``; a test may check state after it).
        arrivals_per_step: requests added before each step.
    """
    step = step or engine.step
    pending, aborted = list(enumerate(requests)), set()
    while pending or engine.has_unfinished():
        for _ in range(arrivals_per_step):
            if pending:
                add(engine, *pending.pop(0))
        live = list(dict.fromkeys(s.request_id for s in engine.seqs.values() if not s.is_finished))
        if live and rng.random() < abort_prob:
            rid = rng.choice(live)
            engine.abort(rid)
            aborted.add(rid)
        if engine.has_unfinished():
            step()
    return aborted


# ---- stop tokens ---------------------------------------------------------------------------------------------------


# Tokens the seed-0 tiny model (LlamaConfig() defaults) often produces: as its checkpoint EOS (the first;
# the others report their id, as a generation config's further EOS ids do in vLLM), requests end by themselves.
STOP_EOS = (186, 321, 492)


def with_eos(model, eos_token_id):
    """The same weights under a config whose checkpoint EOS is ``eos_token_id`` (an id or a tuple of ids)."""
    clone = copy.deepcopy(model)
    clone.config = replace(model.config, eos_token_id=eos_token_id)
    return clone


_REFERENCE: dict = {}


def reference(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """Contiguous greedy generation under ``params``' stopping rules (memoised)."""
    key = (id(model), tuple(prompt), params.max_tokens, tuple(params.stop_token_ids), params.ignore_eos,
           params.min_tokens)  # fmt: skip
    if key not in _REFERENCE:
        _REFERENCE[key] = generate_contiguous(model, prompt, params.max_tokens, stop_token_ids=params.stop_token_ids,
                                              ignore_eos=params.ignore_eos, min_tokens=params.min_tokens)  # fmt: skip
    return _REFERENCE[key]


def stop_params(pick, model, prompt: list[int], max_tokens: int, **extra) -> SamplingParams:
    """Draw stopping rules for a request that fire: stop ids among the tokens it makes without stopping.

    Args:
        pick: ``pick(lo, hi)`` draws an int in ``[lo, hi]`` (``random.Random.randint``, or :func:`hypothesis_pick`).
        model: the model (its EOS is part of the rules unless ``ignore_eos`` is drawn).
        prompt: the request's prompt.
        max_tokens: its ``max_tokens``.
        extra: more SamplingParams fields (``n``, ...).
    """
    free = reference(model, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    stops = tuple(free[pick(0, len(free) - 1)] for _ in range(pick(0, 2)))
    ignore_eos = pick(0, 3) == 0
    min_tokens = pick(1, max_tokens) if pick(0, 1) else 0
    return SamplingParams(max_tokens=max_tokens, stop_token_ids=stops, ignore_eos=ignore_eos, min_tokens=min_tokens,
                          **extra)  # fmt: skip


def hypothesis_pick(data):
    """:func:`stop_params`'s ``pick`` from hypothesis's ``st.data()``."""
    return lambda lo, hi: data.draw(st.integers(lo, hi))


def check_finished(seq) -> str:
    """A finished sequence's reasons agree with its output and rules, and its blocks are freed; returns its reason."""
    out, rules = seq.output_token_ids, seq.stop_rules
    stops = rules.stop_token_ids | {rules.eos_token_id}
    assert seq.status is SequenceStatus.FINISHED and seq.block_table is None, seq
    assert not stops & set(out[:-1]), f"{seq.seq_id!r} went on past a stop token: {out}"
    assert not set(rules.masked_token_ids) & set(out[: rules.min_tokens]), f"{seq.seq_id!r}: a stop before min_tokens"
    if out[-1] == rules.eos_token_id:
        assert (seq.finish_reason, seq.stop_reason) == ("stop", None), seq.seq_id
    elif out[-1] in rules.stop_token_ids:
        assert (seq.finish_reason, seq.stop_reason) == ("stop", out[-1]), seq.seq_id
    else:
        assert (seq.finish_reason, seq.stop_reason, len(out)) == ("length", None, rules.max_tokens), seq.seq_id
    return seq.finish_reason


def allocator_for(caching: bool, hash_fn=None):
    """The allocator class an engine test runs: chapter 06's prefix cache (``hash_fn`` if given), or the plain pool."""
    from functools import partial

    from minipaged.blocks import BlockAllocator
    from minipaged.prefix_cache import PrefixCachingAllocator

    if not caching:
        return BlockAllocator
    return PrefixCachingAllocator if hash_fn is None else partial(PrefixCachingAllocator, hash_fn=hash_fn)
