"""Issue 43: what a model loader, a checkpoint's files, its chat template, a tokenizer and the CLIs are handed.

Each bad input gets an error that names the argument or the file, before anything changes, and the
checkpoint cache heals what a killed or emptied conversion left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_03_gguf import cache, tiny_gguf  # noqa: F401 (cache is a fixture)

from minipaged import pretrained
from minipaged.chat_template import MAX_RENDERED_CHARS, ChatTemplateError, render_chat_template
from minipaged.checkpoint import COURSE_MODEL_DIR, BadCheckpoint, check_load_args
from minipaged.llm import LLM
from minipaged.model import LlamaConfig, LlamaForCausalLM

MESSAGES = [{"role": "user", "content": "hi"}]


# --------------------------------------------------------------------------- load_model, load_tokenizer


@pytest.mark.parametrize("name", ["", "   "])
def test_an_empty_name_is_not_the_current_folder(name):
    with pytest.raises(ValueError, match="name_or_path must name a model"):
        pretrained.checkpoint_dir(name)


def test_a_gguf_file_is_known_by_its_suffix_in_any_case(tmp_path, cache):  # noqa: F811
    _, path, _ = tiny_gguf(tmp_path)
    upper = path.with_name("TINY.GGUF")
    path.rename(upper)
    directory = pretrained.checkpoint_dir(upper)
    assert directory.parent == cache / "gguf" and (directory / "config.json").is_file()


@pytest.mark.parametrize("dtype, error, match", [
    ("float16", None, None), ("bfloat16", None, None), (torch.float32, None, None),
    ("float8", ValueError, "dtype must be a floating torch.dtype or one of"),
    (torch.int64, TypeError, "dtype must be a floating torch.dtype"),
    (16, TypeError, "dtype must be a floating torch.dtype"),
])  # fmt: skip
def test_load_model_takes_a_dtype_or_its_name_and_names_a_bad_one(dtype, error, match):
    if error is None:
        model = pretrained.load_model("course", dtype=dtype)
        assert model.dtype == (dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype))
        return
    with pytest.raises(error, match=match):
        pretrained.load_model("course", dtype=dtype)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device, match", [("cuda", "needs CUDA"), ("cuda:1", "needs CUDA"),
                                           ("gpu", "is not a device torch knows"), ("meta", "must be 'cpu' or 'cuda'")])
def test_a_device_this_machine_lacks_is_named_before_loading(device, match, monkeypatch):
    monkeypatch.setattr(pretrained, "checkpoint_dir", lambda *a: pytest.fail("the model was looked up"))
    with pytest.raises(ValueError, match=match):
        pretrained.load_model("course", device=device)
    with pytest.raises(TypeError, match="device must be a str"):
        check_load_args(torch.float32, 0)


def _checkpoint_copy(tmp_path) -> Path:
    directory = tmp_path / "checkpoint"
    directory.mkdir()
    for f in COURSE_MODEL_DIR.iterdir():
        (directory / f.name).write_bytes(f.read_bytes())
    return directory


@pytest.mark.parametrize("name, text", [("tokenizer.json", '{"version": "1.0", "model": '),
                                        ("tokenizer.json", '{"model": {"type": "NoSuchModel"}}'),
                                        ("tokenizer_config.json", "{not json"),
                                        ("tokenizer_config.json", "[1, 2]"),
                                        ("config.json", "{")])  # fmt: skip
def test_a_corrupt_tokenizer_file_is_named(tmp_path, name, text):
    directory = _checkpoint_copy(tmp_path)
    from tokenizers import Tokenizer, models

    good = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    (directory / "tokenizer.json").write_text(good.to_str())  # a tokenizer.json sends load_tokenizer to the library
    (directory / name).write_text(text)
    with pytest.raises(BadCheckpoint, match=str(directory / name)):
        pretrained.load_tokenizer(directory)


# --------------------------------------------------------------------------- the checkpoint cache


def _cache_error(path, match):
    with pytest.raises(pretrained.CheckpointCacheError, match=match) as exc:
        pretrained.checkpoint_dir(path)
    assert "\n" not in str(exc.value)
    return str(exc.value)


def test_a_cache_that_is_a_file_is_named_with_its_variable(tmp_path, monkeypatch):
    _, path, _ = tiny_gguf(tmp_path)
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    monkeypatch.setenv("MINIPAGED_CACHE", str(blocker))
    message = _cache_error(path, "MINIPAGED_CACHE")
    assert str(blocker) in message and blocker.read_text() == "x"


@pytest.mark.parametrize("where", ["the cache folder", "the conversion"])
def test_an_unwritable_cache_is_named_with_its_variable(tmp_path, cache, monkeypatch, where):  # noqa: F811
    """Root ignores file modes, so the refusal a read-only file system gives is put where it would come from."""
    import errno
    import tempfile

    _, path, _ = tiny_gguf(tmp_path)
    if where == "the cache folder":
        def refuse(*args, dir=None, **kwargs):
            raise OSError(errno.EROFS, "Read-only file system", str(dir))

        monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    else:
        def refuse(source, directory):
            raise OSError(errno.EROFS, "Read-only file system", str(Path(directory) / "config.json"))

        monkeypatch.setattr(pretrained, "convert", refuse)
    message = _cache_error(path, "MINIPAGED_CACHE")
    assert str(cache) in message and "Read-only file system" in message
    assert not (cache / "gguf").exists() or list((cache / "gguf").iterdir()) == []  # nothing left behind


def test_a_gguf_that_cannot_be_read_is_not_called_a_cache_problem(tmp_path, cache, monkeypatch):  # noqa: F811
    _, path, _ = tiny_gguf(tmp_path)

    def unreadable(source, directory):
        raise PermissionError(13, "Permission denied", str(source))

    monkeypatch.setattr(pretrained, "convert", unreadable)
    with pytest.raises(PermissionError) as exc:
        pretrained.checkpoint_dir(path)
    assert not isinstance(exc.value, pretrained.CheckpointCacheError)


def test_a_killed_conversion_is_swept_by_the_next(tmp_path, cache):  # noqa: F811
    _, path, _ = tiny_gguf(tmp_path)
    script = ("import sys\nfrom minipaged import pretrained\n"
              "from minipaged import gguf\n"
              "def hang(source, directory):\n"
              "    (directory / 'model.safetensors').write_bytes(b'partial')\n"
              "    print('converting', flush=True)\n"
              "    import time; time.sleep(600)\n"
              "pretrained.convert = hang\n"
              f"pretrained.checkpoint_dir({str(path)!r})\n")  # fmt: skip
    env = os.environ | {"MINIPAGED_CACHE": str(cache)}
    child = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "converting"
        left = [p for p in (cache / "gguf").iterdir() if p.name.startswith(".")]
        assert len(left) == 1 and str(child.pid) in left[0].name
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert left[0].exists()  # the kill left it
    _, other, _ = tiny_gguf(tmp_path, seed=5)
    pretrained.checkpoint_dir(other)  # another file's conversion sweeps it
    assert not left[0].exists()
    assert [p.name.startswith(".") for p in (cache / "gguf").iterdir()] == [False]


def test_a_live_conversion_is_not_swept(tmp_path, cache):  # noqa: F811
    root = cache / "gguf"
    root.mkdir(parents=True)
    mine = root / f".abc-v1.{os.getpid()}.xyz"
    mine.mkdir()
    _, path, _ = tiny_gguf(tmp_path)
    pretrained.checkpoint_dir(path)
    assert mine.is_dir()


@pytest.mark.parametrize("left", ["empty", "config only"])
def test_an_emptied_cache_entry_is_converted_again(tmp_path, cache, left):  # noqa: F811
    _, path, _ = tiny_gguf(tmp_path)
    first = pretrained.checkpoint_dir(path)
    model = pretrained.load_model(path)
    for f in first.iterdir():
        if left == "empty" or f.name != "config.json":
            f.unlink()
    assert pretrained.checkpoint_dir(path) == first
    again = pretrained.load_model(path)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


# --------------------------------------------------------------------------- the tokenizer seam


class BytesTokenizer:
    """encode is fine; decode returns bytes, as a tokenizer written for another library might."""

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=False):
        return bytes(ids)


def test_a_tokenizer_whose_decode_returns_bytes_is_refused_at_once():
    model = LlamaForCausalLM(LlamaConfig(), seed=0).eval()
    with pytest.raises(TypeError, match=r"tokenizer.decode\(ids, skip_special_tokens=True\) returned a bytes"):
        LLM(model, BytesTokenizer(), num_blocks=16, block_size=4)


# --------------------------------------------------------------------------- the chat template's work


@pytest.mark.parametrize("template, match", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "steps"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}", "steps|characters"),
    ("{% for i in range(100000) %}{{ 'abcdefghijklmnopqrstuvwxyz' }}{% endfor %}", "characters"),
    ("{{ 'x' * 10**8 }}", r"with \*"),
    ("{{ [0] * 10**8 }}", r"with \*"),
    ("{{ 10 ** 100000000 }}", r"with \*\*"),
    ("{% set ns = namespace(n=0) %}{% for i in range(100000) %}{% for j in range(100000) %}"
     "{% set ns.n = ns.n + 1 %}{% endfor %}{% endfor %}", "steps"),
])  # fmt: skip
def test_a_template_that_would_not_end_is_stopped_and_named(template, match):
    start = time.process_time()
    with pytest.raises(ChatTemplateError, match=match):
        render_chat_template(template, MESSAGES)
    assert time.process_time() - start < 60  # bounded by counts, not time: generous even on a slow machine


def test_a_bounded_render_leaves_the_callers_tracer_in_place():
    calls = []

    def tracer(frame, event, arg):
        calls.append(event)

    sys.settrace(tracer)
    try:
        render_chat_template("{{ messages[0].content }}", MESSAGES)
        with pytest.raises(ChatTemplateError):
            render_chat_template("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                                 MESSAGES)  # fmt: skip
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(None)


def test_a_long_conversation_renders_well_inside_the_bounds():
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    long = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 200} for i in range(500)]
    text = render_chat_template(template, long)
    assert len(text) < MAX_RENDERED_CHARS and text.count("<|im_start|>") == 501


# --------------------------------------------------------------------------- CLIs


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0", "x"])
def test_bench_memory_refuses_a_goal_that_is_not_a_finite_positive_number(value, capsys):
    from minipaged.bench.memory import main

    with pytest.raises(SystemExit) as exc:
        main(["--goal-mib", value])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--goal-mib" in err and "Traceback" not in err


def test_serve_names_an_unwritable_cache_in_one_line(tmp_path):
    _, path, _ = tiny_gguf(tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    run = subprocess.run([sys.executable, "-m", "minipaged.serve", str(path), "--prompt-ids", "1", "2"],
                         env=os.environ | {"MINIPAGED_CACHE": str(blocker)}, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert run.returncode == 1, run.stderr
    assert run.stderr.count("\n") == 1 and "MINIPAGED_CACHE" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize("argv, option", [
    (["--lr", "nan"], "--lr"), (["--lr", "0"], "--lr"), (["--decay", "1.5"], "--decay"), (["--steps", "0"], "--steps"),
    (["--warmup", "-1"], "--warmup"), (["--heads", "3"], "--heads"), (["--threads", "x"], "--threads"),
])  # fmt: skip
def test_train_refuses_a_bad_option_in_one_line(tmp_path, capsys, argv, option):
    from minipaged.train import main

    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path / "run"), *argv])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exc.value.code == 2 and err.startswith("python -m minipaged.train: error: argument " + option), err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("cli, argv", [("minipaged.train", ["--report", "{missing}"]),
                                       ("minipaged.bench.vllm", ["--vllm-python", "{missing}"])])
def test_a_missing_file_is_one_line_and_exit_1(tmp_path, capsys, cli, argv):
    import importlib

    missing = str(tmp_path / "missing")
    with pytest.raises(SystemExit) as exc:
        importlib.import_module(cli).main([a.format(missing=missing) for a in argv])
    err = capsys.readouterr().err
    assert exc.value.code == 1 and err.count("\n") == 1 and missing in err and "Traceback" not in err
