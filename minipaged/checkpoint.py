"""Hugging Face checkpoints in and out: ``config.json`` plus ``model.safetensors`` (and ``generation_config.json``).

The tiny Llama already names its parameters as Hugging Face's ``LlamaForCausalLM``
does, so a checkpoint is its state dict in a safetensors file and its
:class:`~minipaged.model.LlamaConfig` in Hugging Face's ``config.json`` fields.
That is all a small Llama-family checkpoint on disk needs to run through the
paged engine, and all vLLM needs to serve the course model's weights.

What the model does not compute is refused, naming the field and its value,
rather than loaded into a model that would quietly compute something else:
another architecture, ``rope_scaling`` (or a ``rope_parameters`` type other
than ``"default"``), biases, an activation other than SiLU, and tensors the
model does not have. :func:`load_course_model` loads the trained course model
shipped with the package.

The end of text, ``eos_token_id`` (an id or a list of ids), is read from ``config.json`` and, when
the checkpoint has a ``generation_config.json`` that sets it, from there instead, as vLLM does: the
generation config is what a model's authors want generation to stop at. ``bos_token_id`` is read
the same way. Use the model's methods:
:meth:`~minipaged.model.LlamaForCausalLM.from_pretrained` and
:meth:`~minipaged.model.LlamaForCausalLM.save_pretrained`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from minipaged.model import LlamaConfig, LlamaForCausalLM, rope_cos_sin
from minipaged.validation import check_int

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
WEIGHTS_NAME = "model.safetensors"
# The course model: a byte-level Llama trained by `python -m minipaged.train`, shipped with the
# package in float16 with its model card (README.md).
COURSE_MODEL_DIR = Path(__file__).resolve().parent / "data" / "course_model"

# A supported field whose value must be exactly this (absent counts as the value).
REQUIRED_VALUES = {
    "model_type": "llama",
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "rope_scaling": None,
}


class UnsupportedCheckpoint(ValueError):
    """The checkpoint asks for something the tiny Llama does not compute."""


class BadCheckpoint(ValueError):
    """A checkpoint file is malformed: not JSON, not a JSON object, a field missing, a truncated weights file."""


def read_json(path: Path) -> dict:
    """The JSON object in ``path``, or ``BadCheckpoint`` naming the file (invalid JSON, or not an object)."""
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadCheckpoint(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise BadCheckpoint(f"{path} must hold a JSON object, got a JSON {type(value).__name__}")
    return value


# The dtypes a model computes in, by the names vLLM's ``--dtype`` also takes.
DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
          "bfloat16": torch.bfloat16, "float64": torch.float64}  # fmt: skip


def check_load_args(dtype, device) -> tuple[torch.dtype, torch.device]:
    """A model load's ``dtype`` and ``device``, checked before anything is read or converted.

    Args:
        dtype: a floating ``torch.dtype``, or its name (a key of :data:`DTYPES`: ``"float16"``, ``"bfloat16"``...).
        device: a ``torch.device`` or its name: ``"cpu"``, or ``"cuda"`` (``"cuda:1"``) where CUDA is available.

    Raises:
        TypeError: ``dtype`` is neither a dtype nor a str, or is an integer dtype; ``device`` is not a str or device.
        ValueError: an unknown dtype name, a device string torch cannot parse, or CUDA asked for without CUDA.
    """
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be a floating torch.dtype or one of {sorted(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype]
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype or one of {sorted(DTYPES)}, got {dtype!r}")
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or a torch.device, got {type(device).__name__}")
    try:
        device = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device {device!r} is not a device torch knows: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} needs CUDA, and torch.cuda.is_available() is False on this "
                         "machine: use device='cpu'")  # fmt: skip
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {str(device)!r}")
    return dtype, device


# The config.json fields a checkpoint must have, each an int >= 1.
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _check_fields(hf) -> None:
    """Refuse a config that is not an object, lacks a required field, or has a size that is not an int >= 1."""
    if not isinstance(hf, dict):
        raise BadCheckpoint(f"{CONFIG_NAME} must hold a JSON object, got a JSON {type(hf).__name__}")
    for field in REQUIRED_FIELDS:
        if field not in hf:
            raise BadCheckpoint(f"{CONFIG_NAME} lacks the field {field!r}")
        check_int(hf[field], field, minimum=1)
    for field in ("num_key_value_heads", "head_dim"):
        if hf.get(field) is not None:
            check_int(hf[field], field, minimum=1)
    for field in ("rope_scaling", "rope_parameters"):
        if hf.get(field) is not None and not isinstance(hf[field], dict):
            raise UnsupportedCheckpoint(f"{field} must be None or an object, got {hf[field]!r}")


def _rope_type(rope: dict | None) -> str | None:
    """A ``rope_scaling`` object's type; None (plain RoPE) for none or ``{"rope_type": "default"}``."""
    kind = None if rope is None else rope.get("rope_type", rope.get("type"))
    return None if kind == "default" else kind


def config_from_hf(hf: dict) -> LlamaConfig:
    """The :class:`LlamaConfig` of a Hugging Face ``config.json`` dict, or ``UnsupportedCheckpoint``.

    Args:
        hf: the parsed ``config.json``. Read: ``vocab_size``, ``hidden_size``,
            ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``,
            ``num_key_value_heads`` (GQA; default: no grouping), ``head_dim``
            (default ``hidden_size / num_attention_heads``), ``rope_theta`` (or
            ``rope_parameters["rope_theta"]``), ``rms_norm_eps``,
            ``max_position_embeddings``, ``tie_word_embeddings``, ``eos_token_id`` (an id, a list
            of ids, or absent) and ``bos_token_id``.
    """
    _check_fields(hf)
    architectures = hf.get("architectures") or ["LlamaForCausalLM"]
    if architectures != ["LlamaForCausalLM"]:
        raise UnsupportedCheckpoint(f"architectures must be ['LlamaForCausalLM'], got {architectures!r}")
    for field, value in REQUIRED_VALUES.items():
        what = _rope_type(hf.get(field)) if field == "rope_scaling" else hf.get(field, value)
        if what != value:
            raise UnsupportedCheckpoint(f"{field} must be {value!r}, got {what!r}: the tiny Llama does not compute it")
    rope_theta = hf.get("rope_theta", 10000.0)
    if hf.get("rope_parameters") is not None:  # transformers >= 5 moves rope_theta here
        rope_type = hf["rope_parameters"].get("rope_type", "default")
        if rope_type != "default":
            raise UnsupportedCheckpoint(f"rope_parameters.rope_type must be 'default', got {rope_type!r}")
        rope_theta = hf["rope_parameters"].get("rope_theta", rope_theta)
    heads = hf["num_attention_heads"]
    return LlamaConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope_theta=rope_theta,  # LlamaConfig checks it is a real number
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        eos_token_id=hf.get("eos_token_id"),
        bos_token_id=hf.get("bos_token_id"),
    )


def config_to_hf(config: LlamaConfig, dtype: torch.dtype) -> dict:
    """The Hugging Face ``config.json`` dict of ``config``, for weights stored in ``dtype``.

    Args:
        config: the model's configuration (its ``eos_token_id`` is written as an id or a list of ids).
        dtype: the dtype the weights are stored in (``torch_dtype``).
    """
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eos_token_id": list(config.eos_token_id) if isinstance(config.eos_token_id, tuple) else config.eos_token_id,
        "bos_token_id": config.bos_token_id,
    }


def save_pretrained(model: LlamaForCausalLM, directory, extra_config: dict | None = None) -> Path:
    """Write ``config.json``, ``generation_config.json`` and ``model.safetensors`` for ``model`` into ``directory``.

    Args:
        model: the model to save; its tensors are stored in their current dtype.
        directory: the checkpoint directory (created if needed).
        extra_config: more ``config.json`` fields, or ones to override.

    ``generation_config.json`` holds the ``eos_token_id`` and ``bos_token_id`` of ``config.json``.
    With tied embeddings ``lm_head.weight`` is not stored (it is ``model.embed_tokens.weight``),
    as Hugging Face does. Returns the directory as a ``Path``.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        del tensors["lm_head.weight"]
    save_file(tensors, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
    config = config_to_hf(model.config, model.dtype) | (extra_config or {})
    (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    generation = {name: config[name] for name in ("bos_token_id", "eos_token_id")}
    (directory / GENERATION_CONFIG_NAME).write_text(json.dumps(generation, indent=2) + "\n")
    return directory


def load_pretrained(directory, dtype: torch.dtype = torch.float32, device="cpu") -> LlamaForCausalLM:
    """The model stored in ``directory`` (``config.json`` + ``model.safetensors``), in eval mode.

    A ``generation_config.json`` beside them, if any, gives the ``eos_token_id`` and ``bos_token_id``
    it sets (see the module docstring).

    Args:
        directory: a Hugging Face checkpoint directory of a Llama-family model.
        dtype: the dtype to compute in (the stored tensors are converted), or its name (see :func:`check_load_args`).
        device: where the model goes (``"cpu"``, or ``"cuda"`` where CUDA is available).

    Raises ``FileNotFoundError`` for a missing file, ``UnsupportedCheckpoint``
    for a config field or a tensor the model does not support, ``BadCheckpoint`` for a
    malformed file (invalid JSON, not an object, a required field missing, a truncated
    weights file), ``TypeError`` / ``ValueError`` for a size of the wrong type or value, and
    ``ValueError`` for a missing tensor or a tensor whose shape disagrees with the config.
    Every message about ``config.json`` names the file and the field.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    dtype, device = check_load_args(dtype, device)
    directory = Path(directory)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (directory / name).is_file():
            raise FileNotFoundError(
                f"{directory / name} does not exist: a checkpoint needs {CONFIG_NAME} and {WEIGHTS_NAME}"
            )
    hf = read_json(directory / CONFIG_NAME)
    if (directory / GENERATION_CONFIG_NAME).is_file():
        generation = read_json(directory / GENERATION_CONFIG_NAME)
        hf |= {name: generation[name] for name in ("eos_token_id", "bos_token_id")
               if generation.get(name) is not None}  # fmt: skip
    try:
        config = config_from_hf(hf)
    except (TypeError, ValueError) as exc:  # the same error, naming the file as well as the field
        raise type(exc)(f"{directory / CONFIG_NAME}: {exc}") from None
    try:
        tensors = load_file(str(directory / WEIGHTS_NAME))
    except SafetensorError as exc:
        raise BadCheckpoint(f"{directory / WEIGHTS_NAME} cannot be read (truncated, or not safetensors): "
                            f"{exc}") from None
    # Built on the meta device: shapes without storage, so no random init (135M random numbers take
    # seconds); the checkpoint's tensors become the parameters.
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    expected = model.state_dict()
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # some exports store the tied copy too
        del expected["lm_head.weight"]
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        raise UnsupportedCheckpoint(f"{WEIGHTS_NAME} has tensors the tiny Llama does not use: {unknown[:5]}")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"{WEIGHTS_NAME} lacks tensors: {missing[:5]}")
    for name, t in tensors.items():
        if t.shape != expected[name].shape:
            want = tuple(expected[name].shape)
            raise ValueError(f"{name} has shape {tuple(t.shape)}, but config.json implies {want}")
    model.load_state_dict(tensors, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rope_cos, model.rope_sin = rope_cos_sin(config)
    return model.to(device=device, dtype=dtype).eval()


def load_course_model(dtype: torch.dtype = torch.float32, device="cpu") -> LlamaForCausalLM:
    """The trained course model (``COURSE_MODEL_DIR``), whose token ids are bytes (:mod:`minipaged.tokenizer`).

    Args:
        dtype: the dtype to compute in (it is stored in float16).
        device: where the model goes.
    """
    return load_pretrained(COURSE_MODEL_DIR, dtype=dtype, device=device)
