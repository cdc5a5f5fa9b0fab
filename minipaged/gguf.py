"""A GGUF file (llama.cpp's format) converted into a Hugging Face checkpoint directory.

A GGUF file is one file holding a model's metadata (architecture, sizes, tokenizer, chat template)
and its tensors, many of them quantised: Q4_1 stores each run of 32 weights as 4-bit integers
with one float16 scale and one float16 minimum. The tiny Llama computes in float, so converting
means *dequantising* every tensor (``gguf.quants.dequantize``: integer times scale plus minimum)
and writing what the rest of the package already reads:

- ``config.json`` and ``generation_config.json``, built from the GGUF metadata;
- ``model.safetensors``: the dequantised tensors in float32, exactly, under Hugging Face's names;
- ``tokenizer.json`` and ``tokenizer_config.json``: the byte-level BPE tokenizer the metadata
  describes, built with the ``tokenizers`` package, and the chat template verbatim.

One step is not a copy: llama.cpp's RoPE rotates adjacent pairs of a head's dimensions,
``(2i, 2i + 1)``, while Hugging Face's rotates ``(i, i + head_dim / 2)``. llama.cpp's converter
therefore reorders the rows of ``q_proj`` and ``k_proj`` within each head, and
:func:`unpermute_rope_rows` puts them back.

Whatever the conversion cannot carry over faithfully is refused by name: another architecture,
a tensor type outside ``SUPPORTED_TYPES``, a tokenizer other than GPT-2-style BPE, a missing
metadata key (``MissingMetadata``), and a truncated or corrupt file (``CorruptGGUF``).
:mod:`minipaged.pretrained` runs :func:`convert` once per file and caches the result.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.quants import dequantize
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from minipaged.checkpoint import CONFIG_NAME, WEIGHTS_NAME, UnsupportedCheckpoint, config_to_hf
from minipaged.model import LlamaConfig

# Bump when the directory convert() writes changes: the cache keys conversions by it.
CONVERTER_VERSION = 1
TYPES = gguf.GGMLQuantizationType
# The tensor types convert() reads; each one is round-tripped in tests/test_03_gguf.py.
SUPPORTED_TYPES = frozenset({TYPES.F32, TYPES.F16, TYPES.BF16, TYPES.Q8_0, TYPES.Q4_0, TYPES.Q4_1, TYPES.Q5_0,
                             TYPES.Q5_1})  # fmt: skip
# llama.cpp's names for a token's kind (tokenizer.ggml.token_type).
TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4
# How each supported tokenizer.ggml.pre splits text before byte-level BPE: GPT-2's regex, after
# cutting every digit out on its own for SmolLM2 (as its Hugging Face tokenizer and llama.cpp do).
PRE_TOKENIZER_DIGITS = {"gpt2": False, "smollm": True}

GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

TOKENIZER_NAME = "tokenizer.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
GENERATION_CONFIG_NAME = "generation_config.json"


class CorruptGGUF(ValueError):
    """The file is not a readable GGUF file: truncated, or its header or a tensor is corrupt."""


class MissingMetadata(UnsupportedCheckpoint):
    """The GGUF file lacks a metadata key the conversion needs."""


def open_gguf(path) -> gguf.GGUFReader:
    """A reader over the GGUF file at ``path``, or ``CorruptGGUF`` when it is truncated or corrupt.

    Args:
        path: the ``.gguf`` file (``FileNotFoundError`` when there is none).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is not a file: a GGUF path must name a .gguf file")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, UnicodeDecodeError, OverflowError) as e:
        raise CorruptGGUF(f"{path} is not a readable GGUF file (truncated or corrupt): {e}") from None


_REQUIRED = object()


def metadata(reader: gguf.GGUFReader, key: str, default=_REQUIRED):
    """The value of metadata ``key`` (a str, number, bool or list), ``default`` when absent.

    Args:
        reader: an open GGUF file.
        key: the metadata key, for example ``"llama.block_count"``.
        default: returned when the key is absent; without one, ``MissingMetadata``.
    """
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise MissingMetadata(f"the GGUF file has no {key!r} metadata, which the conversion needs")
        return default
    try:
        return field.contents()
    except (ValueError, IndexError, UnicodeDecodeError) as e:
        raise CorruptGGUF(f"the GGUF file's {key!r} metadata is corrupt: {e}") from None


def _float32(value) -> float:
    """A float32 metadata value as the shortest decimal that is the same float32 (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def hf_config(reader: gguf.GGUFReader) -> dict:
    """The Hugging Face ``config.json`` dict of the Llama in ``reader``, with ``bos_token_id`` and ``eos_token_id``.

    Args:
        reader: an open GGUF file; its ``general.architecture`` must be ``"llama"``.

    Refuses (``UnsupportedCheckpoint``) what the tiny Llama does not compute: another architecture,
    experts, RoPE scaling, RoPE on part of a head, keys and values of different sizes.
    """
    arch = metadata(reader, "general.architecture")
    if arch != "llama":
        raise UnsupportedCheckpoint(f"general.architecture must be 'llama', got {arch!r}: the tiny Llama computes "
                                    "only Llama-family models")  # fmt: skip
    hidden = metadata(reader, "llama.embedding_length")
    heads = metadata(reader, "llama.attention.head_count")
    head_dim = metadata(reader, "llama.attention.key_length", hidden // heads)
    refused = {
        "llama.expert_count": (metadata(reader, "llama.expert_count", 0), 0),
        "llama.rope.scaling.type": (metadata(reader, "llama.rope.scaling.type", "none"), "none"),
        "llama.rope.dimension_count": (metadata(reader, "llama.rope.dimension_count", head_dim), head_dim),
        "llama.attention.value_length": (metadata(reader, "llama.attention.value_length", head_dim), head_dim),
    }
    for key, (value, supported) in refused.items():
        if value != supported:
            raise UnsupportedCheckpoint(f"{key} must be {supported!r}, got {value!r}: the tiny Llama does not "
                                        "compute it")  # fmt: skip
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    config = LlamaConfig(
        vocab_size=metadata(reader, "llama.vocab_size", len(tokens)),
        hidden_size=hidden,
        intermediate_size=metadata(reader, "llama.feed_forward_length"),
        num_hidden_layers=metadata(reader, "llama.block_count"),
        num_attention_heads=heads,
        num_key_value_heads=metadata(reader, "llama.attention.head_count_kv", heads),
        head_dim=head_dim,
        rope_theta=_float32(metadata(reader, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=_float32(metadata(reader, "llama.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=metadata(reader, "llama.context_length"),
        tie_word_embeddings="output.weight" not in {t.name for t in reader.tensors},
    )
    return config_to_hf(config, torch.float32) | special_token_ids(reader)


def special_token_ids(reader: gguf.GGUFReader) -> dict:
    """``{"bos_token_id": ..., "eos_token_id": ...}`` from the GGUF metadata.

    Args:
        reader: an open GGUF file.
    """
    return {
        "bos_token_id": metadata(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata(reader, "tokenizer.ggml.eos_token_id"),
    }


def hf_name(name: str) -> str:
    """The Hugging Face name of a GGUF tensor: ``blk.3.attn_q.weight`` is ``model.layers.3.self_attn.q_proj.weight``.

    Args:
        name: a GGUF tensor name; one the tiny Llama has no parameter for is ``UnsupportedCheckpoint``.
    """
    if name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[name]
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
    if match is None or match[2] not in LAYER_TENSORS:
        raise UnsupportedCheckpoint(f"the GGUF file has a tensor {name!r} the tiny Llama does not use")
    return f"model.layers.{match[1]}.{LAYER_TENSORS[match[2]]}.weight"


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Hugging Face's row order of a ``q_proj`` / ``k_proj`` weight stored in llama.cpp's.

    Args:
        weight: ``[num_heads * head_dim, hidden]`` as llama.cpp stores it.
        num_heads: the heads the rows belong to (query heads for ``q_proj``, KV heads for ``k_proj``).

    In a head, llama.cpp's row ``2i + s`` (``s`` in {0, 1}) is Hugging Face's row
    ``s * head_dim / 2 + i``: the two halves that HF's RoPE rotates together are interleaved.
    """
    rows, cols = weight.shape
    head_dim = rows // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def hf_tensors(reader: gguf.GGUFReader, config: dict) -> dict[str, np.ndarray]:
    """Every tensor of ``reader``, dequantised to float32, under its Hugging Face name and in HF's layout.

    Args:
        reader: an open GGUF file.
        config: its :func:`hf_config` (the head counts the Q/K rows are grouped by).
    """
    heads = {"self_attn.q_proj": config["num_attention_heads"], "self_attn.k_proj": config["num_key_value_heads"]}
    tensors = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if tensor.tensor_type not in SUPPORTED_TYPES:
            supported = sorted(t.name for t in SUPPORTED_TYPES)
            raise UnsupportedCheckpoint(f"tensor {tensor.name!r} is stored as {tensor.tensor_type.name}, which the "
                                        f"converter does not read (it reads {', '.join(supported)})")  # fmt: skip
        try:
            weight = dequantize(tensor.data, tensor.tensor_type)
        except ValueError as e:
            raise CorruptGGUF(f"tensor {tensor.name!r} is corrupt: {e}") from None
        weight = np.ascontiguousarray(weight, dtype=np.float32)  # a copy: nothing points into the file
        for part, num_heads in heads.items():
            if f".{part}." in name:
                weight = np.ascontiguousarray(unpermute_rope_rows(weight, num_heads))
        tensors[name] = weight
    return tensors


def hf_tokenizer(reader: gguf.GGUFReader) -> Tokenizer:
    """The byte-level BPE tokenizer the GGUF metadata describes, as a ``tokenizers.Tokenizer``.

    Args:
        reader: an open GGUF file with ``tokenizer.ggml.model == "gpt2"`` and a ``tokenizer.ggml.pre``
            in ``PRE_TOKENIZER_DIGITS``.

    Tokens marked control (``<|im_start|>``, ...) become special added tokens, tokens marked
    user-defined plain added tokens: both are matched whole in the text, never split by BPE.
    """
    kind = metadata(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedCheckpoint(f"tokenizer.ggml.model must be 'gpt2' (byte-level BPE), got {kind!r}")
    pre = metadata(reader, "tokenizer.ggml.pre")
    if pre not in PRE_TOKENIZER_DIGITS:
        raise UnsupportedCheckpoint(f"tokenizer.ggml.pre must be one of {sorted(PRE_TOKENIZER_DIGITS)}, got {pre!r}")
    for flag in ("add_space_prefix", "add_bos_token", "add_eos_token"):
        if metadata(reader, f"tokenizer.ggml.{flag}", False):
            raise UnsupportedCheckpoint(f"tokenizer.ggml.{flag} must be false: the converter does not add it")
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise CorruptGGUF(f"tokenizer.ggml.tokens lists {len(tokens)} tokens but only {len(vocab)} distinct ones")
    merges = [tuple(merge.split(" ")) for merge in metadata(reader, "tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if PRE_TOKENIZER_DIGITS[pre]:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    kinds = metadata(reader, "tokenizer.ggml.token_type", [])
    if kinds and len(kinds) != len(tokens):
        raise CorruptGGUF(f"tokenizer.ggml.token_type has {len(kinds)} entries for {len(tokens)} tokens")
    added = [AddedToken(t, special=k == TOKEN_CONTROL, normalized=False) for t, k in zip(tokens, kinds)
             if k in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]  # fmt: skip
    tokenizer.add_special_tokens([t for t in added if t.special])
    tokenizer.add_tokens([t for t in added if not t.special])
    return tokenizer


def hf_tokenizer_config(reader: gguf.GGUFReader, tokenizer: Tokenizer) -> dict:
    """The ``tokenizer_config.json`` dict: special tokens by text, the chat template verbatim, the context length.

    Args:
        reader: an open GGUF file.
        tokenizer: its :func:`hf_tokenizer`.
    """
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # tokenizer.json as it is, in transformers 4 and 5
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": metadata(reader, "llama.context_length"),
        "additional_special_tokens": [t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special],
    }
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token_id = metadata(reader, f"tokenizer.ggml.{key}_token_id", None)
        if token_id is not None:
            config[f"{name}_token"] = tokens[token_id]
    template = metadata(reader, "tokenizer.chat_template", None)
    if template is not None:
        config["chat_template"] = template
    return config


def convert(path, directory) -> Path:
    """Write the Hugging Face checkpoint of the GGUF file at ``path`` into ``directory`` (created if needed).

    Args:
        path: a ``.gguf`` file of a Llama-family model with a byte-level BPE tokenizer.
        directory: where ``config.json``, ``generation_config.json``, ``model.safetensors``,
            ``tokenizer.json`` and ``tokenizer_config.json`` go.

    Everything is read and checked before the first file is written. Returns ``directory`` as a ``Path``.
    """
    from safetensors.numpy import save_file

    reader = open_gguf(path)
    config = hf_config(reader)
    tensors = hf_tensors(reader, config)
    tokenizer = hf_tokenizer(reader)
    tokenizer_config = hf_tokenizer_config(reader, tokenizer)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
    tokenizer.save(str(directory / TOKENIZER_NAME))
    files = {
        CONFIG_NAME: config,
        GENERATION_CONFIG_NAME: special_token_ids(reader),
        TOKENIZER_CONFIG_NAME: tokenizer_config,
    }
    for name, content in files.items():
        (directory / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")
    return directory
