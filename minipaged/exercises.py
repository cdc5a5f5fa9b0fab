"""Generate ``exercises/`` from ``solutions/`` so the two never drift apart.

    python -m minipaged.exercises              # regenerate exercises/*.ipynb
    python -m minipaged.exercises --check      # exit 1 if exercises/ is stale (CI)
    python -m minipaged.exercises release DIR  # write the learners' handout into DIR
    python -m minipaged.exercises reveal 08 DIR  # fill exercise 08's pieces of the handout in DIR
    python -m minipaged.exercises workspace DIR  # a learner's workspace: the handout and its own environment

In a solution notebook the learner's part of a code cell sits between two
markers; the optional text after ``BEGIN SOLUTION`` names the task and gives
the hint that the stub will carry::

    def blocks_needed(num_tokens, block_size):
        ### BEGIN SOLUTION (Task 1.1) hint: a partly filled block is still a block
        return (num_tokens + block_size - 1) // block_size
        ### END SOLUTION

becomes::

    def blocks_needed(num_tokens, block_size):
        # Task 1.1: your code here
        raise NotImplementedError("Task 1.1 is not implemented yet. Hint: a partly filled block is still a block")

Markdown answers use ``<!-- BEGIN SOLUTION -->`` / ``<!-- END SOLUTION -->``.

Cells tagged ``solution-only`` are dropped. Outputs are cleared, because the
learner runs the notebook; the checks then print "not implemented yet".

``release DIR`` writes what learners get (:data:`HANDOUT`): the chapters, the exercises and the
package, without ``solutions/``, the tests, or the checks' instructor side
(``minipaged/checks/instructor/``: reference answers and hidden cases). In their place it writes
``minipaged/checks/expected.json``, each check's public cases and the reference's transcript on
them, so that a learner's checks still PASS and FAIL with the same messages.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import json
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS, EXERCISES = ROOT / "solutions", ROOT / "exercises"

_BEGIN = re.compile(r"^(?P<indent>\s*)### BEGIN SOLUTION\s*(?:\((?P<task>[^)]*)\))?\s*(?:hint:\s*(?P<hint>.*?))?\s*$")
_END = re.compile(r"^\s*### END SOLUTION\s*$")
_MD_SOLUTION = re.compile(r"<!-- BEGIN SOLUTION -->.*?<!-- END SOLUTION -->", re.S)

BANNER = (
    "> **Exercise version.** Generated from `solutions/{name}` by `python -m minipaged.exercises`. "
    "Where a task names a package file, replace each stub in it (an import and a `raise PieceNotBuilt(...)`) with "
    "your code; where a cell of this notebook has a `raise NotImplementedError(...)`, replace that. Then run the "
    "check cells."
)


# What a learner's handout carries, relative to the repository root.
HANDOUT = ("README.md", "GLOSSARY.md", "pyproject.toml", "constraints.txt", "environment.yml", "Makefile",
           "kernels", "minipaged", "notebooks", "exercises")
_LEFT_OUT = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints", "instructor", "expected.json")


class MarkerError(ValueError):
    pass


class ReleaseError(ValueError):
    """The handout cannot be written where it was asked for."""


def first_hint(task: str) -> str:
    """The first staged hint of ``"Task N.M"`` from ``minipaged.checks.chNN.HINTS``, or ``""``.

    A stub carries only this one; ``hint("N.M", level)`` gives the later ones on request.
    """
    match = re.fullmatch(r"Task (\d+)\.(\d+)", task)
    if not match:
        return ""
    try:
        module = importlib.import_module(f"minipaged.checks.ch{int(match[1]):02d}")
    except ModuleNotFoundError:
        return ""
    hints = getattr(module, "HINTS", {}).get(f"{int(match[1])}.{match[2]}", [])
    return hints[0] if hints else ""


# ----------------------------------------------------------------- the package's holes (minipaged.pieces)

_PIECE_BEGIN = re.compile(r"^(?P<indent>\s*)### BEGIN SOLUTION "
                          r"\(Exercise (?P<exercise>\d\d), Task (?P<task>\d+\.\d+)\)\s*$")


@dataclass(frozen=True)
class Hole:
    """One marked body of a package file: lines ``start`` to ``end`` (1-based, markers included)."""

    exercise: str
    task: str
    piece: str  # the enclosing function, with its class: "NgramSpeculator.schedule_drafts"
    indent: str
    start: int
    end: int
    body: tuple[str, ...]  # the lines between the markers


def find_holes(source: str, where: str) -> list[Hole]:
    """The marked bodies of a Python file's source, in order; a :class:`MarkerError` naming ``where`` for bad ones.

    Args:
        source: the file's text.
        where: the file, for messages.
    """
    lines, holes, begin = source.splitlines(), [], None
    for number, line in enumerate(lines, 1):
        if _PIECE_BEGIN.match(line):
            if begin is not None:
                raise MarkerError(f"{where}, line {number}: BEGIN SOLUTION inside another solution")
            begin = number
        elif _END.match(line):
            if begin is None:
                raise MarkerError(f"{where}, line {number}: END SOLUTION without BEGIN")
            marker = _PIECE_BEGIN.match(lines[begin - 1])
            holes.append(Hole(marker["exercise"], marker["task"], _enclosing(source, begin, where), marker["indent"],
                              begin, number, tuple(lines[begin : number - 1])))  # fmt: skip
            begin = None
    if begin is not None:
        raise MarkerError(f"{where}, line {begin}: BEGIN SOLUTION is never closed")
    return holes


def _enclosing(source: str, line: int, where: str) -> str:
    """The qualified name of the innermost function around ``line``."""
    found = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.ClassDef)) and child.lineno <= line <= child.end_lineno:
                name = prefix + child.name
                if isinstance(child, ast.FunctionDef):
                    found.append(name)
                visit(child, name + ".")

    visit(ast.parse(source), "")
    if not found:
        raise MarkerError(f"{where}, line {line}: a BEGIN SOLUTION marker must sit inside a function")
    return found[-1]


def stub_source(source: str, path: str, exercises: Collection[str] | None = None) -> str:
    """``source`` with each marked body replaced by a stub that raises :class:`~minipaged.pieces.PieceNotBuilt`.

    Args:
        source: a package file's text.
        path: the file relative to the handout's root (``"minipaged/speculative.py"``): the stubs name it.
        exercises: stub only these exercises' pieces (``("02",)``); None: every piece.
    """
    holes = [h for h in find_holes(source, path) if exercises is None or h.exercise in exercises]
    if not holes:
        return source
    lines = source.splitlines()
    for hole in reversed(holes):  # the import stays with its raise: once both go, nothing unused is left behind
        lines[hole.start - 1 : hole.end] = [
            f"{hole.indent}# Exercise {hole.exercise}, Task {hole.task}: your code here, "
            "in place of the two lines below",
            f"{hole.indent}from minipaged.pieces import PieceNotBuilt",
            f"{hole.indent}raise PieceNotBuilt({hole.exercise!r}, {hole.task!r}, {hole.piece!r}, {path!r})",
        ]
    return "\n".join(lines) + ("\n" if source.endswith("\n") else "")


def package_holes(root: Path) -> dict[Path, list[Hole]]:
    """Every package file under ``root`` (``minipaged/``, ``kernels/``) that has holes, and its holes."""
    found = {}
    for folder in ("minipaged", "kernels"):
        for path in sorted((root / folder).rglob("*.py")):
            text = path.read_text()
            if any(_PIECE_BEGIN.match(line) for line in text.splitlines()):
                found[path] = find_holes(text, str(path.relative_to(root)))
    return found


def stub_code(source: str, where: str) -> str:
    """Replace every marked solution block in one code cell by a stub."""
    out, inside = [], False
    for lineno, line in enumerate(source.splitlines(), 1):
        begin = _BEGIN.match(line)
        if begin:
            if inside:
                raise MarkerError(f"{where}, line {lineno}: BEGIN SOLUTION inside another solution")
            inside = True
            indent, task = begin["indent"], begin["task"] or "This exercise"
            message = f"{task} is not implemented yet."
            stub_hint = begin["hint"] or first_hint(task)
            if stub_hint:
                message += f" Hint: {stub_hint}"
            out.append(f"{indent}# {task}: your code here")
            out.append(f"{indent}raise NotImplementedError({message!r})")
        elif _END.match(line):
            if not inside:
                raise MarkerError(f"{where}, line {lineno}: END SOLUTION without BEGIN")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise MarkerError(f"{where}: BEGIN SOLUTION is never closed")
    return "\n".join(out)


def make_exercise(solution: nbformat.NotebookNode, name: str) -> nbformat.NotebookNode:
    nb = nbformat.from_dict(solution)  # deep copy
    cells, marked = [], 0
    for i, cell in enumerate(nb.cells):
        if "solution-only" in cell.get("metadata", {}).get("tags", []):
            continue
        if cell.cell_type == "code":
            if "### BEGIN SOLUTION" in cell.source:
                marked += 1
                cell.source = stub_code(cell.source, f"{name}, cell {i}")
            cell.outputs, cell.execution_count = [], None
        elif cell.cell_type == "markdown" and "<!-- BEGIN SOLUTION -->" in cell.source:
            marked += 1
            cell.source = _MD_SOLUTION.sub("*Your answer here.*", cell.source)
        cells.append(cell)
    if not marked:
        raise MarkerError(f"{name} has no ### BEGIN SOLUTION block: nothing for the learner to do")
    banner = nbformat.v4.new_markdown_cell(BANNER.format(name=name))
    banner.id = "exercise-banner"
    nb.cells = [banner] + cells
    return nb


def render(nb: nbformat.NotebookNode) -> str:
    return nbformat.writes(nb) + "\n"


def expected_exercises() -> dict[Path, str]:
    """Every exercise file's expected text, keyed by its path."""
    result = {}
    for path in sorted(SOLUTIONS.glob("*.ipynb")):
        solution = nbformat.read(path, as_version=4)
        result[EXERCISES / path.name] = render(make_exercise(solution, path.name))
    return result


def stale_exercises() -> list[str]:
    """Problems that ``--check`` reports: missing, outdated or orphaned exercises."""
    expected = expected_exercises()
    problems = []
    for path, text in expected.items():
        if not path.exists():
            problems.append(f"missing: {path.relative_to(ROOT)}")
        elif path.read_text() != text:
            problems.append(f"out of date: {path.relative_to(ROOT)}")
    for path in sorted(EXERCISES.glob("*.ipynb")):
        if path not in expected:
            problems.append(f"no solution for: {path.relative_to(ROOT)}")
    return problems


def expected_transcripts() -> dict:
    """Every check's public cases and the reference's transcript on them: a handout's ``expected.json``."""
    from minipaged.checks import Check, expected

    entries = {}
    for path in sorted((ROOT / "minipaged" / "checks").glob("ch[0-9][0-9].py")):
        module = importlib.import_module(f"minipaged.checks.{path.stem}")
        for value in vars(module).values():
            if isinstance(value, Check) and value.name not in entries:
                cases, want = expected(value.name)
                entries[value.name] = {"cases": cases, "want": want}
    return entries


def check_release_target(target: Path) -> None:
    """A :class:`ReleaseError` unless ``target`` is a new or empty folder outside everything the handout copies."""
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ReleaseError(f"{target}: exists and is not an empty folder; release into a new one")
    where = target.resolve()
    for name in HANDOUT:
        source = (ROOT / name).resolve()
        if where == source or source in where.parents:
            raise ReleaseError(f"{target}: inside {name}/, which the handout copies (it would copy itself); "
                               "release into a folder outside it")  # fmt: skip


def release(target: Path) -> list[Path]:
    """Write the learners' handout into ``target`` (new or empty); return the top-level paths written.

    The package's pieces that exercises build (:mod:`minipaged.pieces`) are holes in it: each marked
    body becomes a stub that raises :class:`~minipaged.pieces.PieceNotBuilt`.

    Args:
        target: a folder that does not exist yet, or an empty one, outside the folders the handout copies.
    """
    check_release_target(target)
    try:
        target.mkdir(parents=True, exist_ok=True)  # before anything slow: an unwritable target says so at once
    except OSError as exc:
        raise ReleaseError(f"{target}: cannot write the handout there ({exc.strerror or exc})") from None
    stale = stale_exercises()
    if stale:
        raise ReleaseError(f"exercises/ is out of sync with solutions/ ({stale[0]}): "
                           "run `python -m minipaged.exercises`")
    entries = expected_transcripts()
    try:
        written = _copy_handout(target)
    except OSError as exc:
        raise ReleaseError(f"{target}: cannot write the handout there ({exc.strerror or exc})") from None
    pyproject = target / "pyproject.toml"
    if pyproject.exists():  # the handout has no instructor package to install
        pyproject.write_text(pyproject.read_text().replace('"minipaged.checks.instructor", ', ""))
    checks = target / "minipaged" / "checks" / "expected.json"
    checks.write_text(json.dumps(entries, ensure_ascii=False) + "\n", encoding="utf-8")
    stub_package(target)
    return written


def stub_package(root: Path, exercises: Collection[str] | None = None) -> list[Path]:
    """Replace every piece (or only ``exercises``') in the package under ``root`` by its stub; return the files changed.

    Args:
        root: the folder that holds ``minipaged/`` (and ``kernels/``).
        exercises: as :func:`stub_source` takes them.
    """
    changed = []
    for path, holes in package_holes(root).items():
        if exercises is None or any(h.exercise in exercises for h in holes):
            text = path.read_text()
            path.unlink()  # a new file: ``root`` may be a copy made of hard links
            path.write_text(stub_source(text, str(path.relative_to(root)), exercises))
            changed.append(path)
    return changed


# The exercises whose pieces an exercise is graded on, the learner's own: the capstone assembles four.
ASSEMBLES = {"09": ("02", "03", "05", "06")}


def graded_pieces(exercise: str) -> tuple[str, ...]:
    """The exercises whose pieces grading ``exercise`` takes from the learner (the model answer's for the rest)."""
    return ASSEMBLES.get(exercise, (exercise,))


def lay_pieces(reference: str, theirs: str, exercises: Collection[str], where: str) -> str:
    """``reference`` (a piece file's text) with ``exercises``' pieces taken from a learner's copy, ``theirs``.

    A file whose pieces are all theirs to build is taken whole, as is one that does not parse (its error
    is the learner's). Otherwise each top-level class or function that holds one of those pieces is the
    learner's, with whatever helpers the learner gave it; the rest stays the reference's, and so does each
    method of such a class that another exercise builds (``BlockTable``'s exercise 02 methods when exercise
    06's ``_copy_on_write`` is graded), so one exercise's mistake never fails another's checks.

    Args:
        reference: the repository's text of the file.
        theirs: the learner's text of it.
        exercises: the exercises whose pieces are taken (:func:`graded_pieces`), ``("02",)``.
        where: the file, for messages.
    """
    holes = find_holes(reference, where)
    if all(h.exercise in exercises for h in holes):
        return theirs
    try:
        mine = {node.name: node for node in ast.parse(theirs).body if hasattr(node, "name")}
    except SyntaxError:
        return theirs
    tops = dict.fromkeys(h.piece.split(".")[0] for h in holes if h.exercise in exercises)
    text = reference
    for name in tops:
        if name in mine:
            node = mine[name]
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            text = _replace_function(text, name, theirs.splitlines()[first - 1 : node.end_lineno], where)
    others = dict.fromkeys(h.piece for h in holes if h.exercise not in exercises and "." in h.piece
                           and h.piece.split(".")[0] in tops and h.piece.split(".")[0] in mine)  # fmt: skip
    for piece in others:  # another exercise's method in a class taken from the learner: the model answer's
        with contextlib.suppress(ReleaseError):  # one the learner deleted stays deleted
            text = _replace_function(text, piece, _function_source(reference, piece), where)
    return text


def piece_files() -> list[str]:
    """The package files that hold pieces, relative to the repository (what a learner hands in with the notebooks)."""
    return [str(path.relative_to(ROOT)) for path in package_holes(ROOT)]


def _copy_handout(target: Path) -> list[Path]:
    """Copy :data:`HANDOUT` into ``target`` (made if need be); return the top-level paths written."""
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for name in HANDOUT:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, target / name, ignore=_LEFT_OUT)
        elif source.exists():
            shutil.copy2(source, target / name)
        else:
            continue
        written.append(target / name)
    return written


def workspace(target: Path) -> bool:
    """A learner's workspace in ``target``: a handout (:func:`release`) with an environment of its own.

    The environment, ``target/.venv``, sees this environment's third-party packages (torch, Jupyter,
    ...) and has the handout's own package installed, editable: never the repository's, whose
    pieces are the answers. An existing workspace keeps everything in it (the learner's work);
    only a missing environment is made. Returns True when the handout was written now.

    Args:
        target: the workspace's folder (``../minipaged-workspace`` from ``make learner``).
    """
    made = not (target / "minipaged").is_dir()
    if made:
        release(target)
    python = target / ".venv" / "bin" / "python"
    if not python.exists():
        venv.EnvBuilder(with_pip=False, symlinks=True).create(target / ".venv")
        site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, check=True).stdout.strip())  # fmt: skip
        # A plain path, not a site folder: its .pth files (this repository's editable install) do not run.
        (site / "minipaged-workspace-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                               "--no-build-isolation", "-e", str(target.resolve())], capture_output=True, text=True)
        if done.returncode:  # the build's own warnings are noise when it works
            raise ReleaseError(f"{target}: installing the handout into .venv failed: {done.stderr[-500:]}")
        _jupyter_commands(python)
    return made


def _jupyter_commands(python: Path) -> None:
    """``jupyter``, ``jupyter-lab``, ``jupyter-nbconvert``, ... in the workspace's ``bin``, each run by the workspace's
    own ``python`` (this environment's would import the repository's package, the answers): ``jupyter nbconvert``
    finds its subcommand there, and a kernel it starts is the workspace's."""
    from importlib.metadata import entry_points

    for point in entry_points(group="console_scripts"):
        if point.name == "jupyter" or point.name.startswith("jupyter-"):
            module, _, attr = point.value.partition(":")
            script = python.parent / point.name
            script.write_text(f"#!{python}\nimport sys\nfrom importlib import import_module\n\n"
                              f"main = import_module({module!r})\nfor part in {attr!r}.split('.'):\n"
                              "    main = getattr(main, part)\nsys.exit(main())\n")
            script.chmod(0o755)


REVEALED = Path(".minipaged") / "revealed.json"  # in a workspace: what ``reveal`` filled in, and when


def reveal(exercise: str, workspace: Path) -> list[str]:
    """Fill exercise ``exercise``'s pieces in ``workspace`` (a handout) with the model answers; return their names.

    Each piece's whole function is replaced by the repository's, whatever the workspace holds there
    (the stub, or the learner's attempt), and the workspace's :data:`REVEALED` records it.

    Args:
        exercise: the exercise, ``"08"`` (or ``"8"``).
        workspace: the handout's folder.
    """
    number = f"{int(exercise):02d}" if str(exercise).isdigit() else str(exercise)
    filled = []
    for path, holes in package_holes(ROOT).items():
        wanted = [h for h in holes if h.exercise == number]
        if not wanted:
            continue
        theirs = workspace / path.relative_to(ROOT)
        if not theirs.exists():
            raise ReleaseError(f"{workspace}: no {path.relative_to(ROOT)}; is it a handout?")
        text = theirs.read_text()
        for piece in dict.fromkeys(h.piece for h in wanted):
            text = _replace_function(text, piece, _function_source(path.read_text(), piece), str(theirs))
            filled.append(piece)
        theirs.write_text(text)
    if not filled:
        raise ReleaseError(f"exercise {number} builds no piece of the package")
    record = workspace / REVEALED
    record.parent.mkdir(exist_ok=True)
    log = json.loads(record.read_text()) if record.exists() else []
    log.append({"exercise": number, "pieces": filled, "when": datetime.now(timezone.utc).isoformat(timespec="seconds")})
    record.write_text(json.dumps(log, indent=1) + "\n")
    return filled


def _function_node(source: str, piece: str, where: str):
    """The ``ast`` node of function ``piece`` (``"Class.method"`` or ``"function"``) in ``source``."""
    node = ast.parse(source)
    for name in piece.split("."):
        found = [c for c in node.body if isinstance(c, (ast.ClassDef, ast.FunctionDef)) and c.name == name]
        if not found:
            raise ReleaseError(f"{where}: no {piece} to fill in")
        node = found[0]
    return node


def _function_source(source: str, piece: str) -> list[str]:
    """Function ``piece``'s lines in the repository's ``source``, decorators included, markers left out."""
    node = _function_node(source, piece, piece)
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    lines = source.splitlines()[first - 1 : node.end_lineno]
    return [line for line in lines if not (_PIECE_BEGIN.match(line) or _END.match(line))]


def _replace_function(source: str, piece: str, lines: list[str], where: str) -> str:
    """``source`` with function ``piece`` (decorators included) replaced by ``lines``."""
    node = _function_node(source, piece, where)
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    old = source.splitlines()
    return "\n".join(old[: first - 1] + lines + old[node.end_lineno :]) + ("\n" if source.endswith("\n") else "")


def _handout_command(args) -> str:
    """Run the ``release``, ``workspace`` or ``reveal`` subcommand; return what to print (a ReleaseError escapes)."""
    if args.cmd == "workspace":
        made = workspace(args.dir)
        return (f"{'made' if made else 'kept'} the workspace {args.dir}: its package has holes where the exercises "
                f"build pieces; start it with `cd {args.dir} && .venv/bin/python -m jupyterlab`")
    if args.cmd == "reveal":
        filled = reveal(args.exercise, args.dir)
        return f"revealed in {args.dir}: {', '.join(filled)} (recorded in {args.dir / REVEALED})"
    written = release(args.dir)
    return (f"wrote the handout to {args.dir}: {', '.join(p.name for p in written)} (no solutions/, no tests/, "
            "no minipaged/checks/instructor/; a stub where each piece an exercise builds goes)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minipaged.exercises", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report whether exercises/ is in sync")
    sub = parser.add_subparsers(dest="cmd")
    rel = sub.add_parser("release", help="write the learners' handout (no solutions, no instructor side) into DIR")
    rel.add_argument("dir", type=Path, help="a new or empty folder")
    work = sub.add_parser("workspace", help="make (or reuse) a learner's workspace: a handout with its own environment")
    work.add_argument("dir", type=Path, help="the workspace's folder")
    rev = sub.add_parser("reveal", help="fill one exercise's pieces of a handout with the model answers")
    rev.add_argument("exercise", help="the exercise, e.g. 08")
    rev.add_argument("dir", type=Path, help="the learner's handout (workspace)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd:
        try:
            print(_handout_command(args))
        except ReleaseError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.check:
        problems = stale_exercises()
        for p in problems:
            print(p)
        if problems:
            print("exercises/ is out of sync with solutions/: run `python -m minipaged.exercises`")
            return 1
        print(f"exercises/ is in sync with solutions/ ({len(expected_exercises())} notebooks)")
        return 0
    EXERCISES.mkdir(exist_ok=True)
    for path, text in expected_exercises().items():
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
