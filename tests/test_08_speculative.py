"""Speculative decoding: the n-gram proposer, greedy acceptance, draft rollback, and the engine with them on.

The engine's greedy output with drafts must equal contiguous generation token for token,
under preemption (recompute and swap), chunked prefill, aborts, prefix caching and parallel
sampling; a fault in a step leaves the state as it was; after every step the pool's
refcounts match the tables, no rollback frees a block, and no block holding an unverified
token has a prefix-cache key.
"""

import random
from collections import Counter

import engine_helpers
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import minipaged.engine as engine_module
from minipaged.block_math import blocks_needed
from minipaged.blocks import BlockAllocator, BlockTable
from minipaged.checkpoint import load_course_model
from minipaged.engine import Engine
from minipaged.generate import generate_contiguous
from minipaged.scheduler import EngineConfig, Scheduler
from minipaged.sequence import SamplingParams, Sequence, SequenceStatus
from minipaged.speculative import (
    NgramProposer,
    NgramSpeculator,
    SpeculativeConfig,
    accept_greedy,
    accept_sampled,
    rollback_drafts,
)
from minipaged.stopping import StopRules
from minipaged.tokenizer import encode

pytestmark = pytest.mark.ch08

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def spec_engine(model, spec=SPEC, caching=True, **config):
    """An engine with n-gram drafts (``spec``, vLLM's dict) and, unless ``caching`` is False, prefix caching."""
    return Engine(model, EngineConfig(**config), allocator=engine_helpers.allocator_for(caching),
                  speculator=NgramSpeculator(spec))


SNIPPETS = [
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\n",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n",
    "        self.x = x\n        self.y = y\n        self.z = z\n",
    "import os\nimport sys\nimport re\n",
    "if x is None:\n    x = []\nif y is None:\n    y = []\n",
]


@pytest.fixture(scope="module")
def model():
    """The course model: trained on Python, it continues repetitive code the way prompt lookup guesses."""
    torch.set_num_threads(1)
    return course()


MODEL = None


def course():
    global MODEL
    if MODEL is None:
        torch.set_num_threads(1)
        MODEL = load_course_model()
    return MODEL


_REFERENCE: dict = {}


def reference(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Contiguous greedy generation, cached by prompt (a shorter run is a prefix of a longer one)."""
    key = (id(model), tuple(prompt))
    done = _REFERENCE.get(key, [])
    if len(done) < max_tokens:
        done = _REFERENCE[key] = generate_contiguous(model, prompt, max(max_tokens, 24))
    return done[:max_tokens]


def repetitive_prompt(rng: random.Random) -> list[int]:
    """A window of 8-40 bytes of repetitive Python: drafting finds something, and so does the model."""
    text = rng.choice(SNIPPETS) * 2
    start = rng.randrange(len(text) // 2)
    return encode(text[start:start + rng.randint(8, 40)])


# ---- the pieces ----------------------------------------------------------------------------------------------


def test_config_from_vllms_dict_and_its_defaults():
    spec = NgramSpeculator({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}).config
    assert isinstance(spec, SpeculativeConfig)
    assert (spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min) == (3, 4, 4)
    assert SpeculativeConfig(2).prompt_lookup_max == SpeculativeConfig(2).prompt_lookup_min == 5
    assert SpeculativeConfig(2, prompt_lookup_min=2).prompt_lookup_max == 2
    assert NgramSpeculator(SpeculativeConfig(2)).config == SpeculativeConfig(2)
    assert Scheduler(EngineConfig(), BlockAllocator(4, 4)).speculator is None  # drafting is off unless given one


@pytest.mark.parametrize("options, error, words", [
    ({"num_speculative_tokens": 0}, ValueError, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2.0}, TypeError, "num_speculative_tokens"),
    ({"num_speculative_tokens": True}, TypeError, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "method": "eagle"}, ValueError, "method"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, ValueError, "prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": 0}, ValueError, "prompt_lookup_max"),
    ({"num_speculative_tokens": 2, "draft_model": "x"}, ValueError, "draft_model"),
    ({"method": "ngram"}, ValueError, "num_speculative_tokens"),
])  # fmt: skip
def test_bad_speculative_config_is_refused_naming_the_option(options, error, words):
    with pytest.raises(error, match=words):
        NgramSpeculator(options)


def test_speculative_config_of_the_wrong_type_is_a_type_error():
    with pytest.raises(TypeError, match="config must be a SpeculativeConfig or a dict, got int"):
        NgramSpeculator(4)
    with pytest.raises(TypeError, match="SpeculativeConfig"):
        NgramProposer({"num_speculative_tokens": 2})


def test_ngram_proposer_examples():
    # vLLM's docstring example: [4, 2, 3] has no earlier match, [2, 3] has; three tokens follow it.
    proposer = NgramProposer(SpeculativeConfig(4, prompt_lookup_max=3, prompt_lookup_min=2))
    assert proposer.propose([1, 2, 3, 4, 2, 3]) == [4, 2, 3]
    assert proposer.propose([1, 2, 3, 4, 2, 3], max_num_tokens=2) == [4, 2]
    assert proposer.propose([1, 2, 3, 4, 5, 6]) == []  # nothing repeats
    assert proposer.propose([7]) == []
    assert proposer.propose([1, 2, 3, 4, 2, 3], max_num_tokens=0) == []
    # The longest suffix wins over a shorter one that occurs later, and the earliest occurrence of it.
    longest = NgramProposer(SpeculativeConfig(2, prompt_lookup_max=3, prompt_lookup_min=1))
    assert longest.propose([5, 6, 7, 8, 9, 7, 1, 5, 6, 7]) == [8, 9]
    assert longest.propose([3, 1, 3, 2, 3]) == [1, 3]


def brute_force_proposal(tokens, k, min_n, max_n):
    """The definition, spelled out: longest n first, earliest occurrence that ends before the last token."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=30), st.integers(1, 5), st.integers(1, 4), st.integers(0, 3))
def test_ngram_proposal_follows_an_earlier_occurrence_of_the_suffix(tokens, k, min_n, extra):
    max_n = min_n + extra
    proposal = NgramProposer(SpeculativeConfig(k, prompt_lookup_max=max_n, prompt_lookup_min=min_n)).propose(tokens)
    assert proposal == brute_force_proposal(tokens, k, min_n, max_n)
    assert len(proposal) <= k


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2), max_size=8), st.data())
def test_greedy_acceptance_keeps_the_longest_agreeing_prefix(drafts, data):
    targets = data.draw(st.lists(st.integers(0, 2), min_size=len(drafts) + 1, max_size=len(drafts) + 1))
    j = accept_greedy(drafts, targets)
    assert drafts[:j] == targets[:j]
    assert j == len(drafts) or drafts[j] != targets[j]
    # What the step appends equals what greedy decoding would: the targets up to and including target j.
    assert drafts[:j] + [targets[j]] == targets[: j + 1]


def test_greedy_acceptance_needs_one_target_more_than_drafts():
    with pytest.raises(ValueError, match="one more"):
        accept_greedy([1, 2], [1, 2])


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 20), st.integers(1, 6), st.data(), st.sampled_from([1, 2, 4]))
def test_rollback_keeps_the_accepted_prefix_and_every_block(computed, k, data, block_size):
    j = data.draw(st.integers(0, k))
    alloc = BlockAllocator(40, block_size)
    table = BlockTable(alloc, "s")
    table.append_tokens(computed)
    slots = table.append_tokens(1 + k)  # the last sampled token and k drafts
    blocks, refcounts = list(table.blocks), alloc.refcounts
    assert rollback_drafts(table, computed, k, j) == computed + 1 + j
    assert table.num_tokens == computed + 1 + j
    assert table.blocks == blocks and alloc.refcounts == refcounts  # nothing freed
    # The next step's first token lands in the first rejected slot: the rejected K/V is overwritten.
    if j < k:
        assert int(table.append_tokens(1)[0]) == int(slots[1 + j])


def test_rollback_refuses_bad_arithmetic_before_changing_anything():
    table = BlockTable(BlockAllocator(8, 4), "s")
    table.append_tokens(6)  # 2 computed + 1 + 3 drafts
    with pytest.raises(ValueError, match="cannot exceed"):
        rollback_drafts(table, 2, 3, 4)
    with pytest.raises(ValueError, match="c \\+ 1 \\+ k"):
        rollback_drafts(table, 3, 3, 1)
    with pytest.raises(TypeError, match="num_accepted_tokens"):
        rollback_drafts(table, 2, 3, 1.0)
    with pytest.raises(TypeError, match="BlockTable"):
        rollback_drafts([1, 2], 2, 3, 1)
    assert table.num_tokens == 6


# ---- the engine ----------------------------------------------------------------------------------------------


class Checker:
    """After every step: refcounts match the running tables, no running sequence lost a block to a rollback,
    and every prefix-cache key sits on a block full of its holder's verified tokens."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.blocks = {}
        self.steps_with_drafts = self.rejected = 0

    def step(self):
        out = self.engine.step()
        spec = {sid: len(out.accepted.get(sid, ())) for sid in out.accepted}
        self.steps_with_drafts += bool(spec)
        drafted = {sid: n - 1 for sid, n in out.scheduled.items() if sid in out.accepted}
        self.rejected += sum(drafted[sid] - spec[sid] for sid in spec)
        self.check(out)
        return out

    def check(self, out):
        engine = self.engine
        alloc, sched = engine.cache.allocator, engine.scheduler
        B = alloc.block_size
        k = engine.speculator.config.num_speculative_tokens
        free = alloc.free_queue() if hasattr(alloc, "free_queue") else list(alloc.free_block_ids)
        holders = Counter(b for s in sched.running for b in s.block_table.blocks)
        assert alloc.refcounts == [holders[b] for b in range(alloc.num_blocks)]
        assert len(free) == len(set(free)) == alloc.num_free
        assert set(free) == {b for b in range(alloc.num_blocks) if not holders[b]}
        for s in sched.running:
            table = s.block_table
            assert table.num_tokens == s.num_computed_tokens, s.seq_id
            # Blocks cover the computed tokens, plus at most what k drafts spilled into.
            assert blocks_needed(s.num_computed_tokens, B) <= table.num_blocks <= blocks_needed(s.num_tokens + k, B)
            before = self.blocks.get(s.seq_id)
            if before is not None and s.seq_id not in out.admitted:  # ran on: a rollback never frees a block
                assert len(table.blocks) >= len(before), s.seq_id
            if hasattr(alloc, "entries"):
                for i, b in enumerate(table.blocks):
                    entry = alloc.entries[b]
                    if entry is not None:  # a key only on a block full of verified tokens, and the right ones
                        assert i < s.num_computed_tokens // B, (s.seq_id, i)
                        assert entry.token_ids == tuple(s.token_ids[i * B:(i + 1) * B])
        self.blocks = {s.seq_id: list(s.block_table.blocks) for s in sched.running}


def add_request(engine, i, request):
    prompt, n, *temperature = request
    if isinstance(n, SamplingParams):  # (prompt, params): the request's own stopping rules
        params = n
    else:
        params = SamplingParams(max_tokens=n, temperature=temperature[0] if temperature else 0.0, seed=i)
    engine.add_request(prompt, params, request_id=f"r{i}")


def drive(engine, requests, rng, abort_prob=0.0, checker=None):
    """Add requests (prompt, max_tokens[, temperature]) or (prompt, params) two per step, abort some at random;
    return the aborted ids."""
    checker = checker or Checker(engine)
    return engine_helpers.drive(engine, requests, rng, add_request, abort_prob, checker.step)


@pytest.mark.parametrize("chunked, mode, caching", [(True, "recompute", True), (False, "recompute", False),
                                                    (True, "swap", False), (False, "swap", True)])  # fmt: skip
def test_greedy_output_equals_contiguous_under_preemption_chunking_aborts_and_sharing(model, chunked, mode, caching):
    rng = random.Random(f"{chunked}{mode}{caching}")
    config = EngineConfig(num_blocks=24, block_size=4, max_num_seqs=8, max_num_batched_tokens=64 if not chunked else 24,
                          chunked_prefill=chunked, preemption_mode=mode, keep_finished=True)  # fmt: skip
    engine = Engine(model, config, allocator=engine_helpers.allocator_for(caching), speculator=NgramSpeculator(SPEC))
    shared = repetitive_prompt(rng)
    requests = [(((shared if i % 3 == 0 else []) + repetitive_prompt(rng))[:40], rng.randint(4, 16)) for i in range(14)]
    checker = Checker(engine)
    aborted = drive(engine, requests, rng, abort_prob=0.05, checker=checker)
    assert engine.metrics.num_preemptions > 0
    assert engine.cache.allocator.num_used == 0 and not engine.swap_space
    m = engine.speculator.stats
    assert m.num_accepted_tokens > 0 and checker.rejected > 0  # both paths ran: acceptance and rollback
    assert sum(m.num_accepted_tokens_per_pos) == m.num_accepted_tokens <= m.num_draft_tokens
    for i, (prompt, n) in enumerate(requests):
        seq = engine.seqs[f"r{i}"]
        if f"r{i}" in aborted:
            assert seq.status is SequenceStatus.ABORTED
            continue
        assert seq.output_token_ids == reference(model, prompt, n), f"request r{i} differs"


def test_the_engine_counts_what_step_outputs_report(model):
    engine = spec_engine(model, num_blocks=40, block_size=4)
    rng = random.Random(3)
    for _ in range(3):
        engine.add_request(repetitive_prompt(rng), SamplingParams(max_tokens=20))
    drafts = accepted = verifications = tokens = 0
    while engine.has_unfinished():
        out = engine.step()
        assert out.drafts.keys() == out.accepted.keys()
        for sid, kept in out.accepted.items():
            assert out.scheduled[sid] == 1 + len(out.drafts[sid]) and out.drafts[sid][: len(kept)] == kept
            drafts += out.scheduled[sid] - 1
            accepted += len(kept)
            verifications += 1
        tokens += sum(len(v) for v in out.accepted.values()) + len(out.sampled)
    m = engine.speculator.stats
    assert (m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens) == (verifications, drafts, accepted)
    assert m.acceptance_rate == pytest.approx(accepted / drafts)
    assert m.mean_acceptance_length == pytest.approx(1 + accepted / verifications)
    assert tokens == 60  # every token of the three outputs, reported once


def test_drafts_never_pass_max_tokens_and_stop_tokens_among_them_end_the_output(model):
    rng = random.Random(11)
    prompts = [repetitive_prompt(rng) for _ in range(4)]
    plain = Engine(model, EngineConfig(num_blocks=40, block_size=4)).generate(prompts, SamplingParams(max_tokens=12))
    stops = tuple({o[5] for o in plain})  # a token each output produces mid-way
    params = SamplingParams(max_tokens=12, stop_token_ids=stops)
    want = Engine(model, EngineConfig(num_blocks=40, block_size=4)).generate(prompts, params)
    spec = spec_engine(model, num_blocks=40, block_size=4)
    assert spec.generate(prompts, params) == want
    assert all(len(o) <= 12 for o in want) and any(len(o) < 12 for o in want)
    assert spec.speculator.stats.num_draft_tokens > 0


def free_run_with_drafts(model, prompts, max_tokens):
    """Run ``prompts`` with drafts and no stopping (ignore_eos); per request its output and, per verification step,
    ``(outputs before the step, accepted drafts)``."""
    engine = spec_engine(model, num_blocks=80, block_size=4, keep_finished=True)
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    steps = {i: [] for i in ids}
    while engine.has_unfinished():
        before = {i: engine.seqs[i].num_output_tokens for i in ids}
        out = engine.step()
        for i, kept in out.accepted.items():
            steps[i].append((before[i], kept))
    return [(engine.seqs[i].output_token_ids, steps[i]) for i in ids]


def stop_inside_accepted_drafts(model, rng, max_tokens=24):
    """A prompt, and a draft its greedy run accepts before other accepted drafts: ``(prompt, stop, o, i)``.

    The stop token is accepted draft ``i >= 1`` of a verification step after ``o`` outputs, and its first
    occurrence in the output (so a run that stops at it stops in that step, with drafts after it to drop).
    """
    prompts = [repetitive_prompt(rng) for _ in range(12)]
    for prompt, (out, steps) in zip(prompts, free_run_with_drafts(model, prompts, max_tokens)):
        for o, kept in steps:
            for i in range(1, len(kept) - 1):
                if kept[i] not in out[: o + i] and kept[i] != model.config.eos_token_id:
                    return prompt, kept[i], o, i
    raise AssertionError("no run accepted three drafts in one step: the test needs another prompt")


def test_a_stop_token_inside_accepted_drafts_ends_the_request_there(model):
    prompt, stop, o, i = stop_inside_accepted_drafts(model, random.Random(2))
    params = SamplingParams(max_tokens=24, stop_token_ids=(stop,))
    want = engine_helpers.reference(model, prompt, params)
    assert len(want) == o + i + 1 and want[-1] == stop
    engine = spec_engine(model, num_blocks=80, block_size=4, keep_finished=True)
    rid = engine.add_request(prompt, params)
    while engine.has_unfinished():
        out = engine.step()
    seq = engine.seqs[rid]
    assert out.finished == [rid] and stop in out.accepted[rid][:-1]  # the stop, with accepted drafts after it
    assert seq.output_token_ids == want  # the drafts after it (and the bonus token) are dropped
    assert (seq.finish_reason, seq.stop_reason, seq.block_table) == ("stop", stop, None)
    assert engine.cache.allocator.num_used == 0 and seq.num_computed_tokens <= seq.num_tokens
    engine_helpers.check_finished(seq)


@pytest.mark.parametrize("site", ["check", "finish_reason", "release"])
def test_a_fault_as_a_stop_inside_accepted_drafts_ends_the_request_rolls_the_step_back(model, site, monkeypatch):
    """Issue 25: the stop check that fires on an accepted draft, the reasons it sets, or the release that follows
    raises: the step is rolled back, and the next one stops the request at the same draft."""
    prompt, stop, o, _ = stop_inside_accepted_drafts(model, random.Random(2))
    params = SamplingParams(max_tokens=24, stop_token_ids=(stop,))
    want = engine_helpers.reference(model, prompt, params)
    engine = spec_engine(model, num_blocks=80, block_size=4, keep_finished=True)
    rid = engine.add_request(prompt, params)
    owner, name = {"check": (StopRules, "check"), "finish_reason": (Sequence, "append_token"),
                   "release": (Scheduler, "_release")}[site]  # fmt: skip
    original = getattr(owner, name)

    def patched(*args, **kwargs):
        result = original(*args, **kwargs)
        if result or site == "release":  # the call that stops the request (and the release after it)
            raise Boom(site)
        return result

    faults = 0
    while engine.has_unfinished():
        before = engine_helpers.snapshot(engine)
        with monkeypatch.context() as m:
            if not faults and engine.seqs[rid].num_output_tokens == o:  # the step that stops inside its drafts
                m.setattr(owner, name, patched)
            try:
                out = engine.step()
            except Boom:
                faults += 1
                assert engine_helpers.snapshot(engine) == before, site
    seq = engine.seqs[rid]
    assert faults == 1 and out.finished == [rid] and stop in out.accepted[rid][:-1]
    assert seq.output_token_ids == want and (seq.finish_reason, seq.stop_reason) == ("stop", stop)
    assert engine.cache.allocator.num_used == 0


def test_min_tokens_masks_every_verified_position(model):
    """A stop token that would be accepted as draft ``i >= 1`` before ``min_tokens`` is rejected there.

    Wrong behaviour named: masking only the first verified row (the one plain decoding samples from).
    """
    prompt, stop, o, i = stop_inside_accepted_drafts(model, random.Random(2))
    params = SamplingParams(max_tokens=24, stop_token_ids=(stop,), min_tokens=o + i + 1)
    want = engine_helpers.reference(model, prompt, params)
    assert want[o + i] != stop and stop not in want[: o + i + 1]
    engine = spec_engine(model, num_blocks=80, block_size=4, keep_finished=True)
    rid = engine.add_request(prompt, params)
    masked_drafts = 0
    while engine.has_unfinished():
        before = engine.seqs[rid].num_output_tokens
        out = engine.step()
        drafts = out.drafts.get(rid, [])
        masked_drafts += sum(d == stop and before + j < params.min_tokens for j, d in enumerate(drafts) if j >= 1)
    assert masked_drafts > 0  # the case arose: a stop token drafted past the first row, before min_tokens
    assert engine.seqs[rid].output_token_ids == want
    engine_helpers.check_finished(engine.seqs[rid])


def test_parallel_samples_and_sampled_requests_next_to_drafting_ones(model):
    rng = random.Random(5)
    prompt = repetitive_prompt(rng)

    def run():
        engine = spec_engine(model, num_blocks=40, block_size=4, max_num_seqs=8)
        greedy = engine.add_request(prompt, SamplingParams(max_tokens=14, n=3))
        sampled = engine.add_request(prompt, SamplingParams(max_tokens=14, temperature=0.5, seed=1))
        outputs, drafted = {}, set()
        while engine.has_unfinished():
            out = engine.step()
            drafted |= {sid if sid == sampled else sid[0] for sid in out.drafts}
            outputs.update({o.request_id: o.output_token_ids for o in out.outputs})
        return outputs[greedy], outputs[sampled], drafted == {greedy, sampled}

    greedy, sampled, both_drafted = run()
    assert greedy == [reference(model, prompt, 14)] * 3
    assert both_drafted and len(sampled[0]) == 14
    assert run()[1] == sampled  # a seeded sampled request draws the same tokens again, drafts and all


def test_speculative_sampling_keeps_the_target_distribution():
    # Drafts [1, 2] against fixed target distributions over 4 tokens: the first emitted token must follow
    # probs[0], and, when it is the accepted draft 1, the second must follow probs[1].
    probs = torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.25, 0.25, 0.2, 0.3], [0.4, 0.3, 0.2, 0.1]])
    generator = torch.Generator().manual_seed(0)
    first, second, n = Counter(), Counter(), 20000
    for _ in range(n):
        j, token = accept_sampled([1, 2], probs, generator)
        emitted = [1, 2][:j] + [token]
        first[emitted[0]] += 1
        if j >= 1:
            second[emitted[1]] += 1
    assert all(abs(first[t] / n - float(probs[0, t])) < 0.02 for t in range(4)), first
    total = sum(second.values())
    assert all(abs(second[t] / total - float(probs[1, t])) < 0.02 for t in range(4)), second
    with pytest.raises(ValueError, match="k \\+ 1"):
        accept_sampled([1, 2], probs[:2])


def test_a_rejected_draft_leaves_its_block_reserved_and_uncached(model):
    # One sequence, drafts that cross into a new block; after the step the drafts' block is kept, keyless.
    rng = random.Random(0)
    engine = spec_engine(model, num_blocks=40, block_size=4, keep_finished=True)
    seen = 0
    for _ in range(30):
        prompt = repetitive_prompt(rng)
        rid = engine.add_request(prompt, SamplingParams(max_tokens=16))
        seq = engine.seqs[rid]
        while not seq.is_finished:
            out = engine.step()
            kept = out.accepted.get(rid)
            if kept is None or seq.is_finished:
                continue
            k = out.scheduled[rid] - 1
            table, B = seq.block_table, engine.config.block_size
            if len(kept) < k and table.num_blocks > blocks_needed(seq.num_computed_tokens, B):
                seen += 1
                spare = table.blocks[blocks_needed(seq.num_computed_tokens, B):]
                assert all(engine.cache.allocator.refcount(b) == 1 for b in spare)
                assert all(engine.cache.allocator.block_key(b) is None for b in spare)
                partial = table.blocks[seq.num_computed_tokens // B]
                assert engine.cache.allocator.block_key(partial) is None
        assert seq.output_token_ids == reference(model, prompt, 16)
        if seen >= 3:
            break
    assert seen >= 3


def test_no_drafting_without_repetition_and_spec_off_is_plain_decoding(model):
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(12)] for _ in range(3)]
    params = SamplingParams(max_tokens=6)
    engine = spec_engine(model, {"num_speculative_tokens": 3, "prompt_lookup_min": 4}, num_blocks=40, block_size=4)
    assert engine.generate(prompts, params) == [reference(model, p, 6) for p in prompts]
    stats = engine.speculator.stats
    assert stats.num_draft_tokens == 0 and stats.mean_acceptance_length == 1.0 and stats.acceptance_rate == 0.0


# ---- faults ----------------------------------------------------------------------------------------------------


class Boom(Exception):
    pass


STAGES = {  # where to raise: (object, attribute), after the call when "after"
    "forward": lambda e: (e.model, "forward", "before"),
    "verify": lambda e: (e.speculator, "verify", "before"),
    "propose": lambda e: (e.speculator.proposer, "propose", "after"),
    "rollback": lambda e: (Sequence, "append_token", "after"),
    "sample": lambda e: (engine_module, "sample", "before"),
}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("stage", sorted(STAGES))
def test_a_fault_in_a_speculative_step_leaves_the_engine_as_before(model, stage, mode, monkeypatch):
    rng = random.Random(f"{stage}{mode}")
    config = dict(num_blocks=20, block_size=4, max_num_seqs=6, max_num_batched_tokens=16, keep_finished=True,
                  preemption_mode=mode)  # fmt: skip
    engine = spec_engine(model, **config)
    prompts = [repetitive_prompt(rng)[:24] for _ in range(5)]
    lengths = [rng.randint(6, 14) for _ in prompts]
    for p, n in zip(prompts, lengths):
        engine.add_request(p, SamplingParams(max_tokens=n))
    # A seeded sampled request too: a failed step puts its generator back, so it draws as in a run without faults.
    sampled_rid = engine.add_request(prompts[0], SamplingParams(max_tokens=12, temperature=0.7, seed=3))
    faults = 0
    for _ in range(400):
        if not engine.has_unfinished():
            break
        before = engine_helpers.snapshot(engine)
        with monkeypatch.context() as m:
            if rng.random() < 0.4:
                owner, name, when = STAGES[stage](engine)
                original = getattr(owner, name)

                def patched(*args, _original=original, _when=when, **kwargs):
                    if _when == "after":
                        _original(*args, **kwargs)
                    raise KeyboardInterrupt if stage == "forward" else Boom(stage)

                m.setattr(owner, name, patched)
            try:
                engine.step()
            except (Boom, KeyboardInterrupt):
                faults += 1
                after = engine_helpers.snapshot(engine)
                for key in before:
                    assert after[key] == before[key], (stage, key)
    assert not engine.has_unfinished() and faults > 0
    assert engine.speculator.stats.num_accepted_tokens > 0
    for rid, p in enumerate(prompts):
        seq = engine.seqs[rid]
        assert seq.output_token_ids == reference(model, p, seq.sampling_params.max_tokens), (stage, rid)
    assert engine.cache.allocator.num_used == 0
    clean = spec_engine(model, **config)  # the same requests without faults: the sampled one draws the same tokens
    for p, n in zip(prompts, lengths):
        clean.add_request(p, SamplingParams(max_tokens=n))
    clean.add_request(prompts[0], SamplingParams(max_tokens=12, temperature=0.7, seed=3), request_id=sampled_rid)
    while clean.has_unfinished():
        clean.step()
    assert clean.seqs[sampled_rid].output_token_ids == engine.seqs[sampled_rid].output_token_ids


# ---- random workloads ------------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), k=st.integers(1, 5), lookup=st.tuples(st.integers(1, 3), st.integers(0, 2)),
       block_size=st.sampled_from([2, 4]), spare_blocks=st.integers(0, 12), mode=st.sampled_from(["recompute", "swap"]),
       chunked=st.booleans(), caching=st.booleans(), budget=st.integers(8, 40), num_requests=st.integers(1, 6),
       data=st.data())
def test_random_workloads_match_contiguous_and_keep_the_pool_consistent(seed, k, lookup, block_size, spare_blocks, mode,
                                                                        chunked, caching, budget, num_requests, data):
    model = course()
    pick = engine_helpers.hypothesis_pick(data)
    rng = random.Random(seed)
    num_blocks = blocks_needed(20 + 12 - 1, block_size) + spare_blocks  # the longest request fits, maybe only alone
    min_n, extra = lookup
    spec = {"num_speculative_tokens": k, "prompt_lookup_min": min_n, "prompt_lookup_max": min_n + extra}
    config = EngineConfig(num_blocks=num_blocks, block_size=block_size, max_num_seqs=4,
                          max_num_batched_tokens=budget if chunked else 64, chunked_prefill=chunked,
                          preemption_mode=mode, keep_finished=True, watermark=0.0)  # fmt: skip
    engine = Engine(model, config, allocator=engine_helpers.allocator_for(caching), speculator=NgramSpeculator(spec))
    # Some requests sample (temperature 0.8): they draft and verify by speculative sampling next to greedy ones.
    # Greedy requests stop at stop tokens drawn from what they generate, some with min_tokens or ignore_eos.
    requests = [(repetitive_prompt(rng)[:20], rng.randint(1, 12), rng.choice([0.0, 0.0, 0.8]))
                for _ in range(num_requests)]  # fmt: skip
    requests = [(p, engine_helpers.stop_params(pick, model, p, n)) if t == 0 else (p, n, t) for p, n, t in requests]
    aborted = drive(engine, requests, rng, abort_prob=0.05)
    assert engine.cache.allocator.num_used == 0 and not engine.swap_space
    for i, (prompt, params, *sampled) in enumerate(requests):
        seq = engine.seqs[f"r{i}"]
        if f"r{i}" in aborted:
            continue
        if not sampled:
            assert seq.output_token_ids == engine_helpers.reference(model, prompt, params), f"r{i}"
        engine_helpers.check_finished(seq)  # a sampled one ends at max_tokens or at the EOS


def test_bench_spec_refuses_a_bad_lookup_range_and_builds_prompts_of_the_asked_length():
    from minipaged.bench import spec as bench_spec

    with pytest.raises(SystemExit) as exc:
        bench_spec.main(["--lookup", "3", "2"])
    assert exc.value.code == 2
    for make in (bench_spec.repetitive_prompts, bench_spec.code_prompts):
        prompts = make(3, 50, seed=1)
        assert len(prompts) == 3 and all(len(p) == 50 for p in prompts)
        assert prompts == make(3, 50, seed=1)  # seeded
