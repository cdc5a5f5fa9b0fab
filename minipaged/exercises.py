"""Generate ``exercises/`` from ``solutions/`` so the two never drift apart.

    python -m minipaged.exercises          # regenerate exercises/*.ipynb
    python -m minipaged.exercises --check  # exit 1 if exercises/ is stale (CI)

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
"""

from __future__ import annotations

import argparse
import importlib
import re
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


class MarkerError(ValueError):
    pass


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minipaged.exercises", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report whether exercises/ is in sync")
    args = parser.parse_args(argv)
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
