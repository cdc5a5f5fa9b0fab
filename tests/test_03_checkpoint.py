"""Hugging Face checkpoints in and out: round trip, tied embeddings, every refusal, the shipped course model."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minipaged import tokenizer
from minipaged.checkpoint import (
    CONFIG_NAME,
    COURSE_MODEL_DIR,
    GENERATION_CONFIG_NAME,
    WEIGHTS_NAME,
    UnsupportedCheckpoint,
    config_from_hf,
    load_course_model,
    load_pretrained,
    save_pretrained,
)
from minipaged.generate import generate_contiguous, generate_paged
from minipaged.model import LlamaConfig, LlamaForCausalLM

pytestmark = pytest.mark.ch03

ROOT = Path(__file__).resolve().parent.parent
SMALL = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, rope_theta=500000.0, rms_norm_eps=1e-5)  # fmt: skip


def saved(tmp_path, config=SMALL, seed=0) -> tuple[LlamaForCausalLM, Path]:
    model = LlamaForCausalLM(config, seed=seed).eval()
    return model, save_pretrained(model, tmp_path / "ckpt")


def edit_config(directory: Path, **fields) -> None:
    config = json.loads((directory / CONFIG_NAME).read_text())
    config.update(fields)
    (directory / CONFIG_NAME).write_text(json.dumps(config))


def test_round_trip_keeps_every_tensor_and_the_config(tmp_path):
    model, directory = saved(tmp_path)
    assert sorted(p.name for p in directory.iterdir()) == sorted([CONFIG_NAME, GENERATION_CONFIG_NAME, WEIGHTS_NAME])
    loaded = load_pretrained(directory)
    assert loaded.config == model.config
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    assert generate_contiguous(loaded, prompt, 8) == generate_contiguous(model, prompt, 8)


def test_config_json_uses_hugging_face_fields(tmp_path):
    model, directory = saved(tmp_path)
    hf = json.loads((directory / CONFIG_NAME).read_text())
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["model_type"] == "llama"
    assert (hf["num_key_value_heads"], hf["head_dim"], hf["rope_theta"]) == (2, 16, 500000.0)
    assert hf["torch_dtype"] == "float32" and hf["tie_word_embeddings"] is False


def test_float16_checkpoint_loads_in_the_dtype_asked_for(tmp_path):
    model = LlamaForCausalLM(SMALL, seed=3).half()
    directory = save_pretrained(model, tmp_path / "half")
    assert json.loads((directory / CONFIG_NAME).read_text())["torch_dtype"] == "float16"
    loaded = load_pretrained(directory)
    assert loaded.dtype == torch.float32
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight.float())


def test_tied_embeddings_share_one_tensor_and_store_it_once(tmp_path):
    from safetensors.torch import load_file

    config = LlamaConfig(**{**SMALL.__dict__, "tie_word_embeddings": True})
    model, directory = saved(tmp_path, config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in load_file(str(directory / WEIGHTS_NAME))
    loaded = load_pretrained(directory)
    assert loaded.config.tie_word_embeddings
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert torch.equal(loaded.lm_head.weight, model.model.embed_tokens.weight)
    assert generate_contiguous(loaded, [1, 2, 3], 6) == generate_contiguous(model, [1, 2, 3], 6)


def test_tied_checkpoint_that_also_stores_lm_head_loads(tmp_path):
    from safetensors.torch import load_file, save_file

    config = LlamaConfig(**{**SMALL.__dict__, "tie_word_embeddings": True})
    model, directory = saved(tmp_path, config)
    tensors = load_file(str(directory / WEIGHTS_NAME))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(directory / WEIGHTS_NAME))
    assert torch.equal(load_pretrained(directory).lm_head.weight, model.lm_head.weight)


def test_defaults_of_an_older_config_fill_in(tmp_path):
    """No num_key_value_heads (no GQA) and no head_dim (hidden / heads), as older Llama configs have."""
    config = config_from_hf({"vocab_size": 10, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                             "num_attention_heads": 4})  # fmt: skip
    assert (config.num_key_value_heads, config.head_dim, config.tie_word_embeddings) == (4, 8, False)


def test_rope_parameters_of_transformers_5_are_read():
    hf = {"vocab_size": 10, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 4, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}  # fmt: skip
    assert config_from_hf(hf).rope_theta == 1e6


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"architectures": ["MistralForCausalLM"]}, r"architectures must be \['LlamaForCausalLM'\], got \['Mistral"),
        ({"model_type": "qwen2"}, "model_type must be 'llama', got 'qwen2'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling must be None, got 'llama3'"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling must be None, got 'linear'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters.rope_type must be 'default'"),
        ({"attention_bias": True}, "attention_bias must be False, got True"),
        ({"mlp_bias": True}, "mlp_bias must be False, got True"),
        ({"hidden_act": "gelu"}, "hidden_act must be 'silu', got 'gelu'"),
    ],
)
def test_unsupported_fields_are_refused_by_name_and_value(tmp_path, fields, message):
    _, directory = saved(tmp_path)
    edit_config(directory, **fields)
    with pytest.raises(UnsupportedCheckpoint, match=message):
        load_pretrained(directory)


def test_tensors_the_model_does_not_have_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    _, directory = saved(tmp_path)
    tensors = load_file(str(directory / WEIGHTS_NAME))
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(tensors, str(directory / WEIGHTS_NAME))
    with pytest.raises(UnsupportedCheckpoint, match=r"model\.layers\.0\.self_attn\.q_proj\.bias"):
        load_pretrained(directory)


def test_missing_tensor_wrong_shape_and_missing_file_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    _, directory = saved(tmp_path)
    tensors = load_file(str(directory / WEIGHTS_NAME))
    save_file({k: v for k, v in tensors.items() if k != "model.norm.weight"}, str(directory / WEIGHTS_NAME))
    with pytest.raises(ValueError, match=r"lacks tensors: \['model\.norm\.weight'\]"):
        load_pretrained(directory)
    edit_config(directory, intermediate_size=50)
    save_file(tensors, str(directory / WEIGHTS_NAME))
    with pytest.raises(ValueError, match=r"down_proj\.weight has shape \(32, 48\), but config\.json implies \(32, 50"):
        load_pretrained(directory)
    (directory / WEIGHTS_NAME).unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors does not exist"):
        load_pretrained(directory)


def test_a_loaded_checkpoint_runs_through_the_paged_cache(tmp_path):
    model, directory = saved(tmp_path, seed=5)
    loaded = load_pretrained(directory)
    prompts = [[1, 2, 3, 4, 5], [9] * 11]
    assert generate_paged(loaded, prompts, 6, block_size=4) == [generate_contiguous(model, p, 6) for p in prompts]


def test_eos_and_bos_round_trip_and_generation_config_takes_precedence(tmp_path):
    config = LlamaConfig(**{**SMALL.__dict__, "eos_token_id": (7, 3), "bos_token_id": 1})
    model, directory = saved(tmp_path, config)
    assert json.loads((directory / CONFIG_NAME).read_text())["eos_token_id"] == [7, 3]
    assert json.loads((directory / GENERATION_CONFIG_NAME).read_text()) == {"bos_token_id": 1, "eos_token_id": [7, 3]}
    assert load_pretrained(directory).config == model.config
    # A checkpoint's generation_config.json decides what generation stops at, as vLLM reads it.
    (directory / GENERATION_CONFIG_NAME).write_text(json.dumps({"eos_token_id": 2, "bos_token_id": None}))
    loaded = load_pretrained(directory).config
    assert (loaded.eos_token_id, loaded.bos_token_id) == (2, 1)  # a null in it leaves config.json's value
    (directory / GENERATION_CONFIG_NAME).unlink()  # without one, config.json's
    assert load_pretrained(directory).config.eos_token_id == (7, 3)
    edit_config(directory, eos_token_id=None)
    assert load_pretrained(directory).config.eos_token_id is None


def test_a_checkpoint_whose_eos_is_in_both_files_reads_it():
    """How a converted Hugging Face checkpoint (SmolLM2's: EOS 2 in both files) lists its EOS."""
    hf = {"vocab_size": 10, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 4, "eos_token_id": 2, "bos_token_id": 1}  # fmt: skip
    assert (config_from_hf(hf).eos_token_id, config_from_hf(hf).bos_token_id) == (2, 1)
    assert config_from_hf({**hf, "eos_token_id": [2]}).eos_token_id == 2  # a one-id list is that id
    with pytest.raises(ValueError, match="LlamaConfig.eos_token_id holds 12, outside the vocabulary"):
        config_from_hf({**hf, "eos_token_id": [2, 12]})


# --------------------------------------------------------------------------- the shipped course model


def test_course_model_ends_text_with_its_eos():
    model = load_course_model()
    assert model.config.eos_token_id == tokenizer.EOS_ID == 256  # config.json's: requests stop at it by default
    prompt = tokenizer.encode("x = 1\n")
    free = generate_contiguous(model, prompt, 24, ignore_eos=True)
    assert generate_contiguous(model, prompt, 24, stop_token_ids=[free[5]]) == free[: free.index(free[5]) + 1]


def test_course_model_ships_with_its_card_in_float16():
    assert (COURSE_MODEL_DIR / "README.md").is_file()
    assert json.loads((COURSE_MODEL_DIR / CONFIG_NAME).read_text())["torch_dtype"] == "float16"
    assert (COURSE_MODEL_DIR / WEIGHTS_NAME).stat().st_size <= 8.5e6
    card = (COURSE_MODEL_DIR / "README.md").read_text()
    assert re.search(r"held-out bits per byte", card)


def test_course_model_matches_its_card_s_held_out_bits_per_byte():
    """The shipped weights are the ones the card describes: their held-out bits per byte, measured again."""
    from minipaged import train

    card = (COURSE_MODEL_DIR / "README.md").read_text()
    claimed = float(re.search(r"held-out bits per byte \| \*\*([\d.]+)\*\*", card).group(1))
    model = load_course_model()
    assert model.config.vocab_size == tokenizer.VOCAB_SIZE
    _, held = train.token_streams(train.read_corpus())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        measured = train.held_out_bits_per_byte(model, held, context=256)
    assert measured["mix"] == pytest.approx(claimed, abs=0.05)
    assert measured["mix"] < 2.0  # a uniform guess over bytes costs 8 bits


def test_course_model_continues_python_with_python():
    model = load_course_model()
    prompt = tokenizer.encode("    except KeyError:\n        raise")
    text = tokenizer.decode(generate_contiguous(model, prompt, 64))
    assert "\ufffd" not in text and "\n" in text
    assert any(word in text for word in ("Error", "self", "return", "def ", "if ", "import"))


# --------------------------------------------------------------------------- the README's command


def test_readme_checkpoint_command_runs_on_a_saved_checkpoint(tmp_path):
    """The README's `python -m minipaged.serve ...` line, run on a byte-vocabulary checkpoint saved here."""
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"^(?:\.venv/bin/)?python -m minipaged\.serve (?!-)(\S+) (.+)$", readme, re.M)
    assert command, "README.md must show `python -m minipaged.serve CHECKPOINT_DIR ...`"
    config = LlamaConfig(**{**SMALL.__dict__, "vocab_size": tokenizer.VOCAB_SIZE})
    model, directory = saved(tmp_path, config, seed=7)
    args = [a.strip('"') for a in re.findall(r'"[^"]*"|\S+', command.group(2))]
    out = subprocess.run([sys.executable, "-m", "minipaged.serve", str(directory), *args, "--max-tokens", "12"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    prompt = args[args.index("--prompt") + 1]
    expected = tokenizer.decode(tokenizer.encode(prompt) + generate_contiguous(model, tokenizer.encode(prompt), 12))
    assert out.stdout.startswith(expected + "\n")
