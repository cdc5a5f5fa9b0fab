"""Beam search on fork and copy-on-write equals the contiguous reference, and shares blocks as it should."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.beam_search import beam_search, beam_search_contiguous
from minipaged.block_math import blocks_needed
from minipaged.blocks import BlockTable, OutOfBlocks
from minipaged.generate import forward_contiguous
from minipaged.model import LlamaConfig, LlamaForCausalLM

pytestmark = pytest.mark.ch08

# Float64 weights: paged attention still computes in float32, but the log-probabilities of the two searches
# then agree to ~1e-7 per token, so two proposals closer than that (which could rank differently) are very rare.
# A beam's cum_logprob sums up to 9 of them: 1e-5 bounds the sum (hypothesis found 1.02e-6 over 8 tokens).
MODEL = LlamaForCausalLM(LlamaConfig(vocab_size=64, max_position_embeddings=128), seed=0).double().eval()


def same(paged, ref):
    assert [s.token_ids for s in paged] == [s.token_ids for s in ref]
    assert [s.finished for s in paged] == [s.finished for s in ref]
    for a, b in zip(paged, ref):
        assert a.cum_logprob == pytest.approx(b.cum_logprob, abs=1e-5)
        assert a.score == pytest.approx(b.score, abs=1e-5)


@settings(max_examples=12, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 63), min_size=1, max_size=20),
    beam_width=st.integers(1, 6),
    max_tokens=st.integers(1, 9),
    block_size=st.sampled_from([1, 2, 4, 8]),
    eos=st.sampled_from([None, 0, 5]),
    share=st.booleans(),
)
def test_equals_the_contiguous_reference(prompt, beam_width, max_tokens, block_size, eos, share):
    out = beam_search(MODEL, prompt, beam_width, max_tokens, block_size=block_size, share=share, eos_token_id=eos)
    ref = beam_search_contiguous(MODEL, prompt, beam_width, max_tokens, eos_token_id=eos)
    same(out.sequences, ref)
    assert 1 <= len(ref) <= beam_width
    for seq in out.sequences:  # a finished beam ends with the EOS ("stop"); any other ran to max_tokens ("length")
        ended = eos is not None and seq.token_ids[-1] == eos
        assert seq.finish_reason == ("stop" if ended else "length")
        assert ended or len(seq.token_ids) == max_tokens
    for s in out.steps:
        assert s.blocks_used <= s.logical_blocks  # sharing never costs more than no sharing
        if not share:  # every beam holds private blocks: what no sharing costs, exactly
            assert s.blocks_used == s.logical_blocks and s.num_forks == 0 and s.num_cows == 0
    # The step records are consistent with a replay of the tree: one beam per parent pointer.
    for prev, s in zip(out.steps[1:], out.steps[2:]):
        assert len(s.parents) == s.num_beams and all(0 <= p < prev.num_beams for p in s.parents)


def test_beams_are_ranked_and_scored_by_vllms_key():
    out = beam_search(MODEL, [1, 2, 3], 4, 6, eos_token_id=None, length_penalty=1.0)
    scores = [s.score for s in out.sequences]
    assert scores == sorted(scores, reverse=True) and len(scores) == 4
    for s in out.sequences:  # cum_logprob / seq_len ** 1.0, seq_len counting the prompt
        assert s.score == pytest.approx(s.cum_logprob / (3 + len(s.token_ids)))
        logprobs = _sequence_logprob(MODEL, [1, 2, 3], s.token_ids)
        assert s.cum_logprob == pytest.approx(logprobs, abs=1e-6)


@torch.no_grad()
def _sequence_logprob(model, prompt, tokens):
    ids = torch.tensor(prompt + tokens)
    logits, _ = forward_contiguous(model, ids, torch.arange(len(ids)))
    logp = torch.log_softmax(logits.double(), -1)
    return sum(float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens))


def test_width_one_is_greedy():
    from minipaged.generate import generate_contiguous

    out = beam_search(MODEL, [7, 8, 9, 10, 11], 1, 8, block_size=4)
    assert out.sequences[0].token_ids == generate_contiguous(MODEL, [7, 8, 9, 10, 11], 8)
    assert all(s.num_forks == 0 and s.num_cows == 0 for s in out.steps)


@pytest.mark.parametrize("beam_width", [2, 4, 6])
def test_sharing_saves_blocks_and_no_sharing_costs_logical_blocks(beam_width):
    prompt = list(range(1, 40))
    shared = beam_search(MODEL, prompt, beam_width, 24, block_size=4)
    private = beam_search(MODEL, prompt, beam_width, 24, block_size=4, share=False)
    same(shared.sequences, private.sequences)
    assert private.peak_blocks == private.peak_logical_blocks == shared.peak_logical_blocks
    assert shared.peak_blocks < private.peak_blocks
    # The prompt's full blocks are held once; each beam holds at most the blocks after them.
    full = len(prompt) // 4
    assert shared.peak_blocks <= full + beam_width * (blocks_needed(len(prompt) + 24, 4) - full)
    assert sum(s.num_forks for s in shared.steps) >= beam_width - 1  # the first step alone splits into k beams
    assert sum(s.num_copied_blocks for s in private.steps) > 0 and sum(s.num_copied_blocks for s in shared.steps) == 0


def test_copy_on_write_only_for_a_shared_partly_filled_block():
    # Prompt of 6 tokens, block size 4: the prompt's second block is half full when the first beams fork it.
    out = beam_search(MODEL, [3, 1, 4, 1, 5, 9], 3, 3, block_size=4)
    first = out.steps[1]
    assert first.num_beams == 3 and first.parents == [0, 0, 0]
    assert first.num_forks == 2  # beam 0 carries on, two children fork
    assert first.num_cows == 2  # two of the three holders of the half-full block copy it; the last writes in place
    assert first.blocks_used == 2 + 2  # the prompt's two blocks, plus the two copies
    # At a block boundary nothing is copied: the new token starts a new block.
    out = beam_search(MODEL, [3, 1, 4, 1, 5, 9, 2, 6], 3, 2, block_size=4)
    assert out.steps[1].num_cows == 0 and out.steps[1].blocks_used == 2 + 3


def test_dropped_beams_free_their_blocks_and_the_pool_ends_empty(monkeypatch):
    released = []
    real_release = BlockTable.release

    def spy(self):
        released.append((self.seq_id, self.allocator.num_used))
        real_release(self)
        assert all(self.allocator.refcount(b) >= 0 for b in range(self.allocator.num_blocks))

    monkeypatch.setattr(BlockTable, "release", spy)
    allocators = []
    real_init = BlockTable.__init__

    def init(self, allocator, seq_id=None):
        allocators.append(allocator)
        real_init(self, allocator, seq_id)

    monkeypatch.setattr(BlockTable, "__init__", init)
    beam_search(MODEL, list(range(10)), 4, 12, block_size=2)
    assert len(released) > 4  # beams were dropped during the search, not only released at the end
    assert allocators[0].num_used == 0 and allocators[0].refcounts == [0] * allocators[0].num_blocks


def test_the_kv_of_a_shared_block_is_never_overwritten():
    # Replaying the search's blocks through the cache: every beam's K/V equals a fresh prefill of its tokens.
    # Done indirectly: the reference's scores match only if each beam read its own, uncorrupted K/V; a step
    # with copy-on-write disabled (the copy skipped) must break that equality.
    import minipaged.beam_search as bs

    prompt, k, n = [3, 1, 4, 1, 5, 9], 3, 6
    ref = beam_search_contiguous(MODEL, prompt, k, n)
    same(beam_search(MODEL, prompt, k, n, block_size=4).sequences, ref)

    class NoCopy(bs.PagedKVCache):
        def copy_blocks(self, src, dst):  # forgets the copy before the diverging write
            pass

    original = bs.PagedKVCache
    bs.PagedKVCache = NoCopy
    try:
        broken = beam_search(MODEL, prompt, k, n, block_size=4).sequences
    finally:
        bs.PagedKVCache = original
    assert [s.token_ids for s in broken] != [s.token_ids for s in ref] or any(
        abs(a.cum_logprob - b.cum_logprob) > 1e-6 for a, b in zip(broken, ref))


def test_a_pool_too_small_raises_out_of_blocks():
    with pytest.raises(OutOfBlocks):
        beam_search(MODEL, list(range(10)), 4, 8, block_size=2, num_blocks=6)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"beam_width": 0}, ValueError, "beam_width"),
    ({"beam_width": 2.0}, TypeError, "beam_width"),
    ({"max_tokens": True}, TypeError, "max_tokens"),
    ({"max_tokens": 0}, ValueError, "max_tokens"),
    ({"prompt_token_ids": []}, ValueError, "prompt_token_ids"),
    ({"prompt_token_ids": [64]}, ValueError, "prompt_token_ids"),
    ({"eos_token_id": 64}, ValueError, "eos_token_id"),
    ({"eos_token_id": 1.5}, TypeError, "eos_token_id"),
    ({"length_penalty": "1"}, TypeError, "length_penalty"),
    ({"share": 1}, TypeError, "share"),
    ({"block_size": 0}, ValueError, "block_size"),
    ({"model": "tiny"}, TypeError, "model"),
])
def test_bad_input_is_named(kwargs, error, match):
    args = {"model": MODEL, "prompt_token_ids": [1, 2, 3], "beam_width": 2, "max_tokens": 3} | kwargs
    with pytest.raises(error, match=match):
        beam_search(**args)
    if "share" not in kwargs and "block_size" not in kwargs:
        with pytest.raises(error, match=match):
            beam_search_contiguous(**args)
