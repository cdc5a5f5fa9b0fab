"""Exercise checks that never dump a traceback on the learner.

Every check prints exactly one line that starts with a fixed status:

    ✅ PASS   ch01.blocks_needed: 9 cases
    ❌ FAIL   ch01.blocks_needed: blocks_needed(37, 16) returned 2, expected 3
              hint: a partly filled block still counts as a whole block
    ⏳ NOT IMPLEMENTED YET   ch01.blocks_needed: replace `raise NotImplementedError`
              hint: ...

The printed line is for the learner only. The grader (``python -m
minipaged.checks grade``) never reads it: it starts the kernel with a results
file and a per-run secret in the environment (:data:`RESULTS_ENV`,
:data:`SECRET_ENV`). On import this module takes the secret out of the
environment, and every check appends one JSON record, signed with it, to the
file. Printing cannot forge such a record; see the README's threat model.

Every check runs under a time limit (:data:`DEFAULT_TIMEOUT` seconds unless
the check or :data:`TIMEOUT_ENV` says otherwise): an infinite loop in the
learner's code fails the check with "timed out after N s".

Per-chapter checks live in ``minipaged.checks.chNN`` and are written with the
:func:`check` decorator. A chapter module may also define ``HINTS``,
``{"N.M": [first, second, ...]}``: staged hints that :func:`hint` prints, the
first naming the concept and later ones coming closer to code.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import importlib
import json
import math
import os
import signal
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path

_PACKAGE_DIR = str(Path(__file__).resolve().parent.parent)

RESULTS_ENV = "MINIPAGED_CHECK_RESULTS"  # path of the file the grader reads results from
SECRET_ENV = "MINIPAGED_CHECK_SECRET"  # per-run key that signs each result record
TIMEOUT_ENV = "MINIPAGED_CHECK_TIMEOUT"  # seconds; overrides every check's own limit
DEFAULT_TIMEOUT = 60.0

# Taken out of the environment at import, so learner code that reads os.environ finds nothing.
_SECRET = os.environ.pop(SECRET_ENV, "").encode()
_RESULTS = os.environ.pop(RESULTS_ENV, "")
_SEQ = 0  # numbers the records, so the grader can reject a replayed one

PASS, FAIL, TODO = "PASS", "FAIL", "NOT IMPLEMENTED YET"
_ICONS = {PASS: "✅", FAIL: "❌", TODO: "⏳"}


class CheckFailed(AssertionError):
    """A learner's answer disagrees with the reference."""


@dataclass
class CheckResult:
    name: str
    status: str
    message: str = ""
    hint: str = ""

    @property
    def passed(self) -> bool:
        return self.status == PASS

    def __str__(self) -> str:
        line = f"{_ICONS[self.status]} {self.status}   {self.name}"
        if self.message:
            line += f": {self.message}"
        if self.hint and self.status != PASS:
            line += f"\n          hint: {self.hint}"
        return line

    def __bool__(self) -> bool:
        return self.passed


def sign(secret: bytes, record: dict) -> str:
    """The HMAC-SHA256 of a result record (without its ``sig``), as the grader recomputes it."""
    body = json.dumps({k: v for k, v in record.items() if k != "sig"}, sort_keys=True)
    return hmac.new(secret, body.encode(), hashlib.sha256).hexdigest()


def _record(result: CheckResult) -> None:
    """Append the result to the grader's file, signed; a no-op outside the grader."""
    if not (_SECRET and _RESULTS):
        return
    global _SEQ
    _SEQ += 1
    record = {"name": result.name, "status": result.status, "message": result.message, "seq": _SEQ}
    record["sig"] = sign(_SECRET, record)
    with open(_RESULTS, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


class CheckTimeout(BaseException):
    """The learner's code ran past the check's time limit (a BaseException: ``except Exception`` won't swallow it)."""


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Raise :class:`CheckTimeout` in the main thread after ``seconds`` (where SIGALRM exists)."""
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable or seconds <= 0:
        yield
        return

    def expire(signum, frame):
        raise CheckTimeout(f"timed out after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _timeout(own: float | None) -> float:
    env = os.environ.get(TIMEOUT_ENV)
    if env:
        return float(env)
    return DEFAULT_TIMEOUT if own is None else own


def _where(exc: BaseException) -> str:
    """The innermost frame of the learner's code (a notebook cell), if any."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if not frame.filename.startswith(_PACKAGE_DIR):
            return f" (in {frame.name}, line {frame.lineno})"
    return ""


def check(name: str, hint: str = "", timeout: float | None = None):
    """Turn ``fn(*answers) -> summary`` into a check that prints one status line.

    ``fn`` raises :class:`CheckFailed` (or uses :func:`expect_equal` /
    :func:`expect_close`) on a wrong answer and returns a short summary on
    success. Anything else the learner's code raises becomes a FAIL line that
    names the exception, never a traceback.

    Args:
        name: the check's id, ``chNN.what``; the grader's gradebook column.
        hint: printed under a FAIL line.
        timeout: seconds the whole check may run (default :data:`DEFAULT_TIMEOUT`;
            :data:`TIMEOUT_ENV` overrides it); past it the check FAILs with
            "timed out after N s".
    """

    def decorate(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs) -> CheckResult:
            try:
                with _time_limit(_timeout(timeout)):
                    summary = fn(*args, **kwargs)
            except CheckTimeout as exc:
                result = CheckResult(name, FAIL, f"{exc}: is there an infinite loop?", hint)
            except NotImplementedError as exc:
                where = str(exc) or "replace the `raise NotImplementedError` with your code"
                # A generated stub already carries the task's hint; don't print two.
                result = CheckResult(name, TODO, where, "" if "Hint:" in where else hint)
            except CheckFailed as exc:
                result = CheckResult(name, FAIL, str(exc), hint)
            except Exception as exc:  # the learner's code crashed: summarise, don't dump
                msg = f"your code raised {type(exc).__name__}: {exc}{_where(exc)}"
                result = CheckResult(name, FAIL, msg, hint)
            else:
                result = CheckResult(name, PASS, summary or "")
            print(result)
            _record(result)
            return result

        return run

    return decorate


def expect_equal(actual, expected, what: str) -> None:
    if actual != expected:
        raise CheckFailed(f"{what} returned {actual!r}, expected {expected!r}")


def expect_close(actual, expected, what: str, rel: float = 1e-9, abs_: float = 1e-12) -> None:
    try:
        ok = math.isclose(float(actual), float(expected), rel_tol=rel, abs_tol=abs_)
    except (TypeError, ValueError):
        raise CheckFailed(f"{what} returned {actual!r}, which is not a number") from None
    if not ok:
        raise CheckFailed(f"{what} returned {actual!r}, expected {expected!r}")


def expect_tensor_close(actual, expected, what: str, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    import torch

    if not isinstance(actual, torch.Tensor):
        raise CheckFailed(f"{what} returned {type(actual).__name__}, expected a torch.Tensor")
    if actual.shape != expected.shape:
        raise CheckFailed(f"{what} has shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise CheckFailed(f"{what} has dtype {actual.dtype}, expected {expected.dtype}")
    if not torch.allclose(actual, expected, atol=atol, rtol=rtol, equal_nan=False):
        err = (actual.float() - expected.float()).abs().nan_to_num(float("inf")).max().item()
        raise CheckFailed(f"{what} differs from the reference (max abs error {err:.3g}, atol {atol})")


def hint(task: str, level: int = 1) -> str:
    """Print (and return) staged hint ``level`` of ``task`` (``"5.1"``), from ``minipaged.checks.chNN.HINTS``.

    Args:
        task: the task's number, ``"N.M"``, as the exercise names it.
        level: 1 names the concept; higher levels come closer to code. None is the solution.
    """
    chapter = task.split(".")[0]
    try:
        module = importlib.import_module(f"minipaged.checks.ch{int(chapter):02d}")
    except (ValueError, ModuleNotFoundError):
        raise ValueError(f"task {task!r}: no checks for chapter {chapter!r}") from None
    hints = getattr(module, "HINTS", {}).get(task)
    if not hints:
        raise ValueError(f"task {task!r} has no staged hints")
    if isinstance(level, bool) or not isinstance(level, int):
        raise TypeError(f"level must be an int, got {type(level).__name__}")
    if not 1 <= level <= len(hints):
        raise ValueError(f"level must be between 1 and {len(hints)} for task {task}, got {level}")
    text = f"Hint {level} of {len(hints)} for Task {task}: {hints[level - 1]}"
    print(text)
    return text
