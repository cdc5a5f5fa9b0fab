"""Chapter 07's measurements: the three memory measures, the block-size sweeps, the launch proxy, the ablations."""

from dataclasses import fields

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged import tradeoffs as T
from minipaged.accounting import allocated_slots, utilisation
from minipaged.blocks import BlockAllocator, OutOfBlocks
from minipaged.engine import Engine
from minipaged.generate import generate_contiguous
from minipaged.model import LlamaConfig, LlamaForCausalLM
from minipaged.prefix_cache import PrefixCachingAllocator
from minipaged.scheduler import EngineConfig
from minipaged.sequence import SamplingParams
from minipaged.workload import RequestSpec, make_workload

pytestmark = pytest.mark.ch07


# -- three measures of memory use ------------------------------------------------


def test_vllm_gauge_case_reproduces_the_reported_reading():
    m = T.vllm_gauge_case()
    assert round(100 * m.kv_usage, 1) == 66.7
    assert round(100 * m.token_occupancy, 1) == 36.5
    assert m.used_blocks == 2 * 256  # 17 or 18 tokens take two blocks of 16


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=20), st.sampled_from(T.BLOCK_SIZES))
def test_occupancy_is_usage_times_utilisation(lengths, block_size):
    num_blocks = sum(allocated_slots(n, block_size) // block_size for n in lengths) + 3
    m = T.memory_measures(lengths, block_size, num_blocks)
    assert m.utilisation == pytest.approx(utilisation(lengths, block_size))  # chapter 01's formula
    assert m.token_occupancy == pytest.approx(m.kv_usage * m.utilisation)
    assert m.token_occupancy <= m.kv_usage <= 1


def test_memory_measures_refuse_a_pool_too_small_and_bad_input():
    with pytest.raises(OutOfBlocks):
        T.memory_measures([40, 40], 16, 5)
    with pytest.raises(TypeError, match="lengths\\[1\\]"):
        T.memory_measures([4, 2.5], 16, 8)
    with pytest.raises(ValueError, match="block_size"):
        T.memory_measures([4], 0, 8)


# -- memory per block size, trace simulator against the formula --------------------


def test_memory_sweep_measures_agree_with_chapter_01():
    trace = make_workload(24, 1.0, "tiny_chat", seed=3)
    rows = T.memory_sweep(trace, pool_tokens=1024, block_sizes=(1, 8, 64), max_len=512)
    final = [r.num_prompt_tokens + r.num_output_tokens for r in trace]
    assert [r.block_size for r in rows] == [1, 8, 64]
    assert rows[0].utilisation == 1.0 and rows[0].tail_waste == 0.0
    for r in rows:
        assert r.formula_utilisation == pytest.approx(utilisation(final, r.block_size))
        assert 0 <= r.tail_waste <= r.block_size - 1
        assert r.token_occupancy <= r.kv_usage + 1e-12
        assert r.block_table_bytes == 4 * -(-512 // r.block_size)
    # Bigger blocks waste more: the measured utilisation falls with the block size here.
    assert rows[0].utilisation > rows[1].utilisation > rows[2].utilisation


# -- the Triton launch proxy --------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 16, 128])
def test_decode_launch_counts_the_kernels_grid(block_size, monkeypatch):
    pytest.importorskip("triton")
    from minipaged.kernels import paged_attention as kernel

    grids = []
    real = kernel._paged_decode_kernel

    class Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return real[grid]

    monkeypatch.setattr(kernel, "_paged_decode_kernel", Recorder())
    seq_lens = [3, 70, 130]
    heads, head_dim, group = 2, 16, 2
    blocks = sum(-(-n // block_size) for n in seq_lens)
    k = torch.randn(blocks, block_size, heads, head_dim)
    v = torch.randn_like(k)
    width = max(-(-n // block_size) for n in seq_lens)
    table, start = torch.zeros(len(seq_lens), width, dtype=torch.int32), 0
    for i, n in enumerate(seq_lens):
        nb = -(-n // block_size)
        table[i, :nb] = torch.arange(start, start + nb)
        start += nb
    q = torch.randn(len(seq_lens), heads * group, head_dim)
    kernel.paged_decode_attention(q, k, v, table, torch.tensor(seq_lens, dtype=torch.int32))
    launch = T.decode_launch(seq_lens, block_size, heads)
    grid = grids[0]
    assert launch.programs == grid[0] * grid[1] * grid[2]
    assert launch.num_splits == grid[2]


def test_decode_launch_loop_steps():
    pytest.importorskip("triton")
    one = T.decode_launch([1, 64, 65, 300], 16, 2, num_splits=1)
    assert one.tile == 64
    assert one.loop_steps == 2 * (1 + 1 + 2 + 5)
    assert one.tokens_loaded == one.loop_steps * 64
    assert one.block_table_reads == 2 * (1 + 4 + 5 + 19)
    split = T.decode_launch([300], 16, 1, num_splits=2)  # 5 tiles: 3 + 2
    assert split.loop_steps == 5 and split.programs == 2
    big = T.decode_launch([300], 256, 1, num_splits=1)  # tiles of 64 tokens whatever the block size
    assert big.tile == 64 and big.loop_steps == 5 and big.block_table_reads == 2


# -- sharing: only whole blocks hit -------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 100), st.sampled_from(T.BLOCK_SIZES), st.integers(0, 2**16))
def test_prefix_hit_rate_counts_whole_blocks_of_the_prefix(prefix_len, block_size, seed):
    prompts = T.shared_prefix_prompts(6, prefix_len, (1, 20), seed=seed)

    def common(a, b):  # the longest common prefix; random suffixes may share a token or two beyond the prefix
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    # A prompt hits the whole blocks it shares with the best earlier prompt, never its own last token.
    hits = sum(block_size * max(min(common(p, q) // block_size, (len(p) - 1) // block_size) for q in prompts[:i])
               for i, p in enumerate(prompts) if i)  # fmt: skip
    assert T.prefix_hit_rate(prompts, block_size) == pytest.approx(hits / sum(len(p) for p in prompts))


# -- admission order ------------------------------------------------------------------


def test_scheduling_policy_is_validated():
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo")
    with pytest.raises(TypeError, match="scheduling_policy"):
        EngineConfig(scheduling_policy=1)


@pytest.mark.parametrize("policy", ["fcfs", "shortest_prompt_first"])
def test_admission_order_follows_the_policy_and_outputs_stay_exact(policy):
    model = T.sweep_model()
    engine = Engine(model, EngineConfig(num_blocks=16, block_size=4, max_num_seqs=1, scheduling_policy=policy,
                                        keep_finished=True))
    prompts = {"long": list(range(1, 31)), "short": [5, 6, 7], "mid": list(range(9, 21))}
    for rid, p in prompts.items():
        engine.add_request(p, SamplingParams(max_tokens=3), request_id=rid)
    order = []
    while engine.has_unfinished():
        order += engine.step().admitted
    assert order == (["long", "short", "mid"] if policy == "fcfs" else ["short", "mid", "long"])
    for rid, p in prompts.items():
        assert engine.seqs[rid].output_token_ids == generate_contiguous(model, p, 3)


def test_shortest_prompt_first_readmits_preempted_sequences_first():
    model = T.sweep_model()
    config = EngineConfig(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, watermark=0.0,
                          scheduling_policy="shortest_prompt_first", keep_finished=True)
    engine = Engine(model, config)
    prompts = {f"r{i}": list(range(1 + i, 9 + 3 * i)) for i in range(4)}
    for rid, p in prompts.items():
        engine.add_request(p, SamplingParams(max_tokens=8), request_id=rid)
    preempted = False
    while engine.has_unfinished():
        out = engine.step()
        if out.preempted:
            preempted = True
            victim = out.preempted[0]
            waiting = list(engine.scheduler.waiting)
            assert waiting[0].seq_id == victim
    assert preempted
    for rid, p in prompts.items():
        assert engine.seqs[rid].output_token_ids == generate_contiguous(model, p, 8)


# -- the engine runs -------------------------------------------------------------------


def _small_workload():
    workload = [RequestSpec(0.01 * i, 6 + (7 * i) % 20, 3 + (5 * i) % 9) for i in range(10)]
    return workload, None


def test_run_engine_is_deterministic_and_does_not_depend_on_the_model():
    workload, _ = _small_workload()
    config = EngineConfig(num_blocks=24, block_size=4, max_num_seqs=8, max_num_batched_tokens=32)
    a = T.run_engine(T.sweep_model(), config, workload)
    b = T.run_engine(T.sweep_model(), config, workload)
    assert a == b
    # On the virtual clock the schedule decides every number, so the course's tiny model gives the same.
    c = T.run_engine(LlamaForCausalLM(LlamaConfig(), seed=1).eval(), config, workload)
    assert c == a
    assert a["requests"] == 10
    assert a["normalized_latency"] > 0 and 0 < a["kv_usage"] <= 1


def test_run_engine_caches_prefixes_unless_given_the_plain_allocator():
    workload = [RequestSpec(0.01 * i, 9, 3) for i in range(6)]
    prompts = [list(range(1, 9)) + [20 + i] for i in range(6)]  # two shared blocks of 4, then one own token
    config = EngineConfig(num_blocks=24, block_size=4, max_num_seqs=8, max_num_batched_tokens=32)
    cached = T.run_engine(T.sweep_model(), config, workload, prompts)
    plain = T.run_engine(T.sweep_model(), config, workload, prompts, allocator=BlockAllocator)
    assert cached["hit_rate"] > 0 and plain["hit_rate"] == 0
    assert cached["tokens_per_s"] > plain["tokens_per_s"]  # the hits skip part of the prefill
    (no_caching,) = [a for a in T.ABLATIONS if a.name == "no prefix caching"]
    assert no_caching.allocator is BlockAllocator and T.ABLATIONS[0].allocator is PrefixCachingAllocator


def test_block_size_sweep_keeps_the_pool_slots():
    workload, _ = _small_workload()
    base = EngineConfig(num_blocks=24, block_size=4, max_num_seqs=8, max_num_batched_tokens=32)
    runs = T.block_size_sweep(T.sweep_model(), workload, block_sizes=(2, 32), base=base, pool_tokens=96)
    assert set(runs) == {2, 32}
    # 32-token blocks hold 3 sequences at most in 96 slots; 2-token blocks run more at once.
    assert runs[32]["max_running"] <= 3 < runs[2]["max_running"]
    assert T.block_size_config(32, base, 96).num_blocks == 3


def test_each_ablation_changes_one_factor():
    workload, _ = T.regime_workload("sharegpt_like")
    base_fields = {f.name: getattr(T.BASE_CONFIG, f.name) for f in fields(EngineConfig)}
    names = set()
    for a in T.ABLATIONS:
        config = T.ablation_config(a, workload)
        changed = {k for k, v in base_fields.items() if getattr(config, k) != v}
        if a.allocator is not T.ABLATIONS[0].allocator:  # the engine's allocator: prefix caching on or off
            changed.add("allocator")
        names.add(a.name)
        if a.factor == "-":
            assert not changed
        elif a.factor == "block_size":  # contiguous: one block per sequence in the same slots
            assert changed <= {"block_size", "num_blocks"}
            assert config.block_size >= max(r.num_prompt_tokens + r.num_output_tokens for r in workload)
            assert config.num_blocks * config.block_size <= T.POOL_TOKENS
        else:
            assert changed == {a.factor}
    assert len(names) == len(T.ABLATIONS)


def test_regime_workload_shares_a_prefix_and_rejects_unknown_names():
    workload, prompts = T.regime_workload("alpaca_like")
    assert len({tuple(p[:16]) for p in prompts}) == 1
    assert [len(p) for p in prompts] == [r.num_prompt_tokens for r in workload]
    with pytest.raises(ValueError, match="regime"):
        T.regime_workload("nope")
