"""Chapter 07's capacity planner: vLLM's start-up arithmetic, its failures, and the numbers it keeps."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged import accounting as acc
from minipaged import planner as pl
from minipaged.workload import RequestSpec

pytestmark = pytest.mark.ch07

GiB, MiB = pl.GiB, pl.MiB


def llama(**kw):
    args = dict(model="Llama-3-8B", gpu_memory="A100 (80 GiB)", gpu_memory_utilization=0.9, max_model_len=8192)
    args.update(kw)
    return pl.plan(**args)


# ---------------------------------------------------------------------------
# the arithmetic, worked by hand
# ---------------------------------------------------------------------------


def test_a_plan_worked_by_hand():
    p = llama(kv_dtype="fp16", block_size=16, activation_bytes=GiB, non_torch_bytes=512 * MiB)
    requested = math.floor(80 * GiB * 0.9)
    weights = 8_030_261_248 * 2
    per_token = 2 * 32 * 8 * 128 * 2  # 2 (K and V) · layers · KV heads · head dim · 2 bytes
    budget = requested - weights - GiB - 512 * MiB
    blocks = budget // (16 * per_token)
    assert (p.requested_bytes, p.weight_bytes, p.kv_bytes_per_token, p.block_bytes) == (
        requested, weights, per_token, 16 * per_token)
    assert (p.kv_budget_bytes, p.num_blocks, p.kv_tokens) == (budget, blocks, blocks * 16)
    assert p.leftover_bytes == budget - blocks * 16 * per_token < p.block_bytes
    assert p.starts and p.outcome == "ok" and p.error is None
    assert p.max_concurrency == pytest.approx(blocks * 16 / 8192)
    assert p.kv_bytes_per_token == acc.kv_bytes_per_token("Llama-3-8B", "fp16")  # chapter 01's formula


def test_the_utilisation_is_a_fraction_of_the_whole_gpu_not_of_what_is_free():
    alone = llama(gpu_memory_utilization=0.4)
    beside = llama(gpu_memory_utilization=0.4, other_bytes=30 * GiB)
    assert beside.free_bytes == 50 * GiB
    assert beside.requested_bytes == alone.requested_bytes == math.floor(80 * GiB * 0.4)
    assert beside.num_blocks == alone.num_blocks and beside.starts


def test_weights_default_to_parameters_times_the_models_dtype():
    assert pl.model_weight_bytes("Llama-2-7B") == 6_738_415_616 * 2
    assert pl.model_weight_bytes("llama-2-70b", "fp8") == 68_976_648_192
    assert llama(weight_bytes=GiB).weight_bytes == GiB


def test_kv_dtype_auto_is_the_models_own():
    assert llama(kv_dtype=None).num_blocks == llama(kv_dtype="auto").num_blocks == llama(kv_dtype="bf16").num_blocks
    assert llama(kv_dtype="fp8").kv_dtype_bytes == 1


def test_the_arithmetic_prints_every_step():
    text = str(llama())
    for step in ("= requested", "- weights", "- activation peak", "- non-torch memory", "= KV budget", "/ block",
                 "= KV blocks", "= KV tokens"):
        assert step in text
    p = llama()
    assert f"{p.num_blocks:,}" in text and f"{p.kv_tokens:,}" in text and "fits" in text
    assert "held by others" in llama(other_bytes=GiB).arithmetic()


# ---------------------------------------------------------------------------
# vLLM's start-up failures
# ---------------------------------------------------------------------------


def test_the_reported_case_1478_blocks_23648_tokens():
    """vLLM issue #10517: 1,478 blocks × 16 = 23,648 tokens; max_model_len 29,000 fails, 20,000 starts."""
    bad = pl.reported_case(29_000)
    assert (bad.num_blocks, bad.block_size, bad.kv_tokens) == (1478, 16, 23_648)
    assert bad.outcome == "max_model_len" and not bad.starts and not bad.fits()
    assert bad.error.startswith("The model's max seq len (29000) is larger than the maximum number of tokens "
                                "that can be stored in KV cache (23648).")
    good = pl.reported_case(20_000)
    assert good.starts and good.num_blocks == 1478 and good.fits() and bad.fits(20_000)
    # the log's own rounded numbers: 23.58 GiB × 0.90 − 17.98 GiB peak − 0.35 GiB = 2.89 GiB of KV
    assert round(bad.kv_budget_bytes / GiB, 2) == 2.89 and round(bad.gpu_bytes / GiB, 2) == 23.58


def test_max_model_len_at_the_boundary():
    tokens = pl.reported_case().kv_tokens
    assert pl.reported_case(tokens).starts and pl.reported_case(tokens).fits()
    assert pl.reported_case(tokens + 1).outcome == "max_model_len"


def test_a_budget_of_whole_blocks_leaves_nothing_over():
    block = 16 * acc.kv_bytes_per_token("Llama-3-8B")
    p = pl.plan("Llama-3-8B", 100 * block, 1.0, max_model_len=16, weight_bytes=0, activation_bytes=0,
                non_torch_bytes=0)
    assert (p.num_blocks, p.leftover_bytes) == (100, 0)
    negative = pl.plan("Llama-3-8B", "L4 (24 GiB)", 0.62, max_model_len=2048)
    assert negative.kv_budget_bytes < 0 and negative.leftover_bytes == 0
    assert pl.plan("Llama-2-70B", "A100 (80 GiB)", max_model_len=16).leftover_bytes == 0


def test_the_smallest_utilisation_that_fits():
    u = pl.min_utilization(**{k: v for k, v in pl.REPORTED_CASE.items() if k != "gpu_memory_utilization"},
                           max_model_len=29_000)
    assert 0.9 < u < 1.0
    at = pl.plan(**{**pl.REPORTED_CASE, "gpu_memory_utilization": u}, max_model_len=29_000)
    below = pl.plan(**{**pl.REPORTED_CASE, "gpu_memory_utilization": u - 1e-6}, max_model_len=29_000)
    assert at.starts and at.num_blocks == math.ceil(29_000 / 16) and not below.starts
    assert pl.min_utilization("Llama-2-70B", "A100 (80 GiB)", max_model_len=4096) is None


def test_no_memory_for_cache_blocks():
    # L4, 24 GiB × 0.62 = 14.88 GiB: less than the 8B model's 14.96 GiB of weights, though the GPU holds them
    p = pl.plan("Llama-3-8B", "L4 (24 GiB)", 0.62, max_model_len=2048)
    assert p.kv_budget_bytes < 0 and p.num_blocks == 0 and p.kv_tokens == 0
    assert p.outcome == "no_cache_blocks" and p.error.startswith("No available memory for the cache blocks.")
    # a budget above zero but under one block is no block either
    tiny = llama(weight_bytes=llama().requested_bytes - GiB - 512 * MiB - 1000)
    assert 0 < tiny.kv_budget_bytes < tiny.block_bytes and tiny.outcome == "no_cache_blocks"


def test_weights_larger_than_the_gpu_are_out_of_memory():
    p = pl.plan("Llama-2-70B", "A100 (80 GiB)", 0.9, max_model_len=4096)
    assert p.outcome == "oom" and "CUDA out of memory" in p.error and p.num_blocks == 0
    assert p.weight_bytes > p.gpu_bytes


def test_two_instances_sharing_one_gpu():
    first, second = pl.plan_shared_gpu("Llama-3-8B", "A100 (80 GiB)", [0.9, 0.9], max_model_len=8192)
    assert first.starts and not second.starts and second.outcome == "startup_free_memory"
    assert second.free_bytes == first.gpu_bytes - first.held_bytes < second.requested_bytes
    assert second.error.startswith("Free memory on device (8.00/80.00 GiB) on startup is less than desired GPU "
                                   "memory utilization (0.9, 72.00 GiB).")
    halves = pl.plan_shared_gpu("Llama-3-8B", "A100 (80 GiB)", [0.45, 0.45], max_model_len=8192)
    assert all(p.starts for p in halves) and halves[0].num_blocks == halves[1].num_blocks
    assert sum(p.held_bytes for p in halves) <= halves[0].gpu_bytes


def test_a_started_instance_holds_its_requested_memory_less_the_unused_budget():
    p = llama()
    assert p.held_bytes == p.weight_bytes + p.activation_bytes + p.non_torch_bytes + p.num_blocks * p.block_bytes
    assert pl.reported_case().held_bytes == 0  # it did not start
    assert sum(p.parts().values()) == p.gpu_bytes


# ---------------------------------------------------------------------------
# properties
# ---------------------------------------------------------------------------

PLAN_ARGS = dict(
    gpu=st.integers(1 * GiB, 200 * GiB),
    util=st.floats(0.05, 1.0),
    weights=st.integers(0, 40 * GiB),
    act=st.integers(0, 4 * GiB),
    non_torch=st.integers(0, GiB),
    block_size=st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128, 256]),
    mml=st.integers(1, 1 << 20),
    model=st.sampled_from(sorted(acc.MODEL_PRESETS)),
)


def make(gpu, util, weights, act, non_torch, block_size, mml, model, kv_dtype="fp16"):
    return pl.plan(model, gpu, util, max_model_len=mml, kv_dtype=kv_dtype, block_size=block_size,
                   weight_bytes=weights, activation_bytes=act, non_torch_bytes=non_torch)


@settings(max_examples=100, deadline=None)
@given(**PLAN_ARGS, more=st.integers(0, 100 * GiB), util_more=st.floats(0.0, 0.5))
def test_more_memory_or_utilisation_never_gives_fewer_blocks(gpu, util, weights, act, non_torch, block_size, mml,
                                                             model, more, util_more):
    p = make(gpu, util, weights, act, non_torch, block_size, mml, model)
    assert make(gpu + more, util, weights, act, non_torch, block_size, mml, model).num_blocks >= p.num_blocks
    u2 = min(util + util_more, 1.0)
    assert make(gpu, u2, weights, act, non_torch, block_size, mml, model).num_blocks >= p.num_blocks


@settings(max_examples=100, deadline=None)
@given(**PLAN_ARGS)
def test_fits_iff_the_pool_holds_one_full_length_sequence(gpu, util, weights, act, non_torch, block_size, mml, model):
    p = make(gpu, util, weights, act, non_torch, block_size, mml, model)
    assert p.fits() == (p.num_blocks * p.block_size >= mml)
    # vLLM V1 asks it in bytes: ceil(max_model_len / B) whole blocks within the budget
    in_bytes = p.kv_budget_bytes > 0 and math.ceil(mml / block_size) * p.block_bytes <= p.kv_budget_bytes
    assert p.fits() == in_bytes
    assert (p.outcome == "max_model_len") == (p.num_blocks > 0 and not p.fits())
    assert p.starts == (p.outcome == "ok") == (p.error is None)


@settings(max_examples=100, deadline=None)
@given(**PLAN_ARGS)
def test_fp8_gives_about_twice_the_blocks_of_fp16(gpu, util, weights, act, non_torch, block_size, mml, model):
    half = make(gpu, util, weights, act, non_torch, block_size, mml, model, kv_dtype="fp16")
    eighth = make(gpu, util, weights, act, non_torch, block_size, mml, model, kv_dtype="fp8")
    assert eighth.block_bytes * 2 == half.block_bytes
    if half.outcome not in ("startup_free_memory", "oom"):
        assert 2 * half.num_blocks <= eighth.num_blocks <= 2 * half.num_blocks + 1


@settings(max_examples=100, deadline=None)
@given(**PLAN_ARGS)
def test_every_byte_of_the_request_is_accounted_for(gpu, util, weights, act, non_torch, block_size, mml, model):
    p = make(gpu, util, weights, act, non_torch, block_size, mml, model)
    if p.kv_budget_bytes >= 0:
        assert (p.weight_bytes + p.activation_bytes + p.non_torch_bytes + p.num_blocks * p.block_bytes
                + p.leftover_bytes) == p.requested_bytes
        assert sum(p.parts().values()) == p.gpu_bytes
    if p.num_blocks:
        assert 0 <= p.leftover_bytes < p.block_bytes


@settings(max_examples=100, deadline=None)
@given(**PLAN_ARGS)
def test_doubling_the_block_size_never_adds_kv_tokens(gpu, util, weights, act, non_torch, block_size, mml, model):
    small = make(gpu, util, weights, act, non_torch, block_size, mml, model)
    big = make(gpu, util, weights, act, non_torch, 2 * block_size, mml, model)
    assert big.kv_tokens <= small.kv_tokens
    if small.kv_budget_bytes > 0:
        assert small.kv_tokens - big.kv_tokens < 2 * block_size  # at most the big block that no longer fits


@settings(max_examples=100, deadline=None)
@given(utils=st.lists(st.floats(0.05, 1.0), min_size=1, max_size=4), gpu=st.integers(20 * GiB, 200 * GiB))
def test_instances_on_one_gpu_never_hold_more_than_it_has(utils, gpu):
    shared = pl.plan_shared_gpu("Llama-2-7B", gpu, utils, max_model_len=1024, activation_bytes=GiB)
    assert sum(p.held_bytes for p in shared) <= gpu
    for p, u in zip(shared, utils):
        assert p.requested_bytes == math.floor(gpu * u)
    if sum(utils) <= 1 and shared[0].starts:  # fractions of the whole GPU that add up to at most one all fit
        assert all(p.outcome != "startup_free_memory" for p in shared)


@settings(max_examples=100, deadline=None)
@given(**PLAN_ARGS)
def test_min_utilization_is_the_boundary(gpu, util, weights, act, non_torch, block_size, mml, model):
    kw = dict(kv_dtype="fp16", block_size=block_size, weight_bytes=weights, activation_bytes=act,
              non_torch_bytes=non_torch)
    u = pl.min_utilization(model, gpu, max_model_len=mml, **kw)
    if u is None:
        assert not pl.plan(model, gpu, 1.0, max_model_len=mml, **kw).starts
    else:
        p = pl.plan(model, gpu, u, max_model_len=mml, **kw)
        need = weights + act + non_torch + math.ceil(mml / block_size) * p.block_bytes
        assert p.starts and p.requested_bytes == need  # exactly one full-length sequence's blocks are left
        lower = u * (1 - 2e-9)  # at least one byte less on a GPU of 1 GiB or more
        assert not pl.plan(model, gpu, lower, max_model_len=mml, **kw).starts


# ---------------------------------------------------------------------------
# concurrency for a length distribution
# ---------------------------------------------------------------------------


def test_concurrency_of_a_length_preset():
    p = llama(block_size=16, max_model_len=4096)
    c = pl.concurrency(p, "chat", seed=0)
    assert c.worst_case == p.num_blocks // (4096 // 16) == int(p.max_concurrency)
    lengths = acc.sample_lengths("chat", p.num_blocks + 1, 4096, 0)
    blocks = [acc.blocks_needed(int(n), 16) for n in lengths]
    assert c.admitted_blocks == sum(blocks[: c.admitted]) <= p.num_blocks < sum(blocks[: c.admitted + 1])
    assert c.mean_blocks == pytest.approx(sum(blocks) / len(blocks))
    assert c.admitted > 5 * c.worst_case  # chat sequences are far shorter than max_model_len
    assert c.expected == pytest.approx(c.admitted, rel=0.1) and c.expected == p.num_blocks / c.mean_blocks
    assert "admitted" in str(c)


@settings(max_examples=60, deadline=None)
@given(blocks_in_pool=st.integers(1, 400), block_size=st.sampled_from([1, 4, 16, 64]),
       lens=st.lists(st.tuples(st.integers(1, 3000), st.integers(1, 3000)), min_size=1, max_size=60))
def test_concurrency_of_requests_admits_in_order_until_one_does_not_fit(blocks_in_pool, block_size, lens):
    per_token = acc.kv_bytes_per_token("Llama-2-7B")
    budget = blocks_in_pool * block_size * per_token
    p = pl.plan("Llama-2-7B", 80 * GiB, 1.0, max_model_len=2048, block_size=block_size, activation_bytes=0,
                non_torch_bytes=0, weight_bytes=80 * GiB - budget)
    assert p.num_blocks == blocks_in_pool
    reqs = [RequestSpec(0.0, a, b) for a, b in lens]
    c = pl.concurrency(p, reqs)
    need = [math.ceil(min(a + b, 2048) / block_size) for a, b in lens]
    k = 0
    while k < len(need) and sum(need[: k + 1]) <= blocks_in_pool:
        k += 1
    assert c.admitted == k and c.num_seqs == len(reqs)
    assert c.admitted >= min(c.worst_case, len(reqs))  # no sequence needs more than a full-length one


# ---------------------------------------------------------------------------
# bad input: the error names the argument
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kw, exc, match", [
    (dict(gpu_memory_utilization=0.0), ValueError, "gpu_memory_utilization"),
    (dict(gpu_memory_utilization=1.5), ValueError, "gpu_memory_utilization"),
    (dict(gpu_memory_utilization="0.9"), TypeError, "gpu_memory_utilization"),
    (dict(gpu_memory_utilization=float("nan")), ValueError, "gpu_memory_utilization"),
    (dict(gpu_memory=0), ValueError, "gpu_memory"),
    (dict(gpu_memory=80.0 * GiB), TypeError, "gpu_memory"),
    (dict(gpu_memory="B200"), ValueError, "gpu_memory"),
    (dict(max_model_len=0), ValueError, "max_model_len"),
    (dict(max_model_len=4096.0), TypeError, "max_model_len"),
    (dict(block_size=0), ValueError, "block_size"),
    (dict(block_size=True), TypeError, "block_size"),
    (dict(kv_dtype="fp4"), ValueError, "kv_dtype"),
    (dict(kv_dtype=1), TypeError, "kv_dtype"),
    (dict(weight_bytes=-1), ValueError, "weight_bytes"),
    (dict(activation_bytes=1.5), TypeError, "activation_bytes"),
    (dict(non_torch_bytes=-1), ValueError, "non_torch_bytes"),
    (dict(other_bytes=81 * GiB), ValueError, "other_bytes"),
    (dict(model="GPT-5"), ValueError, "GPT-5"),
    (dict(model=7), TypeError, "model"),
])
def test_bad_input_names_the_argument(kw, exc, match):
    with pytest.raises(exc, match=match):
        llama(**kw)


def test_bad_input_elsewhere():
    custom = acc.ModelSpec("mine", 2, 4, 4, 16)
    with pytest.raises(ValueError, match="weight_bytes"):
        pl.plan(custom, 4 * GiB, max_model_len=16)  # no parameter count to default from
    assert pl.plan(custom, 4 * GiB, max_model_len=16, weight_bytes=0).starts
    with pytest.raises(TypeError, match="utilizations"):
        pl.plan_shared_gpu("Llama-3-8B", "A100 (80 GiB)", 0.9, max_model_len=8192)
    with pytest.raises(TypeError, match="other_bytes"):
        pl.plan_shared_gpu("Llama-3-8B", "A100 (80 GiB)", [0.4], max_model_len=8192, other_bytes=0)
    with pytest.raises(TypeError, match="workload"):
        pl.concurrency(llama(), [])
    with pytest.raises(TypeError, match="p must be a Plan"):
        pl.concurrency("plan", "chat")
    with pytest.raises(ValueError, match="preset"):
        pl.concurrency(llama(), "no-such-preset")
    with pytest.raises(ValueError, match="kv_budget_bytes|block_bytes"):
        pl.num_kv_blocks(10, 0)
    assert pl.num_kv_blocks(-5, 3) == 0 and pl.num_kv_blocks(10, 3) == 3
