"""Generate ``exercises/`` from ``solutions/`` so the two never drift apart.

    python -m minipaged.exercises              # regenerate exercises/*.ipynb
    python -m minipaged.exercises --check      # exit 1 if exercises/ is stale (CI)
    python -m minipaged.exercises release DIR  # write the learners' handout into DIR

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

The capstone (:data:`CAPSTONE`) assembles the pieces of earlier exercises. Its cells tagged
``piece:NN:Name`` are copies of the solution cell of exercise NN that defines ``Name``, kept in sync
here (:func:`sync_capstone`): the tasks become the capstone's, under a comment naming where the code
comes from, and a line that ends ``# in the capstone: LINE`` becomes ``LINE`` (a prefix cache's base class
becomes the learner's own allocator).
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
import importlib
import json
import re
import shutil
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS, EXERCISES = ROOT / "solutions", ROOT / "exercises"

_BEGIN = re.compile(r"^(?P<indent>\s*)### BEGIN SOLUTION\s*(?:\((?P<task>[^)]*)\))?\s*(?:hint:\s*(?P<hint>.*?))?\s*$")
_END = re.compile(r"^\s*### END SOLUTION\s*$")
_MD_SOLUTION = re.compile(r"<!-- BEGIN SOLUTION -->.*?<!-- END SOLUTION -->", re.S)

BANNER = (
    "> **Exercise version.** Generated from `solutions/{name}` by `python -m minipaged.exercises`. "
    "Replace each `raise NotImplementedError(...)` with your code, then run the check cell below it."
)


# What a learner's handout carries, relative to the repository root.
HANDOUT = ("README.md", "GLOSSARY.md", "pyproject.toml", "constraints.txt", "environment.yml", "Makefile",
           "kernels", "minipaged", "notebooks", "exercises")
_LEFT_OUT = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints", "instructor", "expected.json")


class MarkerError(ValueError):
    pass


CAPSTONE = "09_your_engine.ipynb"
CAPSTONE_TASK = "Task 9.1"
_PIECE = re.compile(r"^piece:(?P<number>\d\d):(?P<name>\w+)$")
_IN_CAPSTONE = re.compile(r"^(?P<indent>\s*).*?#\s*in the capstone:\s*(?P<line>.+?)\s*$")


def capstone_piece(source: str, number: str) -> str:
    """Solution cell ``source`` of exercise ``number`` as the capstone carries it.

    Args:
        source: the code cell's source.
        number: the exercise it comes from, ``"02"``.
    """
    lines = []
    for line in source.splitlines():
        begin, swap = _BEGIN.match(line), _IN_CAPSTONE.match(line)
        if begin:
            origin = f", {begin['task']}" if begin["task"] else ""
            lines.append(f"{begin['indent']}# yours from exercise {number}{origin}")
            line = f"{begin['indent']}### BEGIN SOLUTION ({CAPSTONE_TASK})"
        elif swap:
            line = swap["indent"] + swap["line"]
        lines.append(line)
    return "\n".join(lines)


def _defines(source: str) -> set[str]:
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    return {node.name for node in tree.body if isinstance(node, (ast.ClassDef, ast.FunctionDef))} | {
        t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)}


def sync_capstone(capstone: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """``capstone`` with each ``piece:NN:Name`` cell's source copied from exercise NN's solution cell defining Name."""
    nb = nbformat.from_dict(capstone)
    for cell in nb.cells:
        for tag in cell.get("metadata", {}).get("tags", []):
            piece = _PIECE.match(tag)
            if not piece:
                continue
            matches = sorted(SOLUTIONS.glob(f"{piece['number']}_*.ipynb"))
            if not matches:
                raise MarkerError(f"{CAPSTONE}: tag {tag}: no solution for exercise {piece['number']}")
            sources = [c.source for c in nbformat.read(matches[0], as_version=4).cells
                       if c.cell_type == "code" and piece["name"] in _defines(c.source)]
            if len(sources) != 1:
                raise MarkerError(f"{CAPSTONE}: tag {tag}: {len(sources)} cells of {matches[0].name} define "
                                  f"{piece['name']} (one expected)")
            cell.source = capstone_piece(sources[0], piece["number"])
    return nb


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


def _capstone_stale() -> list[str]:
    path = SOLUTIONS / CAPSTONE
    if not path.exists():
        return []
    nb = nbformat.read(path, as_version=4)
    return [] if render(sync_capstone(nb)) == render(nb) else [f"pieces out of date: {path.relative_to(ROOT)}"]


def stale_exercises() -> list[str]:
    """Problems that ``--check`` reports: missing, outdated or orphaned exercises, and the capstone's pieces."""
    expected = expected_exercises()
    problems = _capstone_stale()
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


def release(target: Path) -> list[Path]:
    """Write the learners' handout into ``target`` (new or empty); return the top-level paths written.

    Args:
        target: a folder that does not exist yet, or an empty one.
    """
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ReleaseError(f"{target}: exists and is not an empty folder; release into a new one")
    stale = stale_exercises()
    if stale:
        raise ReleaseError(f"exercises/ is out of sync with solutions/ ({stale[0]}): "
                           "run `python -m minipaged.exercises`")
    entries = expected_transcripts()
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
    pyproject = target / "pyproject.toml"
    if pyproject.exists():  # the handout has no instructor package to install
        pyproject.write_text(pyproject.read_text().replace('"minipaged.checks.instructor", ', ""))
    checks = target / "minipaged" / "checks" / "expected.json"
    checks.write_text(json.dumps(entries, ensure_ascii=False) + "\n", encoding="utf-8")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minipaged.exercises", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report whether exercises/ is in sync")
    sub = parser.add_subparsers(dest="cmd")
    rel = sub.add_parser("release", help="write the learners' handout (no solutions, no instructor side) into DIR")
    rel.add_argument("dir", type=Path, help="a new or empty folder")
    args = parser.parse_args(argv)
    if args.cmd == "release":
        try:
            written = release(args.dir)
        except ReleaseError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"wrote the handout to {args.dir}: {', '.join(p.name for p in written)} (no solutions/, no tests/, "
              "no minipaged/checks/instructor/)")
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
    capstone = SOLUTIONS / CAPSTONE
    if _capstone_stale():
        capstone.write_text(render(sync_capstone(nbformat.read(capstone, as_version=4))))
        print(f"wrote the pieces of {capstone.relative_to(ROOT)} (run it again: its outputs predate them)")
    EXERCISES.mkdir(exist_ok=True)
    for path, text in expected_exercises().items():
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
