"""Grade a class: ``python -m minipaged.checks grade submissions/``.

    python -m minipaged.checks grade PATH [PATH ...] [--gradebook PREFIX] [--instructor]
        [--check-timeout S] [--notebook-timeout S]

A PATH is a notebook or a folder searched for notebooks. A notebook's learner
is the name of its parent folder (``submissions/<learner>/NN_name.ipynb``) and
its exercise is the solution whose name starts with the same two digits.

For each notebook, the grader:

1. learns the exercise's checks from its solution: every code cell whose saved
   output shows a check line is a *check cell*, known by its cell id;
2. restores each check cell's source from the solution (an edited cell gets its
   source back, a deleted one is put back after the cell it followed, a copy of
   one is dropped), as nbgrader's autograder restores its locked cells;
3. executes the notebook in a fresh kernel, each cell under a time limit and
   the whole notebook under a budget, with a results file and a per-run secret
   in the kernel's environment;
4. takes each check's result from the signed records the check framework
   wrote to that file *while that check's own cell ran*, never from printed
   text. A check with no such record FAILs.

It prints one table (a row per learner, a column per check) and writes it as
``PREFIX.csv`` and ``PREFIX.json``; the JSON also holds every failure message,
the notes on each notebook, and the model answer to every free-text question
beside each learner's answer (``--instructor`` prints those too). The exit
status is 0 when every check passed, 1 when some did not, 2 when an input
could not be graded.
"""

from __future__ import annotations

import argparse
import ast
import csv
import hmac
import json
import os
import re
import secrets
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from minipaged.checks import FAIL, PASS, RESULTS_ENV, SECRET_ENV, TIMEOUT_ENV, TODO, sign

ROOT = Path(__file__).resolve().parent.parent.parent
SOLUTIONS = ROOT / "solutions"
_LINE = re.compile(rf"^\S+ ({PASS}|{FAIL}|{TODO})\s+(\S+?)(?::|$)", re.M)
_ANSWER = re.compile(r"<!-- BEGIN SOLUTION -->(.*?)<!-- END SOLUTION -->", re.S)
_ANSWER_HERE = "*Your answer here.*"
MISSING = "MISSING"


class GradeError(ValueError):
    """A path that cannot be graded: missing, not a notebook, or no exercise for its chapter."""


@dataclass
class CheckCell:
    """A check cell of an exercise: its id in the solution, its pristine source, the checks it runs."""

    cell_id: str
    source: str
    names: list[str]


@dataclass
class Exercise:
    """What the grader knows about one exercise, all of it read from the solution notebook."""

    path: Path
    check_cells: list[CheckCell]
    previous: dict[str, str | None]  # check cell id -> id of the solution cell before it
    questions: dict[str, tuple[str, str]]  # markdown cell id -> (question title, model answer)
    framing: dict[str, tuple[str, str]] = field(default_factory=dict)  # question cell id -> text around the answer

    @property
    def checks(self) -> list[str]:
        return [name for cell in self.check_cells for name in cell.names]


@dataclass
class Outcome:
    status: str
    message: str = ""


@dataclass
class Graded:
    """One graded notebook."""

    learner: str
    path: Path
    exercise: Exercise
    results: dict[str, Outcome]
    notes: list[str] = field(default_factory=list)
    answers: dict[str, str] = field(default_factory=dict)  # question cell id -> the learner's answer


def _read(path: Path):
    import nbformat

    if not path.exists():
        raise GradeError(f"{path}: no such file")
    if path.suffix != ".ipynb":
        raise GradeError(f"{path}: not a notebook (expected a .ipynb file)")
    try:
        return nbformat.read(path, as_version=4)
    except Exception as exc:  # invalid JSON or not the notebook schema: say which file, not a traceback
        raise GradeError(f"{path}: not a notebook ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None


def _printed(cell) -> str:
    return "".join(out.get("text", "") for out in cell.get("outputs", []) if out.get("output_type") == "stream")


def load_exercise(solution_path: Path) -> Exercise:
    """The check cells and free-text questions of the exercise whose solution is ``solution_path``."""
    nb = _read(solution_path)
    check_cells, previous, questions, framing, before = [], {}, {}, {}, None
    title = ""
    for cell in nb.cells:
        if cell.cell_type == "markdown" and cell.source.startswith("#"):
            title = cell.source.splitlines()[0].lstrip("# ").strip()
        names = [name for _, name in _LINE.findall(_printed(cell))] if cell.cell_type == "code" else []
        if names:
            if "BEGIN SOLUTION" in cell.source:
                raise GradeError(f"{solution_path}: check cell {cell.id} also holds a solution; split the cell")
            check_cells.append(CheckCell(cell.id, cell.source, names))
            previous[cell.id] = before
        if cell.cell_type == "markdown":
            for answer in _ANSWER.findall(cell.source):
                questions[cell.id] = (title, answer.strip())
                before_answer, _, after_answer = _ANSWER.sub("\0", cell.source).partition("\0")
                framing[cell.id] = (before_answer.strip(), after_answer.strip())
        before = cell.id
    if not check_cells:
        raise GradeError(f"{solution_path}: no check cell has a saved check line; execute the solution first")
    return Exercise(solution_path, check_cells, previous, questions, framing)


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
                f"{path}: no exercise for chapter {chapter!r}; a submission's name starts with its chapter "
                f"({known})"
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
        source = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in cell.source.splitlines())
        try:
            ast.parse(source)
        except SyntaxError as exc:
            notes.append(f"cell {index} (id {cell.get('id')}) has a syntax error at line {exc.lineno}: {exc.msg}")
    return notes


def _records(path: Path, offset: int, secret: bytes) -> tuple[list[dict], int, int]:
    """Signed records appended to ``path`` since ``offset``; also the new offset and the number rejected."""
    with open(path, encoding="utf-8") as f:
        f.seek(offset)
        text = f.read()
        offset = f.tell()
    good, bad = [], 0
    for line in text.splitlines():
        try:
            record = json.loads(line)
            ok = hmac.compare_digest(str(record.get("sig", "")), sign(secret, record))
        except (ValueError, AttributeError, TypeError):
            ok = False
        if ok:
            good.append(record)
        else:
            bad += 1
    return good, offset, bad


def execute(nb, exercise: Exercise, cwd: Path, check_timeout: float, notebook_timeout: float):
    """Run ``nb`` (already restored) and collect each check's outcome from its signed records."""
    from nbclient import NotebookClient
    from nbformat.v4 import new_code_cell

    check_of = {c.cell_id: c for c in exercise.check_cells}
    results: dict[str, Outcome] = {}
    notes: list[str] = []
    secret = secrets.token_hex(32)
    with tempfile.TemporaryDirectory(prefix="minipaged-grade-") as tmp:
        results_path = Path(tmp) / "results.jsonl"
        results_path.touch()
        env = dict(os.environ)
        env.update({RESULTS_ENV: str(results_path), SECRET_ENV: secret, TIMEOUT_ENV: f"{check_timeout:g}"})
        cell_limit = check_timeout + 15  # the check's own alarm should fire first
        client = NotebookClient(
            nb, timeout=cell_limit, allow_errors=True, interrupt_on_timeout=True, kernel_name="python3",
            resources={"metadata": {"path": str(cwd)}},
        )
        offset, last_seq, outside, forged = 0, 0, 0, 0
        start = time.monotonic()
        with client.setup_kernel(env=env):
            # Before any learner code: importing the framework takes the secret out of os.environ.
            # (execute_cell stores the cell at its index, so the preamble gets a slot of its own.)
            nb.cells.insert(0, new_code_cell("import minipaged.checks"))
            client.execute_cell(nb.cells[0], 0)
            del nb.cells[0]
            for index, cell in enumerate(nb.cells):
                if cell.cell_type != "code":
                    continue
                left = notebook_timeout - (time.monotonic() - start)
                if left <= 0:
                    notes.append(f"the notebook timed out after {notebook_timeout:g} s; later cells did not run")
                    break
                client.timeout = max(1, int(min(cell_limit, left)))
                began = time.monotonic()
                client.execute_cell(cell, index)
                took = time.monotonic() - began
                records, offset, bad = _records(results_path, offset, secret.encode())
                forged += bad
                fresh = [r for r in records if r.get("seq", 0) > last_seq]
                forged += len(records) - len(fresh)
                last_seq = max([last_seq] + [r["seq"] for r in fresh])
                expected = check_of.get(cell.get("id"))
                if expected is None:
                    outside += len(fresh)
                    continue
                for record in fresh:  # the last record of each expected check is the one the check wrote
                    if record["name"] in expected.names and record["status"] in (PASS, FAIL, TODO):
                        results[record["name"]] = Outcome(record["status"], record["message"])
                    else:
                        outside += 1
                for name in expected.names:
                    if name not in results and took >= client.timeout - 1:
                        results[name] = Outcome(FAIL, f"timed out after {client.timeout} s")
    if outside:
        notes.append(f"{outside} check result(s) from outside their check cells were ignored")
    if forged:
        notes.append(f"{forged} unsigned or replayed result record(s) were rejected")
    for name in exercise.checks:
        if name not in results:
            results[name] = Outcome(FAIL, "did not run: its check cell raised before the check, or never ran")
    return results, notes


def grade_notebook(path: Path, exercises: dict[str, Exercise], check_timeout: float = 60,
                   notebook_timeout: float = 600) -> Graded:
    """Restore, execute and grade one submission."""
    nb = _read(path)
    exercise = find_exercise(path, exercises)
    notes = syntax_errors(nb) + restore(nb, exercise)
    answers = {}
    for cell in nb.cells:
        if cell.get("id") in exercise.questions:
            answer = cell.source.strip()
            for around in exercise.framing[cell.id]:  # keep only what the learner wrote
                answer = answer.replace(around, "") if around else answer
            answers[cell.id] = answer.strip()
    results, run_notes = execute(nb, exercise, path.parent, check_timeout, notebook_timeout)
    return Graded(path.resolve().parent.name, path, exercise, results, notes + run_notes, answers)


def collect(paths: list[Path]) -> tuple[list[Path], list[str]]:
    """The notebooks named by ``paths`` (folders are searched), and an error for each path that is missing."""
    found, errors = [], []
    for path in paths:
        if path.is_dir():
            notebooks = sorted(p for p in path.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
            if not notebooks:
                errors.append(f"{path}: a folder with no notebook in it")
            found += notebooks
        elif path.exists():
            found.append(path)
        else:
            errors.append(f"{path}: no such file or folder")
    return found, errors


_SHORT = {PASS: "PASS", FAIL: "FAIL", TODO: "TODO", MISSING: "MISSING"}


def gradebook(graded: list[Graded]) -> dict:
    """One row per learner, one column per check, plus messages, notes and the free-text answers."""
    exercises = sorted({g.exercise.path: g.exercise for g in graded}.values(), key=lambda e: e.path.name)
    columns = [name for e in exercises for name in e.checks]
    learners: dict[str, dict] = {}
    for g in sorted(graded, key=lambda g: (g.learner, g.path.name)):
        row = learners.setdefault(g.learner, {"checks": {}, "notes": {}, "answers": {}})
        row["checks"].update({n: {"status": o.status, "message": o.message} for n, o in g.results.items()})
        if g.notes:
            row["notes"][g.path.name] = g.notes
        row["answers"].update(g.answers)
    for row in learners.values():
        for name in columns:
            row["checks"].setdefault(name, {"status": MISSING, "message": "notebook not submitted"})
        row["passed"] = sum(row["checks"][n]["status"] == PASS for n in columns)
        row["total"] = len(columns)
    questions = {
        cell_id: {"exercise": e.path.name, "question": title, "model_answer": answer}
        for e in exercises
        for cell_id, (title, answer) in e.questions.items()
    }
    return {"checks": columns, "learners": learners, "questions": questions}


def write_gradebook(book: dict, prefix: Path) -> tuple[Path, Path]:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = prefix.with_suffix(".csv"), prefix.with_suffix(".json")
    with open(csv_path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["learner", *book["checks"], "passed", "total"])
        for learner, row in book["learners"].items():
            statuses = [row["checks"][n]["status"] for n in book["checks"]]
            writer.writerow([learner, *statuses, row["passed"], row["total"]])
    json_path.write_text(json.dumps(book, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return csv_path, json_path


def format_table(book: dict) -> str:
    header = ["learner", *book["checks"], "passed"]
    rows = [
        [learner, *(_SHORT[row["checks"][n]["status"]] for n in book["checks"]), f"{row['passed']}/{row['total']}"]
        for learner, row in book["learners"].items()
    ]
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [header] + rows]
    return "\n".join(lines)


def format_details(book: dict, instructor: bool) -> str:
    lines = []
    for learner, row in book["learners"].items():
        for name in book["checks"]:
            outcome = row["checks"][name]
            if outcome["status"] not in (PASS, MISSING):
                lines.append(f"{learner} · {name}: {outcome['status']}: {outcome['message']}")
        for notebook, notes in row["notes"].items():
            lines += [f"{learner} · {notebook}: {note}" for note in notes]
    if instructor:
        for cell_id, q in book["questions"].items():
            lines.append(f"\n{q['exercise']} · {q['question']}\n  model answer: {q['model_answer']}")
            for learner, row in book["learners"].items():
                answer = row["answers"].get(cell_id, "(not submitted)")
                answer = "(not answered)" if _ANSWER_HERE in answer else answer
                lines.append(f"  {learner}: {answer}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minipaged.checks", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("grade", help="restore the check cells, execute the notebooks and write a gradebook")
    g.add_argument("paths", nargs="+", type=Path, help="notebooks, or folders of submissions/<learner>/NN_x.ipynb")
    g.add_argument("--gradebook", type=Path, default=Path("gradebook"), help="writes PREFIX.csv and PREFIX.json")
    g.add_argument("--check-timeout", type=float, default=60.0, help="seconds per check (default 60)")
    g.add_argument("--notebook-timeout", type=float, default=600.0, help="seconds per notebook (default 600)")
    g.add_argument("--instructor", action="store_true", help="also print the model answers beside the learners'")
    args = parser.parse_args(argv)

    notebooks, errors = collect(args.paths)
    exercises: dict[str, Exercise] = {}
    graded = []
    for path in notebooks:
        try:
            graded.append(grade_notebook(path, exercises, args.check_timeout, args.notebook_timeout))
        except GradeError as exc:
            errors.append(str(exc))
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    if not graded:
        print("error: nothing to grade", file=sys.stderr)
        return 2
    book = gradebook(graded)
    csv_path, json_path = write_gradebook(book, args.gradebook)
    print(format_table(book))
    details = format_details(book, args.instructor)
    if details:
        print("\n" + details)
    print(f"\ngradebook: {csv_path} and {json_path}")
    if errors:
        return 2
    return 0 if all(row["passed"] == row["total"] for row in book["learners"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
