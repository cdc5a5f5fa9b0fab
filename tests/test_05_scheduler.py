"""Scheduler invariants under random workloads, driven by a fake model so they run fast.

The fake "model" samples token = f(seq_id, length): deterministic, so a
request's output must not depend on how it was batched, chunked or preempted.
"""

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from minipaged.block_math import blocks_needed
from minipaged.blocks import BlockAllocator
from minipaged.request_queue import FCFSQueue
from minipaged.scheduler import EngineConfig, Scheduler, can_admit
from minipaged.sequence import SamplingParams, Sequence, SequenceStatus

pytestmark = pytest.mark.ch05

VOCAB = 50


def fake_token(seq: Sequence) -> int:
    return (31 * hash(seq.seq_id) + 7 * seq.num_tokens) % VOCAB


def alone(seq: Sequence) -> tuple[list[int], str]:
    """What the fake model generates for ``seq`` with nobody else around, and its finish reason."""
    params, out = seq.sampling_params, []
    stops = set(params.stop_token_ids) | ({seq.eos_token_id} if not params.ignore_eos else set())
    for k in range(params.max_tokens):
        out.append((31 * hash(seq.seq_id) + 7 * (seq.num_prompt_tokens + k)) % VOCAB)
        if out[-1] in stops:
            return out, "stop"
    return out, "length"


def step(sched: Scheduler, now: float):
    """One engine step with the fake model; checks the per-step invariants."""
    out = sched.schedule()
    cfg = sched.config
    assert out.num_batched_tokens <= cfg.max_num_batched_tokens
    assert len(sched.running) <= cfg.max_num_seqs
    assert all(n >= 1 for n in out.num_new_tokens)
    assert len({id(s) for s in out.seqs}) == len(out.seqs)
    for seq, n, slots in zip(out.seqs, out.num_new_tokens, out.slot_mappings):
        assert seq.status is SequenceStatus.RUNNING
        assert seq.block_table.num_tokens == seq.num_computed_tokens + n
        assert len(slots) == n
        if not cfg.chunked_prefill:
            assert n == seq.num_uncomputed_tokens
    # The running set fits the pool: exactly its blocks are in use, no more (no leak), no less.
    held = [b for s in sched.running for b in s.block_table.blocks]
    assert len(held) == len(set(held)) == sched.allocator.num_used
    assert all(s.block_table is None for s in sched.waiting)
    for seq, saved in out.swap_out:  # swap mode saves exactly the blocks that hold computed K/V
        assert len(saved) == blocks_needed(seq.num_computed_tokens, cfg.block_size) and seq in sched.waiting
    for seq in out.swap_in:
        assert seq in out.admitted and seq.num_computed_tokens > 0
    if cfg.preemption_mode == "recompute":
        assert not out.swap_out and all(s.num_computed_tokens == 0 for s in sched.waiting)
    scheduled = zip(out.seqs, out.num_new_tokens)
    sampled = {s.seq_id: fake_token(s) for s, n in scheduled if s.num_computed_tokens + n == s.num_tokens}
    finished = sched.postprocess(out, sampled, now)
    for seq in finished:  # freed at the stop: its blocks are back in the pool by the end of the step
        assert seq.status is SequenceStatus.FINISHED and seq.block_table is None and seq not in sched.running
    held = [b for s in sched.running for b in s.block_table.blocks]
    assert len(held) == sched.allocator.num_used
    return out, finished


@st.composite
def pools_and_requests(draw):
    """A small pool and requests that each fit it alone (most of them) but not all together."""
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    num_blocks = draw(st.integers(2, 16))
    cap = min(num_blocks * block_size, 48)  # tokens one request may hold
    reqs = []
    for _ in range(draw(st.integers(2, 10))):
        prompt_len = draw(st.integers(1, cap))
        max_tokens = draw(st.integers(1, cap - prompt_len + 2))  # + 2: now and then one too big for the pool
        reqs.append((prompt_len, max_tokens, draw(st.integers(0, 4))))  # arrival step
    return block_size, num_blocks, reqs


@settings(max_examples=200, deadline=None)
@given(
    pool_and_reqs=pools_and_requests(),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 48),
    watermark=st.sampled_from([0.0, 0.05, 0.2]),
    chunked=st.booleans(),
    aborts=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 9)), max_size=3),
    stop=st.sets(st.integers(0, VOCAB - 1), max_size=2),
    eos=st.one_of(st.none(), st.integers(0, VOCAB - 1)),
    ignore_eos=st.booleans(),
    mode=st.sampled_from(["recompute", "swap"]),
)
def test_random_workload_invariants(pool_and_reqs, max_num_seqs, budget, watermark, chunked, aborts, stop, eos,
                                    ignore_eos, mode):  # fmt: skip
    block_size, num_blocks, reqs = pool_and_reqs
    cfg = EngineConfig(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=budget, watermark=watermark, chunked_prefill=chunked,
                       preemption_mode=mode)  # fmt: skip
    sched = Scheduler(cfg, BlockAllocator(num_blocks, block_size))
    seqs = []
    for i, (p, m, t) in enumerate(reqs):
        params = SamplingParams(max_tokens=m, stop_token_ids=tuple(stop), ignore_eos=ignore_eos)
        seq = Sequence(i, [(i + j) % VOCAB for j in range(p)], params, float(t), eos_token_id=eos)
        seqs.append(seq)
    arrivals = sorted(seqs, key=lambda s: s.arrival_time)
    accepted, finished, aborted, preemptions = [], [], set(), 0
    for tick in range(2000):
        while arrivals and arrivals[0].arrival_time <= tick:
            seq = arrivals.pop(0)
            try:
                sched.add(seq)
                accepted.append(seq)
            except ValueError:  # too big for this pool or budget: rejected up front, nothing changed
                assert seq.status is SequenceStatus.WAITING and seq not in sched.waiting
        for when, idx in aborts:
            if when == tick and idx < len(accepted) and not accepted[idx].is_finished:
                sched.abort(accepted[idx])
                aborted.add(accepted[idx].seq_id)
                assert accepted[idx].block_table is None
        if not arrivals and not sched.has_unfinished():
            break
        out, done = step(sched, float(tick))
        finished += done
        preemptions += len(out.preempted)
    else:
        pytest.fail("the run did not terminate: some admitted request never finished")
    event(f"{mode}: {'some' if preemptions else 'no'} preemption")  # coverage, see --hypothesis-show-statistics
    # Every admitted request finished or was aborted, and every block is back.
    assert {s.seq_id for s in finished} | aborted == {s.seq_id for s in accepted}
    assert sched.allocator.num_free == num_blocks
    for seq in finished:
        assert seq.status is SequenceStatus.FINISHED
        assert (seq.output_token_ids, seq.finish_reason) == alone(seq)
        event(f"finish_reason {seq.finish_reason}")
        last = seq.output_token_ids[-1]
        by_eos = last == eos and not ignore_eos  # the EOS reports None, a stop token its id
        assert seq.stop_reason == (None if seq.finish_reason == "length" or by_eos else last)
    for seq in accepted:
        if seq.seq_id in aborted:
            assert (seq.status, seq.finish_reason, seq.stop_reason) == (SequenceStatus.ABORTED, "abort", None)


def test_preempts_youngest_and_keeps_tokens():
    # 4 blocks of 2 slots; two requests that each grow to 4 blocks cannot both stay.
    cfg = EngineConfig(num_blocks=4, block_size=2, max_num_seqs=4, max_num_batched_tokens=16, watermark=0.0)
    sched = Scheduler(cfg, BlockAllocator(4, 2))
    old = Sequence("old", [1, 2, 3], SamplingParams(max_tokens=5), arrival_time=0.0)
    young = Sequence("young", [4, 5, 6], SamplingParams(max_tokens=5), arrival_time=1.0)
    events = []
    sched.allocator.subscribe(lambda e: events.append(e) if e.kind == "preempt" else None)
    sched.add(old)
    sched.add(young)
    preempted = []
    for t in range(40):
        if not sched.has_unfinished():
            break
        out, _ = step(sched, float(t))
        preempted += out.preempted
    assert preempted and all(s is young for s in preempted)
    assert [e.seq_id for e in events] == ["young"] * len(preempted)
    assert young.num_preemptions == len(preempted)
    assert old.status is young.status is SequenceStatus.FINISHED
    assert len(young.output_token_ids) == 5


def test_preempted_goes_to_front_and_recomputes_everything():
    cfg = EngineConfig(num_blocks=3, block_size=2, max_num_seqs=4, max_num_batched_tokens=16, watermark=0.0)
    sched = Scheduler(cfg, BlockAllocator(3, 2))
    a = Sequence("a", [1, 2], SamplingParams(max_tokens=4), arrival_time=0.0)
    b = Sequence("b", [3, 4], SamplingParams(max_tokens=4), arrival_time=1.0)
    c = Sequence("c", [5], SamplingParams(max_tokens=1), arrival_time=2.0)
    for s in (a, b):
        sched.add(s)
    step(sched, 0.0)  # both prefilled, 1 block each, 1 token generated each
    sched.add(c)
    out, _ = step(sched, 1.0)  # a and b each need a 2nd block: only 1 free, so b (younger) goes
    assert out.preempted == [b]
    assert list(sched.waiting) == [b, c]  # in front of the later arrival
    assert b.status is SequenceStatus.PREEMPTED and b.num_computed_tokens == 0 and b.block_table is None
    assert b.output_token_ids  # its generated token is kept...
    while b.status is not SequenceStatus.RUNNING:
        length = b.num_tokens
        out, _ = step(sched, 2.0)
    assert out.num_new_tokens[out.seqs.index(b)] == length == 3  # ...and recomputed with the prompt


def test_chunked_prefill_splits_a_long_prompt():
    cfg = EngineConfig(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    sched = Scheduler(cfg, BlockAllocator(32, 4))
    seq = Sequence(0, list(range(20)), SamplingParams(max_tokens=2))
    sched.add(seq)
    chunks = []
    while sched.has_unfinished():
        out, _ = step(sched, 0.0)
        chunks.append(out.num_new_tokens[0])
    assert chunks == [8, 8, 4, 1]


def test_without_chunking_a_prompt_waits_for_a_whole_budget():
    cfg = EngineConfig(num_blocks=32, block_size=4, max_num_batched_tokens=12, chunked_prefill=False)
    sched = Scheduler(cfg, BlockAllocator(32, 4))
    a = Sequence("a", [1] * 4, SamplingParams(max_tokens=3))
    b = Sequence("b", [1] * 10, SamplingParams(max_tokens=3))
    sched.add(a)
    sched.add(b)
    out, _ = step(sched, 0.0)
    assert out.seqs == [a]  # b's 10 tokens do not fit the 8 left, and it will not be split
    out, _ = step(sched, 1.0)
    assert out.seqs == [a, b] and out.num_new_tokens == [1, 10]


def test_watermark_holds_back_admission():
    cfg = EngineConfig(num_blocks=10, block_size=4, watermark=0.2)  # keep 2 blocks free
    sched = Scheduler(cfg, BlockAllocator(10, 4))
    a = Sequence("a", [1] * 24, SamplingParams(max_tokens=2))  # 6 blocks
    b = Sequence("b", [1] * 8, SamplingParams(max_tokens=2))  # 2 more would leave 2: allowed
    c = Sequence("c", [1] * 4, SamplingParams(max_tokens=2))  # 1 more would leave 1: refused
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    assert out.admitted == [a, b] and list(sched.waiting) == [c]


def test_admission_and_victim_helpers():
    assert can_admit(num_free_blocks=5, num_needed_blocks=3, watermark_blocks=2, num_running=0, max_num_seqs=4)
    assert not can_admit(num_free_blocks=5, num_needed_blocks=4, watermark_blocks=2, num_running=0, max_num_seqs=4)
    assert not can_admit(num_free_blocks=50, num_needed_blocks=1, watermark_blocks=0, num_running=4, max_num_seqs=4)
    seqs = [Sequence(i, [1], SamplingParams(), arrival_time=t) for i, t in enumerate([0.0, 3.0, 1.0, 3.0])]
    assert FCFSQueue.victim(seqs) is seqs[3]  # latest arrival; the tie goes to the later admitted


def test_abort_frees_blocks_and_unknown_abort_is_an_error():
    cfg = EngineConfig(num_blocks=8, block_size=4)
    sched = Scheduler(cfg, BlockAllocator(8, 4))
    a = Sequence("a", [1] * 10, SamplingParams(max_tokens=4))
    sched.add(a)
    step(sched, 0.0)
    assert sched.allocator.num_free == 5
    sched.abort(a)
    assert sched.allocator.num_free == 8 and a.status is SequenceStatus.ABORTED
    with pytest.raises(ValueError, match="neither waiting nor running"):
        sched.abort(a)


def test_request_too_big_for_the_pool_is_refused_up_front():
    cfg = EngineConfig(num_blocks=4, block_size=4)
    sched = Scheduler(cfg, BlockAllocator(4, 4))
    with pytest.raises(ValueError, match="needs up to 5 blocks"):
        sched.add(Sequence(0, [1] * 16, SamplingParams(max_tokens=2)))
    assert not sched.waiting
    sched.add(Sequence(1, [1] * 16, SamplingParams(max_tokens=1)))  # 16 tokens: exactly 4 blocks


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(max_tokens=0), ValueError, "max_tokens"),
        (dict(max_tokens=2.5), TypeError, "max_tokens"),
        (dict(max_tokens=True), TypeError, "max_tokens"),
        (dict(temperature=-1.0), ValueError, "temperature"),
        (dict(temperature=float("nan")), ValueError, "temperature"),
        (dict(temperature="hot"), TypeError, "temperature"),
        (dict(seed=1.5), TypeError, "seed"),
        (dict(stop_token_ids=(-3,)), ValueError, r"stop_token_ids\[0\]"),
        (dict(stop_token_ids=(1, 2.0)), TypeError, r"stop_token_ids\[1\]"),
        (dict(min_tokens=-1), ValueError, "min_tokens must be >= 0"),
        (dict(max_tokens=4, min_tokens=5), ValueError, "min_tokens must be at most max_tokens=4"),
        (dict(min_tokens=1.5), TypeError, "min_tokens must be an int"),
        (dict(ignore_eos="no"), TypeError, "ignore_eos must be True or False"),
    ],
)
def test_bad_sampling_params(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(max_num_seqs=0), ValueError, "max_num_seqs"),
        (dict(num_blocks=8.0), TypeError, "num_blocks"),
        (dict(block_size=False), TypeError, "block_size"),
        (dict(max_num_batched_tokens=-1), ValueError, "max_num_batched_tokens"),
        (dict(watermark=1.0), ValueError, "watermark"),
        (dict(watermark="0.1"), TypeError, "watermark"),
        (dict(preemption_mode="teleport"), ValueError, "preemption_mode"),
        (dict(backend="cuda"), ValueError, "backend"),
    ],
)
def test_bad_config(kwargs, error, match):
    with pytest.raises(error, match=match):
        EngineConfig(**kwargs)
