"""Prefill/decode disaggregation: equal tokens, consistent pools, transfers on the clock, faults that change nothing."""

import math
import random
from collections import Counter

import engine_helpers
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import minipaged.disagg as disagg
from minipaged.block_math import blocks_needed
from minipaged.blocks import OutOfBlocks
from minipaged.cache import PagedKVCache
from minipaged.clock import VirtualClock, WallClock
from minipaged.disagg import (
    DISAGG_PRESET,
    DisaggregatedEngine,
    KVLink,
    add_prefilled,
    compare_disaggregation,
    take_prefilled,
    transfer_kv,
)
from minipaged.engine import Engine
from minipaged.generate import generate_contiguous
from minipaged.model import LlamaConfig, LlamaForCausalLM
from minipaged.scheduler import EngineConfig
from minipaged.sequence import SamplingParams, Sequence, SequenceStatus
from minipaged.workload import make_workload

pytestmark = pytest.mark.ch08


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return LlamaForCausalLM(LlamaConfig(), seed=0).eval()


def small(num_blocks, **kw):
    kw = {"block_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 32, "keep_finished": True, **kw}
    return EngineConfig(num_blocks=num_blocks, **kw)


def check_pools(d: DisaggregatedEngine) -> None:
    """Both pools' bookkeeping agrees with the tables that hold blocks, and each request is in one place."""
    in_prefill = [s.block_table for s, _ in d.waiting_transfer] + [t.src_table for t in d.in_flight]
    in_decode = [t.dst_table for t in d.in_flight]
    for engine, transit in ((d.prefill, in_prefill), (d.decode, in_decode)):
        alloc = engine.cache.allocator
        tables = [s.block_table for s in engine.scheduler.running] + transit
        assert all(t is not None and t.allocator is alloc and not t.released for t in tables)
        for t in tables:
            assert len(t.blocks) == blocks_needed(t.num_tokens, alloc.block_size)
        held = Counter(b for t in tables for b in t.blocks)
        assert alloc.refcounts == [held[b] for b in range(alloc.num_blocks)]
        free = alloc.free_queue() if hasattr(alloc, "free_queue") else list(alloc.free_block_ids)
        assert sorted(free) == [b for b in range(alloc.num_blocks) if not held[b]]
        assert all(s.block_table is None for s in engine.scheduler.waiting)  # recompute mode: waiting holds nothing
    places = ([a.request_id for a in d.arrivals]
              + [s.request_id for s in [*d.prefill.scheduler.running, *d.prefill.scheduler.waiting]]
              + [s.request_id for s, _ in d.waiting_transfer] + [t.request_id for t in d.in_flight]
              + [s.request_id for s in [*d.decode.scheduler.running, *d.decode.scheduler.waiting]])  # fmt: skip
    assert len(places) == len(set(places))
    for t in d.in_flight:  # a request on the link holds blocks in both pools and runs in neither engine
        assert t.seq.block_table is t.src_table and t.dst_table.num_tokens == t.num_tokens


def drain(d: DisaggregatedEngine) -> dict:
    """Step to the end, checking the pools after every event; returns request_id -> finished sequence."""
    done, steps = {}, 0
    while d.has_unfinished():
        out = d.step()
        steps += 1
        assert out is not None and steps < 20_000  # no engine may step on the spot forever
        check_pools(d)
        for o in out.outputs:
            done[o.request_id] = o.seqs[0]
    assert d.step() is None
    return done


def assert_all_free(d: DisaggregatedEngine) -> None:
    for engine in (d.prefill, d.decode):
        alloc = engine.cache.allocator
        assert alloc.num_free == alloc.num_blocks and not any(alloc.refcounts)
    assert not d.waiting_transfer and not d.in_flight and not d.arrivals


# ---------------------------------------------------------------- equal tokens


def test_greedy_equals_one_engine_under_preemption_on_both_sides(model):
    rng = random.Random(3)
    vocab = model.config.vocab_size
    requests = [([rng.randrange(vocab) for _ in range(rng.randint(1, 40))], rng.randint(1, 12)) for _ in range(14)]
    # Small pools and few seats on both sides: prefill chunks, preemption in both engines, transfers that wait.
    d = DisaggregatedEngine(model, small(14, max_num_batched_tokens=16), small(18, max_num_seqs=3),
                            KVLink(bandwidth=1e9))  # fmt: skip
    ids = [d.add_request(p, SamplingParams(max_tokens=n), arrival_time=0.004 * i) for i, (p, n) in enumerate(requests)]
    done = drain(d)
    assert d.prefill.metrics.num_preemptions > 0 and d.decode.metrics.num_preemptions > 0
    assert any(t.wait > 0 for t in d.transfers)
    for i, (prompt, n) in zip(ids, requests):
        assert done[i].status is SequenceStatus.FINISHED
        assert done[i].output_token_ids == generate_contiguous(model, prompt, n), f"request {i} differs"
    assert len(d.transfers) == sum(n > 1 for _, n in requests)  # a one-token request never leaves the prefill engine
    assert_all_free(d)


def test_generate_equals_engine_generate_with_stop_tokens_and_sampling(model):
    rng = random.Random(8)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(2, 30))] for _ in range(6)]
    ref_engine = Engine(model, EngineConfig(num_blocks=64, block_size=4))
    greedy = ref_engine.generate(prompts, SamplingParams(max_tokens=10))
    stop = greedy[0][3]  # a token greedy decoding meets: requests stop there (one maybe at its first token)
    params = SamplingParams(max_tokens=10, stop_token_ids=(stop,))
    want = Engine(model, EngineConfig(num_blocks=64, block_size=4)).generate(prompts, params)
    assert DisaggregatedEngine(model, small(20), small(20)).generate(prompts, params) == want
    assert any(len(w) < 10 for w in want)
    # Seeded sampling: the per-request generator travels with the sequence.
    sampled = SamplingParams(max_tokens=8, temperature=0.9, seed=11)
    want = Engine(model, EngineConfig(num_blocks=64, block_size=4)).generate(prompts, sampled)
    assert DisaggregatedEngine(model, small(20), small(20)).generate(prompts, sampled) == want


def test_stopping_rules_travel_with_the_request_from_prefill_to_decode(model):
    """The EOS may end a request in the prefill engine; min_tokens and ignore_eos keep it going, past the hand-over."""
    prompt = [5, 6, 7, 8]
    free = generate_contiguous(model, prompt, 10)
    eos_model = engine_helpers.with_eos(model, free[0])  # its first token is the EOS
    rng = random.Random(4)
    requests = [(prompt, SamplingParams(max_tokens=10)), (prompt, SamplingParams(max_tokens=10, min_tokens=6)),
                (prompt, SamplingParams(max_tokens=10, ignore_eos=True))]
    requests += [(p, engine_helpers.stop_params(rng.randint, eos_model, p, n)) for p, n in
                 [([rng.randrange(512) for _ in range(rng.randint(2, 30))], rng.randint(1, 12)) for _ in range(10)]]
    d = DisaggregatedEngine(eos_model, small(16, max_num_batched_tokens=16), small(16, max_num_seqs=3),
                            KVLink(bandwidth=1e9))  # fmt: skip
    ids = [d.add_request(p, params, arrival_time=0.002 * i) for i, (p, params) in enumerate(requests)]
    done = drain(d)
    moved = {t.request_id for t in d.transfers}
    for i, (prompt, params) in zip(ids, requests):
        assert done[i].output_token_ids == engine_helpers.reference(eos_model, prompt, params), f"request {i}"
        engine_helpers.check_finished(done[i])
        assert done[i].sampling_params.max_tokens == params.max_tokens  # the prefill engine's cap is gone
        assert done[i].sampling_params.min_tokens == params.min_tokens
    first, late, ignoring = (done[i] for i in ids[:3])
    assert (first.output_token_ids, first.finish_reason, ids[0] in moved) == ([free[0]], "stop", False)
    assert len(late.output_token_ids) >= 6 and ids[1] in moved  # wrong: min_tokens capped by the prefill engine's 2
    assert ignoring.output_token_ids == free and ignoring.finish_reason == "length"
    assert_all_free(d)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 36), st.integers(1, 9), st.integers(0, 3)), min_size=1, max_size=8),
    st.integers(10, 24),
    st.integers(10, 24),
    st.integers(1, 4),
    st.sampled_from([8, 16, 64]),
    st.booleans(),
    st.sampled_from([1e8, 1e9, 25e9]),
    st.sampled_from(["recompute", "swap"]),
    st.booleans(),
    st.integers(0, 2**16),
)
def test_property_tokens_and_pools(model, specs, prefill_blocks, decode_blocks, seats, budget, caching, bw, mode,
                                   chunked, seed):  # fmt: skip
    """Any workload (shared prefixes included): every step leaves both pools consistent; outputs equal one engine's."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(512) for _ in range(12)] for _ in range(2)]
    cfg = {"block_size": 4, "max_num_seqs": seats, "max_num_batched_tokens": budget, "preemption_mode": mode,
           "chunked_prefill": chunked}  # fmt: skip
    alloc = engine_helpers.allocator_for(caching)
    d = DisaggregatedEngine(model, small(prefill_blocks, **cfg), small(decode_blocks, **cfg), KVLink(bandwidth=bw),
                            prefill_allocator=alloc, decode_allocator=alloc)  # fmt: skip
    ref = Engine(model, EngineConfig(num_blocks=64, block_size=4, keep_finished=True))
    ids = []
    for i, (length, n, gap) in enumerate(specs):
        shared = prefixes[i % 2][: rng.randint(0, 12)] if i % 3 else []
        prompt = shared + [rng.randrange(512) for _ in range(length)]
        params = SamplingParams(max_tokens=n)
        try:
            rid = d.add_request(prompt, params, arrival_time=0.005 * gap * i)
        except ValueError as exc:  # too big for a pool or (unchunked) a step: refused before anything changed
            assert "needs up to" in str(exc) or "enable chunked_prefill" in str(exc)
            continue
        ids.append((rid, ref.add_request(prompt, params)))
    done = drain(d)
    while ref.has_unfinished():
        ref.step()
    for rid, ref_id in ids:
        assert done[rid].output_token_ids == ref.seqs[ref_id].output_token_ids
    assert_all_free(d)
    assert not d.prefill.swap_space and not d.decode.swap_space
    for t in d.transfers:  # the clock: ready -> (wait) -> start -> bytes / bandwidth -> end; one transfer at a time
        assert t.ready_time <= t.start_time < t.end_time
        assert math.isclose(t.end_time - t.start_time, t.num_bytes / bw)
        assert t.num_bytes == t.num_blocks * 4 * KVLink().bytes_per_token
    for a, b in zip(d.transfers, d.transfers[1:]):
        assert b.start_time >= a.end_time - 1e-12


def test_decode_starts_only_after_the_transfer_and_prefill_cache_is_kept(model):
    prompt = list(range(1, 30))
    d = DisaggregatedEngine(model, small(20), small(20), KVLink(bandwidth=1e8))  # slow link: 1 ms per 200 KB
    d.add_request(prompt, SamplingParams(max_tokens=4), request_id="a")
    events = []
    while d.has_unfinished():
        out = d.step()
        events.append(out.kind)
        check_pools(d)
    assert events[:4] == ["arrive", "prefill", "transfer_start", "transfer_end"]
    (t,) = d.transfers
    a = d.decode.seqs["a"]
    assert a.token_times[0] == t.ready_time  # the first token comes from the prefill engine
    assert a.token_times[1] > t.end_time  # the second from a decode step that began when the K/V had arrived
    assert t.num_tokens == len(prompt) and t.num_blocks == blocks_needed(len(prompt), 4)
    # The prompt's full blocks stay cached in the prefill pool: the same prefix again skips them.
    assert d.prefill.cache.allocator.num_cached_blocks == len(prompt) // 4
    d.add_request(prompt + [7, 7], SamplingParams(max_tokens=2), request_id="b")
    drain(d)
    assert d.prefill.metrics.prefix_cache.hits == (len(prompt) // 4) * 4


# ---------------------------------------------------------------- the transfer


def test_transfer_kv_copies_every_layer_and_is_all_or_nothing(model, monkeypatch):
    src = Engine(model, small(12))
    src.add_request(list(range(3, 22)), SamplingParams(max_tokens=3), request_id="r")
    src.step()
    seq = take_prefilled(src, "r")
    mc = model.config
    dst = PagedKVCache(mc.num_hidden_layers, 10, 4, mc.num_key_value_heads, mc.head_dim)
    table = transfer_kv(seq, src.cache, dst)
    assert table.allocator is dst.allocator and table.num_tokens == 19 and dst.allocator.num_used == 5
    for layer in range(mc.num_hidden_layers):
        for a, b in zip(src.cache.gather(layer, seq.block_table), dst.gather(layer, table)):
            assert torch.equal(a, b)
    taken = dst.allocator.allocate()  # 4 free blocks left, 5 needed
    before = (dst.allocator.refcounts, list(dst.allocator.free_block_ids), src.cache.allocator.refcounts)
    with pytest.raises(OutOfBlocks):
        transfer_kv(seq, src.cache, dst)
    assert (dst.allocator.refcounts, list(dst.allocator.free_block_ids), src.cache.allocator.refcounts) == before
    dst.allocator.free(taken)
    before = (dst.allocator.refcounts, list(dst.allocator.free_block_ids), src.cache.allocator.refcounts)

    def broken(*args):
        raise RuntimeError("link down")

    monkeypatch.setattr(disagg, "swap_in", broken)
    with pytest.raises(RuntimeError, match="link down"):
        transfer_kv(seq, src.cache, dst)
    assert dst.allocator.refcounts == before[0] and src.cache.allocator.refcounts == before[2]
    assert sorted(dst.allocator.free_block_ids) == sorted(before[1])
    assert seq.block_table.allocator is src.cache.allocator


def test_transfer_kv_bad_inputs(model):
    src = Engine(model, small(12))
    src.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=3), request_id="r")
    src.step()
    seq = take_prefilled(src, "r")
    mc = model.config
    dst = PagedKVCache(mc.num_hidden_layers, 10, 4, mc.num_key_value_heads, mc.head_dim)
    with pytest.raises(TypeError, match="seq"):
        transfer_kv("r", src.cache, dst)
    with pytest.raises(TypeError, match="dst"):
        transfer_kv(seq, src.cache, object())
    with pytest.raises(ValueError, match="two pools"):
        transfer_kv(seq, src.cache, src.cache)
    with pytest.raises(ValueError, match="block_size"):
        transfer_kv(seq, src.cache, PagedKVCache(mc.num_hidden_layers, 10, 8, mc.num_key_value_heads, mc.head_dim))
    with pytest.raises(ValueError, match="live table of src"):
        transfer_kv(seq, dst, src.cache)
    fresh = Sequence("x", [1, 2], SamplingParams())
    with pytest.raises(ValueError, match="live table"):
        transfer_kv(fresh, src.cache, dst)
    assert dst.allocator.num_free == 10


# ---------------------------------------------------------------- the engine hooks


def test_take_and_add_prefilled_check_everything_first(model):
    e = Engine(model, small(12))
    e.add_request([1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=4), request_id="r")
    e.add_request(list(range(40)), SamplingParams(max_tokens=2, n=2), request_id="n2")
    with pytest.raises(KeyError):
        take_prefilled(e, "nope")
    with pytest.raises(ValueError, match="must be running"):
        take_prefilled(e, "r")  # still waiting
    e.step()  # r: prompt + first token; n2: a first chunk only
    with pytest.raises(ValueError, match="2 samples"):
        take_prefilled(e, "n2")
    running = list(e.scheduler.running)
    assert "n2" in e.requests and len(running) == 2  # the refusals changed nothing
    seq = take_prefilled(e, "r")
    assert "r" not in e.seqs and seq not in e.scheduler.running and seq.block_table.num_tokens == 6

    d = Engine(model, small(12, max_num_seqs=1))
    with pytest.raises(TypeError, match="seq must be a Sequence"):
        add_prefilled(d, "r")
    with pytest.raises(ValueError, match="live table of this engine's pool"):
        add_prefilled(d, seq)  # its table is still the first engine's
    seq.block_table = transfer_kv(seq, e.cache, d.cache)
    d.add_request([9, 9], SamplingParams(max_tokens=2), request_id="other")
    d.step()
    with pytest.raises(ValueError, match="no free seat"):
        add_prefilled(d, seq)
    assert seq not in d.scheduler.running and "r" not in d.seqs and "r" not in d.requests
    d.step()
    assert not d.has_unfinished()
    add_prefilled(d, seq)
    with pytest.raises(ValueError, match="already in use"):
        add_prefilled(d, seq)
    while d.has_unfinished():
        d.step()
    assert seq.output_token_ids == generate_contiguous(model, [1, 2, 3, 4, 5, 6], 4)


# ---------------------------------------------------------------- faults and bad input


def engine_state(d, engine):
    running = engine.scheduler.running
    return (engine.cache.allocator.refcounts, [s.num_computed_tokens for s in running], engine.clock.now(),
            len(d.waiting_transfer), len(d.in_flight))  # fmt: skip


def test_a_failing_engine_step_changes_nothing_and_the_run_goes_on(model, monkeypatch):
    rng = random.Random(1)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(3, 25))] for _ in range(5)]
    d = DisaggregatedEngine(model, small(16), small(16))
    for p in prompts:
        d.add_request(p, SamplingParams(max_tokens=6))
    kinds, original = set(), LlamaForCausalLM.forward
    while d.has_unfinished():
        kind = d.next_event()[1]
        if kind in ("prefill", "decode") and kind not in kinds:
            kinds.add(kind)
            engine = d.prefill if kind == "prefill" else d.decode
            before = engine_state(d, engine)

            def boom(*args, **kwargs):
                raise RuntimeError("device lost")

            monkeypatch.setattr(LlamaForCausalLM, "forward", boom)
            with pytest.raises(RuntimeError, match="device lost"):
                d.step()
            monkeypatch.setattr(LlamaForCausalLM, "forward", original)
            assert engine_state(d, engine) == before
            check_pools(d)
        d.step()
        check_pools(d)
    assert kinds == {"prefill", "decode"}
    assert_all_free(d)


def test_a_failing_transfer_end_changes_nothing(model, monkeypatch):
    d = DisaggregatedEngine(model, small(16), small(16))
    d.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=3), request_id="r")
    while d.next_event()[1] != "transfer_end":
        d.step()
    t = d.in_flight[0]

    def refuse(seq):
        raise ValueError("no")

    monkeypatch.setattr("minipaged.disagg.add_prefilled", lambda engine, seq: refuse(seq))
    with pytest.raises(ValueError, match="no"):
        d.step()
    assert d.in_flight[0] is t and t.seq.block_table is t.src_table
    check_pools(d)
    monkeypatch.undo()
    drain(d)
    assert_all_free(d)


def test_bad_inputs_name_the_argument_and_change_nothing(model):
    with pytest.raises(TypeError, match="prefill_config"):
        DisaggregatedEngine(model, prefill_config={"num_blocks": 4})
    with pytest.raises(TypeError, match="link"):
        DisaggregatedEngine(model, link=25e9)
    with pytest.raises(TypeError, match="decode_clock must be a VirtualClock"):
        DisaggregatedEngine(model, decode_clock=WallClock())
    clock = VirtualClock()
    with pytest.raises(ValueError, match="two clocks"):
        DisaggregatedEngine(model, prefill_clock=clock, decode_clock=clock)
    with pytest.raises(ValueError, match="block_size"):
        DisaggregatedEngine(model, small(8), small(8, block_size=8))
    for bad, err in ((0, ValueError), (-1.0, ValueError), (math.nan, ValueError), ("x", TypeError), (True, TypeError)):
        with pytest.raises(err, match="KVLink.bandwidth"):
            KVLink(bandwidth=bad)
    with pytest.raises(TypeError, match="KVLink.bytes_per_token"):
        KVLink(bytes_per_token=1.5)

    d = DisaggregatedEngine(model, small(8), small(6))
    with pytest.raises(ValueError, match="sampling_params.n must be 1"):
        d.add_request([1, 2], SamplingParams(n=2))
    with pytest.raises(ValueError, match="decode engine's pool"):
        d.add_request([1] * 10, SamplingParams(max_tokens=20))  # 29 tokens: 8 blocks > 6
    with pytest.raises(ValueError, match="prefill engine's pool"):
        d.add_request([1] * 40, SamplingParams(max_tokens=1))
    with pytest.raises(TypeError, match="arrival_time"):
        d.add_request([1, 2], arrival_time="soon")
    with pytest.raises(TypeError, match="cache_salt"):
        d.add_request([1, 2], cache_salt=3)
    with pytest.raises(TypeError, match="request_id must be hashable"):
        d.add_request([1, 2], request_id=[1])
    with pytest.raises(ValueError, match="prompt_token_ids"):
        d.add_request([1, 9999])
    d.add_request([1, 2], request_id="x")
    with pytest.raises(ValueError, match="already in use"):
        d.add_request([3], request_id="x")
    with pytest.raises(ValueError, match="decode engine's pool"):  # the whole run is refused, nothing queued
        d.generate([[1, 2], [1] * 10], SamplingParams(max_tokens=20))
    assert [a.request_id for a in d.arrivals] == ["x"]
    assert d.generate([[4, 5, 6]], SamplingParams(max_tokens=3)) == [generate_contiguous(model, [4, 5, 6], 3)]


# ---------------------------------------------------------------- the measurement


def test_compare_disaggregation_equal_memory_decoupled_latency(model):
    workload = make_workload(12, rate=18, preset=DISAGG_PRESET, seed=1)
    cmp = compare_disaggregation(model, workload, prefill_blocks=64, decode_blocks=128)
    assert list(cmp.summaries) == ["mixed", "2 x mixed", "disaggregated"]
    assert cmp.engines["mixed"][0].config.num_blocks == 64 + 128  # equal total memory
    assert [e.config.num_blocks for e in cmp.engines["2 x mixed"]] == [64, 128]
    prefill, decode = cmp.engines["disaggregated"]
    assert (prefill.config.num_blocks, decode.config.num_blocks) == (64, 128)
    assert all(s["requests"] == 12 for s in cmp.summaries.values())
    # The same tokens in every setup (greedy), so the same work: throughput is set by the arrivals here.
    outs = {name: sorted(tuple(s.output_token_ids) for e in engines for s in e.seqs.values())
            for name, engines in cmp.engines.items()}  # fmt: skip
    assert len(outs["mixed"]) == 12 and outs["mixed"] == outs["2 x mixed"] == outs["disaggregated"]
    # The decode engine's steps carry no prompt (nobody is preempted here); the mixed engine's do, and TPOT shows it.
    assert decode.metrics.num_preemptions == 0 and not any(r.num_prefill_tokens for r in decode.metrics.history)
    assert any(r.num_prefill_tokens and r.num_running > 1 for r in cmp.engines["mixed"][0].metrics.history)
    for p in (50, 90, 99):
        assert cmp.summaries["disaggregated"][f"tpot_p{p}"] < cmp.summaries["mixed"][f"tpot_p{p}"]
    # The same work everywhere: throughput differs only by how long each setup takes to finish it.
    tokens = {s["output_tokens"] for s in cmp.summaries.values()}
    assert len(tokens) == 1 and cmp.ratio("tokens_per_s") == pytest.approx(
        cmp.summaries["mixed"]["duration_s"] / cmp.summaries["disaggregated"]["duration_s"])
    assert len(cmp.transfers) == 12 and "KV transfers" in cmp.describe()
    again = compare_disaggregation(model, workload, prefill_blocks=64, decode_blocks=128)
    assert again.summaries == cmp.summaries  # deterministic: virtual time only


def test_bench_prints_its_ratios(capsys):
    from minipaged.bench.disagg import main

    assert main(["--requests", "3", "--rates", "inf", "--bandwidths", "25e9", "--sweep-rate", "inf"]) == 0
    out = capsys.readouterr().out
    assert "throughput disaggregated / 2 x mixed" in out and "25 GB/s: transfer" in out and "never at once" in out
    with pytest.raises(SystemExit):
        main(["--rates", "0"])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_abort_anywhere_frees_both_pools(model, seed):
    rng = random.Random(seed)
    requests = [([rng.randrange(512) for _ in range(rng.randint(2, 30))], rng.randint(2, 8)) for _ in range(10)]
    d = DisaggregatedEngine(model, small(14), small(16, max_num_seqs=2), KVLink(bandwidth=2e8))
    ids = [d.add_request(p, SamplingParams(max_tokens=n), arrival_time=0.01 * i) for i, (p, n) in enumerate(requests)]
    aborted, where, done = set(), set(), {}
    while d.has_unfinished():
        live = [i for i in ids if i not in aborted and i not in done]
        if live and rng.random() < 0.15:
            rid = rng.choice(live)
            where.add("arrivals" if rid in [a.request_id for a in d.arrivals] else
                      "prefill" if rid in d.prefill.requests else "decode" if rid in d.decode.requests else
                      "link" if rid in [t.request_id for t in d.in_flight] else "waiting_transfer")  # fmt: skip
            d.abort(rid)
            aborted.add(rid)
            check_pools(d)
            with pytest.raises(KeyError):
                d.abort(rid)
            continue
        out = d.step()
        check_pools(d)
        done.update({o.request_id: o.seqs[0] for o in out.outputs})
    assert aborted and len(where) >= 2
    assert_all_free(d)
    for i, (prompt, n) in zip(ids, requests):
        if i not in aborted:
            assert done[i].output_token_ids == generate_contiguous(model, prompt, n)


@pytest.mark.parametrize("seed", [134, 138])
def test_decode_engine_waits_for_a_transfer_instead_of_spinning(model, seed):
    """Regression (found by fuzzing): a request the decode engine preempted cannot come back while a transfer holds
    its blocks; the decode engine must wait for that transfer to end, not step on the spot forever."""
    rng = random.Random(seed)
    cfg = {"max_num_seqs": rng.randint(1, 4), "max_num_batched_tokens": rng.choice([8, 16, 64])}
    alloc = engine_helpers.allocator_for(rng.random() < 0.5)
    cfg |= {"preemption_mode": rng.choice(["recompute", "swap"]), "chunked_prefill": rng.random() < 0.5}
    pb, db = rng.randint(10, 24), rng.randint(10, 24)
    d = DisaggregatedEngine(model, small(pb, **cfg), small(db, **cfg), KVLink(bandwidth=rng.choice([1e8, 1e9, 25e9])),
                            prefill_allocator=alloc, decode_allocator=alloc)  # fmt: skip
    prefixes = [[rng.randrange(512) for _ in range(12)] for _ in range(2)]
    requests = {}
    for i in range(rng.randint(1, 8)):
        shared = prefixes[i % 2][: rng.randint(0, 12)] if i % 3 else []
        prompt = shared + [rng.randrange(512) for _ in range(rng.randint(1, 36))]
        n, arrival = rng.randint(1, 9), 0.005 * rng.randint(0, 3) * i
        try:
            requests[d.add_request(prompt, SamplingParams(max_tokens=n), arrival_time=arrival)] = (prompt, n)
        except ValueError:
            pass
    done = drain(d)
    assert any(not r.num_batched_tokens for r in d.decode.metrics.history)  # the decode engine did have to wait
    assert_all_free(d)
    for rid, (prompt, n) in requests.items():
        assert done[rid].output_token_ids == generate_contiguous(model, prompt, n)


def test_blocks_the_decode_pool_has_cached_are_shared_not_moved(model):
    prefix = list(range(40, 52))  # 3 full blocks of 4
    d = DisaggregatedEngine(model, small(20), small(20), KVLink(bandwidth=1e9))
    d.add_request(prefix + [1, 2], SamplingParams(max_tokens=3), request_id="first")
    drain(d)
    d.add_request(prefix + [9, 8, 7, 6, 5], SamplingParams(max_tokens=4), request_id="second")
    done = drain(d)
    first, second = d.transfers
    assert (first.num_hit_blocks, first.num_blocks) == (0, 4)
    assert (second.num_hit_blocks, second.num_blocks) == (3, 2)  # 17 tokens: 5 blocks, 3 of them cached there
    assert second.num_bytes == 2 * 4 * KVLink().bytes_per_token
    assert d.decode.metrics.prefix_cache.hits == 12
    assert done["second"].output_token_ids == generate_contiguous(model, prefix + [9, 8, 7, 6, 5], 4)
    assert_all_free(d)
    # Without caching in the decode engine every block moves.
    d = DisaggregatedEngine(model, small(20), small(20), decode_allocator=engine_helpers.allocator_for(False))
    d.generate([prefix + [1, 2], prefix + [9, 8, 7, 6, 5]], SamplingParams(max_tokens=3))
    assert [t.num_hit_blocks for t in d.transfers] == [0, 0] and d.transfers[1].num_blocks == 5
