"""Issue 11: the engine's invariants hold after every operation, whatever the order (a hypothesis state machine).

Rules: add a request (prompts share prefixes, so prefix caching hits), add an invalid one
(named error, nothing changes), abort one, step, and step with a fault injected at a random
stage (the step is rolled back: nothing changes). Issue 25 adds the stop handling's stages to
those (the ``min_tokens`` mask, the stop check, a finished request's release), a request from
the future (refused, nothing changes) and a step whose event subscriber hears of it once it is
over (issue 39: the state it sees is final, and it may step the engine again itself). After every
rule the machine checks:

- the free list has no duplicates, and holds exactly the blocks nobody references;
- each block's refcount equals the number of tables holding it;
- every running table holds exactly its computed tokens (and just the blocks they need);
- no request is lost: the unfinished requests are exactly those queued, running or about to fork;
- swap space only for waiting (preempted) requests;
- the metrics agree with the allocator;
- each finished greedy output equals contiguous generation under the same stopping rules, and
  its ``finish_reason`` and ``stop_reason`` agree with its output (requests stop at the model's
  EOS, at stop tokens drawn from what they would generate, never before ``min_tokens``; some
  ``ignore_eos``); an aborted one's reason is ``"abort"``.

Both preemption modes, prefix caching on and off, keep_finished on and off. Seeded
(``derandomize``) and bounded: a small model and pool, a few examples.
"""

import math
from collections import Counter

import engine_helpers
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

import minipaged.engine as engine_module
import minipaged.swap as swap_module
from minipaged.blocks import BlockTable
from minipaged.engine import Engine
from minipaged.model import LlamaConfig, LlamaForCausalLM
from minipaged.scheduler import EngineConfig, Scheduler
from minipaged.sequence import SamplingParams, Sequence, SequenceStatus
from minipaged.stopping import StopRules

pytestmark = pytest.mark.ch05

torch.set_num_threads(1)
# Its EOS ids are tokens it often produces for these prompts, so requests end by themselves.
MODEL = LlamaForCausalLM(LlamaConfig(eos_token_id=(211, 487, 368)), seed=0).eval()
MAX_TOKENS = 6
PREFIXES = [[], [11, 12, 13, 14], [11, 12, 13, 14, 15, 16, 17, 18]]  # block_size 4: whole shared blocks


class Fault(Exception):
    pass


# Where a fault can strike: (object to patch, attribute, raise before or after the original call).
def fault_sites(engine):
    return {
        "schedule": (engine.scheduler, "schedule", "before"),
        "schedule_midway": (BlockTable, "append_tokens", "after"),  # some tables already grew
        "swap": (swap_module, "swap_out", "before") if engine.config.preemption_mode == "swap"
        else (engine.cache, "move_kv", "before"),
        "forward": (engine.model, "forward", "before"),
        "mask": (engine_module, "mask_stop_tokens", "after"),
        "stop_mask": (StopRules, "mask", "after"),  # one request's min_tokens rows masked, the others' not yet
        "stop_check": (StopRules, "check", "after"),  # a token checked (it may stop its request), not yet recorded
        "sample": (engine_module, "sample", "before"),
        "postprocess_midway": (Sequence, "append_token", "after"),  # a sequence already took its token
        "metrics": (engine.metrics, "record_step", "after"),
        "finish": (Scheduler, "_release", "after"),  # a finished (or preempted) request's blocks already freed
        "hand_over": (engine_module, "RequestOutput", "before"),  # a finished request about to be handed over
    }


STAGES = ["schedule", "schedule_midway", "swap", "forward", "mask", "stop_mask", "sample", "stop_check",
          "postprocess_midway", "finish", "metrics", "hand_over"]

INVALID = {
    "float id": (lambda e: e.add_request([3.7, 2.2]), TypeError),
    "out of vocab": (lambda e: e.add_request([1, MODEL.config.vocab_size]), ValueError),
    "empty prompt": (lambda e: e.add_request([]), ValueError),
    "string prompt": (lambda e: e.add_request("hello"), TypeError),
    "dict params": (lambda e: e.add_request([1, 2], {"max_tokens": 3}), TypeError),
    "nan arrival": (lambda e: e.add_request([1, 2], arrival_time=math.nan), ValueError),
    "too big for the pool": (lambda e: e.add_request([1] * 60, SamplingParams(max_tokens=4)), ValueError),
    "bad generate": (lambda e: e.generate([[1, 2], [1.5]]), TypeError),
    "stop id out of vocab": (lambda e: e.add_request([1, 2], SamplingParams(stop_token_ids=(3, 512))), ValueError),
    "min_tokens past max_tokens": (lambda e: e.add_request([1, 2], SamplingParams(max_tokens=2, min_tokens=3)),
                                   ValueError),
}


def snapshot(engine: Engine):
    """The bookkeeping a rejected input or a failed step must leave as it was."""
    alloc, sched = engine.cache.allocator, engine.scheduler
    seqs = [*sched.running, *sched.waiting]
    seqs += [c for s in seqs for c in s.pending_forks]
    return (alloc.free_queue() if hasattr(alloc, "free_queue") else list(alloc.free_block_ids), alloc.refcounts,
            [alloc.block_key(b) for b in range(alloc.num_blocks)] if hasattr(alloc, "block_key") else None,
            [s.seq_id for s in sched.running], [s.seq_id for s in sched.waiting],
            [(s.seq_id, s.status, s.num_computed_tokens, list(s.token_ids), s.finish_reason, s.stop_reason,
              s.num_preemptions,
              None if s.block_table is None else (list(s.block_table.blocks), s.block_table.num_tokens)) for s in seqs],
            sorted(map(str, engine.seqs)), sorted(map(str, engine.requests)), sorted(map(str, engine.swap_space)),
            engine.clock.now(), engine.metrics.num_steps,
            list(engine.metrics.history))  # fmt: skip


REASONS: Counter = Counter()  # finish reasons over every run of the machine: the stops must actually fire


class EngineMachine(RuleBasedStateMachine):
    @initialize(mode=st.sampled_from(["recompute", "swap"]), caching=st.booleans(), keep=st.booleans())
    def setup(self, mode, caching, keep):
        config = EngineConfig(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=12, watermark=0.0,
                              preemption_mode=mode, keep_finished=keep)  # fmt: skip
        self.engine = Engine(MODEL, config, allocator=engine_helpers.allocator_for(caching))
        self.live: dict[int, tuple[list[int], SamplingParams]] = {}  # request_id -> (prompt, params)
        self.finished: set[int] = set()
        self.reasons: Counter = Counter()

    def _collect(self, outputs) -> None:
        for out in outputs:
            prompt, params = self.live.pop(out.request_id)
            assert out.output_token_ids == [engine_helpers.reference(MODEL, prompt, params)], out.request_id
            for seq in out.seqs:
                self.reasons[engine_helpers.check_finished(seq)] += 1
            assert out.finish_reason == [s.finish_reason for s in out.seqs]
            self.finished.add(out.request_id)

    @rule(requests=st.lists(st.tuples(st.sampled_from(PREFIXES), st.lists(st.integers(0, 60), min_size=1, max_size=6),
                                       st.integers(1, MAX_TOKENS)), min_size=1, max_size=3),
          data=st.data())  # fmt: skip
    def add(self, requests, data):
        for prefix, suffix, max_tokens in requests:
            prompt = prefix + suffix
            params = engine_helpers.stop_params(engine_helpers.hypothesis_pick(data), MODEL, prompt, max_tokens)
            rid = self.engine.add_request(prompt, params)
            self.live[rid] = (prompt, params)

    @rule(kind=st.sampled_from(sorted(INVALID)))
    def invalid_add(self, kind):
        call, error = INVALID[kind]
        before = snapshot(self.engine)
        with pytest.raises(error):
            call(self.engine)
        assert snapshot(self.engine) == before, kind

    @rule(delay=st.floats(1e-6, 1e6), prefix=st.sampled_from(PREFIXES))
    def future_request(self, delay, prefix):
        before = snapshot(self.engine)
        with pytest.raises(ValueError, match="arrival_time"):
            self.engine.add_request(prefix + [7], arrival_time=self.engine.clock.now() + delay)
        assert snapshot(self.engine) == before

    @rule(nested=st.booleans())
    def step_heard_by_a_subscriber(self, nested):
        """Events arrive once the step is over: the subscriber sees its final state, and may step again itself."""
        seen, outputs = [], []

        def hear(event):
            seen.append((self.engine._in_step, snapshot(self.engine)))
            if nested and len(seen) == 1:
                outputs.extend(self.engine.step().outputs)

        errors = self.engine.cache.allocator.num_subscriber_errors
        unsubscribe = self.engine.cache.allocator.subscribe(hear)
        try:
            outputs[:0] = self.engine.step().outputs
        finally:
            unsubscribe()
        assert self.engine.cache.allocator.num_subscriber_errors == errors
        assert not any(in_step for in_step, _ in seen)
        if not nested:
            assert all(state == snapshot(self.engine) for _, state in seen)
        self._collect(outputs)

    @rule(data=st.data())
    def abort(self, data):
        if not self.live:
            return
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.engine.abort(rid)
        del self.live[rid]
        assert self.engine.config.keep_finished == (rid in self.engine.requests)
        if self.engine.config.keep_finished:
            assert {(s.finish_reason, s.stop_reason) for s in self.engine.requests[rid]} == {("abort", None)}

    @rule()
    def step(self):
        self._collect(self.engine.step().outputs)

    @rule(stage=st.sampled_from(STAGES), interrupt=st.booleans())
    def faulty_step(self, stage, interrupt):
        owner, name, when = fault_sites(self.engine)[stage]
        original = getattr(owner, name)
        error = KeyboardInterrupt if interrupt else Fault

        def patched(*args, **kwargs):
            if when == "before":
                raise error(stage)
            original(*args, **kwargs)
            raise error(stage)

        before = snapshot(self.engine)
        setattr(owner, name, patched)
        out = None
        try:
            out = self.engine.step()
        except (Fault, KeyboardInterrupt):
            assert snapshot(self.engine) == before, stage
        finally:
            if owner in (BlockTable, Sequence, StopRules, Scheduler, engine_module, swap_module):
                setattr(owner, name, original)
            else:
                delattr(owner, name)  # the instance attribute hid the class's method
        if out is not None:  # the stage was not reached (an empty step, no swap): an ordinary step
            self._collect(out.outputs)  # after the patch is gone: the reference run calls StopRules too

    @invariant()
    def pool_and_tables(self):
        engine = self.engine
        alloc, sched = engine.cache.allocator, engine.scheduler
        free = alloc.free_queue() if hasattr(alloc, "free_queue") else list(alloc.free_block_ids)
        assert len(free) == len(set(free))
        tables = [s.block_table for s in sched.running]
        assert all(t is not None for t in tables)
        holders = Counter(b for t in tables for b in t.blocks)
        assert alloc.refcounts == [holders[b] for b in range(alloc.num_blocks)]
        assert set(free) == {b for b in range(alloc.num_blocks) if not holders[b]}
        for s in sched.running:
            assert s.block_table.num_tokens == s.num_computed_tokens, s.seq_id
            assert s.block_table.num_blocks == -(-s.num_computed_tokens // alloc.block_size)
            assert not s.block_table.pending_copies
        assert all(s.block_table is None for s in sched.waiting)

    @invariant()
    def no_request_lost(self):
        engine, sched = self.engine, self.engine.scheduler
        queued = [*sched.running, *sched.waiting]
        queued_ids = {s.request_id for s in queued} | {c.request_id for s in queued for c in s.pending_forks}
        assert queued_ids == set(self.live)
        assert all(not s.is_finished and s.finish_reason is None for s in queued)
        if engine.config.keep_finished:
            assert self.finished <= set(engine.requests)
            assert all(s.status is SequenceStatus.FINISHED and s.finish_reason in ("stop", "length")
                       for r in self.finished for s in engine.requests[r])  # fmt: skip
        else:
            assert set(engine.requests) == set(self.live)

    @invariant()
    def swap_space_only_for_waiting(self):
        waiting = {s.seq_id: s for s in self.engine.scheduler.waiting}
        assert set(self.engine.swap_space) <= set(waiting)
        if self.engine.config.preemption_mode == "swap":  # every preempted sequence with computed K/V has it saved
            assert {i for i, s in waiting.items() if s.num_computed_tokens > 0} == set(self.engine.swap_space)

    def teardown(self):
        if hasattr(self, "engine"):  # drain: every request still queued finishes correctly, in bounded steps
            for _ in range(400):  # a leak that starves admission must fail here, not hang
                if not self.engine.has_unfinished():
                    break
                self._collect(self.engine.step().outputs)
            assert not self.live and self.engine.cache.allocator.num_used == 0
            if self.reasons:
                REASONS.update(self.reasons)


EngineMachine.TestCase.settings = settings(max_examples=12, stateful_step_count=40, deadline=None, derandomize=True,
                                           suppress_health_check=list(HealthCheck))  # fmt: skip
test_engine_state_machine = EngineMachine.TestCase


def test_stops_fired_in_the_state_machine():
    """Collected after the machine (file order): its requests ended by stop tokens and by their length."""
    if not REASONS:  # run alone: run the machine first
        run_state_machine_as_test(EngineMachine, settings=EngineMachine.TestCase.settings)
    assert REASONS["stop"] > 0 and REASONS["length"] > 0, REASONS
