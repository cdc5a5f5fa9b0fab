"""Issue 11, chapter 03: attention, the model config and generation name the bad argument."""

import pytest
import torch

from minipaged.attention import contiguous_attention, paged_attention, paged_prefill_attention
from minipaged.generate import generate_contiguous, generate_paged
from minipaged.model import LlamaConfig, LlamaForCausalLM

pytestmark = pytest.mark.ch03


@pytest.fixture(scope="module")
def model():
    return LlamaForCausalLM(LlamaConfig(max_position_embeddings=64), seed=0).eval()


def decode_case():
    k_cache = torch.randn(4, 4, 2, 8)
    q = torch.randn(2, 4, 8)
    return q, k_cache, k_cache.clone(), torch.tensor([[0], [1]], dtype=torch.int32), torch.tensor([3, 2])


@pytest.mark.parametrize("scale, error", [(float("nan"), ValueError), (float("inf"), ValueError),
                                          (-1.0, ValueError), ("0.1", TypeError)])  # fmt: skip
@pytest.mark.parametrize("backend", ["torch", "loop", "prefill", "contiguous"])
def test_a_bad_scale_is_named(scale, error, backend):
    q, k_cache, v_cache, tables, lens = decode_case()
    with pytest.raises(error, match="scale"):
        if backend == "prefill":
            paged_prefill_attention(q, k_cache, v_cache, tables, lens, torch.tensor([0, 1, 2]), scale=scale)
        elif backend == "contiguous":
            contiguous_attention(q, k_cache[0], v_cache[0], scale=scale)
        else:
            paged_attention(q, k_cache, v_cache, tables, lens, scale=scale, backend=backend)


@pytest.mark.parametrize("starts, error", [([0, 1, 2], TypeError), (torch.tensor([[0, 1, 2]]), ValueError)])
def test_query_start_loc_as_a_list_or_2d_blames_query_start_loc(starts, error):
    q, k_cache, v_cache, tables, lens = decode_case()
    with pytest.raises(error, match="query_start_loc"):
        paged_prefill_attention(q, k_cache, v_cache, tables, lens, starts)


@pytest.mark.parametrize("shape, name", [((3, 16), "k"), ((3, 4, 8, 1), "k")])
def test_contiguous_attention_checks_k_shape_first(shape, name):
    with pytest.raises(ValueError, match=f"^{name} must be 3-D"):
        contiguous_attention(torch.randn(3, 4, 8), torch.randn(*shape), torch.randn(*shape))
    with pytest.raises(ValueError, match="head_dim"):
        contiguous_attention(torch.randn(3, 4, 8), torch.randn(3, 2, 16), torch.randn(3, 2, 16))


@pytest.mark.parametrize("field, value, error", [
    ("num_key_value_heads", 0, ValueError), ("vocab_size", -1, ValueError), ("hidden_size", -5, ValueError),
    ("num_attention_heads", 4.0, TypeError), ("head_dim", True, TypeError), ("max_position_embeddings", 0, ValueError),
    ("rope_theta", float("nan"), ValueError), ("rms_norm_eps", "1e-6", TypeError),
    ("eos_token_id", 512, ValueError), ("eos_token_id", "2", TypeError), ("eos_token_id", (2, 2.0), TypeError),
    ("eos_token_id", -1, ValueError), ("bos_token_id", 512, ValueError), ("bos_token_id", True, TypeError),
])  # fmt: skip
def test_llama_config_names_the_bad_field(field, value, error):
    with pytest.raises(error, match=f"LlamaConfig.{field}"):
        LlamaConfig(**{field: value})


@pytest.mark.parametrize("prompt, error, where", [
    ([1, 999], ValueError, r"\[1\] = 999 is outside the token ids"), ([1.5, 2], TypeError, r"\[0\] must be an int"),
    ([float("nan")], TypeError, r"\[0\] must be an int"), ("hello", TypeError, " must be a list of token ids"),
    ([], ValueError, " must hold at least one token"),
    ([1] * 60, ValueError, " has 60 tokens.*max_position_embeddings=64"),
])  # fmt: skip
def test_generation_names_the_bad_prompt(model, prompt, error, where):
    with pytest.raises(error, match="prompt_token_ids" + where):
        generate_contiguous(model, prompt, 5)
    with pytest.raises(error, match=r"prompts\[1\]" + where):
        generate_paged(model, [[1, 2], prompt], 5)


def test_generation_fits_max_position_embeddings_exactly(model):
    # prompt + max_new_tokens == max_position_embeddings is the longest that runs; one more is refused.
    assert generate_contiguous(model, [1] * 60, 4) == generate_paged(model, [[1] * 60], 4, block_size=4)[0]
    with pytest.raises(ValueError, match="65 exceeds"):
        generate_paged(model, [[1] * 60], 5)


def test_generate_paged_needs_prompts_and_a_block_size(model):
    with pytest.raises(ValueError, match="prompts must hold at least one prompt"):
        generate_paged(model, [], 2)
    with pytest.raises(ValueError, match="block_size"):
        generate_paged(model, [[1, 2]], 2, block_size=0)
    with pytest.raises(TypeError, match="block_size"):
        generate_paged(model, [[1, 2]], 2, block_size=2.0)
