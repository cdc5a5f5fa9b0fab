"""The engine with prefix caching and parallel sampling: outputs, sharing, references, bad input."""

import random

import engine_helpers
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minipaged.engine import Engine
from minipaged.generate import generate_contiguous
from minipaged.model import LlamaConfig, LlamaForCausalLM
from minipaged.prefix_cache import PrefixCachingAllocator
from minipaged.scheduler import EngineConfig
from minipaged.sequence import SamplingParams, SequenceStatus

pytestmark = pytest.mark.ch06


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return LlamaForCausalLM(LlamaConfig(), seed=0).eval()


_reference: dict = {}


def reference(model, prompt, n):
    """Contiguous greedy generation, memoised (the hypothesis test asks for the same prompts again)."""
    key = (tuple(prompt), n)
    if key not in _reference:
        _reference[key] = generate_contiguous(model, prompt, n)
    return _reference[key]


def refcounts_match_tables(engine):
    """Every block's reference count is the number of running tables that hold it."""
    held = [0] * engine.config.num_blocks
    for seq in engine.scheduler.running:
        for b in seq.block_table.blocks:
            held[b] += 1
    return held == engine.cache.allocator.refcounts


def add_request(engine, i, request):
    prompt, n, salt = request
    engine.add_request(prompt, SamplingParams(max_tokens=n), request_id=i, cache_salt=salt)


def drive(engine, requests, rng, abort_prob=0.0):
    """Add two requests per step, abort some at random, check references every step; return the aborted ids."""

    def step():
        engine.step()
        assert refcounts_match_tables(engine)

    aborted = engine_helpers.drive(engine, requests, rng, add_request, abort_prob, step)
    assert refcounts_match_tables(engine)
    return aborted


def shared_prefix_requests(rng, vocab, num_requests, block_size):
    """Requests over a few shared prefixes (some exactly whole blocks long), a few salted."""
    prefixes = [[rng.randrange(vocab) for _ in range(k)] for k in (2 * block_size, 3 * block_size + 1, 5)]
    requests = []
    for _ in range(num_requests):
        prefix = rng.choice(prefixes)
        suffix = [rng.randrange(vocab) for _ in range(rng.choice([0, 0, 1, 3, 6]))]
        requests.append((prefix + suffix, rng.randint(1, 16), rng.choice([None, None, "tenant"])))
    return requests


@pytest.mark.parametrize("chunked, mode", [(True, "recompute"), (False, "recompute"), (True, "swap"), (False, "swap")])
def test_outputs_match_contiguous_with_caching_under_preemption_chunking_and_aborts(model, chunked, mode):
    rng = random.Random(7 + chunked)
    requests = shared_prefix_requests(rng, model.config.vocab_size, 16, block_size=4)
    outputs = {}
    for caching in (False, True):
        config = EngineConfig(num_blocks=14, block_size=4, max_num_seqs=8, max_num_batched_tokens=24 if chunked else 64,
                              chunked_prefill=chunked, preemption_mode=mode, keep_finished=True)
        engine = Engine(model, config, allocator=engine_helpers.allocator_for(caching))
        aborted = drive(engine, requests, random.Random(3), abort_prob=0.08)
        assert engine.metrics.num_preemptions > 0
        assert engine.cache.allocator.num_free == config.num_blocks and not engine.swap_space  # nothing leaked
        for i, (prompt, n, _) in enumerate(requests):
            seq = engine.seqs[i]
            if i in aborted:
                assert seq.status is SequenceStatus.ABORTED and seq.block_table is None
            else:
                assert seq.output_token_ids == reference(model, prompt, n), f"request {i} differs, caching {caching}"
        outputs[caching] = {i: engine.seqs[i].output_token_ids for i in range(len(requests)) if i not in aborted}
        if caching:
            stats = engine.metrics.prefix_cache
            assert stats.hits > 0 and 0 < stats.hit_rate < 1 and engine.cache.allocator.num_cached_blocks > 0
    common = outputs[True].keys() & outputs[False].keys()  # the random aborts hit other requests in the two runs
    assert len(common) >= 8 and all(outputs[True][i] == outputs[False][i] for i in common)


# 14 blocks hold the longest request at B = 2: (3B + 1) prefix + 6 suffix + 16 new tokens - 1 = 28 slots.
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10**6), num_blocks=st.integers(14, 24), block_size=st.sampled_from([2, 4]),
       budget=st.integers(8, 32), mode=st.sampled_from(["recompute", "swap"]), chunked=st.booleans())
def test_random_shared_prefix_workloads_match_contiguous(model, seed, num_blocks, block_size, budget, mode, chunked):
    rng = random.Random(seed)
    requests = shared_prefix_requests(rng, model.config.vocab_size, 8, block_size)
    config = EngineConfig(keep_finished=True, num_blocks=num_blocks, block_size=block_size, max_num_seqs=6,
                          max_num_batched_tokens=budget if chunked else 64, chunked_prefill=chunked,
                          preemption_mode=mode)  # fmt: skip
    engine = Engine(model, config, allocator=PrefixCachingAllocator)
    assert isinstance(engine.cache.allocator, PrefixCachingAllocator)  # the engine builds the allocator it is given
    aborted = drive(engine, requests, rng, abort_prob=0.05)
    assert engine.cache.allocator.num_free == num_blocks and not engine.swap_space
    for i, (prompt, n, _) in enumerate(requests):
        if i not in aborted:
            assert engine.seqs[i].output_token_ids == reference(model, prompt, n)


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10**6), num_blocks=st.integers(16, 28), mode=st.sampled_from(["recompute", "swap"]),
       chunked=st.booleans(), data=st.data())
def test_stops_with_shared_prefixes_and_parallel_samples_match_contiguous(model, seed, num_blocks, mode, chunked, data):
    """Stop tokens, the EOS, ignore_eos and min_tokens with prefix hits and n greedy samples (all the same output)."""
    eos_model = engine_helpers.with_eos(model, engine_helpers.STOP_EOS)
    rng = random.Random(seed)
    pick = engine_helpers.hypothesis_pick(data)
    requests = [(prompt, engine_helpers.stop_params(pick, eos_model, prompt, n, n=pick(1, 3)))
                for prompt, n, _ in shared_prefix_requests(rng, model.config.vocab_size, 8, block_size=4)]  # fmt: skip
    config = EngineConfig(keep_finished=True, num_blocks=num_blocks, block_size=4, max_num_seqs=6,
                          max_num_batched_tokens=16 if chunked else 64, chunked_prefill=chunked, preemption_mode=mode)
    engine = Engine(eos_model, config, allocator=PrefixCachingAllocator)

    def add(engine, i, request):
        engine.add_request(request[0], request[1], request_id=i)

    def step():
        out = engine.step()
        for seq_id in out.finished:
            engine_helpers.check_finished(engine.seqs[seq_id])  # its blocks are free from this step on
        assert refcounts_match_tables(engine)

    aborted = engine_helpers.drive(engine, requests, rng, add, 0.05, step)
    assert engine.cache.allocator.num_free == num_blocks and not engine.swap_space
    for i, (prompt, params) in enumerate(requests):
        if i not in aborted:
            want = engine_helpers.reference(eos_model, prompt, params)
            assert [s.output_token_ids for s in engine.requests[i]] == [want] * params.n, f"request {i}"
            for s in engine.requests[i]:
                engine_helpers.check_finished(s)


def test_a_hit_shares_blocks_and_starts_at_the_hit_length(model):
    engine = Engine(model, EngineConfig(keep_finished=True, num_blocks=16, block_size=4),
                    allocator=PrefixCachingAllocator)
    prompt = list(range(1, 12))  # 11 tokens: blocks 0 and 1 full, block 2 partly
    engine.add_request(prompt, SamplingParams(max_tokens=5), request_id="a")
    engine.step()  # a's prompt computed: its two full blocks get keys
    first = engine.seqs["a"].block_table.blocks[:2]
    engine.add_request(prompt[:9] + [40, 41], SamplingParams(max_tokens=2), request_id="b")
    out = engine.step()
    b = engine.seqs["b"]
    assert out.scheduled["b"] == 11 - 8  # only the tokens after the two hit blocks are computed
    assert b.block_table.blocks[:2] == first and all(engine.cache.allocator.refcount(x) == 2 for x in first)
    assert engine.metrics.prefix_cache.hits == 8
    while engine.has_unfinished():
        engine.step()
    assert b.output_token_ids == generate_contiguous(model, b.prompt_token_ids, 2)
    # Both finished: the cached blocks wait in the free queue with their keys, still reusable.
    allocator = engine.cache.allocator
    assert allocator.num_free == 16 and all(allocator.block_key(x) is not None for x in first)
    engine.add_request(prompt, SamplingParams(max_tokens=2), request_id="c")
    engine.step()
    assert engine.seqs["c"].block_table.blocks[:2] == first


def test_a_prompt_of_whole_blocks_recomputes_its_last_block(model):
    engine = Engine(model, EngineConfig(keep_finished=True, num_blocks=16, block_size=4),
                    allocator=PrefixCachingAllocator)
    prompt = list(range(1, 9))  # exactly 2 blocks
    engine.generate([prompt], SamplingParams(max_tokens=1))
    engine.add_request(prompt, SamplingParams(max_tokens=3), request_id="again")
    out = engine.step()
    assert out.scheduled["again"] == 4  # block 0 hit; block 1 recomputed for the last token's logits
    while engine.has_unfinished():
        engine.step()
    assert engine.seqs["again"].output_token_ids == generate_contiguous(model, prompt, 3)


def test_generated_tokens_are_cached_too(model):
    engine = Engine(model, EngineConfig(keep_finished=True, num_blocks=16, block_size=4),
                    allocator=PrefixCachingAllocator)
    prompt = [5, 6, 7]
    out = engine.generate([prompt], SamplingParams(max_tokens=9))[0]
    # prompt + 8 fed-back outputs = 11 computed tokens: blocks 0 and 1 hold generated tokens and are cached.
    match = engine.cache.allocator.match_prefix(prompt + out)
    assert match.num_tokens == 8


def test_admission_counts_a_free_hit_block_as_used(model):
    # 6 blocks, watermark 2. Request "a" leaves 2 cached blocks in the free queue.
    engine = Engine(model, EngineConfig(keep_finished=True, num_blocks=6, block_size=4, watermark=0.34),
                    allocator=PrefixCachingAllocator)
    prefix = list(range(1, 9))
    engine.generate([prefix + [9]], SamplingParams(max_tokens=1))
    allocator = engine.cache.allocator
    assert allocator.num_free == 6 and allocator.num_cached_blocks >= 2
    # "b" hits both cached blocks and needs 2 new ones: 6 free - 2 touched - 2 new = 2 = watermark, admitted.
    engine.add_request(prefix + [20, 21, 22, 23, 24], SamplingParams(max_tokens=4), request_id="b")
    engine.step()
    assert engine.seqs["b"].status is SequenceStatus.RUNNING
    assert allocator.num_free == 2 and engine.metrics.history[-1].kv_used_blocks == 4
    # "c" shares the same 2 blocks (already in use, so nothing is touched) and needs 1 new: 2 - 1 < watermark.
    engine.add_request(prefix + [30], SamplingParams(max_tokens=1), request_id="c")
    engine.step()
    assert engine.seqs["c"].status is SequenceStatus.WAITING
    while engine.has_unfinished():
        engine.step()
    assert engine.seqs["c"].output_token_ids == generate_contiguous(model, prefix + [30], 1)


def test_salts_isolate_and_the_same_salt_shares(model):
    prompt = list(range(1, 10))
    for salt, shares in (("alice", True), ("bob", False), (None, False), (b"alice", False)):
        engine = Engine(model, EngineConfig(keep_finished=True, num_blocks=16, block_size=4),
                        allocator=PrefixCachingAllocator)
        engine.add_request(prompt, SamplingParams(max_tokens=1), cache_salt="alice")
        while engine.has_unfinished():
            engine.step()
        engine.add_request(prompt, SamplingParams(max_tokens=1), request_id="x", cache_salt=salt)
        out = engine.step()
        assert (out.scheduled["x"] < len(prompt)) is shares, salt
        assert engine.seqs["x"].output_token_ids == generate_contiguous(model, prompt, 1)


def test_swapped_out_sequence_drops_its_references_and_hits_again(model):
    # Two sequences share a 2-block prefix; the pool forces the younger one out by swap.
    config = EngineConfig(num_blocks=8, block_size=4, max_num_seqs=2, preemption_mode="swap",
                          watermark=0.0, keep_finished=True)
    engine = Engine(model, config, allocator=PrefixCachingAllocator)
    prefix = list(range(1, 9))
    engine.add_request(prefix + [9], SamplingParams(max_tokens=14), request_id="old")
    engine.step()
    engine.add_request(prefix + [10], SamplingParams(max_tokens=14), request_id="young")  # arrives now: the younger
    allocator = engine.cache.allocator
    shared = engine.seqs["old"].block_table.blocks[:2]
    swapped = False
    while engine.has_unfinished():
        out = engine.step()
        if "young" in out.preempted:
            swapped = True
            assert all(allocator.refcount(b) == 1 for b in shared)  # the shared blocks stay with "old"
            assert "young" in engine.swap_space
        assert refcounts_match_tables(engine)
    assert swapped and engine.metrics.swapped_in_blocks < engine.metrics.swapped_out_blocks  # part came back by hits
    for rid, last in (("old", 9), ("young", 10)):
        assert engine.seqs[rid].output_token_ids == generate_contiguous(model, prefix + [last], 14)


def test_parallel_samples_equal_the_same_seed_run_alone(model):
    prompt = list(range(3, 13))  # 10 tokens, block size 4: the last prompt block is shared and partly filled
    params = SamplingParams(max_tokens=8, temperature=0.9, seed=11, n=4)
    for caching in (False, True):
        engine = Engine(model, EngineConfig(num_blocks=32, block_size=4, keep_finished=True),
                        allocator=engine_helpers.allocator_for(caching))
        rid = engine.add_request(prompt, params)
        engine.step()  # the prompt: sample 0 computes it, samples 1..3 fork its table
        tables = [s.block_table.blocks for s in engine.requests[rid]]
        assert all(t == tables[0] for t in tables)  # shared by fork, nothing copied yet
        assert all(engine.cache.allocator.refcount(b) == 4 for b in tables[0])
        engine.step()  # the first divergent append: copy-on-write of the shared last block
        assert engine.metrics.num_cow == 3  # the last writer finds it no longer shared
        assert [s.block_table.blocks[:2] for s in engine.requests[rid]] == [tables[0][:2]] * 4
        assert len({s.block_table.blocks[2] for s in engine.requests[rid]}) == 4
        assert refcounts_match_tables(engine)
        while engine.has_unfinished():
            engine.step()
        outs = [s.output_token_ids for s in engine.requests[rid]]
        for i, out in enumerate(outs):
            alone = Engine(model).generate([prompt], SamplingParams(max_tokens=8, temperature=0.9, seed=11 + i))[0]
            assert out == alone, f"sample {i}, caching {caching}"
        assert len({tuple(o) for o in outs}) > 1
        assert engine.cache.allocator.num_free == 32


def test_generate_returns_every_sample_prompt_by_prompt(model):
    engine = Engine(model, EngineConfig(keep_finished=True, num_blocks=32, block_size=4),
                    allocator=PrefixCachingAllocator)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    outs = engine.generate(prompts, SamplingParams(max_tokens=3, n=2))
    greedy = [generate_contiguous(model, p, 3) for p in prompts]
    assert outs == [greedy[0], greedy[0], greedy[1], greedy[1]]  # greedy samples agree
    assert sorted(engine.requests) == [0, 1] and engine.requests[1][1].seq_id == (1, 1)


def test_parallel_samples_under_preemption_and_abort(model):
    # Samples fork, run out of blocks, get preempted (each one alone afterwards), and one request is aborted.
    for mode in ("recompute", "swap"):
        engine = Engine(model, EngineConfig(num_blocks=10, block_size=4, max_num_seqs=4,
                                            preemption_mode=mode, keep_finished=True), allocator=PrefixCachingAllocator)
        prompt = list(range(1, 8))
        rid = engine.add_request(prompt, SamplingParams(max_tokens=12, n=3))
        other = engine.add_request([9, 8, 7], SamplingParams(max_tokens=12))
        engine.step()
        engine.abort(other)
        while engine.has_unfinished():
            engine.step()
            assert refcounts_match_tables(engine)
        assert engine.metrics.num_preemptions > 0
        want = generate_contiguous(model, prompt, 12)
        assert [s.output_token_ids for s in engine.requests[rid]] == [want] * 3
        assert engine.seqs[other].status is SequenceStatus.ABORTED
        assert engine.cache.allocator.num_free == 10 and not engine.swap_space


def test_abort_before_the_fork_aborts_every_sample(model):
    engine = Engine(model, EngineConfig(keep_finished=True, num_blocks=16, block_size=4, max_num_batched_tokens=4),
                    allocator=PrefixCachingAllocator)
    rid = engine.add_request(list(range(1, 11)), SamplingParams(max_tokens=3, n=3))
    engine.step()  # a first chunk of the prompt only
    engine.abort(rid)
    assert all(s.status is SequenceStatus.ABORTED for s in engine.requests[rid])
    assert not engine.has_unfinished() and engine.cache.allocator.num_free == 16
    with pytest.raises(ValueError, match="already aborted"):
        engine.abort(rid)


def test_bad_input_is_named_and_changes_nothing(model):
    engine = Engine(model, EngineConfig(num_blocks=16, block_size=4, max_num_seqs=4), allocator=PrefixCachingAllocator)
    with pytest.raises(ValueError, match="n must be >= 1"):
        SamplingParams(n=0)
    with pytest.raises(TypeError, match="n must be an int"):
        SamplingParams(n=2.0)
    with pytest.raises(ValueError, match=r"SamplingParams.n = 5 .* max_num_seqs is 4"):
        engine.add_request([1, 2], SamplingParams(n=5), request_id="many")
    for salt in (3, ["a"], 1.5):
        with pytest.raises(TypeError, match="cache_salt must be a str, bytes or None"):
            engine.add_request([1, 2], cache_salt=salt)
    with pytest.raises(TypeError, match="allocator must be a class"):  # prefix caching is the allocator, not a flag
        Engine(model, allocator=1)
    assert not engine.seqs and not engine.requests and not engine.has_unfinished()
    assert engine.cache.allocator.num_free == 16
    engine.add_request([1, 2], SamplingParams(n=4), request_id="ok")  # n == max_num_seqs is fine
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1, 2], request_id="ok")


@pytest.mark.parametrize("argv, named", [
    (["--requests", "0"], "--requests: must be >= 1, got 0"),
    (["--block-size", "0"], "--block-size: must be >= 1, got 0"),
    (["--repeats", "0"], "--repeats: must be >= 1, got 0"),
    (["--rate", "-5"], "--rate: must be a number > 0"),
    (["--rate", "nan"], "--rate: must be a number > 0"),
    (["--suffix-len", "32", "8"], "--suffix-len LOW must be at most HIGH, got 32 8"),
    (["--output-len", "0", "8"], "--output-len: must be >= 1, got 0"),
])  # fmt: skip
def test_bench_prefix_refuses_a_bad_option_as_a_usage_error(argv, named, capsys):
    """Issue 43: these ended in tracebacks; now each is a usage error (exit 2) that names the option."""
    from minipaged.bench import prefix

    with pytest.raises(SystemExit) as exc:
        prefix._parse(argv)
    assert exc.value.code == 2 and named in capsys.readouterr().err
