"""Grade a class: ``python -m minipaged.checks grade submissions/``.

    python -m minipaged.checks grade PATH [PATH ...] [--gradebook PREFIX] [--instructor] [--jobs N]
        [--check-timeout S] [--notebook-timeout S] [--seed N] [--unsandboxed]

A PATH is a notebook or a folder of submissions. Under a folder, a notebook's learner is the first
folder below it (``submissions/<learner>/.../NN_name.ipynb``); a notebook named on its own belongs
to its parent folder. Its exercise is the solution whose name starts with the same two digits.

For each notebook, the grader:

1. learns the exercise's checks from its solution: every code cell that calls ``chNN.check_x(...)``
   is a *check cell*, known by its cell id;
2. restores each check cell from the solution (an edited cell gets its source back, a deleted one
   is put back after the cell it followed, a copy of one is dropped);
3. runs the learner's cells in a kernel process of its own, in a sandbox (:mod:`minipaged.checks.sandbox`:
   bubblewrap, a uid of its own, no network, limits), with a working directory of its own, against a copy of
   the package without its instructor side (``minipaged.checks.instructor``) and without ``solutions/``; the
   sandbox shows nothing else of the machine's files but the system's and the venv. In place of each check
   cell it runs a cell of its own, which calls the learner's code through the check's probe on the public
   cases and on hidden ones drawn from the grading seed, and prints the probe's transcript as JSON;
4. decides each verdict in its own process: it checks the transcript's exact types, runs the
   reference on the same cases and compares. Nothing the kernel prints, reads or writes is a verdict.
5. flags, for the instructor to look at, a learner's piece or cell that is a copy of the model answer, of
   another function of the package or of a classmate's (:mod:`minipaged.checks.copies`), and a cell that
   imports, subclasses or calls a package module its exercise rebuilds (:func:`delegations`, the modules from
   the chapter's ``chNN.REBUILDS``). Flags are static analysis, not verdicts and not a security boundary;
   they leave the verdicts as they are.

A cell past its limit (N seconds of CPU time on each of the kernel's threads, counted over its process tree,
or a wall-clock backstop of ``WALL_FACTOR`` times N for a cell that waits) is interrupted; if it does not stop
within :data:`KILL_GRACE` s the kernel is killed. The check FAILs with "timed out after N s of CPU time", a
dead kernel FAILs the rest of its notebook, and the batch goes on. It prints one table (a row per learner, a
column per check) and writes it as ``PREFIX.csv`` and ``PREFIX.json``; the JSON also holds every failure
message, the notes and flags on each notebook, and the model answer to every free-text question beside each
learner's answer (``--instructor`` prints those too). The exit status is 0 when every check passed, 1 when
some did not, 2 when an input could not be graded, 3 when the grader itself failed on a notebook.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import csv
import json
import math
import os
import queue
import random
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from minipaged.checks import (
    DEFAULT_TIMEOUT,
    FAIL,
    PASS,
    TODO,
    WALL_FACTOR,
    Check,
    CheckResult,
    copies,
    instructor_side,
    reference_transcript,
    timeout_message,
)
from minipaged.checks import sandbox as sandboxes
from minipaged.checks.cpu_time import tree_cpu_seconds
from minipaged.checks.handin import GradeError, read_handed_in, shown
from minipaged.cli import positive_int

ROOT = Path(__file__).resolve().parent.parent.parent
SOLUTIONS = ROOT / "solutions"
_ANSWER = re.compile(r"<!-- BEGIN SOLUTION -->(.*?)<!-- END SOLUTION -->", re.S)
_ANSWER_HERE = "*Your answer here.*"
_CHECK_CALL = re.compile(r"^ch\d\d$")
MISSING = "MISSING"
KILL_GRACE = 5.0  # seconds a cell gets to stop after an interrupt before its kernel is killed
CELL_SLACK = 15.0  # a learner's own cell may run this much longer than a check
MAX_OUTPUT = 32 * 2**20  # characters of a cell's stdout the grader keeps (the last ones)
IOPUB_GRACE = 5.0  # seconds a cell's output may still arrive after its shell reply
CPU_SAMPLE = 0.25  # seconds between two readings of a kernel's CPU time
MAX_MESSAGE = 16 * 2**20  # bytes of one message from a kernel that the grader receives; a bigger one is dropped
UNGRADED = "UNGRADED"  # the status of every check of a notebook whose files the grader could not read
_CSV_FORMULA = ("=", "+", "-", "@", "\t", "\r")


@dataclass
class CheckCall:
    """One ``chNN.check_x(arg, ...)`` call of a check cell: the check and its arguments' source."""

    check: Check
    args: list[str]


@dataclass
class CheckCell:
    """A check cell of an exercise: its id in the solution, its pristine source, the checks it calls."""

    cell_id: str
    source: str
    calls: list[CheckCall]

    @property
    def names(self) -> list[str]:
        return [call.check.name for call in self.calls]


@dataclass
class Exercise:
    """What the grader knows about one exercise, all of it read from the solution notebook."""

    path: Path
    check_cells: list[CheckCell]
    previous: dict[str, str | None]  # check cell id -> id of the solution cell before it
    questions: dict[str, tuple[str, str]]  # markdown cell id -> (question title, model answer)
    framing: dict[str, tuple[str, str]] = field(default_factory=dict)  # question cell id -> text around the answer
    rebuilds: tuple[str, ...] = ()  # the package modules the exercise rebuilds (its chapter's ``REBUILDS``)
    given: frozenset[str] = frozenset()  # what the solution's own cells import from them (``module.name``)

    @property
    def checks(self) -> list[str]:
        return [name for cell in self.check_cells for name in cell.names]

    @property
    def formative(self) -> list[str]:
        """The checks reported but not counted in the mark (:func:`minipaged.checks.check`'s ``formative``)."""
        return [call.check.name for cell in self.check_cells for call in cell.calls if call.check.formative]


@dataclass
class Outcome:
    status: str
    message: str = ""


@dataclass
class Submission:
    """One notebook to grade, whose it is, and the learner's folder (where the package files they built are)."""

    learner: str
    path: Path
    folder: Path | None = None
    nb: object = None  # the notebook as read once, before grading (:func:`screen`)


@dataclass
class Graded:
    """One graded notebook."""

    learner: str
    path: Path
    exercise: Exercise
    results: dict[str, Outcome]
    notes: list[str] = field(default_factory=list)
    answers: dict[str, str] = field(default_factory=dict)  # question cell id -> the learner's answer
    flags: list[str] = field(default_factory=list)


@dataclass
class Limits:
    """The grading run's settings: time limits (seconds; ``check`` None means each check's own), the seed, the
    threads each kernel may use (the machine's cores shared among the notebooks graded at once: an
    oversubscribed kernel can run several times slower and time out without a fault of its learner's), and each
    kernel's sandbox limits (None: the kernels run unsandboxed, ``--unsandboxed``)."""

    check: float | None
    notebook: float
    seed: int
    threads: int = 1
    confinement: sandboxes.Confinement | None = None


# ---------------------------------------------------------------------------
# Reading exercises and submissions
# ---------------------------------------------------------------------------


def _read(path: Path):
    import nbformat

    if not os.path.lexists(path):
        raise GradeError(f"{shown(path)}: no such file")
    if path.suffix != ".ipynb":
        raise GradeError(f"{shown(path)}: not a notebook (expected a .ipynb file)")
    data = read_handed_in(path)
    try:
        with warnings.catch_warnings():  # a cell without an id is graded all the same
            warnings.simplefilter("ignore")
            nb = nbformat.reads(data.decode("utf-8"), as_version=4)
            nbformat.validate(nb)
    except Exception as exc:  # invalid JSON or not the notebook schema: say which file, not a traceback
        first = (str(exc).splitlines() or [""])[0][:200]
        why = f"{type(exc).__name__}: {shown(first)}" if first else f"{type(exc).__name__} in its nbformat fields"
        raise GradeError(f"{shown(path)}: not a notebook ({why})") from None
    return nb


def _code(source: str) -> str:
    """A cell's source with IPython ``%`` and ``!`` lines blanked, so that ``ast`` can parse it."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


def _tree(source: str) -> ast.Module | None:
    """A cell's AST (IPython lines skipped), or None if Python cannot parse it."""
    try:
        return ast.parse(_code(source))
    except SyntaxError:
        return None


def check_calls(source: str) -> list[CheckCall]:
    """The ``chNN.check_x(...)`` calls in a cell, resolved to the grader's own :class:`Check` objects."""
    import importlib

    tree = _tree(source)
    if tree is None:
        return []
    calls = []
    for node in ast.walk(tree):
        func = getattr(node, "func", None)
        if not (isinstance(node, ast.Call) and isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
                and _CHECK_CALL.match(func.value.id) and func.attr.startswith("check_")):
            continue
        target = getattr(importlib.import_module(f"minipaged.checks.{func.value.id}"), func.attr, None)
        if isinstance(target, Check):
            calls.append(CheckCall(target, [ast.get_source_segment(_code(source), a) for a in node.args]))
    return calls


def load_exercise(solution_path: Path) -> Exercise:
    """The check cells, free-text questions and task cells of the exercise whose solution is ``solution_path``."""
    import importlib

    nb = _read(solution_path)
    check_cells, previous, questions, framing, before = [], {}, {}, {}, None
    title = ""
    for cell in nb.cells:
        if cell.cell_type == "markdown" and cell.source.startswith("#"):
            title = cell.source.splitlines()[0].lstrip("# ").strip()
        calls = check_calls(cell.source) if cell.cell_type == "code" else []
        if calls:
            if "BEGIN SOLUTION" in cell.source:
                raise GradeError(f"{solution_path}: check cell {cell.id} also holds a solution; split the cell")
            check_cells.append(CheckCell(cell.id, cell.source, calls))
            previous[cell.id] = before
        if cell.cell_type == "markdown":
            for answer in _ANSWER.findall(cell.source):
                questions[cell.id] = (title, answer.strip())
                before_answer, _, after_answer = _ANSWER.sub("\0", cell.source).partition("\0")
                framing[cell.id] = (before_answer.strip(), after_answer.strip())
        before = cell.id
    if not check_cells:
        raise GradeError(f"{solution_path}: no code cell calls a chNN.check_* function")
    rebuilds = tuple(getattr(importlib.import_module(f"minipaged.checks.ch{solution_path.name[:2]}"), "REBUILDS", ()))
    given = frozenset(name for cell in nb.cells if cell.cell_type == "code" and not _solution_only(cell)
                      for name in _imported(cell.source))  # a reveal's imports are not the learner's to use
    return Exercise(solution_path, check_cells, previous, questions, framing, rebuilds, given)


def find_exercise(path: Path, exercises: dict[str, Exercise]) -> Exercise:
    """The exercise a submission is for, by its file name's two-digit chapter prefix."""
    chapter = path.name[:2]
    if chapter not in exercises:
        for solution in sorted(SOLUTIONS.glob(f"{chapter}_*.ipynb")) if chapter.isdigit() else []:
            exercises[chapter] = load_exercise(solution)
            break
        else:
            known = ", ".join(sorted(p.name[:2] for p in SOLUTIONS.glob("[0-9][0-9]_*.ipynb")))
            raise GradeError(
                f"{shown(path)}: no exercise for chapter {shown(repr(chapter))}; a submission's name starts with its "
                f"chapter ({known})"
            )
    return exercises[chapter]


def restore(nb, exercise: Exercise) -> list[str]:
    """Put the exercise's check cells back into ``nb`` as the solution has them; return what was changed."""
    import nbformat

    notes, seen, cells = [], set(), []
    pristine = {c.cell_id: c for c in exercise.check_cells}
    for cell in nb.cells:
        if cell.get("id") in pristine:
            if cell.id in seen:
                notes.append(f"a copy of check cell {cell.id} was dropped")
                continue
            seen.add(cell.id)
            if cell.cell_type != "code" or cell.source != pristine[cell.id].source:
                notes.append(f"check cell {cell.id} was edited; its source was restored")
                cell.cell_type, cell.source = "code", pristine[cell.id].source
                cell.setdefault("outputs", []), cell.setdefault("execution_count", None)
        cells.append(cell)
    for check_cell in exercise.check_cells:
        if check_cell.cell_id in seen:
            continue
        notes.append(f"check cell {check_cell.cell_id} ({', '.join(check_cell.names)}) was missing and was put back")
        restored = nbformat.v4.new_code_cell(check_cell.source)
        restored.id = check_cell.cell_id
        ids = [c.get("id") for c in cells]
        after = exercise.previous.get(check_cell.cell_id)
        cells.insert(ids.index(after) + 1 if after in ids else len(cells), restored)
        seen.add(check_cell.cell_id)
    nb.cells = cells
    return notes


def syntax_errors(nb) -> list[str]:
    """A note for every code cell Python cannot parse (IPython ``%`` and ``!`` lines are skipped)."""
    notes = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        try:
            ast.parse(_code(cell.source))
        except SyntaxError as exc:
            notes.append(f"cell {index} (id {cell.get('id')}) has a syntax error at line {exc.lineno}: {exc.msg}")
    return notes


def _solution_only(cell) -> bool:
    """A cell the exercise generator drops (a solution's reveal): never a learner's, never what they are given."""
    return "solution-only" in cell.get("metadata", {}).get("tags", [])


def _imported(source: str) -> list[str]:
    """The dotted names a cell's ``import`` statements bring in (``minipaged.blocks.OutOfBlocks``)."""
    tree = _tree(source)
    if tree is None:
        return []
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


class _Delegation(ast.NodeVisitor):
    """What one cell does with the modules an exercise rebuilds: ``{module: [how, ...]}``.

    ``bindings`` maps a name to the dotted name it stands for (``pc`` -> ``minipaged.prefix_cache``) and carries
    over from cell to cell; ``rebuilds`` are the modules, ``given`` the dotted names the solution itself imports.
    """

    def __init__(self, bindings: dict[str, str], rebuilds: tuple[str, ...], given: frozenset[str]):
        self.bindings, self.rebuilds, self.given = bindings, rebuilds, given
        self.uses: dict[str, list[str]] = {}
        self._inner: set[int] = set()  # attribute nodes that are part of a longer chain

    def _module(self, dotted: str | None) -> str | None:
        """The rebuilt module ``dotted`` is (in), unless the solution imports that very name too."""
        if dotted is None or dotted in self.given:
            return None
        return next((m for m in self.rebuilds if dotted == m or dotted.startswith(m + ".")), None)

    def _use(self, dotted: str | None, how: str) -> None:
        module = self._module(dotted)
        if module is not None and how not in self.uses.setdefault(module, []):
            self.uses[module].append(how)

    def _dotted(self, node) -> str | None:
        if isinstance(node, ast.Name):
            return self.bindings.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self._dotted(node.value)
            return None if base is None else f"{base}.{node.attr}"
        return None

    def visit_Import(self, node):
        for alias in node.names:
            self._use(alias.name, f"import {alias.name}" + (f" as {alias.asname}" if alias.asname else ""))
            head = alias.name.partition(".")[0]
            self.bindings[alias.asname or head] = alias.name if alias.asname else head

    def visit_ImportFrom(self, node):
        for alias in node.names if not node.level and node.module else []:
            dotted = f"{node.module}.{alias.name}"
            self._use(dotted, f"from-import {alias.name}" + (f" as {alias.asname}" if alias.asname else ""))
            self.bindings[alias.asname or alias.name] = dotted

    def visit_ClassDef(self, node):
        for base in node.bases:
            self._inner.add(id(base))  # said as a subclass, not again as an attribute
            self._use(self._dotted(base), f"subclass of {ast.unparse(base)}")
        self.generic_visit(node)

    def visit_Call(self, node):
        target = self._dotted(node.func)
        self._inner.add(id(node.func))  # said as a call, not again as an attribute
        literal = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
        if target in ("importlib.import_module", "builtins.__import__") and isinstance(literal, str):
            self._use(literal, f"{target.rpartition('.')[2]}({literal!r})")
        else:
            self._use(target, f"call of {ast.unparse(node.func)}")
        self.generic_visit(node)

    def visit_Attribute(self, node):
        if isinstance(node.value, ast.Attribute):
            self._inner.add(id(node.value))
        if id(node) not in self._inner:
            self._use(self._dotted(node), f"attribute {ast.unparse(node)}")
        self.generic_visit(node)


def delegations(nb, exercise: Exercise) -> list[str]:
    """A flag for every learner's code cell that imports, subclasses or calls a module the exercise rebuilds.

    The learner's cells are every code cell but the check cells, in order, so an import in one cell is known
    in the next. What the solution's own cells import is allowed
    (chapter 02's ``OutOfBlocks``), except its ``solution-only`` cells' (a reveal that shows the package's
    version), which are skipped as the generator drops them; a cell that does not parse is skipped. Static
    analysis: a flag for a person to look at, which a determined learner can evade, never a verdict.
    """
    if not exercise.rebuilds:
        return []
    check_ids = {c.cell_id for c in exercise.check_cells}
    bindings = {"minipaged": "minipaged", "importlib": "importlib", "__import__": "builtins.__import__"}
    flags = []
    for cell in nb.cells:
        if cell.cell_type != "code" or cell.get("id") in check_ids or _solution_only(cell):
            continue
        tree = _tree(cell.source)
        if tree is None:
            continue
        visitor = _Delegation(bindings, exercise.rebuilds, exercise.given)
        visitor.visit(tree)
        if visitor.uses:
            uses = "; ".join(f"{module} ({', '.join(hows)})" for module, hows in visitor.uses.items())
            flags.append(f"cell {cell.get('id')} uses {uses}")
    return flags


# ---------------------------------------------------------------------------
# Running a notebook in a kernel of its own
# ---------------------------------------------------------------------------


@dataclass
class CellRun:
    """How one cell ended: ``ok``, ``error``, ``timeout`` (interrupted), ``killed`` or ``dead``; its stdout; and,
    past its limit, whether the CPU time ran out (``cpu``) or the wall-clock backstop did."""

    status: str
    stdout: str = ""
    error: str = ""
    cpu: bool = True
    lost_output: bool = False  # its output stopped reaching the grader (a message over MAX_MESSAGE was dropped)
    _out: list[str] = field(default_factory=list, repr=False)
    _size: int = 0

    def take(self, msg: dict) -> bool:
        """Keep what an iopub message of the cell says (the last :data:`MAX_OUTPUT` characters of its stdout, its
        error); True at its ``idle`` status, the cell's end."""
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream" and content.get("name") == "stdout":
            self._out.append(content.get("text", ""))
            self._size += len(self._out[-1])
            while self._size > MAX_OUTPUT and len(self._out) > 1:
                self._size -= len(self._out.pop(0))
        elif kind == "error":
            self.error = f"{content.get('ename')}: {content.get('evalue')}"[:500]
        return kind == "status" and content.get("execution_state") == "idle"

    def ended(self, status: str) -> CellRun:
        self.status, self.stdout = status, "".join(self._out)
        return self


class Kernel:
    """One learner's kernel process: run a cell under a limit; interrupt, then kill, a cell that will not stop.

    A limit of N seconds is N seconds of CPU time on each of the kernel's ``threads``, counted over the kernel's
    whole process tree (:func:`~minipaged.checks.cpu_time.tree_cpu_seconds`), so a busy machine does not fail
    correct work; a cell that waits rather than computes is stopped after :data:`~minipaged.checks.WALL_FACTOR`
    times N seconds of wall-clock time.

    Args:
        cwd: its working directory.
        env: its environment.
        sandbox: where it runs (None: unsandboxed, as the grader's user).
        threads: the threads it may use (its CPU time is divided by them).
    """

    def __init__(self, cwd: Path, env: dict, sandbox: sandboxes.Sandbox | None = None, threads: int = 1):
        self.cwd, self.env, self.sandbox, self.threads = cwd, env, sandbox, threads
        self.km = self.kc = None

    async def start(self) -> None:
        import zmq
        from jupyter_client import AsyncKernelManager

        if self.sandbox is None:
            self.km = AsyncKernelManager(kernel_name="python3")
        else:
            self.sandbox.prepare()
            self.km = sandboxes.kernel_manager(self.sandbox)
        # The kernel's own stdout and stderr (start-up warnings, a crash's last words) are not the grader's.
        await self.km.start_kernel(env=self.env, cwd=str(self.cwd), stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        self.kc = self.km.client()
        # A message bigger than this (one huge print) is dropped by ZeroMQ before the grader reads it, so the
        # grader's memory stays bounded; the channel stays silent after it, and :meth:`run` connects anew.
        self.kc.context.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
        self.kc.start_channels()
        await self.kc.wait_for_ready(timeout=120)

    async def stop(self) -> None:
        if self.kc is not None:
            self.kc.stop_channels()
        if self.km is not None and self.km.has_kernel:
            await self.km.shutdown_kernel(now=True)

    async def run(self, code: str, limit: float, wall: float | None = None) -> CellRun:
        """Execute ``code``; once it has used ``limit`` seconds of CPU time per thread, or run ``wall`` seconds
        (default :data:`~minipaged.checks.WALL_FACTOR` times ``limit``), interrupt it; kill the kernel if it runs
        :data:`KILL_GRACE` more. The cell has ended at its ``idle`` status, or :data:`IOPUB_GRACE` s after its
        shell reply when that status never comes (a message too big for the grader was dropped with it)."""
        msg_id = self.kc.execute(code, store_history=False, allow_stdin=False)
        loop = asyncio.get_running_loop()
        root = getattr(self.km.provisioner, "pid", None)
        used = (lambda: tree_cpu_seconds(root) / self.threads) if root is not None else (lambda: 0.0)
        start, cpu_start = loop.time(), used()
        deadline = start + (WALL_FACTOR * limit if wall is None else wall)
        run, interrupted, replied, sampled, spent = CellRun("ok"), None, None, start, False
        while True:
            now = loop.time()
            if now >= sampled + CPU_SAMPLE:  # /proc is walked a few times a second, not once per message
                sampled, spent = now, used() - cpu_start >= limit
            if interrupted is None and (now >= deadline or spent):
                run.cpu = now < deadline
                await self.km.interrupt_kernel()
                interrupted = now
            if interrupted is not None and now >= interrupted + KILL_GRACE:
                await self.km.shutdown_kernel(now=True)
                return run.ended("killed")
            try:
                msg = await self.kc.get_iopub_msg(timeout=0.25)
            except queue.Empty:
                if not await self.km.is_alive():
                    return run.ended("dead")
                replied = replied or (await self._replied(msg_id, run) and now)
                if replied and now >= replied + IOPUB_GRACE:  # the output channel dropped a message: connect anew
                    self.kc.stop_channels()
                    self.kc = self.km.client()
                    self.kc.start_channels()
                    run.lost_output = True
                    return run.ended("timeout" if interrupted is not None else ("error" if run.error else "ok"))
                continue
            if msg["parent_header"].get("msg_id") == msg_id and run.take(msg):
                return run.ended("timeout" if interrupted is not None else ("error" if run.error else "ok"))

    async def _replied(self, msg_id: str, run: CellRun) -> bool:
        """Whether the shell reply to ``msg_id`` has come (an error it reports goes in ``run``); others are dropped."""
        while True:
            try:
                reply = await self.kc.get_shell_msg(timeout=0)
            except queue.Empty:
                return False
            if reply["parent_header"].get("msg_id") == msg_id:
                content = reply["content"]
                if content.get("status") == "error" and not run.error:
                    run.error = f"{content.get('ename')}: {content.get('evalue')}"[:500]
                return True


def exercise_package(target: Path, exercise: str) -> Path:
    """Copy the package into ``target`` as exercise ``exercise`` is graded on it: no instructor side, no
    solutions, a stub in place of each of that exercise's pieces (the capstone's: those of the exercises it
    assembles, :func:`~minipaged.exercises.graded_pieces`) and the model answer of every other piece."""
    from minipaged.exercises import graded_pieces, stub_package

    package = ROOT / "minipaged"
    shutil.copytree(package, target / "minipaged",
                    ignore=shutil.ignore_patterns("__pycache__", "instructor", "expected.json"))
    if (ROOT / "kernels").is_dir():  # installed as minipaged.kernels
        shutil.copytree(ROOT / "kernels", target / "minipaged" / "kernels",
                        ignore=shutil.ignore_patterns("__pycache__"))
    stub_package(target, graded_pieces(exercise))
    return target


def learner_package(base: Path, folder: Path | None, exercise: str, target: Path) -> Path:
    """``base`` (an :func:`exercise_package`) with the learner's own code for exercise ``exercise``'s pieces.

    Only the files that hold that exercise's pieces are read (``minipaged/blocks.py``, ...), each from where
    the learner's handout has it, and only those pieces (with the classes around them) are taken
    (:func:`minipaged.exercises.lay_pieces`); without any, ``base`` itself is the learner's package.

    Args:
        base: the package graded for this exercise, shared by every learner.
        folder: the learner's submission folder (None: notebooks only).
        exercise: the exercise graded, ``"02"``.
        target: a new folder for this learner's copy.

    Raises :class:`GradeError` when a piece file handed in cannot be read (:func:`read_handed_in`).
    """
    from minipaged.exercises import graded_pieces, lay_pieces, package_holes

    graded = graded_pieces(exercise)
    theirs = {path.relative_to(ROOT): holes for path, holes in package_holes(ROOT).items()
              if folder is not None and any(h.exercise in graded for h in holes)
              and os.path.lexists(folder / path.relative_to(ROOT))}  # fmt: skip
    if not theirs:
        return base
    shutil.copytree(base, target, copy_function=os.link)  # hard links: each piece file is replaced, never written
    for name in theirs:  # the handout's kernels/ is installed as minipaged.kernels
        inside = target / (name if name.parts[0] == "minipaged" else Path("minipaged", name))
        theirs_text = read_handed_in(folder / name).decode("utf-8", errors="replace")
        text = lay_pieces((ROOT / name).read_text(), theirs_text, graded, str(name))
        inside.unlink()
        inside.write_text(text)
    return target


class References:
    """The grading run's cases (public, then hidden from the seed) and the reference transcripts, per check."""

    def __init__(self, seed: int):
        self.seed = seed
        self._cache: dict[str, tuple[list, int, dict]] = {}
        self._lock = threading.Lock()  # notebooks graded at once ask from their own threads

    def get(self, check: Check) -> tuple[list, int, dict]:
        """``(cases, number of public ones, reference transcript)`` for ``check``, computed once per run."""
        with self._lock:
            if check.name not in self._cache:
                side = instructor_side(check.name)
                if side is None:
                    raise RuntimeError("the grader needs minipaged.checks.instructor (an instructor's checkout)")
                public = side.public()
                cases = public + side.hidden(random.Random(f"{self.seed}:{check.name}"))
                self._cache[check.name] = (cases, len(public), reference_transcript(check.name, cases))
            return self._cache[check.name]


def _probe_code(call: CheckCall, marker: str, cases: list) -> str:
    args = "".join(f", {a}" for a in call.args)
    return (f"from minipaged.checks import probe_json as _minipaged_probe\n"
            f"_minipaged_probe({marker!r}, {call.check.name!r}, {json.dumps(cases)!r}{args})")


def _transcript(stdout: str, marker: str):
    """The last transcript the probe printed (decoded JSON, not checked yet), or ``None``; a line JSON cannot
    decode (nested past the parser's depth, or an integer of more than 4,300 digits) is :class:`Unreadable`."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(marker):
            try:
                return json.loads(line[len(marker):])
            except RecursionError:
                return Unreadable("nested too deep to decode")
            except ValueError as exc:
                return Unreadable(f"not JSON: {str(exc)[:100]}")
    return None


@dataclass
class Unreadable:
    """A transcript line the grader could not decode, and why: its check FAILs."""

    why: str


async def execute(nb, exercise: Exercise, kernel: Kernel, limits: Limits, refs: References):
    """Run ``nb`` (already restored) in ``kernel`` (not started yet); judge each check from its probe's transcript."""
    check_of = {c.cell_id: c for c in exercise.check_cells}
    results: dict[str, Outcome] = {}
    notes: list[str] = []
    marker = f"@@minipaged-transcript-{secrets.token_hex(8)}@@"
    stopped = ""  # why the rest of the notebook did not run
    start = time.monotonic()
    try:
        await kernel.start()
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code" or stopped:
                continue
            left = limits.notebook - (time.monotonic() - start)
            if left <= 0:
                stopped = f"did not run: the notebook ran past its {limits.notebook:g} s budget"
                notes.append(f"the notebook timed out after {limits.notebook:g} s; later cells did not run")
                break
            check_cell = check_of.get(cell.get("id"))
            if check_cell is None:
                limit = (limits.check or DEFAULT_TIMEOUT) + CELL_SLACK
                run = await kernel.run(cell.source, limit, min(WALL_FACTOR * limit, left))
                stopped = _after(run, index, timeout_message(limit, run.cpu, kernel.threads), notes)
                continue
            for call in check_cell.calls:
                check = call.check
                limit = limits.check or DEFAULT_TIMEOUT
                cases, public, want = await asyncio.to_thread(refs.get, check)
                run = await kernel.run(_probe_code(call, marker, cases), limit, min(WALL_FACTOR * limit, left))
                timed_out = timeout_message(limit, run.cpu, kernel.threads)
                results[check.name] = await _judged(run, marker, timed_out, check, cases, public, want)
                stopped = _after(run, index, timed_out, notes)
                if stopped:
                    break
    finally:
        await kernel.stop()
    for name in exercise.checks:
        if name not in results:
            results[name] = Outcome(FAIL, stopped or "did not run: its check cell never ran")
    return results, notes


async def _judged(run: CellRun, marker: str, timed_out: str, check: Check, cases: list, public: int,
                  want: dict) -> Outcome:
    """The verdict on a probe's ``run``, judged in the grader's process against the reference's ``want``."""
    if run.status in ("timeout", "killed"):
        return Outcome(FAIL, timed_out)
    if run.status == "dead":
        return Outcome(FAIL, "the kernel died while this check ran")
    got = _transcript(run.stdout, marker)
    if isinstance(got, Unreadable):
        return Outcome(FAIL, f"no usable answer came back (its transcript is {got.why})")
    if got is None:
        why = f": {run.error}" if run.error else ""
        return Outcome(FAIL, f"did not run: its check cell raised before the check{why}")
    verdict: CheckResult = await asyncio.to_thread(check.verdict, cases, got, want, public)
    return Outcome(verdict.status, verdict.message)


def _after(run: CellRun, index: int, timed_out: str, notes: list[str]) -> str:
    """Note how cell ``index`` ended; return why the notebook cannot go on (``""`` when it can).

    Args:
        run: how the cell ended.
        index: the cell's index in the notebook.
        timed_out: what its time limit says when it ran past it (:func:`~minipaged.checks.timeout_message`).
        notes: the notebook's notes, appended to.
    """
    if run.lost_output:
        notes.append(f"cell {index} sent the grader a message of more than {MAX_MESSAGE // 2**20} MiB (one huge "
                     "print?): it was dropped, with what the cell printed after it")
    if run.status == "timeout":
        notes.append(f"cell {index} {timed_out} and was interrupted")
    elif run.status == "killed":
        notes.append(f"cell {index} {timed_out} and did not stop within {KILL_GRACE:g} s of an "
                     "interrupt: the kernel was killed, and the cells after it did not run")
        return f"did not run: the kernel was killed after cell {index} {timed_out}"
    elif run.status == "dead":
        notes.append(f"the kernel died while running cell {index} (os._exit, a crash or out of memory); "
                     "the cells after it did not run")
        return f"did not run: the kernel died in cell {index}"
    return ""


def _answers(nb, exercise: Exercise) -> dict[str, str]:
    answers = {}
    for cell in nb.cells:
        if cell.get("id") in exercise.questions:
            answer = cell.source.strip()
            for around in exercise.framing[cell.id]:  # keep only what the learner wrote
                answer = answer.replace(around, "") if around else answer
            answers[cell.id] = answer.strip()
    return answers


async def grade_notebook(submission: Submission, exercise: Exercise, limits: Limits, refs: References,
                         package: Path, uid: int = sandboxes.FIRST_UID) -> Graded:
    """Restore, execute and grade one submission, in a working directory of its own.

    Args:
        submission: the notebook and whose it is.
        exercise: its exercise.
        limits: the run's settings; with ``limits.confinement`` the kernel runs in a sandbox.
        refs: the run's cases and reference transcripts.
        package: the learner's package copy for this exercise.
        uid: the sandboxed kernel's uid, which no kernel running at the same time has.
    """
    from minipaged.pretrained import cache_root

    nb = submission.nb if submission.nb is not None else _read(submission.path)
    notes = syntax_errors(nb) + restore(nb, exercise)
    with tempfile.TemporaryDirectory(prefix="minipaged-learner-") as tmp:
        cwd = Path(tmp, "work")
        cwd.mkdir()
        if limits.confinement is None:
            threads = str(limits.threads)
            env = dict(os.environ, PYTHONPATH=str(package), OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
            kernel = Kernel(cwd, env, threads=limits.threads)
        else:
            (Path(tmp) / "run").mkdir()
            cache = cache_root() if cache_root().is_dir() else None
            sandbox = sandboxes.Sandbox(package, cwd, Path(tmp, "run"), uid, limits.confinement, cache)
            kernel = Kernel(cwd, sandbox.env(limits.threads), sandbox, limits.threads)
        results, run_notes = await execute(nb, exercise, kernel, limits, refs)
    return Graded(submission.learner, submission.path, exercise, results, notes + run_notes, _answers(nb, exercise),
                  delegations(nb, exercise))


def _not_graded(submission: Submission, exercise: Exercise, status: str, note: str) -> Graded:
    """A notebook's row when it was not graded: each check ``status`` (:data:`FAIL` when the grader failed on it,
    :data:`UNGRADED` when its learner's files could not be read), with ``note`` saying why."""
    why = "not graded: the grader failed on this notebook" if status == FAIL else f"could not be graded: {note}"
    results = {name: Outcome(status, why) for name in exercise.checks}
    return Graded(submission.learner, submission.path, exercise, results, [note])


async def grade_all(submissions: list[Submission], exercises: dict[str, Exercise], limits: Limits, jobs: int):
    """Grade every submission, ``jobs`` at a time: ``(graded, the notebooks the grader failed on, errors)``.

    A learner's piece file that cannot be read makes their notebook of that exercise a row of :data:`UNGRADED`
    checks and an error; an internal failure on one notebook is noted; either way the batch goes on."""
    refs = References(limits.seed)
    uids: asyncio.Queue[int] = asyncio.Queue()  # one uid per kernel running at once (RLIMIT_NPROC counts per uid)
    for slot in range(jobs):
        uids.put_nowait(sandboxes.FIRST_UID + slot)
    crashed, unread = [], []
    with tempfile.TemporaryDirectory(prefix="minipaged-handout-") as tmp:
        bases, packages = {}, {}
        for s in submissions:
            number = s.path.name[:2]
            if number not in bases:
                bases[number] = exercise_package(Path(tmp) / "exercises" / number, number)
            if (s.learner, number) not in packages:
                try:
                    packages[s.learner, number] = learner_package(bases[number], s.folder, number,
                                                                  Path(tmp) / "learners" / str(len(packages)))
                except GradeError as exc:
                    packages[s.learner, number] = exc

        async def one(submission: Submission) -> Graded:
            exercise = exercises[submission.path.name[:2]]
            package = packages[submission.learner, submission.path.name[:2]]
            if isinstance(package, GradeError):
                unread.append(str(package))
                return _not_graded(submission, exercise, UNGRADED, str(package))
            uid = await uids.get()
            try:
                return await grade_notebook(submission, exercise, limits, refs, package, uid)
            except Exception as exc:  # a grader bug: say so, keep grading the others
                traceback.print_exc()
                crashed.append(submission.path)
                return _not_graded(submission, exercise, FAIL, f"the grader failed: {type(exc).__name__}: {exc}")
            finally:
                uids.put_nowait(uid)

        graded = await asyncio.gather(*(one(s) for s in submissions))
    return list(graded), crashed, unread


# ---------------------------------------------------------------------------
# Inputs and outputs
# ---------------------------------------------------------------------------


def collect(paths: list[Path]) -> tuple[list[Submission], list[str]]:
    """The notebooks named by ``paths`` and whose they are; an error for each path that cannot be graded.

    Under a folder the learner is the first folder below it; a notebook named directly belongs to its
    parent folder. Two notebooks of one learner for one chapter are an error naming both, and neither is graded.
    """
    found, errors = [], []
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            notebooks = sorted(_notebooks_under(path, errors))
            if not notebooks:
                errors.append(f"{path}: a folder with no notebook in it")
            for notebook in notebooks:
                parts = notebook.relative_to(path).parts
                if len(parts) < 2:
                    errors.append(f"{shown(notebook)}: a notebook directly in {shown(path)}; put it in a folder "
                                  "named after its learner")
                else:
                    found.append(Submission(parts[0], notebook, path / parts[0]))
        elif os.path.lexists(path):
            found.append(Submission(path.absolute().parent.name, path, path.absolute().parent))
        else:
            errors.append(f"{shown(path)}: no such file or folder")
    by_key: dict[tuple[str, str], list[Submission]] = {}
    for submission in found:
        by_key.setdefault((submission.learner, submission.path.name[:2]), []).append(submission)
    kept = []
    for (learner, chapter), group in by_key.items():
        if len(group) > 1:
            errors.append(f"learner {shown(repr(learner))} has {len(group)} notebooks for chapter {shown(chapter)}: "
                          + ", ".join(shown(s.path) for s in group) + "; keep one")
        else:
            kept.append(group[0])
    return sorted(kept, key=lambda s: (s.learner, s.path.name)), errors


def _notebooks_under(root: Path, errors: list[str]) -> list[Path]:
    """Every entry named ``*.ipynb`` under ``root`` that is not a folder, whatever it is (a FIFO or a link is
    refused when it is read, as its learner's row); links to folders are not followed, and are an error."""
    found = []
    for folder, subfolders, files in os.walk(root):
        if ".ipynb_checkpoints" in Path(folder).parts:
            continue
        for name in subfolders:
            if os.path.islink(os.path.join(folder, name)):
                errors.append(f"{shown(os.path.join(folder, name))}: a symbolic link to a folder, not followed")
        found += [Path(folder, name) for name in files if name.endswith(".ipynb")]
    return found


def screen(submissions: list[Submission], exercises: dict[str, Exercise]):
    """Read each submission's notebook once: ``(gradable, not gradable, errors)``.

    A notebook whose chapter has an exercise but which cannot be read (not a regular file, too big, not a
    notebook) is a row of its learner's with every check :data:`UNGRADED`; one for no known chapter is an error.
    """
    gradable, ungraded, errors = [], [], []
    for submission in submissions:
        try:
            exercise = find_exercise(submission.path, exercises)
        except GradeError as exc:
            errors.append(str(exc))
            continue
        try:
            submission.nb = _read(submission.path)
            gradable.append(submission)
        except GradeError as exc:
            errors.append(str(exc))
            ungraded.append(_not_graded(submission, exercise, UNGRADED, str(exc)))
    return gradable, ungraded, errors


_SHORT = {PASS: "PASS", FAIL: "FAIL", TODO: "TODO", MISSING: "MISSING", UNGRADED: "UNGRADED"}


def gradebook(graded: list[Graded], seed: int) -> dict:
    """One row per learner, one column per check, plus messages, notes, flags and the free-text answers.

    ``passed`` and ``total`` count the checks that are marked; a formative check's verdict is in its column and
    in ``formative_passed``, not in the mark."""
    exercises = sorted({g.exercise.path: g.exercise for g in graded}.values(), key=lambda e: e.path.name)
    columns = [name for e in exercises for name in e.checks]
    formative = [name for e in exercises for name in e.formative]
    counted = [name for name in columns if name not in formative]
    learners: dict[str, dict] = {}
    for g in sorted(graded, key=lambda g: (g.learner, g.path.name)):
        row = learners.setdefault(g.learner, {"checks": {}, "notes": {}, "flags": {}, "answers": {}})
        row["checks"].update({n: {"status": o.status, "message": o.message} for n, o in g.results.items()})
        if g.notes:
            row["notes"][g.path.name] = g.notes
        if g.flags:
            row["flags"][g.path.name] = g.flags
        row["answers"].update(g.answers)
    for row in learners.values():
        for name in columns:
            row["checks"].setdefault(name, {"status": MISSING, "message": "notebook not submitted"})
        row["passed"] = sum(row["checks"][n]["status"] == PASS for n in counted)
        row["total"] = len(counted)
        row["formative_passed"] = sum(row["checks"][n]["status"] == PASS for n in formative)
    questions = {
        cell_id: {"exercise": e.path.name, "question": title, "model_answer": answer}
        for e in exercises
        for cell_id, (title, answer) in e.questions.items()
    }
    return {"seed": seed, "checks": columns, "formative": formative, "learners": learners, "questions": questions}


def csv_cell(value) -> str:
    """A CSV cell a spreadsheet shows as text: one starting with ``=``, ``+``, ``-``, ``@``, tab or CR gets a ``'``."""
    text = str(value)
    return "'" + text if text.startswith(_CSV_FORMULA) else text


def write_gradebook(book: dict, prefix: Path) -> tuple[Path, Path]:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = prefix.with_suffix(".csv"), prefix.with_suffix(".json")
    with open(csv_path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["learner", *(_heading(book, name) for name in book["checks"]), "passed", "total", "flags"])
        for learner, row in book["learners"].items():
            statuses = [row["checks"][n]["status"] for n in book["checks"]]
            flags = "; ".join(flag for notebook in row["flags"].values() for flag in notebook)
            writer.writerow([csv_cell(shown(v)) for v in (learner, *statuses, row["passed"], row["total"], flags)])
    json_path.write_text(json.dumps(book, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return csv_path, json_path


def _heading(book: dict, name: str) -> str:
    return f"{name} (formative)" if name in book["formative"] else name


def format_table(book: dict) -> str:
    header = ["learner", *(_heading(book, name) for name in book["checks"]), "passed"]
    rows = [
        [shown(learner), *(_SHORT[row["checks"][n]["status"]] for n in book["checks"]),
         f"{row['passed']}/{row['total']}"]
        for learner, row in book["learners"].items()
    ]
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [header] + rows]
    if book["formative"]:
        lines.append("(formative): measured inside the learner's kernel, whose code could falsify it; reported, "
                     "not counted in passed")
    return "\n".join(lines)


def format_details(book: dict, instructor: bool) -> str:
    """The gradebook's messages, notes, flags and (``instructor``) answers, a line each; whatever a learner could
    have written (a name, a message built from their code's output, an answer) is :func:`shown` escaped."""
    lines = []
    for learner, row in book["learners"].items():
        for name in book["checks"]:
            outcome = row["checks"][name]
            if outcome["status"] not in (PASS, MISSING, UNGRADED):  # an UNGRADED notebook's note says why
                lines.append(f"{shown(learner)} · {name}: {outcome['status']}: {shown(outcome['message'])}")
        for notebook, notes in row["notes"].items():
            lines += [f"{shown(learner)} · {shown(notebook)}: {shown(note)}" for note in notes]
        for notebook, flags in row["flags"].items():
            lines += [f"{shown(learner)} · {shown(notebook)}: FLAG: {shown(flag)}" for flag in flags]
    if instructor:
        for cell_id, q in book["questions"].items():
            lines.append(f"\n{q['exercise']} · {q['question']}\n  model answer: {q['model_answer']}")
            for learner, row in book["learners"].items():
                answer = row["answers"].get(cell_id, "(not submitted)")
                answer = "(not answered)" if _ANSWER_HERE in answer else answer
                lines.append(f"  {shown(learner)}: {shown(answer)}")
    return "\n".join(lines)


def seconds(text: str) -> float:
    """An argparse type: a positive, finite number of seconds; fractions allowed."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a time limit must be positive and finite")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minipaged.checks", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("grade", help="restore the check cells, execute the notebooks and write a gradebook")
    g.add_argument("paths", nargs="+", type=Path, help="notebooks, or folders of submissions/<learner>/NN_x.ipynb")
    g.add_argument("--gradebook", type=Path, default=Path("gradebook"), help="writes PREFIX.csv and PREFIX.json")
    g.add_argument("--check-timeout", type=seconds, default=None,
                   help=f"seconds per check (default: each check's own, {DEFAULT_TIMEOUT:g} s unless it says)")
    g.add_argument("--notebook-timeout", type=seconds, default=600.0, help="seconds per notebook (default 600)")
    g.add_argument("--jobs", type=positive_int, default=1, help="notebooks graded at once (default 1)")
    g.add_argument("--seed", type=int, default=None, help="the hidden cases' seed (default: a fresh random one)")
    g.add_argument("--instructor", action="store_true", help="also print the model answers beside the learners'")
    g.add_argument("--unsandboxed", action="store_true",
                   help="run learners' code without the sandbox, as your user, with your files (not for grading)")
    return parser


def _sandbox_ready(unsandboxed: bool) -> bool:
    """Whether grading may start: the sandbox is there, or the instructor waived it (a warning, then True)."""
    if unsandboxed:
        print("warning: --unsandboxed: learners' code runs as your user and can read and change your files, "
              "signal your processes and reach the network", file=sys.stderr)
        return True
    try:
        sandboxes.require()
    except sandboxes.SandboxUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not _sandbox_ready(args.unsandboxed):
        return 2
    submissions, errors = collect(args.paths)
    exercises: dict[str, Exercise] = {}
    gradable, ungraded, unread = screen(submissions, exercises)
    errors += unread
    seed = secrets.randbits(64) if args.seed is None else args.seed
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    confinement = None if args.unsandboxed else sandboxes.Confinement.for_run(args.notebook_timeout, threads, args.jobs)
    limits = Limits(args.check_timeout, args.notebook_timeout, seed, threads, confinement)
    graded, crashed, unread = [], [], []
    if gradable:
        graded, crashed, unread = asyncio.run(grade_all(gradable, exercises, limits, args.jobs))
    copies.add_flags(graded, {s.learner: s.folder for s in gradable})
    graded += ungraded
    errors += unread
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    if not graded:
        print("error: nothing to grade", file=sys.stderr)
        return 2
    book = gradebook(graded, seed)
    csv_path, json_path = write_gradebook(book, args.gradebook)
    print(format_table(book))
    details = format_details(book, args.instructor)
    if details:
        print("\n" + details)
    print(f"\ngradebook: {csv_path} and {json_path}")
    if crashed:
        print(f"error: the grader failed on {len(crashed)} notebook(s); see the tracebacks above", file=sys.stderr)
        return 3
    if errors:
        return 2
    return 0 if all(row["passed"] == row["total"] for row in book["learners"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
