"""Prefix caching keys blocks when they are allocated, as vLLM does, and a key always promises its K/V.

- Two requests with the same 11-token prompt admitted in one step, blocks of 4: the second hits the
  first's two full blocks, although their K/V is written in that very step, and computes 3 tokens.
- A key is given only for K/V the step writes: drafts are excluded, a victim taken back within the
  step never keeps a key (keys for the running sequences are given once every preemption is decided),
  and a step that fails rolls its keys back with everything else. Two checkers: after every plan,
  each key given in it must be covered by a planned sequence's tokens; after every step, each keyed
  block's K/V must equal its whole prefix's K/V computed contiguously. A scheduler that keys drafts
  (a known-wrong one) is caught.
- Re-admissions after preemption are counted apart (vLLM's ``preempted_*`` counters).
"""

import random

import pytest
import torch

from minipaged.engine import Engine
from minipaged.generate import forward_contiguous, generate_contiguous
from minipaged.model import LlamaForCausalLM
from minipaged.prefix_cache import PrefixCachingAllocator
from minipaged.scheduler import EngineConfig, Scheduler
from minipaged.sequence import SamplingParams
from minipaged.speculative import NgramSpeculator


@pytest.fixture(scope="module")
def model():
    return LlamaForCausalLM(seed=0).eval()


def keyed_prefixes(allocator: PrefixCachingAllocator) -> dict[int, list[int]]:
    """block id -> the token ids of the whole prefix its key names (blocks whose chain is still cached)."""
    by_serial = {e.serial: e for e in allocator.entries if e is not None}
    prefixes = {}
    for block_id, entry in enumerate(allocator.entries):
        chain = [entry] if entry is not None else []
        while chain and chain[-1].parent is not None:
            parent = by_serial.get(chain[-1].parent)
            if parent is None:  # an ancestor was evicted: nothing to compare against
                chain = []
                break
            chain.append(parent)
        if chain:
            prefixes[block_id] = [t for e in reversed(chain) for t in e.token_ids]
    return prefixes


@torch.no_grad()
def broken_keys(engine: Engine, model) -> list[int]:
    """The keyed blocks whose K/V is not the K/V of the tokens their key names (first and last layer)."""
    B, cache, bad = engine.config.block_size, engine.cache, []
    for block_id, prefix in keyed_prefixes(engine.cache.allocator).items():
        ids = torch.tensor(prefix)
        _, present = forward_contiguous(model, ids, torch.arange(len(prefix)))
        for layer in (0, len(present) - 1):
            want = present[layer][0][-B:]
            if not torch.allclose(cache.k_caches[layer][block_id], want, atol=1e-3, rtol=1e-3):
                bad.append(block_id)
                break
    return bad


def test_requests_admitted_in_one_step_share_the_blocks_that_step_fills(model):
    prompt = [7, 3, 9, 1, 4, 4, 2, 8, 6, 5, 3]  # 11 tokens: two full blocks of 4 and a partial one
    engine = Engine(model, EngineConfig(num_blocks=16, block_size=4, keep_finished=True),
                    allocator=PrefixCachingAllocator)  # fmt: skip
    params = SamplingParams(max_tokens=4)
    engine.add_request(prompt, params, request_id="a")
    engine.add_request(prompt, params, request_id="b")
    out = engine.step()
    assert out.admitted == ["a", "b"]
    assert out.scheduled == {"a": 11, "b": 3}  # vLLM computes 3 for the second request; keying after the step, 11
    stats = engine.cache.allocator.stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 22, 8)
    assert broken_keys(engine, model) == []
    while engine.has_unfinished():
        engine.step()
    want = generate_contiguous(model, prompt, 4)
    assert [engine.seqs[r].output_token_ids for r in "ab"] == [want, want]


def test_a_key_is_given_only_once_the_tokens_are_scheduled_drafts_and_later_chunks_excluded(model):
    prompt = list(range(1, 23))  # 22 tokens, computed in chunks of 8
    engine = Engine(model, EngineConfig(num_blocks=16, block_size=4, max_num_batched_tokens=8, keep_finished=True),
                    allocator=PrefixCachingAllocator)  # fmt: skip
    engine.add_request(prompt, SamplingParams(max_tokens=2), request_id="a")
    allocator = engine.cache.allocator
    for scheduled in (8, 16):
        engine.step()
        table = engine.seqs["a"].block_table
        assert [allocator.block_key(b) is not None for b in table.blocks] == [i < scheduled // 4 for i in
                                                                              range(len(table.blocks))]  # fmt: skip
        assert broken_keys(engine, model) == []


class CheckedScheduler(Scheduler):
    """The package's scheduler, checking after every plan that each key given in it covers tokens the step writes."""

    def schedule(self):
        before = list(self.allocator.entries)
        out = super().schedule()
        planned = {id(s.block_table): (s, n - len(out.spec_token_ids.get(s.seq_id, ())))
                   for s, n in zip(out.seqs, out.num_new_tokens)}  # fmt: skip
        holders = {}
        for seq in self.running:
            for i, block_id in enumerate(seq.block_table.blocks):
                holders.setdefault(block_id, []).append((seq, i))
        B = self.config.block_size
        for block_id, entry in enumerate(self.allocator.entries):
            if entry is None or entry is before[block_id]:
                continue
            covered = [(seq, i) for seq, i in holders.get(block_id, ()) if id(seq.block_table) in planned
                       and (i + 1) * B <= seq.num_computed_tokens + planned[id(seq.block_table)][1]]  # fmt: skip
            assert covered, f"block {block_id} got a key in this plan, but no planned sequence writes all its tokens"
        return out


class KeysDrafts(CheckedScheduler):
    """A known-wrong scheduler: keys the blocks that draft tokens fill, before verification decides on them."""

    def _admit(self, out, budget):
        for seq, n in zip(out.seqs, out.num_new_tokens):
            drafts = out.spec_token_ids.get(seq.seq_id, [])
            if drafts:  # the drafts' K/V is written this step, but a rejected one is not the sequence's token
                self.allocator.cache_full_blocks(seq.block_table, seq.token_ids + drafts, seq.num_computed_tokens + n,
                                                 seq.cache_salt)  # fmt: skip
        return super()._admit(out, budget)


def run_checked(model, rng, scheduler=CheckedScheduler) -> tuple[int, bool]:
    """A random shared-prefix workload under preemption, with n-gram drafts; (blocks with a broken key, outputs right).

    Its prompts repeat themselves, so that the drafts are sometimes right and sometimes wrong."""
    config = EngineConfig(num_blocks=rng.randint(9, 14), block_size=4, max_num_seqs=4,
                          max_num_batched_tokens=rng.choice([8, 16]), watermark=0.0, keep_finished=True,
                          preemption_mode=rng.choice(["recompute", "swap"]),
                          scheduling_policy=rng.choice(["fcfs", "shortest_prompt_first"]))  # fmt: skip
    engine = Engine(model, config, allocator=PrefixCachingAllocator, scheduler=scheduler,
                    speculator=NgramSpeculator({"num_speculative_tokens": 3, "prompt_lookup_min": 1}))  # fmt: skip
    prefix = [rng.randrange(512) for _ in range(9)]
    prompts = [(prefix[: rng.randint(4, 9)] + [rng.randrange(8) for _ in range(rng.randint(1, 6))]) for _ in range(6)]
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(max_tokens=rng.randint(6, 14), ignore_eos=True), request_id=i,
                           arrival_time=-float(len(prompts) - i))  # fmt: skip
    broken = 0
    while engine.has_unfinished():
        engine.step()
        broken += len(broken_keys(engine, model))
    right = all(engine.seqs[i].output_token_ids == generate_contiguous(model, p, engine.seqs[i].sampling_params.
                                                                       max_tokens, ignore_eos=True)
                for i, p in enumerate(prompts))  # fmt: skip
    return broken, right


def test_no_key_ever_promises_k_v_that_was_not_written_and_a_mutant_that_keys_too_early_is_caught(model):
    caught = 0
    for seed in range(10):
        broken, right = run_checked(model, random.Random(seed))
        assert broken == 0 and right, f"seed {seed}: {broken} broken keys, outputs right: {right}"
        try:
            run_checked(model, random.Random(seed), KeysDrafts)
        except AssertionError as exc:
            assert "got a key in this plan" in str(exc)
            caught += 1
    assert caught > 0  # keys for draft tokens that verification may reject are caught when they are given


def test_a_failed_step_takes_back_the_keys_it_gave(model, monkeypatch):
    engine = Engine(model, EngineConfig(num_blocks=16, block_size=4, keep_finished=True),
                    allocator=PrefixCachingAllocator)  # fmt: skip
    engine.add_request(list(range(1, 12)), SamplingParams(max_tokens=3), request_id="a")
    allocator = engine.cache.allocator

    def fail(*args, **kwargs):
        raise RuntimeError("the forward pass failed")

    monkeypatch.setattr(engine, "model", fail)  # the step schedules (and keys), then fails in the forward pass
    with pytest.raises(RuntimeError, match="forward pass failed"):
        engine.step()
    assert allocator.num_cached_blocks == 0 and allocator.stats().requests == 0
    assert engine.scheduler.waiting[0].seq_id == "a" and engine.scheduler.waiting[0].block_table is None
    monkeypatch.undo()
    engine.add_request(list(range(1, 12)), SamplingParams(max_tokens=3), request_id="b")
    while engine.has_unfinished():
        engine.step()
        assert broken_keys(engine, model) == []
    want = generate_contiguous(model, list(range(1, 12)), 3)
    assert engine.seqs["a"].output_token_ids == engine.seqs["b"].output_token_ids == want


def test_re_admissions_after_preemption_are_counted_apart(model):
    config = EngineConfig(num_blocks=10, block_size=4, max_num_seqs=4, watermark=0.0, keep_finished=True)
    engine = Engine(model, config, allocator=PrefixCachingAllocator)
    admissions = []
    engine.cache.allocator.subscribe(lambda e: admissions.append(e.seq_id) if e.kind == "preempt" else None)
    prompts = [[i + 1] * 6 for i in range(4)]
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(max_tokens=16, ignore_eos=True), request_id=i)
    first_lookups = preempted_lookups = 0
    while engine.has_unfinished():
        out = engine.step()
        for rid in out.admitted:
            seq = engine.seqs[rid]
            first_lookups += seq.num_preemptions == 0
            preempted_lookups += seq.num_preemptions > 0
    stats = engine.cache.allocator.stats()
    assert admissions and preempted_lookups == len(admissions)  # every victim came back once
    assert (stats.requests, stats.preempted_requests) == (first_lookups, preempted_lookups) == (4, len(admissions))
    assert stats.queries == sum(map(len, prompts))  # the prompts, once each: re-admissions look up more tokens
    assert stats.preempted_queries > 0 and stats.preempted_hits <= stats.preempted_queries
    assert stats.hit_rate == stats.hits / stats.queries
