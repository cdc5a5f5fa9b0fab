"""Issue 11 item 1: a step is all or nothing.

A fault is injected at each stage of :meth:`Engine.step` (schedule, swap, forward,
sample, postprocess, metrics), some after the stage has already changed part of the
state. After each: the exception propagates, the bookkeeping equals what it was
before the step, the next steps work, and greedy outputs equal contiguous generation.
Issue 25 adds the stop handling's stages: the stop check, the ``min_tokens`` mask, the
``finish_reason`` bookkeeping as a request stops, and the release of a finished request's blocks.
"""

import functools
import os
import random

import engine_helpers
import pytest
import torch
from engine_helpers import snapshot
from test_02_checks import MyAllocator, MyBlockTable  # a correct allocator and table that differ from the package
from test_05_checks import Model  # a correct scheduling step that differs from the package's
from test_06_checks import OtherCowTable, OtherPrefixCache  # a correct prefix cache and copy-on-write, the same

import minipaged.engine as engine_module
import minipaged.swap as swap
from minipaged.blocks import BlockAllocator
from minipaged.engine import Engine
from minipaged.generate import generate_contiguous
from minipaged.model import LlamaConfig, LlamaForCausalLM
from minipaged.prefix_cache import PrefixCachingAllocator
from minipaged.scheduler import EngineConfig, Scheduler
from minipaged.sequence import SamplingParams, Sequence
from minipaged.speculative import NgramSpeculator
from minipaged.stopping import StopRules

pytestmark = pytest.mark.ch05


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return LlamaForCausalLM(LlamaConfig(), seed=0).eval()


class Boom(Exception):
    pass


def fault_points(engine, monkeypatch, stage, after_calls):
    """Patch ``stage`` so that its call number ``after_calls`` raises (Boom, or KeyboardInterrupt in the forward)."""
    calls = {"n": 0}

    def trip():
        calls["n"] += 1
        if calls["n"] == after_calls:
            raise KeyboardInterrupt if stage == "forward" else Boom(stage)

    def wrap(obj, name):
        original = getattr(obj, name)

        def patched(*args, **kwargs):
            if stage in ("postprocess_midway", "schedule_midway", "metrics"):  # the record is made, then the fault
                result = original(*args, **kwargs)
                trip()  # the state already changed part way
                return result
            trip()
            return original(*args, **kwargs)

        monkeypatch.setattr(obj, name, patched)

    if stage == "schedule":
        wrap(engine.scheduler, "schedule")
    elif stage == "schedule_midway":  # after some tables already grew
        wrap(engine.scheduler.block_table, "append_tokens")
    elif stage == "swap" and engine.config.preemption_mode == "swap":  # inside the K/V copies
        wrap(swap, "swap_in")
        wrap(swap, "swap_out")
    elif stage == "swap":  # the step's K/V moves (none but copy-on-write in recompute mode)
        wrap(engine.cache, "move_kv")
    elif stage == "forward":
        wrap(engine.model, "forward")
    elif stage == "sample":
        wrap(engine_module, "sample")
    elif stage == "postprocess_midway":  # after one sequence already took its token
        wrap(Sequence, "append_token")
    elif stage == "metrics":
        wrap(engine.metrics, "record_step")


def step_with_faults(engine, rng, monkeypatch, inject, probability: float, stage: str) -> int:
    """Step until done, ``inject(monkeypatch_context)`` a fault before a step with ``probability``; returns the faults.

    After each fault (Boom, or KeyboardInterrupt) the bookkeeping must equal its snapshot from before the step,
    and so must everything the engine reaches (:func:`engine_helpers.object_graph`).
    """
    faults = 0
    for step in range(400):
        if not engine.has_unfinished():
            break
        before, graph = snapshot(engine), engine_helpers.object_graph(engine)
        with monkeypatch.context() as m:
            if rng.random() < probability:  # a fault in some steps, so that the run still ends
                inject(m)
            try:
                engine.step()
                continue
            except (Boom, KeyboardInterrupt):
                faults += 1
                after = snapshot(engine)
                for key in before:
                    assert after[key] == before[key], (stage, step, key)
        after_graph = engine_helpers.object_graph(engine)  # once the fault's patch is gone
        assert [(x, y) for x, y in zip(graph, after_graph) if x != y] == [] and len(after_graph) == len(graph), stage
    return faults


SEED = int(os.environ.get("FAULT_SEED", 0))
MANY_CALLS = ("schedule_midway", "postprocess_midway")  # called once per sequence: fault at the 1st, 2nd or 3rd
STAGES = ["schedule", "schedule_midway", "swap", "forward", "sample", "postprocess_midway", "metrics"]


def run_with_faults(model, stage, mode, monkeypatch, allocator, **seams):
    """Six requests with shared prompt starts, a small pool, a fault at ``stage`` in some steps; checks the run."""
    rng = random.Random(f"{stage}-{mode}-{hasattr(allocator, 'match_prefix')}-{SEED}")
    # A small pool: preemption (and so swaps) happens; shared prompt starts make prefix hits.
    config = EngineConfig(num_blocks=14, block_size=4, max_num_seqs=6, max_num_batched_tokens=16, keep_finished=True,
                          preemption_mode=mode)
    engine = Engine(model, config, allocator=allocator, **seams)
    base = [rng.randrange(512) for _ in range(8)]
    prompts = [base[: rng.randint(2, 8)] + [rng.randrange(512) for _ in range(rng.randint(1, 10))] for _ in range(6)]
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=rng.randint(3, 9)))

    def inject(m):
        fault_points(engine, m, stage, after_calls=rng.randint(1, 3) if stage in MANY_CALLS else 1)

    faults = step_with_faults(engine, rng, monkeypatch, inject, 0.4, stage)
    assert not engine.has_unfinished()
    assert faults > 0
    outputs = [engine.seqs[i].output_token_ids for i in range(len(prompts))]
    for p, rid in zip(prompts, range(len(prompts))):
        n = engine.seqs[rid].sampling_params.max_tokens
        assert outputs[rid] == generate_contiguous(model, p, n), (stage, rid)
    assert engine.cache.allocator.num_used == 0


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("stage", STAGES)
def test_a_fault_at_any_stage_leaves_the_engine_as_before_the_step(model, stage, mode, prefix_caching, monkeypatch):
    run_with_faults(model, stage, mode, monkeypatch, engine_helpers.allocator_for(prefix_caching))


@functools.cache  # each notebook is read and run once (the speculator is stateless, so one serves every test)
def _model_solutions() -> dict:
    """Each exercise's model solution (its solution notebook's classes), as the engine seams it plugs into."""
    return {
        "02": {"allocator": MyAllocator, "block_table": MyBlockTable},
        "05": {"allocator": BlockAllocator, "scheduler": Model},
        "06": {"allocator": OtherPrefixCache, "block_table": OtherCowTable},
        "08": {"allocator": PrefixCachingAllocator,  # exercise 08's model answer is the package's own (its holes)
               "speculator": NgramSpeculator({"method": "ngram", "num_speculative_tokens": 2})},
    }  # fmt: skip


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("exercise", ["02", "05", "06", "08"])
def test_a_fault_leaves_an_engine_on_the_model_solutions_as_before_the_step(model, exercise, stage, mode, monkeypatch):
    """The explicit step state covers a learner's piece: the base class it extends names the state to put back."""
    run_with_faults(model, stage, mode, monkeypatch, **_model_solutions()[exercise])


def test_keyboard_interrupt_in_the_forward_pass_then_the_engine_goes_on(model, monkeypatch):
    engine = Engine(model, EngineConfig(num_blocks=16, block_size=4, keep_finished=True))
    prompts = [[5, 6, 7, 8, 9], [1, 2, 3]]
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=6))
    engine.step()
    before = snapshot(engine)
    events = []
    engine.cache.allocator.subscribe(events.append)

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine.model, "forward", interrupt)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert snapshot(engine) == before
    assert events[-1].kind == "rollback"
    monkeypatch.undo()
    while engine.has_unfinished():
        engine.step()
    expected = [generate_contiguous(model, p, 6) for p in prompts]
    assert [engine.seqs[i].output_token_ids for i in range(2)] == expected


def _stop_fault(owner, name: str, when: str):
    """A replacement for ``owner.name`` that raises Boom: before the call, after it, or only when it stops a request."""
    original = getattr(owner, name)

    def patched(*args, **kwargs):
        if when == "before":
            raise Boom(name)
        result = original(*args, **kwargs)
        if when == "after" or result:  # "on_stop": only the call that ends a request
            raise Boom(name)
        return result

    return patched


# The stop handling's stages (issue 25): (object, attribute, when the fault strikes).
STOP_STAGES = {
    "check": (StopRules, "check", "before"),
    "check_on_stop": (StopRules, "check", "on_stop"),  # a request is stopping: its reasons are set next
    "finish_reason": (Sequence, "append_token", "on_stop"),  # its finish_reason and stop_reason already set
    "mask": (StopRules, "mask", "after"),  # min_tokens: one request's rows masked, the others' not yet
    "mask_stop_tokens": (engine_module, "mask_stop_tokens", "after"),
    "finish": (Scheduler, "_release", "after"),  # a finished (or preempted) request's blocks already freed
}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("stage", sorted(STOP_STAGES))
def test_a_fault_in_the_stop_handling_leaves_the_engine_as_before_the_step(model, stage, mode, monkeypatch):
    rng = random.Random(f"stop-{stage}-{mode}-{SEED}")
    eos_model = engine_helpers.with_eos(model, engine_helpers.STOP_EOS)
    config = EngineConfig(num_blocks=14, block_size=4, max_num_seqs=6, max_num_batched_tokens=16, keep_finished=True,
                          preemption_mode=mode)  # fmt: skip
    engine = Engine(eos_model, config, allocator=PrefixCachingAllocator)  # a finished request's blocks stay cached
    requests = []
    for _ in range(6):
        prompt = [rng.randrange(512) for _ in range(rng.randint(2, 12))]
        params = engine_helpers.stop_params(rng.randint, eos_model, prompt, rng.randint(3, 9))
        requests.append((engine.add_request(prompt, params), prompt, params))
    owner, name, when = STOP_STAGES[stage]
    patched = _stop_fault(owner, name, when)
    faults = step_with_faults(engine, rng, monkeypatch, lambda m: m.setattr(owner, name, patched), 0.5, stage)
    assert not engine.has_unfinished() and faults > 0
    for rid, prompt, params in requests:
        seq = engine.seqs[rid]
        assert seq.output_token_ids == engine_helpers.reference(eos_model, prompt, params), (stage, rid)
        engine_helpers.check_finished(seq)
    assert {engine.seqs[rid].finish_reason for rid, _, _ in requests} == {"stop", "length"}
    assert engine.cache.allocator.num_used == 0
