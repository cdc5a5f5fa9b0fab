"""Chapter 01: KV-cache memory accounting."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged import accounting as acc
from minipaged import block_math
from minipaged import workload as wl

pytestmark = pytest.mark.ch01

WORKED = [37, 91, 128, 201, 511]

lengths_st = st.lists(st.integers(0, 5000), min_size=1, max_size=40)
block_st = st.integers(1, 512)


# ---------------------------------------------------------------- bytes per token


def test_opt_13b_is_800_kib_per_token_fp16():
    # vLLM paper, section 3: 2 (K and V) x 5120 (hidden) x 40 (layers) x 2 bytes = 800 KB.
    assert acc.kv_bytes_per_token("OPT-13B", "fp16") == 2 * 5120 * 40 * 2 == 819200 == 800 * 1024


def test_llama_3_8b_is_128_kib_per_token_bf16():
    assert acc.kv_bytes_per_token(acc.get_model_preset("Llama-3-8B"), torch.bfloat16) == 128 * 1024


def test_llama_2_7b_is_512_kib_per_token():
    assert acc.get_model_preset("llama-2-7b").kv_bytes_per_token() == 512 * 1024


def test_gqa_and_mqa_shrink_kv_by_the_head_ratio():
    l2, l3 = acc.get_model_preset("Llama-2-7B"), acc.get_model_preset("Llama-3-8B")
    assert acc.kv_bytes_per_token(l2) == 4 * acc.kv_bytes_per_token(l3)  # 32 vs 8 KV heads
    falcon = acc.get_model_preset("Falcon-7B")
    assert (falcon.attention, l3.attention, l2.attention) == ("MQA", "GQA", "MHA")
    assert acc.kv_bytes_per_token(falcon) == 2 * 32 * 1 * 64 * 2


@pytest.mark.parametrize("dtype, b", [("fp32", 4), ("fp16", 2), ("bf16", 2), ("fp8", 1), (torch.float32, 4),
                                      (torch.float16, 2), (torch.float8_e4m3fn, 1), (2, 2), ("torch.bfloat16", 2)])
def test_dtype_bytes(dtype, b):
    assert acc.dtype_bytes(dtype) == b
    assert acc.kv_bytes_per_token("Llama-2-7B", dtype) == 32 * 32 * 128 * 2 * b


@given(n=st.integers(0, 10**6), name=st.sampled_from(list(acc.MODEL_PRESETS)))
def test_kv_bytes_is_linear_in_tokens(n, name):
    spec = acc.get_model_preset(name)
    expected = 2 * spec.num_layers * n * spec.num_kv_heads * spec.head_dim * spec.dtype_bytes
    assert acc.kv_bytes(spec, n) == expected == n * acc.kv_bytes_per_token(spec)


# ---------------------------------------------------------------- worked example


def test_worked_example_exactly():
    assert sum(WORKED) == 968
    assert acc.fixed_slots(WORKED, 512) == 2560
    assert acc.paged_slots(WORKED, 16) == 992
    assert acc.paged_slots(WORKED, 32) == 1024
    assert round(100 * acc.fixed_utilisation(WORKED, 512), 2) == 37.81
    assert round(100 * acc.utilisation(WORKED, 16), 2) == 97.58
    assert round(100 * acc.utilisation(WORKED, 32), 2) == 94.53
    rows = acc.compare_slots(WORKED, 512, (16, 32))
    assert [(r.allocated, r.wasted) for r in rows] == [(2560, 1592), (992, 24), (1024, 56)]
    table = acc.slot_table(rows)
    assert "37.81%" in table and "97.58%" in table and "94.53%" in table


@pytest.mark.parametrize("n, B, blocks, alloc, waste", [
    (0, 16, 0, 0, 0), (1, 16, 1, 16, 15), (16, 16, 1, 16, 0), (17, 16, 2, 32, 15),
    (37, 16, 3, 48, 11), (511, 32, 16, 512, 1), (5, 1, 5, 5, 0),
])
def test_block_arithmetic_by_hand(n, B, blocks, alloc, waste):
    assert acc.blocks_needed(n, B) == blocks
    assert acc.allocated_slots(n, B) == alloc
    assert acc.tail_waste(n, B) == waste


# ---------------------------------------------------------------- properties


@given(n=st.integers(0, 10**6), B=block_st)
def test_tail_waste_is_less_than_one_block(n, B):
    w, a = acc.tail_waste(n, B), acc.allocated_slots(n, B)
    assert 0 <= w < B
    assert a >= n and a - n < B and a % B == 0
    assert a == w + n


@given(lengths=lengths_st.filter(lambda ls: sum(ls) > 0), B=block_st)
def test_utilisation_in_zero_one(lengths, B):
    u = acc.utilisation(lengths, B)
    assert 0 < u <= 1
    assert (u == 1) == all(n % B == 0 for n in lengths)


@given(data=st.data(), max_len=st.integers(1, 4096))
def test_fixed_holds_at_least_as_much_as_paged(data, max_len):
    lengths = data.draw(st.lists(st.integers(0, max_len), min_size=1, max_size=30))
    B = data.draw(st.integers(1, max_len))
    # Each sequence holds at most A_B(max_len) slots when paged...
    assert acc.paged_slots(lengths, B) <= len(lengths) * acc.allocated_slots(max_len, B)
    # ...which is max_len itself when B divides max_len (as it does in practice).
    if max_len % B == 0:
        assert acc.fixed_slots(lengths, max_len) >= acc.paged_slots(lengths, B)
        if sum(lengths):
            assert acc.fixed_utilisation(lengths, max_len) <= acc.utilisation(lengths, B)


def test_fixed_can_hold_less_when_block_does_not_divide_max_len():
    # "fixed >= paged for B <= max_len" needs B | max_len: 3 tokens in blocks of 2 take 4 slots.
    assert acc.fixed_slots([3], 3) == 3 < acc.paged_slots([3], 2) == 4


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("call, arg", [
    (lambda: acc.blocks_needed(-1, 16), "num_tokens"),
    (lambda: acc.blocks_needed(10, 0), "block_size"),
    (lambda: acc.blocks_needed(10, -4), "block_size"),
    (lambda: acc.utilisation([3, -1], 16), "lengths[1]"),
    (lambda: acc.utilisation([], 16), "lengths"),
    (lambda: acc.utilisation([0, 0], 16), "lengths"),
    (lambda: acc.fixed_slots([10, 600], 512), "max_len"),
    (lambda: acc.fixed_slots([10], 0), "max_len"),
    (lambda: acc.kv_bytes("Llama-3-8B", -5), "num_tokens"),
    (lambda: acc.kv_bytes_per_token("Llama-3-8B", "fp12"), "dtype"),
    (lambda: acc.get_model_preset("GPT-5"), "name"),
    (lambda: acc.ModelSpec("x", 2, 6, 4, 64), "num_kv_heads"),
    (lambda: acc.sample_lengths("chat", -1, 2048), "n"),
    (lambda: acc.sample_lengths("chat", 10, 0), "max_len"),
    (lambda: acc.capacity("Llama-3-8B", 2**30, 0, 2048, "chat"), "block_size"),
    (lambda: acc.capacity("Llama-3-8B", 2**30, 16, 2048, "nope"), "preset"),
    (lambda: acc.saving_grid("Llama-3-8B", ["chat"], [0]), "batch_size"),
])
def test_bad_values_raise_value_error_naming_the_argument(call, arg):
    with pytest.raises(ValueError) as info:
        call()
    assert arg in str(info.value)


@pytest.mark.parametrize("call, arg", [
    (lambda: acc.blocks_needed(10.5, 16), "num_tokens"),
    (lambda: acc.allocated_slots(10, 2.0), "block_size"),
    (lambda: acc.tail_waste(True, 16), "num_tokens"),
    (lambda: acc.utilisation([3, 1.5], 16), "lengths[1]"),
    (lambda: acc.utilisation(7, 16), "lengths"),
    (lambda: acc.kv_bytes_per_token("Llama-3-8B", [2]), "dtype"),
    (lambda: acc.kv_bytes_per_token(42), "model"),
    (lambda: acc.get_model_preset(None), "name"),
    (lambda: acc.ModelSpec("x", 2.0, 4, 4, 64), "num_layers"),
    (lambda: acc.capacity("Llama-3-8B", 2.0**30, 16, 2048, "chat"), "budget_bytes"),
    (lambda: acc.capacity("Llama-3-8B", 2**30, 16, 2048, 3), "preset"),
])
def test_wrong_types_raise_type_error_naming_the_argument(call, arg):
    with pytest.raises(TypeError) as info:
        call()
    assert arg in str(info.value)


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError, match="OPT-13B.*Llama-3-8B"):
        acc.get_model_preset("llama-4")


def test_length_above_max_len_is_named():
    with pytest.raises(ValueError, match=r"lengths\[1\] = 600 is longer than max_len = 512"):
        acc.fixed_slots([10, 600], 512)


# ---------------------------------------------------------------- sequence lengths


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(["chat", "long_tail", "uniform"]), max_len=st.integers(1, 4096),
       seed=st.integers(0, 2**32))
def test_sample_lengths_are_seeded_and_cut_off_at_max_len(name, max_len, seed):
    a, b = acc.sample_lengths(name, 500, max_len, seed), acc.sample_lengths(name, 500, max_len, seed)
    assert a.dtype == np.int64 and a.shape == (500,)
    assert np.array_equal(a, b)
    assert a.min() >= 1 and a.max() <= max_len


def test_sample_lengths_are_prompt_plus_output():
    p = wl.LENGTH_PRESETS["chat"]
    full = p.sequence_lengths(1000, np.random.default_rng(3))
    np.testing.assert_array_equal(acc.sample_lengths(p, 1000, 2048, seed=3), np.minimum(full, 2048))


def test_long_tail_is_heavier_than_chat_at_the_top():
    c, t = acc.sample_lengths("chat", 20000, 10**6), acc.sample_lengths("long_tail", 20000, 10**6)
    assert np.median(t) < np.median(c)
    assert t.max() / np.median(t) > c.max() / np.median(c)


# ---------------------------------------------------------------- capacity


def test_capacity_small_case_by_hand():
    # 1-layer, 1-head, head_dim 1, 1 byte: one slot = 2 bytes. max_len 8, B = 4.
    tiny = acc.ModelSpec("tiny", 1, 1, 1, 1, dtype_bytes=1)
    preset = wl.WorkloadPreset("short", wl.Uniform(1, 4), wl.Uniform(1, 4))
    r = acc.capacity(tiny, 100, 4, 8, preset, seed=3)
    lengths = r.lengths  # admission order, up to the first sequence paging refused
    assert r.fixed.num_seqs == 100 // 16 == 6
    assert r.fixed.effective_kv == 2 * int(lengths[:6].sum())
    cost = [2 * acc.allocated_slots(int(n), 4) + 4 * 2 for n in lengths]
    k = next(i for i in range(len(cost)) if sum(cost[: i + 1]) > 100)
    assert r.paged.num_seqs == k
    assert r.paged.block_table == 8 * k
    assert r.paged.tail_waste == 2 * sum(acc.tail_waste(int(n), 4) for n in lengths[:k])


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(list(acc.MODEL_PRESETS)),
    budget_mib=st.integers(0, 4096),
    B=st.sampled_from([1, 8, 16, 32, 128]),
    max_len=st.sampled_from([128, 512, 2048]),
    which=st.sampled_from(["chat", "long_tail", "uniform"]),
    seed=st.integers(0, 2**16),
)
def test_capacity_invariants(name, budget_mib, B, max_len, which, seed):
    budget = budget_mib * 2**20
    r = acc.capacity(name, budget, B, max_len, which, seed=seed)
    assert r.fixed.total == budget == r.paged.total
    for part in (*r.fixed.parts().values(), *r.paged.parts().values()):
        assert part >= 0
    # With B | max_len a paged sequence never costs more than a reservation plus its block-table row.
    row = 4 * acc.blocks_needed(max_len, B)
    if max_len % B == 0:
        assert r.paged.num_seqs >= budget // (max_len * acc.kv_bytes_per_token(name) + row)
    slot = acc.kv_bytes_per_token(name)
    assert r.paged.tail_waste < r.paged.num_seqs * B * slot or r.paged.num_seqs == 0
    # the next sequence really would not fit
    nxt = acc.allocated_slots(int(r.lengths[r.paged.num_seqs]), B) * slot + row
    assert r.paged.unused < nxt


def test_paging_admits_fewer_when_every_sequence_is_max_len():
    # Paging is not free: with no short sequences, the block table is pure overhead.
    tiny = acc.ModelSpec("tiny", 1, 1, 1, 1, dtype_bytes=1)  # 2 bytes per slot
    full = wl.WorkloadPreset("all at max_len", wl.Constant(4), wl.Constant(4))
    r = acc.capacity(tiny, 48, 4, 8, full)
    assert (r.fixed.num_seqs, r.paged.num_seqs) == (3, 2)  # 16 B each vs 16 + 8 B each
    assert r.paged.block_table == 16 and r.paged.tail_waste == 0


def test_capacity_report_prints_a_table():
    r = acc.capacity("Llama-3-8B", 8 * 2**30, 16, 2048, "chat", dtype="bf16", seed=0)
    text = str(r)
    for word in ("Llama-3-8B", "sequences", "effective KV", "tail waste", "reservation waste", "block table",
                 "unused", "total", "chat lengths"):
        assert word in text
    assert f"{r.paged.num_seqs}" in text and r.gain == r.paged.num_seqs / r.fixed.num_seqs


# ---------------------------------------------------------------- the "57% at every batch size" claim


def test_saving_depends_on_distribution_not_batch_size():
    rows = acc.saving_grid("Llama-2-7B", ["chat", "long_tail", "uniform"], [256, 1024, 4096], block_size=16,
                           max_len=2048)
    by_dist = {}
    for r in rows:
        assert r.fixed_bytes == r.batch_size * 2048 * 512 * 1024
        by_dist.setdefault(r.preset, []).append(r)
    expected = {name: rs[0].expected_saving for name, rs in by_dist.items()}
    # different distributions save very different fractions...
    assert max(expected.values()) - min(expected.values()) > 0.3
    # ...while for large batches the batch size hardly matters
    for name, rs in by_dist.items():
        for r in rs:
            assert abs(r.saving - expected[name]) < 0.05, (name, r)


def test_saving_grid_draws_every_batch_afresh():
    # two batches are two draws, not one seed twice (with one seed, a batch's prompts began every larger batch's)
    rows = acc.saving_grid("Llama-2-7B", ["uniform"], [64, 64], seed=0)
    assert rows[0].paged_bytes != rows[1].paged_bytes
    assert rows[0].paged_bytes == acc.saving_grid("Llama-2-7B", ["uniform"], [64], seed=0)[0].paged_bytes  # seeded


def test_expected_saving_matches_formula_for_a_constant_length():
    const = wl.WorkloadPreset("880", wl.Constant(800), wl.Constant(80))
    # 880 tokens in 2048: A_16 = 880, saving = 1 - 880/2048 = 57.0%
    assert math.isclose(acc.expected_saving(const, 16, 2048), 1 - 880 / 2048)



def test_waste_breakdown_worked_by_hand():
    # prompt 3, output 2, max_len 8, B = 4: the request holds 4 then 5 tokens of a final 5.
    preset = wl.WorkloadPreset("const", prompt_len=wl.Constant(3), output_len=wl.Constant(2))
    got = acc.waste_breakdown(preset, max_len=8, block_size=4, num_seqs=3)
    assert got["fixed max_len"] == pytest.approx({"effective KV": 9 / 16, "reserved": 1 / 16,
                                                  "internal fragmentation": 6 / 16})
    assert got["fixed pow2"] == got["fixed max_len"]  # the next power of two above 5 is 8
    assert got["fixed oracle"] == pytest.approx({"effective KV": 0.9, "reserved": 0.1, "internal fragmentation": 0})
    assert got["paged B=4"] == pytest.approx({"effective KV": 0.75, "reserved": 0, "internal fragmentation": 0.25})


@settings(max_examples=25, deadline=None)
@given(max_len=st.integers(8, 600), block_size=st.sampled_from([1, 4, 16, 64]), seed=st.integers(0, 50))
def test_waste_breakdown_shares_sum_to_one_and_paging_reserves_nothing(max_len, block_size, seed):
    got = acc.waste_breakdown("chat", max_len, block_size, num_seqs=40, seed=seed)
    for parts in got.values():
        assert sum(parts.values()) == pytest.approx(1.0)
        assert all(v >= 0 for v in parts.values())
    paged = got[f"paged B={block_size}"]
    assert paged["reserved"] == 0
    assert got["fixed oracle"]["internal fragmentation"] == 0
    # each contiguous scheme holds at least what the one before it holds: n <= pow2 (capped) <= max_len
    eff = [got[k]["effective KV"] for k in ("fixed oracle", "fixed pow2", "fixed max_len")]
    assert eff[0] >= eff[1] - 1e-12 and eff[1] >= eff[2] - 1e-12
    if block_size == 1:
        assert paged["effective KV"] == 1.0


def test_waste_breakdown_rejects_bad_input():
    with pytest.raises(ValueError, match="max_len"):
        acc.waste_breakdown("chat", 0)
    with pytest.raises(TypeError, match="block_size"):
        acc.waste_breakdown("chat", 128, block_size=16.0)


@given(st.integers(0, 500), st.integers(1, 64), st.integers(1, 64), st.integers(1, 32))
def test_the_pool_measures_have_one_owner_and_agree(num_tokens, used_blocks, extra_blocks, block_size):
    num_blocks = used_blocks + extra_blocks
    u = acc.slot_utilisation(num_tokens, used_blocks * block_size)
    assert u == num_tokens / (used_blocks * block_size)
    assert block_math.kv_usage(used_blocks, num_blocks) == used_blocks / num_blocks
    occupancy = block_math.token_occupancy(num_tokens, num_blocks * block_size)
    assert occupancy == pytest.approx(block_math.kv_usage(used_blocks, num_blocks) * u)


def test_the_pool_measures_refuse_bad_input():
    assert acc.slot_utilisation(0, 0) == 0.0  # nothing allocated holds nothing
    with pytest.raises(TypeError, match="num_tokens"):
        acc.slot_utilisation(1.5, 4)
    with pytest.raises(ValueError, match="num_slots"):
        acc.slot_utilisation(1, -4)
    with pytest.raises(ValueError, match="num_blocks"):
        block_math.kv_usage(0, 0)
    with pytest.raises(ValueError, match="pool_slots"):
        block_math.token_occupancy(3, 0)
