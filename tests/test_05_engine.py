"""The engine end to end with the tiny model: outputs, memory, metrics, errors, and the static baseline."""

import math
import random
from collections import Counter
from dataclasses import replace

import engine_helpers
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minipaged.clock import VirtualClock
from minipaged.engine import Engine
from minipaged.generate import forward_contiguous, generate_contiguous
from minipaged.latency import percentiles, summarize
from minipaged.model import LlamaConfig, LlamaForCausalLM
from minipaged.scheduler import EngineConfig
from minipaged.sequence import SamplingParams, SequenceStatus
from minipaged.static_batching import static_engine
from minipaged.workload import RequestSpec, make_workload

pytestmark = pytest.mark.ch05


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)  # tiny matmuls; threads only add contention
    return LlamaForCausalLM(LlamaConfig(), seed=0).eval()


@pytest.fixture(scope="module")
def eos_model(model):
    return engine_helpers.with_eos(model, engine_helpers.STOP_EOS)


def random_requests(rng, n, vocab, max_prompt=40, max_out=12):
    """``n`` (prompt token ids, max_tokens) pairs."""
    return [
        ([rng.randrange(vocab) for _ in range(rng.randint(1, max_prompt))], rng.randint(1, max_out)) for _ in range(n)
    ]


def add_request(engine, i, request):
    prompt, n = request
    engine.add_request(prompt, SamplingParams(max_tokens=n), request_id=f"r{i}")


def drive(engine, requests, rng, abort_prob=0.0, arrivals_per_step=2):
    """Add requests (prompt, max_tokens) a few per step, abort some at random; return the ids that were aborted."""
    return engine_helpers.drive(engine, requests, rng, add_request, abort_prob, arrivals_per_step=arrivals_per_step)


@pytest.mark.parametrize("chunked, mode", [(True, "recompute"), (False, "recompute"), (True, "swap"), (False, "swap")])
def test_outputs_match_contiguous_under_preemption_chunking_and_aborts(model, chunked, mode):
    rng = random.Random(5 + chunked)
    # 20 blocks of 4 slots for up to 8 sequences that each grow to ~13 blocks: preemption is certain.
    config = EngineConfig(num_blocks=20, block_size=4, max_num_seqs=8, max_num_batched_tokens=64 if not chunked else 24,
                          chunked_prefill=chunked, preemption_mode=mode, keep_finished=True)
    engine = Engine(model, config)
    requests = random_requests(rng, 16, model.config.vocab_size)
    aborted = drive(engine, requests, rng, abort_prob=0.08)
    assert engine.metrics.num_preemptions > 0
    assert engine.cache.allocator.num_free == config.num_blocks  # nothing leaked
    assert not engine.swap_space  # nothing left parked in CPU memory either
    if mode == "swap":
        assert engine.metrics.swapped_out_blocks > 0 and engine.metrics.swapped_in_blocks > 0
    if chunked:
        assert any(0 < r.num_prefill_tokens and r.num_batched_tokens == 24 for r in engine.metrics.history)
    finished = 0
    for i, (prompt, n) in enumerate(requests):
        seq = engine.seqs[f"r{i}"]
        if f"r{i}" in aborted:
            assert seq.status is SequenceStatus.ABORTED and seq.block_table is None
            continue
        assert seq.status is SequenceStatus.FINISHED
        assert seq.output_token_ids == generate_contiguous(model, prompt, n), f"request r{i} differs"
        finished += 1
    assert finished >= 8


def add_stopping_request(engine, i, request):
    prompt, params = request
    engine.add_request(prompt, params, request_id=f"r{i}")


def run_with_stops(model, config, requests, rng, abort_prob, caching=False):
    """Drive ``(prompt, params)`` requests; after every step the ones that finished hold no block.

    Returns the count of each finish reason, having checked every output against the reference.
    """
    engine = Engine(model, config, allocator=engine_helpers.allocator_for(caching))

    def step():
        out = engine.step()
        for seq_id in out.finished:
            engine_helpers.check_finished(engine.seqs[seq_id])  # its blocks are free from this step on

    aborted = engine_helpers.drive(engine, requests, rng, add_stopping_request, abort_prob, step)
    assert engine.cache.allocator.num_free == config.num_blocks and not engine.swap_space
    reasons = Counter()
    for i, (prompt, params) in enumerate(requests):
        seq = engine.seqs[f"r{i}"]
        if f"r{i}" in aborted:
            assert (seq.status, seq.finish_reason, seq.stop_reason) == (SequenceStatus.ABORTED, "abort", None)
            reasons["abort"] += 1
            continue
        assert seq.output_token_ids == engine_helpers.reference(model, prompt, params), f"request r{i} differs"
        reasons[engine_helpers.check_finished(seq)] += 1
    return engine, reasons


@pytest.mark.parametrize("chunked, mode", [(True, "recompute"), (False, "swap")])
def test_outputs_with_stops_match_contiguous_under_preemption_and_chunking(eos_model, chunked, mode):
    rng = random.Random(21 + chunked)
    config = EngineConfig(num_blocks=20, block_size=4, max_num_seqs=8, max_num_batched_tokens=64 if not chunked else 24,
                          chunked_prefill=chunked, preemption_mode=mode, keep_finished=True)  # fmt: skip
    requests = [(p, engine_helpers.stop_params(rng.randint, eos_model, p, n))
                for p, n in random_requests(rng, 16, eos_model.config.vocab_size)]  # fmt: skip
    engine, reasons = run_with_stops(eos_model, config, requests, rng, abort_prob=0.05, caching=True)
    assert engine.metrics.num_preemptions > 0
    assert reasons["stop"] >= 3 and reasons["length"] >= 3 and reasons["abort"] >= 1, reasons
    stopped = [s for s in engine.seqs.values() if s.finish_reason == "stop"]
    eos_ids = engine_helpers.STOP_EOS
    assert any(s.stop_reason is None or s.stop_reason in eos_ids[1:] for s in stopped)  # by the checkpoint's EOS
    assert any(s.stop_reason in s.sampling_params.stop_token_ids for s in stopped)  # and by the caller's stop tokens
    masked = [s for s in engine.seqs.values() if s.finish_reason != "abort" and s.output_token_ids !=
              engine_helpers.reference(eos_model, s.prompt_token_ids, replace(s.sampling_params, min_tokens=0))]
    assert masked  # min_tokens changed some outputs: a stop token came up before it and was masked


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10**6), num_blocks=st.integers(14, 30), chunked=st.booleans(),
       mode=st.sampled_from(["recompute", "swap"]), caching=st.booleans(), data=st.data())
def test_random_workloads_with_stops_match_contiguous(eos_model, seed, num_blocks, chunked, mode, caching, data):
    rng = random.Random(seed)
    config = EngineConfig(num_blocks=num_blocks, block_size=4, max_num_seqs=6, keep_finished=True,
                          max_num_batched_tokens=16 if chunked else 64, chunked_prefill=chunked,
                          preemption_mode=mode)  # fmt: skip
    pick = engine_helpers.hypothesis_pick(data)
    requests = [(p, engine_helpers.stop_params(pick, eos_model, p, n))
                for p, n in random_requests(rng, 8, eos_model.config.vocab_size, max_prompt=30)]  # fmt: skip
    run_with_stops(eos_model, config, requests, rng, abort_prob=0.05, caching=caching)


def test_ignore_eos_and_stop_token_ids_against_named_wrong_behaviours(model):
    prompt = [1, 2, 3]
    free = generate_contiguous(model, prompt, 12)
    eos = free[2]
    assert eos not in free[:2]
    with_eos = engine_helpers.with_eos(model, eos)
    engine = Engine(with_eos, EngineConfig(keep_finished=True))
    ids = {name: engine.add_request(prompt, params) for name, params in {
        "default": SamplingParams(max_tokens=12),
        "ignore_eos": SamplingParams(max_tokens=12, ignore_eos=True),
        "ignore_eos, a stop token": SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(free[6],)),
        "a stop token at the last allowed token": SamplingParams(max_tokens=2, stop_token_ids=(free[1],)),
    }.items()}  # fmt: skip
    while engine.has_unfinished():
        engine.step()
    seq = {name: engine.seqs[i] for name, i in ids.items()}
    out = {name: s.output_token_ids for name, s in seq.items()}
    assert out["default"] == free[:3]  # wrong: running past the EOS, or dropping it from the output
    assert (seq["default"].finish_reason, seq["default"].stop_reason) == ("stop", None)
    assert out["ignore_eos"] == free  # wrong: the EOS still stops it, or is left out of the output
    assert seq["ignore_eos"].finish_reason == "length"
    assert out["ignore_eos, a stop token"] == free[: free.index(free[6]) + 1]  # wrong: ignore_eos ignores them too
    assert seq["ignore_eos, a stop token"].stop_reason == free[6]
    last = seq["a stop token at the last allowed token"]
    assert (last.finish_reason, last.stop_reason) == ("stop", free[1])  # stop is checked before length, as in vLLM
    # A workload's num_output_tokens means exactly that many tokens, although the EOS comes up early.
    done = Engine(with_eos).run([RequestSpec(0.0, 3, 12), RequestSpec(0.0, 3, 5)], progress=False, prompts=[prompt] * 2)
    assert [s.output_token_ids for s in done] == [free, free[:5]]
    assert [s.finish_reason for s in done] == ["length", "length"]
    # A further EOS id of the checkpoint stops too and reports its id (vLLM's generation-config EOS ids);
    # RequestOutput says so per sample.
    two = Engine(engine_helpers.with_eos(model, (free[5], eos)))
    two.add_request(prompt, SamplingParams(max_tokens=12, n=2))
    outputs = []
    while two.has_unfinished():
        outputs += two.step().outputs
    [o] = outputs
    assert (o.output_token_ids, o.finish_reason, o.stop_reason) == ([free[:3]] * 2, ["stop"] * 2, [eos] * 2)


def test_min_tokens_against_named_wrong_behaviours(model):
    prompt = [1, 2, 3]
    free = generate_contiguous(model, prompt, 12)
    eos, stop = free[2], free[4]
    assert eos not in free[:2] and stop not in free[:4]
    with_eos = engine_helpers.with_eos(model, eos)

    def run(**params):
        engine = Engine(with_eos, EngineConfig(keep_finished=True))
        rid = engine.add_request(prompt, SamplingParams(max_tokens=12, stop_token_ids=(stop,), **params))
        while engine.has_unfinished():
            engine.step()
        return engine.seqs[rid]

    def masked_argmax(tokens):
        """The greedy token after ``prompt + tokens`` with the EOS and the stop token masked (computed afresh)."""
        ids = torch.tensor(prompt + tokens)
        row = forward_contiguous(with_eos, ids, torch.arange(len(ids)))[0][-1].clone()
        row[[eos, stop]] = float("-inf")
        return int(row.argmax())

    assert run().output_token_ids == free[:3]
    at_eos = run(min_tokens=3).output_token_ids  # the EOS at position 2 is masked, so the next-best token comes
    assert len(at_eos) > 3  # wrong: stopping before min_tokens
    assert at_eos[2] != eos and at_eos[2] == masked_argmax(free[:2])  # wrong: not stopping but keeping the EOS
    assert stop not in at_eos[:3] and eos not in at_eos[:3]
    assert run(min_tokens=2).output_token_ids == free[:3]  # wrong: masking past min_tokens (one row too many)
    ignoring = run(min_tokens=3, ignore_eos=True).output_token_ids
    assert ignoring[2] == masked_argmax(free[:2])  # vLLM masks the EOS before min_tokens even with ignore_eos
    for seq in (run(min_tokens=3), run(min_tokens=12)):
        assert seq.output_token_ids == engine_helpers.reference(with_eos, prompt, seq.sampling_params)
        engine_helpers.check_finished(seq)


def test_static_batching_outputs_match_and_batches_wait_for_the_longest(model):
    rng = random.Random(11)
    requests = random_requests(rng, 10, model.config.vocab_size, max_prompt=20, max_out=10)
    config = EngineConfig(keep_finished=True, num_blocks=24, block_size=4, max_num_seqs=8)
    engine = static_engine(model, config, max_model_len=30)  # 8 blocks per reservation: batches of 3
    assert engine.scheduler.batch_size == 3
    for i, (prompt, n) in enumerate(requests):
        engine.add_request(prompt, SamplingParams(max_tokens=n), request_id=i)
    while engine.has_unfinished():
        out = engine.step()
        if out.admitted:  # a new batch starts only when the previous one is completely done
            assert len(out.admitted) <= 3
            assert all(engine.seqs[i].status is SequenceStatus.FINISHED for i in range(min(out.admitted)))
        assert engine.cache.allocator.num_used in (0, 8 * len(engine.scheduler.batch))
    for i, (prompt, n) in enumerate(requests):
        assert engine.seqs[i].output_token_ids == generate_contiguous(model, prompt, n)
    assert engine.cache.allocator.num_free == config.num_blocks


def test_triton_backend_matches(model):
    pytest.importorskip("triton")
    engine = Engine(model, EngineConfig(num_blocks=8, block_size=16, max_num_batched_tokens=16, backend="triton"))
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3], [2, 7, 1, 8]]
    outs = engine.generate(prompts, SamplingParams(max_tokens=3))
    assert outs == [generate_contiguous(model, p, 3) for p in prompts]


def test_seeded_sampling_does_not_depend_on_the_batch(model):
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=123)
    alone = Engine(model).generate([[5, 6, 7]], params)[0]
    crowd = Engine(model).generate([[9] * 30, [5, 6, 7], [1, 2]], params)[1]
    assert alone == crowd
    other = Engine(model).generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.8, seed=124))[0]
    assert other != alone
    assert alone != Engine(model).generate([[5, 6, 7]], SamplingParams(max_tokens=8))[0]  # not greedy


def test_stop_token_ends_a_request_early(model):
    greedy = generate_contiguous(model, [1, 2, 3], 8)
    stop = greedy[3]
    out = Engine(model).generate([[1, 2, 3]], SamplingParams(max_tokens=8, stop_token_ids=(stop,)))[0]
    assert out == greedy[: greedy.index(stop) + 1]


def test_clear_errors_leave_the_engine_unchanged(model):
    engine = Engine(model, EngineConfig(keep_finished=True, num_blocks=4, block_size=4))
    with pytest.raises(ValueError, match="pool has 4 blocks"):
        engine.add_request([1] * 15, SamplingParams(max_tokens=4))  # needs 18 slots = 5 blocks
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([1, model.config.vocab_size])
    with pytest.raises(TypeError, match=r"prompt_token_ids\[1\]"):
        engine.add_request([1, 2.0])
    with pytest.raises(ValueError, match=r"prompt_token_ids\[0\]"):
        engine.add_request([-1])
    assert not engine.seqs and not engine.has_unfinished()
    rid = engine.add_request([1, 2], SamplingParams(max_tokens=2), request_id="a")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1, 2], request_id="a")
    with pytest.raises(KeyError, match="no request with id 'nope'"):
        engine.abort("nope")
    while engine.has_unfinished():
        engine.step()
    with pytest.raises(ValueError, match="already finished"):
        engine.abort(rid)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request([1], SamplingParams(max_tokens=-1))


def test_abort_frees_blocks_at_once(model):
    engine = Engine(model, EngineConfig(num_blocks=16, block_size=4))
    rid = engine.add_request(list(range(20)), SamplingParams(max_tokens=5))
    engine.step()
    assert engine.cache.allocator.num_free == 11
    engine.abort(rid)
    assert engine.cache.allocator.num_free == 16 and not engine.has_unfinished()


def test_virtual_clock_runs_are_deterministic_and_metrics_follow_events(model):
    workload = make_workload(12, rate=40.0, preset="tiny_chat", seed=3)
    workload = [RequestSpec(r.arrival_time, min(r.num_prompt_tokens, 40), min(r.num_output_tokens, 12))
                for r in workload]
    config = EngineConfig(num_blocks=16, block_size=8, max_num_batched_tokens=64)
    runs = []
    for _ in range(2):
        engine = Engine(model, config, VirtualClock())
        events = []
        engine.cache.allocator.subscribe(lambda e, events=events: events.append(e.kind))
        seqs = engine.run(workload, progress=False)
        runs.append(summarize(seqs))
        h = engine.metrics.history
        assert engine.metrics.num_preemptions == events.count("preempt")
        assert sum(r.preemptions for r in h) == engine.metrics.num_preemptions
        assert sum(r.finished for r in h) == len(workload)
        assert [r.step for r in h] == list(range(len(h)))
        assert all(a.time < b.time for a, b in zip(h, h[1:]))
        assert max(r.kv_used_blocks for r in h) <= config.num_blocks and h[-1].kv_used_blocks == 0
        pool_slots = config.num_blocks * config.block_size
        for r in h:  # KV usage counts blocks, token occupancy tokens: the gap is the tail waste
            assert r.kv_usage == r.kv_used_blocks / config.num_blocks
            assert r.token_occupancy * pool_slots == pytest.approx(r.kv_used_blocks * config.block_size - r.tail_waste)
        assert any(r.token_occupancy < r.kv_usage for r in h)
        assert all(s.arrival_time == w.arrival_time for s, w in zip(seqs, workload))  # the clock starts at 0
        assert all(s.first_token_time >= s.arrival_time for s in seqs)
    assert runs[0] == runs[1]
    assert runs[0]["ttft_p50"] <= runs[0]["ttft_p90"] <= runs[0]["ttft_p99"]


def test_percentiles():
    assert percentiles([1.0, 2.0, 3.0, 4.0, 5.0]) == {50: 3.0, 90: 4.6, 99: pytest.approx(4.96)}
    assert all(math.isnan(v) for v in percentiles([]).values())


def test_run_replays_arrivals_and_idles_between_them(model):
    """Requests join when they arrive; an idle gap costs no step, and the prompts are the seeded ones."""
    from minipaged.workload import prompt_token_ids

    workload = [RequestSpec(0.0, 5, 3), RequestSpec(10.0, 4, 2), RequestSpec(0.001, 6, 2)]
    engine = Engine(model, EngineConfig(num_blocks=16, block_size=4))
    seqs = engine.run(workload, progress=False, seed=7)
    assert [s.arrival_time for s in seqs] == [0.0, 10.0, 0.001]  # in the workload's order
    assert seqs[2].first_token_time < 10.0 <= seqs[1].first_token_time
    assert [s.prompt_token_ids for s in seqs] == [
        prompt_token_ids(i, r.num_prompt_tokens, model.config.vocab_size, seed=7) for i, r in enumerate(workload)
    ]
    # Step 1 prefills request 0 alone; step 2 decodes it and prefills request 2, which arrived meanwhile;
    # step 3 finishes both. Then the clock jumps to t = 10 without a step, and request 1 takes two.
    assert [r.num_running for r in engine.metrics.history] == [1, 2, 0, 1, 0]
    assert engine.metrics.history[2].time < 10.0 < engine.metrics.history[3].time
    assert Engine(model).run([], progress=False) == []
