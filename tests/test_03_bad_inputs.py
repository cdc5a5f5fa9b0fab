"""Issues 11 and 25, chapter 03: attention, the model config, checkpoints and generation name the bad argument."""

import json

import pytest
import torch

from minipaged.attention import contiguous_attention, paged_attention, paged_prefill_attention
from minipaged.checkpoint import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    BadCheckpoint,
    UnsupportedCheckpoint,
    load_pretrained,
    save_pretrained,
)
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


def test_an_attention_backend_that_is_not_a_name_is_a_type_error():
    q, k_cache, v_cache, tables, lens = decode_case()
    with pytest.raises(TypeError, match=r"backend must be one of \('loop', 'torch', 'triton'\), got int 1"):
        paged_attention(q, k_cache, v_cache, tables, lens, backend=1)


# --------------------------------------------------------------------------- checkpoints (issue 25)

TINY = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=8)  # fmt: skip


@pytest.fixture()
def checkpoint(tmp_path):
    return save_pretrained(LlamaForCausalLM(TINY, seed=0), tmp_path / "ckpt")


def write_config(directory, edit):
    path = directory / CONFIG_NAME
    config = json.loads(path.read_text())
    path.write_text(edit(config) if callable(edit) else json.dumps(config | edit))


@pytest.mark.parametrize("edit, error, match", [
    ({"rope_scaling": "linear"}, UnsupportedCheckpoint, "rope_scaling must be None or an object, got 'linear'"),
    ({"rope_parameters": "yarn"}, UnsupportedCheckpoint, "rope_parameters must be None or an object"),
    (lambda c: json.dumps({k: v for k, v in c.items() if k != "vocab_size"}), BadCheckpoint,
     "lacks the field 'vocab_size'"),  # was: KeyError
    ({"num_attention_heads": 0, "head_dim": None}, ValueError, "num_attention_heads must be >= 1, got 0"),
    ({"hidden_size": "16"}, TypeError, "hidden_size must be an int, got str"),
    ({"rope_theta": "big"}, TypeError, "rope_theta must be a real number"),  # was: float() of a string
    (lambda c: json.dumps([c]), BadCheckpoint, "must hold a JSON object, got a JSON list"),  # was: AttributeError
    (lambda c: json.dumps(c)[:-3], BadCheckpoint, "is not valid JSON"),  # was: JSONDecodeError, no file name
])  # fmt: skip
def test_a_malformed_config_is_a_named_error_with_the_file_and_the_field(checkpoint, edit, error, match):
    write_config(checkpoint, edit)
    with pytest.raises(error, match=match) as info:
        load_pretrained(checkpoint)
    assert str(checkpoint / CONFIG_NAME) in str(info.value)


@pytest.mark.parametrize("rope", [{"rope_type": "default"}, {"type": "default"}, None])
def test_default_rope_scaling_is_plain_rope(checkpoint, rope):
    write_config(checkpoint, {"rope_scaling": rope})  # was: {"rope_type": "default"} refused
    loaded = load_pretrained(checkpoint)
    assert loaded.config == TINY


def test_a_truncated_weights_file_is_a_named_error(checkpoint):
    weights = checkpoint / WEIGHTS_NAME
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(BadCheckpoint, match="cannot be read") as info:  # was: safetensors' SafetensorError
        load_pretrained(checkpoint)
    assert str(weights) in str(info.value)
    weights.write_bytes(b"")
    with pytest.raises(BadCheckpoint, match=WEIGHTS_NAME):
        load_pretrained(checkpoint)
