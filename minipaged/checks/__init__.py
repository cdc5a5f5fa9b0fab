"""Exercise checks that never dump a traceback on the learner.

Every check prints exactly one line that starts with a fixed status:

    ✅ PASS   ch01.blocks_needed: 9 cases
    ❌ FAIL   ch01.blocks_needed: blocks_needed(37, 16) returned 2, expected 3
              hint: a partly filled block still counts as a whole block
    ⏳ NOT IMPLEMENTED YET   ch01.blocks_needed: replace `raise NotImplementedError`
              hint: ...

The grader (``python -m minipaged.checks grade``) reads these lines back, so
their format is part of the interface. Per-chapter checks live in
``minipaged.checks.chNN`` and are written with the :func:`check` decorator.
"""

from __future__ import annotations

import functools
import math
import traceback
from dataclasses import dataclass
from pathlib import Path

_PACKAGE_DIR = str(Path(__file__).resolve().parent.parent)

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


def _where(exc: BaseException) -> str:
    """The innermost frame of the learner's code (a notebook cell), if any."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if not frame.filename.startswith(_PACKAGE_DIR):
            return f" (in {frame.name}, line {frame.lineno})"
    return ""


def check(name: str, hint: str = ""):
    """Turn ``fn(*answers) -> summary`` into a check that prints one status line.

    ``fn`` raises :class:`CheckFailed` (or uses :func:`expect_equal` /
    :func:`expect_close`) on a wrong answer and returns a short summary on
    success. Anything else the learner's code raises becomes a FAIL line that
    names the exception, never a traceback.
    """

    def decorate(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs) -> CheckResult:
            try:
                summary = fn(*args, **kwargs)
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
