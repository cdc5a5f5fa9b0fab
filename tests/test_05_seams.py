"""The engine's seams: a learner's class with the documented interface drops in, and the whole still runs.

Each seam is one constructor argument (allocator, block table, scheduler, speculator) or one registry
name (the scheduling policy, the attention backend, whose toy is in test_03_backends.py). A toy policy
registered from this file alone changes the admission order; drop-in subclasses are called, and the
tokens stay those of contiguous generation. A class's own state is put back after a failed step once it
names it (``_step_containers``). What a seam returns is checked where the engine receives it: a wrong
kind or size is an error that names the seam, and the step that met it is undone.
"""

import subprocess
import sys
from collections import deque

import engine_helpers
import pytest
import torch

from minipaged import attention
from minipaged.attention import (
    AttentionBackend,
    get_backend,
    paged_attention,
    paged_prefill_attention,
    register_backend,
)
from minipaged.blocks import BlockAllocator, BlockTable
from minipaged.engine import Engine, NonFiniteLogits
from minipaged.generate import generate_contiguous
from minipaged.model import LlamaForCausalLM
from minipaged.request_queue import SCHEDULING_POLICIES, FCFSQueue, register_policy
from minipaged.scheduler import EngineConfig, Scheduler
from minipaged.sequence import SamplingParams
from minipaged.speculative import NgramSpeculator
from minipaged.testing import make_paged_case

pytestmark = pytest.mark.ch05

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [1, 2], [3, 4, 5, 6], [9, 9, 9, 9, 9, 9, 9, 9, 9, 9]]


@pytest.fixture(scope="module")
def model():
    return LlamaForCausalLM(seed=0).eval()


class LongestPromptFirst(FCFSQueue):
    """A toy policy: the longest waiting prompt first (preempted ones still at the front)."""

    def append(self, seq):
        n = seq.num_prompt_tokens
        shorter = (i for i, s in enumerate(self) if s.num_preemptions == 0 and s.num_prompt_tokens < n)
        i = next(shorter, len(self))
        self.insert(i, seq)


@pytest.fixture
def toy_policy(monkeypatch):
    monkeypatch.setitem(SCHEDULING_POLICIES, "longest_first_probe", None)  # restored afterwards, whatever happens
    del SCHEDULING_POLICIES["longest_first_probe"]
    register_policy("longest_first_probe", LongestPromptFirst)
    return "longest_first_probe"


def test_a_policy_registered_from_one_file_orders_admission_and_keeps_the_tokens(model, toy_policy):
    assert LongestPromptFirst.__module__ == __name__  # the whole policy lives in this file: one file, one call
    engine = Engine(model, EngineConfig(num_blocks=32, block_size=4, max_num_seqs=1, scheduling_policy=toy_policy,
                                        keep_finished=True))  # fmt: skip
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, SamplingParams(max_tokens=3), request_id=i)
    order = []
    while engine.has_unfinished():
        order += engine.step().admitted
    assert order == [3, 0, 2, 1]  # by prompt length, longest first: one seat, so one at a time
    for i, p in enumerate(PROMPTS):
        assert engine.seqs[i].output_token_ids == generate_contiguous(model, p, 3)


def test_register_policy_refuses_a_taken_name_and_a_class_without_a_victim():
    with pytest.raises(ValueError, match="already registered"):
        register_policy("fcfs", FCFSQueue)
    with pytest.raises(TypeError, match="victim"):
        register_policy("no_victim_probe", deque)
    with pytest.raises(TypeError, match="name must be a str"):
        register_policy(3, FCFSQueue)
    assert "no_victim_probe" not in SCHEDULING_POLICIES


class CountingAllocator(BlockAllocator):
    calls = 0

    def allocate(self, seq_id=None):
        CountingAllocator.calls += 1
        return super().allocate(seq_id)


class CountingTable(BlockTable):
    appends = 0

    def append_tokens(self, num_tokens):
        CountingTable.appends += 1
        return super().append_tokens(num_tokens)


class CountingScheduler(Scheduler):
    plans = 0

    def schedule(self):
        CountingScheduler.plans += 1
        return super().schedule()


class CountingSpeculator(NgramSpeculator):
    rollbacks = 0

    def rollback(self, table, num_computed_tokens, num_draft_tokens, num_accepted_tokens):
        CountingSpeculator.rollbacks += 1
        return super().rollback(table, num_computed_tokens, num_draft_tokens, num_accepted_tokens)


def test_learner_style_parts_drop_in_through_the_constructor_and_are_the_ones_called(model):
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 4, 5, 4, 5]]  # 40 outputs each: some tokens recur, drafts follow
    engine = Engine(model, EngineConfig(num_blocks=48, block_size=4), allocator=CountingAllocator,
                    block_table=CountingTable, scheduler=CountingScheduler,
                    speculator=CountingSpeculator({"num_speculative_tokens": 2, "prompt_lookup_min": 1}))  # fmt: skip
    out = engine.generate(prompts, SamplingParams(max_tokens=40))
    assert out == [generate_contiguous(model, p, 40) for p in prompts]
    assert type(engine.cache.allocator) is CountingAllocator and type(engine.scheduler) is CountingScheduler
    assert CountingAllocator.calls > 0 and CountingTable.appends > 0 and CountingScheduler.plans > 0
    assert CountingSpeculator.rollbacks > 0 and engine.speculator.stats.num_draft_tokens > 0


@pytest.mark.parametrize("name", ["allocator", "block_table", "scheduler"])
def test_a_seam_that_is_not_callable_is_a_type_error_naming_it(model, name):
    with pytest.raises(TypeError, match=f"{name} must be a class"):
        Engine(model, **{name: 1})


class Annotating(Scheduler):
    """A scheduler with bookkeeping of its own, a dict of sets, named for the rollback in one line."""

    _step_containers = ("seen",)

    def __init__(self, *args):
        super().__init__(*args)
        self.seen: dict[object, set] = {}
        self.num_plans = 0

    def schedule(self):
        out = super().schedule()
        self.num_plans += 1
        for seq in out.seqs:
            self.seen.setdefault(seq.seq_id, set()).add(seq.num_computed_tokens)
        return out


def test_a_failed_step_puts_back_the_state_a_seam_names(model, monkeypatch):
    engine = Engine(model, EngineConfig(num_blocks=24, block_size=4), scheduler=Annotating)
    for p in PROMPTS[:2]:
        engine.add_request(p, SamplingParams(max_tokens=6))
    engine.step()
    engine.step()
    seen, plans = {k: set(v) for k, v in engine.scheduler.seen.items()}, engine.scheduler.num_plans
    rng_state = torch.get_rng_state()

    def fail(*args, **kwargs):
        raise RuntimeError("the forward pass failed")

    monkeypatch.setattr(engine, "model", fail)
    with pytest.raises(RuntimeError, match="forward pass failed"):
        engine.step()
    assert engine.scheduler.seen == seen  # the sets the failed plan added to are put back, in place
    assert engine.scheduler.num_plans == plans  # a plain attribute needs no naming
    assert torch.equal(torch.get_rng_state(), rng_state)


def test_chapter_05s_engine_imports_no_later_chapter():
    code = ("import sys; from minipaged.engine import Engine; from minipaged.model import LlamaForCausalLM; "
            "from minipaged.sequence import SamplingParams; "
            "Engine(LlamaForCausalLM()).generate([[1, 2, 3]], SamplingParams(max_tokens=2)); "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('minipaged'))))")
    loaded = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    for later in ("prefix_cache", "speculative", "disagg", "checkpoint", "generate", "kernels", "attention_loop"):
        assert f"minipaged.{later}" not in loaded
    assert "minipaged.engine" in loaded


# -- what a seam returns is checked where the engine receives it (issue 39) ------------------------------


class PlanIsNone(Scheduler):
    def schedule(self):
        super().schedule()
        return None


class SlotShort(Scheduler):
    def schedule(self):
        out = super().schedule()
        if out.slot_mappings:
            out.slot_mappings[0] = out.slot_mappings[0][:-1]
        return out


class StringBlocks(BlockAllocator):
    def allocate_many(self, num_blocks, seq_id=None):
        return [str(b) for b in super().allocate_many(num_blocks, seq_id)]


@pytest.mark.parametrize("seams, error, message", [
    ({"scheduler": lambda *args: None}, TypeError, r"scheduler=.* returned a NoneType without add\(\), schedule"),
    ({"allocator": lambda num_blocks, block_size: object()}, TypeError, "allocator=.* returned a object: a block"),
])  # fmt: skip
def test_a_seam_factory_that_returns_the_wrong_kind_is_named_at_construction(model, seams, error, message):
    with pytest.raises(error, match=message):
        Engine(model, EngineConfig(num_blocks=24, block_size=4), **seams)


@pytest.mark.parametrize("seams, error, message", [
    ({"scheduler": PlanIsNone}, TypeError, r"scheduler.schedule\(\) returned a NoneType, not a SchedulerOutput"),
    ({"scheduler": SlotShort}, ValueError,
     r"scheduler.schedule\(\) returned slot mappings of \[6, 2\] slots .* for \[7, 2\] scheduled tokens"),
    ({"allocator": StringBlocks}, TypeError, r"allocator.allocate_many\(2\) returned \['0', '1'\]"),
])  # fmt: skip
def test_a_seam_that_returns_the_wrong_thing_is_named_and_the_step_undone(model, seams, error, message):
    """Was: 'can only concatenate str', 'list index out of range', or an AttributeError deep in the step."""
    engine = Engine(model, EngineConfig(num_blocks=24, block_size=4), **seams)
    for p in PROMPTS[:2]:
        engine.add_request(p, SamplingParams(max_tokens=3))
    before = engine_helpers.snapshot(engine)
    with pytest.raises(error, match=message):
        engine.step()
    assert engine_helpers.snapshot(engine) == before


@pytest.mark.parametrize("call", ["decode", "prefill"])
@pytest.mark.parametrize("result, error, message", [
    (lambda q: None, TypeError, "returned a NoneType, not a tensor"),
    (lambda q: q[:, :1], ValueError, r"returned a torch.float32 tensor of shape \(\d+, 1, 16\); expected q's"),
    (lambda q: q.double(), ValueError, "returned a torch.float64 tensor"),
])  # fmt: skip
def test_an_attention_backend_that_returns_the_wrong_tensor_is_named(call, result, error, message):
    case = make_paged_case([5, 9], num_new_tokens=[1, 1] if call == "decode" else [2, 4], block_size=4, num_heads=4,
                           num_kv_heads=2, head_dim=16)  # fmt: skip
    torch_backend = get_backend("torch")
    wrong = AttentionBackend("wrong", decode=lambda q, *args, **kw: result(q), prefill=lambda q, *args, **kw: result(q),
                             write=torch_backend.write)  # fmt: skip
    run = paged_attention if call == "decode" else paged_prefill_attention
    args = case.decode_args if call == "decode" else case.prefill_args
    with pytest.raises(error, match=f"attention backend 'wrong': its {call} " + message):
        run(*args, backend=wrong)


def test_a_backend_that_gives_nan_is_named_before_anything_is_sampled(model, monkeypatch):
    """Issue 43: was sampled silently as token 0."""
    monkeypatch.setattr(attention, "_REGISTRY", dict(attention._REGISTRY))
    torch_backend = get_backend("torch")
    register_backend("nan_decode", AttentionBackend(
        "nan_decode", decode=lambda q, *args, **kw: torch.full_like(q, float("nan")), prefill=torch_backend.prefill,
        write=torch_backend.write))  # fmt: skip
    engine = Engine(model, EngineConfig(num_blocks=24, block_size=4, backend="nan_decode"))
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=3))
    engine.step()  # the prefill runs the torch backend's prefill
    before = engine_helpers.snapshot(engine)
    with pytest.raises(NonFiniteLogits, match=r"attention backend 'nan_decode'\) gave NaN or inf logits for the "
                                              r"rows of \[0\]: nothing was sampled"):  # fmt: skip
        engine.step()
    assert engine_helpers.snapshot(engine) == before
