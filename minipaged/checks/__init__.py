"""Exercise checks that never dump a traceback on the learner, and whose verdict the learner's kernel never decides.

Every check prints exactly one line that starts with a fixed status:

    ✅ PASS   ch01.blocks_needed: 9 cases
    ❌ FAIL   ch01.blocks_needed: blocks_needed(37, 16): returned 2, expected 3
              hint: a partly filled block still counts as a whole block
    ⏳ NOT IMPLEMENTED YET   ch01.blocks_needed: replace `raise NotImplementedError`
              hint: ...

A check has two halves, so that the half that decides can run where the learner's code cannot reach it:

- the **probe** calls the learner's code on one case and returns what it observed as plain data
  (:func:`plain`: ``None``, ``bool``, ``int``, ``float``, ``str``, lists and dicts with string keys,
  tensors as ``{"tensor": values, "dtype": ..., "shape": ...}``). :meth:`Check.transcript` runs it on
  every case and gives a :data:`SCHEMA` transcript (CONTRIBUTING.md describes it);
- the **judge** compares one case's observation with the reference's, which the same probe gives on
  the reference answer, and raises :class:`CheckFailed` with a teaching message.

The cases, the reference answers and the hidden cases live on the instructor's side
(``minipaged.checks.instructor``), which a learner's handout does not carry: there, the public
cases and their reference transcript come from ``expected.json``, written by
``python -m minipaged.exercises release``. A learner's call ``check_x(answer)`` runs both halves in
its own process on the public cases. The grader (``python -m minipaged.checks grade``) runs only the
probe in the learner's kernel, through :func:`probe_json`, on the public cases and on hidden ones
drawn from a seed the kernel never sees, and judges the transcript in its own process.

Every check runs under one time limit, the same for the learner and the grader (:data:`DEFAULT_TIMEOUT`
seconds unless :data:`TIMEOUT_ENV` says otherwise), counted in CPU time so that a busy machine does not
fail correct work: N seconds on each thread the kernel may use (:func:`threads`). An infinite loop in the
learner's code fails the check with "timed out after N s of CPU time"; code that waits instead of computing
is stopped after :data:`WALL_FACTOR` times N seconds of wall-clock time. When the learner's code raises, the
FAIL line names the exception and
the innermost frame of the learner's code, with the arguments it was called with.

Per-chapter checks live in ``minipaged.checks.chNN`` and are written with :func:`check`. A chapter
module may also define ``HINTS``, ``{"N.M": [first, second, ...]}``: staged hints that :func:`hint`
prints, the first naming the concept and later ones coming closer to code.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import math
import os
import signal
import sysconfig
import threading
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

_PACKAGE_DIR = str(Path(__file__).resolve().parent.parent)
EXPECTED = Path(__file__).resolve().parent / "expected.json"  # public cases and reference transcripts (handouts)

TIMEOUT_ENV = "MINIPAGED_CHECK_TIMEOUT"  # seconds; overrides every check's own limit in the learner's kernel
DEFAULT_TIMEOUT = 60.0
WALL_FACTOR = 10  # a check still running after this many times its limit, in wall-clock time, is stopped too
SCHEMA = "minipaged-transcript/1"
MAX_DEPTH = 32  # nesting a transcript may have

PASS, FAIL, TODO = "PASS", "FAIL", "NOT IMPLEMENTED YET"
_ICONS = {PASS: "✅", FAIL: "❌", TODO: "⏳"}


class CheckFailed(AssertionError):
    """A learner's answer disagrees with the reference.

    Args:
        message: what went wrong, naming the first case, step, token or block where it did.
        hint: the hint for *this* failure, printed under the FAIL line in place of the check's default.
    """

    def __init__(self, message: str = "", hint: str = ""):
        super().__init__(message)
        self.hint = hint


class NotPlainData(TypeError):
    """A probe observed a value that is not plain data (an ``int`` subclass, a NumPy array, an object)."""


@dataclass
class CheckResult:
    """One check's verdict: its status line, and (for a learner's own run) what the probe observed.

    Attributes:
        observations: the learner's observations on the public cases, in case order, so a notebook can
            show more of a passing run than its one line (empty for the grader, who keeps them in its JSON).
    """

    name: str
    status: str
    message: str = ""
    hint: str = ""
    observations: list = field(default_factory=list, repr=False)

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


# ---------------------------------------------------------------------------
# Plain data: what crosses from the learner's kernel to the grader
# ---------------------------------------------------------------------------


def plain(value, depth: int = 0):
    """``value`` as plain data, checked by exact type (``type(x) is int``, never ``isinstance``).

    Tuples become lists; a ``torch.Tensor`` becomes ``{"tensor": nested lists, "dtype": "float32",
    "shape": [...]}``. Anything else, an ``int`` subclass included, raises :class:`NotPlainData`.

    Args:
        value: what the probe observed.
        depth: the nesting so far (at most :data:`MAX_DEPTH`).
    """
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if depth >= MAX_DEPTH:
        raise NotPlainData(f"nested deeper than {MAX_DEPTH} levels")
    if kind in (list, tuple):
        return [plain(v, depth + 1) for v in value]
    if kind is dict:
        if any(type(k) is not str for k in value):
            raise NotPlainData("a dict whose keys are not all str")
        return {k: plain(v, depth + 1) for k, v in value.items()}
    torch = _torch()
    if torch is not None and kind in (torch.Tensor, torch.nn.Parameter):
        t = value.detach().cpu()
        return {"tensor": t.tolist(), "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
    raise NotPlainData(f"a {kind.__module__}.{kind.__qualname__}")


def _torch():
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return None
    return torch


def check_plain(value, depth: int = 0) -> None:
    """Raise :class:`NotPlainData` unless ``value`` is JSON-decoded plain data (the grader's side of :func:`plain`).

    Args:
        value: a decoded JSON value.
        depth: the nesting so far.
    """
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return
    if depth >= MAX_DEPTH:
        raise NotPlainData(f"nested deeper than {MAX_DEPTH} levels")
    if kind is list:
        for v in value:
            check_plain(v, depth + 1)
    elif kind is dict:
        for k, v in value.items():
            if type(k) is not str:
                raise NotPlainData("a dict whose keys are not all str")
            check_plain(v, depth + 1)
    else:
        raise NotPlainData(f"a {kind.__name__}")


def as_tensor(observed):
    """The tensor a probe recorded with :func:`plain`, rebuilt; ``None`` if ``observed`` is not one."""
    import torch

    if type(observed) is not dict or set(observed) != {"tensor", "dtype", "shape"}:
        return None
    dtype = getattr(torch, str(observed["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        return None
    try:
        t = torch.tensor(observed["tensor"], dtype=torch.float64 if dtype.is_floating_point else dtype)
        return t.reshape([int(s) for s in observed["shape"]]).to(dtype)
    except (TypeError, ValueError, RuntimeError):
        return None


def outcome(fn, *args):
    """Call ``fn(*args)`` for a probe: ``{"returned": plain value}`` or ``{"raised": [exception class names]}``.

    ``NotImplementedError`` passes through, so an unfinished task still reads NOT IMPLEMENTED YET.
    """
    try:
        value = fn(*args)
    except NotImplementedError:
        raise
    except Exception as exc:
        return {"raised": [c.__name__ for c in type(exc).__mro__], "message": str(exc)[:300]}
    return {"returned": plain(value)}


def to_tuples(value):
    """Lists back to tuples, all the way down (a probe rebuilds tuple-valued inputs this way)."""
    return tuple(to_tuples(v) for v in value) if type(value) is list else value


# ---------------------------------------------------------------------------
# Time limits
# ---------------------------------------------------------------------------


class CheckTimeout(BaseException):
    """The learner's code ran past the check's time limit (a BaseException: ``except Exception`` won't swallow it)."""


def threads() -> int:
    """The threads a kernel may use: ``OMP_NUM_THREADS`` where set (the grader sets it), else its cores."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "")))
    except ValueError:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def timeout_message(seconds: float, cpu: bool, on: int) -> str:
    """What a check past its limit of ``seconds`` FAILs with: its CPU time used up (``cpu``) on each of ``on``
    threads, or the wall-clock backstop."""
    if cpu:
        return f"timed out after {seconds:g} s of CPU time" + (f" on each of {on} threads" if on > 1 else "")
    return f"timed out: still running after {seconds * WALL_FACTOR:g} s, mostly waiting rather than computing"


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Raise :class:`CheckTimeout` in the main thread once this process has used ``seconds`` of CPU time on each of
    its :func:`threads` (``ITIMER_PROF``), or after :data:`WALL_FACTOR` times ``seconds`` (``ITIMER_REAL``)."""
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable or seconds <= 0:
        yield
        return

    def expire(signum, frame):
        raise CheckTimeout(timeout_message(seconds, signum == signal.SIGPROF, threads()))

    previous = {sig: signal.signal(sig, expire) for sig in (signal.SIGPROF, signal.SIGALRM)}
    signal.setitimer(signal.ITIMER_PROF, seconds * threads())
    signal.setitimer(signal.ITIMER_REAL, seconds * WALL_FACTOR)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _timeout() -> float:
    """The one per-check limit: :data:`TIMEOUT_ENV` if set, else :data:`DEFAULT_TIMEOUT`."""
    env = os.environ.get(TIMEOUT_ENV)
    return float(env) if env else DEFAULT_TIMEOUT


_LIBRARY_DIRS = tuple({sysconfig.get_path(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")})
MAX_ARGUMENT_CHARS = 80  # of each argument a FAIL line shows


def _is_learners(filename: str) -> bool:
    """Whether a traceback frame is the learner's code: not this package, the standard library or an installed one."""
    return not filename.startswith((_PACKAGE_DIR, *_LIBRARY_DIRS)) and not filename.startswith("<frozen")


def _shown(value) -> str:
    """``value`` as a FAIL line shows an argument: a tensor by its shape and dtype, anything else by a short repr."""
    torch = _torch()
    if torch is not None and isinstance(value, torch.Tensor):
        return f"tensor(shape={list(value.shape)}, dtype={str(value.dtype).removeprefix('torch.')})"
    try:
        text = repr(value)
    except Exception:  # a learner's __repr__ that raises
        text = f"<{type(value).__name__}>"
    return text if len(text) <= MAX_ARGUMENT_CHARS else text[: MAX_ARGUMENT_CHARS - 3] + "..."


def _where(exc: BaseException) -> str:
    """Where in the learner's code ``exc`` was raised: the innermost such frame and the arguments it had then."""
    tb, found = exc.__traceback__, None
    while tb is not None:
        code = tb.tb_frame.f_code
        if _is_learners(code.co_filename) and not code.co_name.startswith("<"):  # not a comprehension's frame
            found = tb
        tb = tb.tb_next
    if found is None:
        return ""
    code, values = found.tb_frame.f_code, found.tb_frame.f_locals
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    args = ", ".join(f"{n}={_shown(values[n])}" for n in names if n != "self" and n in values)
    return f" (in {code.co_name}, line {found.tb_lineno}{', called with ' + args if args else ''})"


# ---------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------


class Check:
    """One exercise check: a probe (runs the learner's code), a judge (compares with the reference), a label.

    Calling it, ``check_x(*answers)``, runs the public cases in this process and prints one status line.
    """

    def __init__(self, name: str, probe, hint: str, label, summary, formative: bool = False):
        self.name, self.probe, self.hint = name, probe, hint
        self.label, self.summary, self.formative = label, summary, formative
        self._judge = _judge_equal
        self.__name__ = probe.__name__
        self.__doc__ = probe.__doc__
        params = list(inspect.signature(probe).parameters.values())[1:]  # the case comes first
        self.__signature__ = inspect.Signature(params)

    def judge(self, fn):
        """Decorator: ``fn(case, got, want)`` raises :class:`CheckFailed` when the observation ``got`` is wrong."""
        self._judge = fn
        return fn

    def transcript(self, cases: list, answers: tuple) -> dict:
        """Run the probe on each case; the :data:`SCHEMA` transcript, plain data, JSON round-tripped."""
        observations, end = [], {"kind": "done"}
        for index, case in enumerate(cases):
            try:
                observations.append(plain(self.probe(case, *answers)))
            except NotImplementedError as exc:
                end = {"kind": "todo", "case": index, "message": str(exc)}
                break
            except NotPlainData as exc:
                end = {"kind": "not_plain", "case": index, "message": str(exc)}
                break
            except Exception as exc:  # the learner's code crashed: summarise, don't dump
                end = {"kind": "raised", "case": index, "message": f"{type(exc).__name__}: {exc}{_where(exc)}"}
                break
        record = {"schema": SCHEMA, "check": self.name, "observations": observations, "end": end}
        return json.loads(json.dumps(record))

    def verdict(self, cases: list, got, want: dict, public: int) -> CheckResult:
        """Judge the transcript ``got`` against the reference's ``want``; cases from ``public`` on are hidden.

        Args:
            cases: the cases both transcripts ran, public ones first.
            got: the learner's transcript (decoded JSON, not trusted: its shape is checked here).
            want: the reference's transcript on the same cases.
            public: how many of ``cases`` are public; a hidden case's FAIL does not show its expected value.
        """
        problem = transcript_problem(got, self.name)
        if problem:
            return CheckResult(self.name, FAIL, f"no usable answer came back ({problem})", self.hint)
        if want["end"]["kind"] != "done" or len(want["observations"]) != len(cases):
            raise RuntimeError(f"{self.name}: the reference failed its own cases: {want['end']}")
        observed, end = got["observations"], got["end"]
        for index, case in enumerate(cases):
            hidden = index >= public
            label = f"hidden case {index - public + 1} ({self.label(case)})" if hidden else self.label(case)
            if index >= len(observed):
                if end["kind"] == "todo" and end.get("message") is not None:
                    message = str(end["message"]) or "replace the `raise NotImplementedError` with your code"
                    return CheckResult(self.name, TODO, message, "" if "Hint:" in message else self.hint)
                if end["kind"] == "not_plain":
                    message = (f"{label}: your code returned {end.get('message')}; return plain Python values "
                               "(int, float, str, bool, None, lists, dicts, tensors)")
                elif end["kind"] == "raised":
                    message = f"{label}: your code raised {end.get('message')}"
                else:
                    message = f"{label}: no answer came back for this case"
                return CheckResult(self.name, FAIL, message, self.hint)
            try:
                self._judge(case, observed[index], want["observations"][index])
            except (KeyError, TypeError, IndexError, AttributeError, ValueError, ArithmeticError,
                    RecursionError) as exc:  # a malformed observation: 10**400 where a float goes, too deep, ...
                exc = CheckFailed(f"the observation has an unexpected shape ({type(exc).__name__}: {exc})")
                return CheckResult(self.name, FAIL, f"{label}: {exc}", self.hint)
            except CheckFailed as exc:
                if hidden:
                    return CheckResult(self.name, FAIL, f"{label}: a wrong answer (a hidden case's expected value "
                                       "is not shown; test your code on cases like it)", exc.hint or self.hint)
                return CheckResult(self.name, FAIL, f"{label}: {exc}", exc.hint or self.hint)
        extra = f", {len(cases) - public} hidden" if len(cases) > public else ""
        if callable(self.summary):
            return CheckResult(self.name, PASS, self.summary(cases[:public], observed[:public]) + extra)
        return CheckResult(self.name, PASS, self.summary.format(n=public) + extra)

    def __call__(self, *answers) -> CheckResult:
        cases, want = expected(self.name)
        try:
            with _time_limit(_timeout()):
                got = self.transcript(cases, answers)
        except CheckTimeout as exc:
            result = CheckResult(self.name, FAIL, f"{exc}: is there an infinite loop?", self.hint)
        else:
            result = self.verdict(cases, got, want, len(cases))
            result.observations = got["observations"] if type(got.get("observations")) is list else []
        print(result)
        return result


def _judge_equal(case, got, want) -> None:
    expect_equal(got, want)


def transcript_problem(record, name: str) -> str:
    """Why ``record`` is not a transcript of check ``name`` (``""`` when it is one)."""
    try:
        check_plain(record)
    except NotPlainData as exc:
        return f"not plain data: {exc}"
    if type(record) is not dict or record.get("schema") != SCHEMA or record.get("check") != name:
        return f"not a {SCHEMA} transcript of {name}"
    end = record.get("end")
    if type(record.get("observations")) is not list or type(end) is not dict:
        return "a transcript needs a list of observations and an end"
    if end.get("kind") not in ("done", "todo", "raised", "not_plain"):
        return f"an unknown end {end.get('kind')!r}"
    return ""


def check(name: str, hint: str = "", label=None, summary="{n} cases", formative: bool = False):
    """Turn a probe ``fn(case, *answers) -> observation`` into a :class:`Check` named ``name``.

    The probe calls the learner's code on one case (plain data) and returns what it saw; anything the
    learner's code raises becomes a FAIL line that names the exception, never a traceback. Add the
    judge with ``@check_x.judge``; without one, the observation must equal the reference's.

    Args:
        name: the check's id, ``chNN.what``; the grader's gradebook column.
        hint: printed under a FAIL line.
        label: ``label(case) -> str``, how a FAIL names the case (only its inputs: it is shown for hidden ones).
        summary: the PASS line's text, where ``{n}`` is the number of public cases; or
            ``summary(cases, observations) -> str`` on the public cases and the learner's (judged) observations.
        formative: the observation is a measurement that only the learner's process can take (operation or
            torch-call counts), which code in that process can falsify; the grader reports the verdict apart and
            does not count it in the mark.
    """

    def decorate(fn) -> Check:
        return Check(name, fn, hint, label or (lambda case: f"case {case!r}"), summary, formative)

    return decorate


def find(name: str) -> Check:
    """The :class:`Check` called ``name`` (``"ch01.fixed_breakdown"``), from its chapter's module."""
    chapter, _, short = name.partition(".")
    module = importlib.import_module(f"minipaged.checks.{chapter}")
    for value in vars(module).values():
        if isinstance(value, Check) and value.name == name:
            return value
    raise KeyError(f"no check called {name!r} in minipaged.checks.{chapter}")


def instructor_side(name: str):
    """The instructor's side of check ``name`` (its cases, hidden cases, reference), or ``None`` in a handout."""
    chapter, _, short = name.partition(".")
    try:
        module = importlib.import_module(f"minipaged.checks.instructor.{chapter}")
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("minipaged.checks.instructor"):
            return None
        raise
    return module.SIDES[short]


@cache
def _expected_file() -> dict:
    return json.loads(EXPECTED.read_text(encoding="utf-8")) if EXPECTED.exists() else {}


def expected(name: str) -> tuple[list, dict]:
    """The public cases of check ``name`` and the reference's transcript on them.

    From the instructor's side where it is installed, else from a handout's ``expected.json``.
    """
    side = instructor_side(name)
    if side is None:
        entry = _expected_file().get(name)
        if entry is None:
            raise RuntimeError(f"{name}: neither minipaged.checks.instructor nor {EXPECTED.name} knows its cases")
        return entry["cases"], entry["want"]
    return json.loads(_instructor_expected(name))  # a fresh copy: a probe may change the cases it is given


@cache
def _instructor_expected(name: str) -> str:
    """``[cases, reference transcript]`` of check ``name`` as JSON, computed once per process."""
    cases = instructor_side(name).public()
    return json.dumps([cases, reference_transcript(name, cases)])


def reference_transcript(name: str, cases: list) -> dict:
    """The transcript of the reference answer of check ``name`` on ``cases`` (the instructor's side only)."""
    side = instructor_side(name)
    return find(name).transcript(cases, side.reference())


def probe_json(marker: str, name: str, cases_json: str, *answers) -> None:
    """The grader's entry point in the learner's kernel: print ``marker`` and the transcript as JSON.

    Nothing here decides a verdict: whatever this prints is compared, in the grader's process, with
    the grader's own reference. A kernel that lies about it only changes the answer being judged.
    """
    print(marker + json.dumps(find(name).transcript(json.loads(cases_json), answers)), flush=True)


def same(a, b) -> bool:
    """Plain data ``a`` equals ``b`` with the same exact types all the way down (``True`` is not ``1``, nor ``1.0``)."""
    if type(a) is not type(b):
        return False
    if type(a) is list:
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b or (type(a) is float and math.isnan(a) and math.isnan(b))


def expect_equal(actual, expected, what: str = "") -> None:
    """Raise :class:`CheckFailed` "``what`` returned X, expected Y" unless :func:`same`."""
    if not same(actual, expected):
        raise CheckFailed(f"{what + ' ' if what else ''}returned {actual!r}, expected {expected!r}")


def expect_int(value, what: str = "") -> None:
    """An exact ``int`` (not a ``bool``), or :class:`CheckFailed`."""
    if type(value) is not int:
        raise CheckFailed(f"{what + ' ' if what else ''}returned {value!r}; return an int")


def expect_raised(observed, exc_name: str, what: str) -> None:
    """The probe's :func:`outcome` ``observed`` must be a raise of ``exc_name`` (or a subclass)."""
    raised = observed.get("raised") if type(observed) is dict else None
    if type(raised) is list and exc_name in raised:
        return
    if type(raised) is list and raised:
        raise CheckFailed(f"{what} raised {raised[0]}: {observed.get('message', '')}; expected {exc_name}")
    raise CheckFailed(f"{what} returned normally; expected it to raise {exc_name}")


def expect_close(actual, expected, what: str, rel: float = 1e-9, abs_: float = 1e-12) -> None:
    if type(actual) not in (int, float):
        raise CheckFailed(f"{what} returned {actual!r}, which is not a number")
    try:
        close = math.isclose(float(actual), float(expected), rel_tol=rel, abs_tol=abs_)
    except OverflowError:
        raise CheckFailed(f"{what} returned an integer of {len(str(abs(actual)))} digits, too large to compare as a "
                          "float") from None
    if not close:
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
