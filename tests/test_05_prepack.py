"""Prepacking (minipaged.prepack): fused, oneDNN-prepacked matmuls that change the speed, not the model.

The packed model keeps its parameters and their names, computes the plain model's logits up to
float32 rounding (another summation order), and makes the same greedy tokens on the tiny model;
unpacking gives back the plain model's logits bit for bit. Speed is the benchmarks' business
(``python -m minipaged.bench vllm``), never a test's.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.checkpoint import load_pretrained, save_pretrained
from minipaged.engine import Engine
from minipaged.generate import forward_contiguous, generate_contiguous
from minipaged.llm import LLM
from minipaged.model import LlamaConfig, LlamaForCausalLM
from minipaged.prepack import PackedLinear, is_prepacked, prepack, unpack
from minipaged.sequence import SamplingParams

pytestmark = pytest.mark.ch05

TOLERANCE = 1e-4  # float32 logits of the tiny model, packed against plain (another summation order)


def tiny(seed=0, **config):
    return LlamaForCausalLM(LlamaConfig(**config), seed=seed).eval()


def prompts(n=6, length=20, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(512, (length + i,), generator=gen).tolist() for i in range(n)]


@torch.no_grad()
def logits(model, ids):
    return forward_contiguous(model, torch.tensor(ids), torch.arange(len(ids)))[0]


def test_prepacked_model_keeps_its_parameters_and_their_names():
    model = tiny(tie_word_embeddings=True)
    before = {name: p.clone() for name, p in model.state_dict().items()}
    params = list(model.parameters())
    prepack(model)
    assert is_prepacked(model)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[name], t) for name, t in before.items())
    assert list(model.parameters()) == params
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied


def test_packed_logits_are_the_plain_ones_up_to_rounding_and_unpack_restores_them_exactly():
    model, ids = tiny(), prompts(1, 30)[0]
    plain = logits(model, ids)
    packed = logits(prepack(model), ids)
    torch.testing.assert_close(packed, plain, rtol=TOLERANCE, atol=TOLERANCE)
    assert torch.equal(packed.argmax(-1), plain.argmax(-1))
    assert torch.equal(logits(unpack(model), ids), plain)
    assert not is_prepacked(model)


def test_packed_engine_makes_the_plain_greedy_tokens():
    model, params = tiny(), SamplingParams(max_tokens=24, ignore_eos=True)
    plain = Engine(model).generate(prompts(), params)
    packed = Engine(prepack(model)).generate(prompts(), params)
    assert packed == plain
    assert packed == [generate_contiguous(model, p, 24) for p in prompts()]  # the packed contiguous path too


def test_a_changed_weight_is_packed_again(tmp_path):
    model, other, ids = prepack(tiny(seed=0)), tiny(seed=1), prompts(1)[0]
    before = logits(model, ids)
    model.load_state_dict(other.state_dict())  # in place: the packed copies must follow
    after = logits(model, ids)
    torch.testing.assert_close(after, logits(other, ids), rtol=TOLERANCE, atol=TOLERANCE)
    assert not torch.allclose(after, before)
    save_pretrained(model, tmp_path)  # a packed model saves Hugging Face's names, and loads back plain
    reloaded = load_pretrained(tmp_path)
    assert not is_prepacked(reloaded)
    torch.testing.assert_close(logits(reloaded, ids), logits(other, ids), rtol=0, atol=0)


def test_prepack_twice_is_a_no_op():
    model = prepack(tiny())
    packed = dict(model.model.layers[0].self_attn.__dict__)
    prepack(model)
    assert model.model.layers[0].self_attn.__dict__["qkv"] is packed["qkv"]


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(0, 40), in_features=st.integers(1, 48),
       sizes=st.lists(st.integers(1, 40), min_size=1, max_size=3), seed=st.integers(0, 2**16))  # fmt: skip
def test_packed_linear_is_the_stacked_layers(rows, in_features, sizes, seed):
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(n, in_features, generator=gen) for n in sizes]
    x = torch.randn(rows, in_features, generator=gen)
    got = PackedLinear(weights)(x)
    got = got if len(sizes) > 1 else (got,)
    assert [tuple(g.shape) for g in got] == [(rows, n) for n in sizes]
    for g, w in zip(got, weights):
        torch.testing.assert_close(g, F.linear(x, w), rtol=TOLERANCE, atol=TOLERANCE)


def test_packed_linear_falls_back_to_plain_linear_off_float32():
    weights = [torch.randn(5, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)]
    x = torch.randn(4, 8, dtype=torch.float64)
    packed = PackedLinear(weights)
    a, b = packed(x)
    assert not packed.packed.is_mkldnn  # oneDNN's prepacked matmul is float32's only here
    torch.testing.assert_close(a, F.linear(x, weights[0]), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(b, F.linear(x, weights[1]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("call", [prepack, unpack, is_prepacked])
def test_a_model_that_is_not_a_llama_is_refused(call):
    with pytest.raises(TypeError, match="model must be a LlamaForCausalLM"):
        call(torch.nn.Linear(2, 2))


def test_llm_prepack_must_be_a_bool():
    with pytest.raises(TypeError, match="prepack must be True or False"):
        LLM(tiny(), tokenizer="bytes", prepack=1)
