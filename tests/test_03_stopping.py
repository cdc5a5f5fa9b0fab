"""Stopping rules (vLLM V1's): EOS, stop tokens, ignore_eos, min_tokens; and the chapter-03 reference loops."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.generate import forward_contiguous, generate_contiguous, generate_paged
from minipaged.model import LlamaConfig, LlamaForCausalLM
from minipaged.stopping import StopRules, eos_token_ids

pytestmark = pytest.mark.ch03

VOCAB = 24  # a small vocabulary: a random model's greedy output meets any given token soon
SMALL = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16)  # fmt: skip


def small_model(eos_token_id=None):
    torch.set_num_threads(1)
    config = LlamaConfig(**{**SMALL.__dict__, "eos_token_id": eos_token_id})
    return LlamaForCausalLM(config, seed=1).eval()


def test_eos_token_ids_takes_none_an_id_or_a_list():
    assert eos_token_ids(None) == () and eos_token_ids(5) == (5,) and eos_token_ids([7, 5, 7]) == (7, 5)
    with pytest.raises(TypeError, match="eos_token_id must be None, an int or a list"):
        eos_token_ids("2")
    with pytest.raises(TypeError, match=r"eos_token_id\[1\]"):
        eos_token_ids([2, 2.5])
    with pytest.raises(ValueError, match=r"eos_token_id must be >= 0"):
        eos_token_ids(-1)


def test_resolve_follows_vllm_for_the_eos_the_extra_eos_ids_and_ignore_eos():
    rules = StopRules.resolve(8, (2, 9), stop_token_ids=[4])
    assert (rules.eos_token_id, rules.stop_token_ids) == (2, {4, 9})  # the further EOS ids join the stop tokens
    assert rules.masked_token_ids == ()  # nothing to mask without min_tokens
    ignored = StopRules.resolve(8, (2, 9), stop_token_ids=[4], ignore_eos=True, min_tokens=3)
    assert (ignored.eos_token_id, ignored.stop_token_ids) == (None, {4})  # the caller's stop ids still stop it
    assert ignored.masked_token_ids == (2, 4, 9)  # vLLM masks the EOS ids before min_tokens even with ignore_eos
    assert StopRules.resolve(8, 2, stop_token_ids=[2]).stop_token_ids == set()  # the EOS reports as the EOS


def test_check_order_is_eos_then_stop_tokens_then_length():
    rules = StopRules.resolve(3, (2, 9), stop_token_ids=[4])
    assert rules.check(2, 1) == ("stop", None)  # the EOS: no stop_reason
    assert rules.check(9, 1) == ("stop", 9)  # a further EOS id reports its id, as vLLM's generation config does
    assert rules.check(4, 3) == ("stop", 4)  # a stop token as the last allowed token is a stop, not a length
    assert rules.check(5, 3) == ("length", None)
    assert rules.check(5, 2) is None
    assert StopRules.resolve(3, 2, ignore_eos=True).check(2, 1) is None


def test_mask_covers_the_rows_before_min_tokens_only():
    rules = StopRules.resolve(8, 2, stop_token_ids=[4], min_tokens=3)
    logits = torch.zeros(4, 6)
    masked = rules.mask(logits, 1)  # rows pick outputs 1, 2, 3, 4: the first two are before min_tokens
    assert torch.isinf(masked[:2, [2, 4]]).all() and torch.isfinite(masked[2:]).all()
    assert torch.isfinite(masked[:, [0, 1, 3, 5]]).all()
    assert torch.equal(logits, torch.zeros(4, 6))  # the input is left as it was
    assert rules.mask(logits, 3) is logits  # nothing left to mask


@pytest.mark.parametrize("args, error, words", [
    ((0, None, (), False, 1), ValueError, "min_tokens must be at most max_tokens=0"),
    ((4, None, (), False, -1), ValueError, "min_tokens must be >= 0"),
    ((4, None, (2.0,)), TypeError, r"stop_token_ids\[0\]"),
    ((4, None, (), False, 1.5), TypeError, "min_tokens"),
])
def test_resolve_names_the_bad_argument(args, error, words):
    with pytest.raises(error, match=words):
        StopRules.resolve(*args)


def test_resolve_refuses_ids_outside_the_vocabulary():
    with pytest.raises(ValueError, match=r"stop_token_ids\[1\] = 30 is outside"):
        StopRules.resolve(4, 2, stop_token_ids=[1, 30], vocab_size=24)
    with pytest.raises(ValueError, match=r"eos_token_id\[0\] = 30 is outside"):
        StopRules.resolve(4, 30, vocab_size=24)


def oracle(model, prompt, max_tokens, stop_token_ids, ignore_eos, min_tokens):
    """vLLM's rules written out once more, recomputing the whole sequence at every position (no cache)."""
    eos = list(eos_token_ids(model.config.eos_token_id))
    stops = set(stop_token_ids) | (set() if ignore_eos else set(eos))
    masked = sorted(set(stop_token_ids) | set(eos))
    out = []
    while len(out) < max_tokens:
        ids = torch.tensor(prompt + out)
        row = forward_contiguous(model, ids, torch.arange(len(ids)))[0][-1].clone()
        if len(out) < min_tokens:
            row[masked] = float("-inf")
        out.append(int(row.argmax()))
        if out[-1] in stops:
            break
    return out


@settings(max_examples=30, deadline=None, derandomize=True)
@given(eos=st.one_of(st.none(), st.integers(0, VOCAB - 1), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3)),
       prompts=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9), min_size=1, max_size=3),
       max_tokens=st.integers(1, 10), stops=st.lists(st.integers(0, VOCAB - 1), max_size=3), ignore_eos=st.booleans(),
       data=st.data())
def test_reference_loops_stop_as_vllm_does(eos, prompts, max_tokens, stops, ignore_eos, data):
    model = small_model(eos)
    min_tokens = data.draw(st.integers(0, max_tokens))
    rules = {"stop_token_ids": stops, "ignore_eos": ignore_eos, "min_tokens": min_tokens}
    want = [oracle(model, p, max_tokens, stops, ignore_eos, min_tokens) for p in prompts]
    assert [generate_contiguous(model, p, max_tokens, **rules) for p in prompts] == want
    assert generate_paged(model, prompts, max_tokens, block_size=4, prefill_chunk_size=3, **rules) == want


def test_the_reference_stops_at_the_eos_and_min_tokens_masks_it():
    free = generate_contiguous(small_model(), [3, 1, 4], 10)
    eos = free[2]
    first = free.index(eos)
    model = small_model(eos)
    stopped = generate_contiguous(model, [3, 1, 4], 10)
    assert stopped == free[: first + 1]  # wrong: running past the EOS, or dropping it from the output
    assert generate_contiguous(model, [3, 1, 4], 10, ignore_eos=True) == free  # wrong: the EOS still stops it
    late = generate_contiguous(model, [3, 1, 4], 10, min_tokens=first + 1)
    assert len(late) > first + 1 and late[first] != eos  # wrong: stopping before min_tokens, or sampling the EOS
    assert late[:first] == free[:first]
    assert generate_contiguous(model, [3, 1, 4], 10, min_tokens=first) == stopped  # wrong: masking one row too many


def test_reference_loops_name_bad_stopping_arguments():
    model = small_model(2)
    with pytest.raises(TypeError, match="ignore_eos must be True or False"):
        generate_contiguous(model, [1, 2], 4, ignore_eos="yes")
    with pytest.raises(TypeError, match="stop_token_ids must be a sequence"):
        generate_paged(model, [[1, 2]], 4, stop_token_ids=3)
    with pytest.raises(ValueError, match="min_tokens must be at most max_tokens=4"):
        generate_paged(model, [[1, 2]], 4, min_tokens=5)
    with pytest.raises(ValueError, match=r"stop_token_ids\[0\] = 99 is outside"):
        generate_contiguous(model, [1, 2], 4, stop_token_ids=[99])
