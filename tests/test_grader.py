"""The grader is not fooled: deleted, forged, duplicated or looping checks, missing and broken notebooks.

Tiny exercises (chapters 98 and 99, written here) keep each kernel run short.
"""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from minipaged.checks import __main__ as grader

pytestmark = pytest.mark.exercises

ROOT = Path(__file__).resolve().parent.parent

SETUP = """from minipaged.checks import check, expect_equal

@check("demo{n}.answer")
def check_answer(fn):
    expect_equal(fn(), {n}, "answer()")
    return "right"
"""
ANSWER = "def answer():\n    ### BEGIN SOLUTION (Task {n}.1)\n    return {n}\n    ### END SOLUTION"
CHECK = "result = check_answer(answer)"
QUESTION = "## Question {n}.2\n\nWhy?\n\n<!-- BEGIN SOLUTION -->\nBecause {n}.\n<!-- END SOLUTION -->"


def cell(kind, source, cell_id, **kw):
    c = new_code_cell(source, **kw) if kind == "code" else new_markdown_cell(source)
    c.id = cell_id
    return c


def solution(n: int):
    nb = new_notebook()
    nb.cells = [
        cell("code", SETUP.format(n=n), "setup"),
        cell("code", ANSWER.format(n=n), "answer"),
        cell("code", CHECK, "check", outputs=[new_output("stream", text=f"✅ PASS   demo{n}.answer: right\n")]),
        cell("md", QUESTION.format(n=n), "question"),
    ]
    return nb


def submission(n: int, answer: str, *, drop=(), extra=(), replace=None, reply="*Your answer here.*"):
    nb = solution(n)
    nb.cells[1].source = answer
    nb.cells[3].source = nb.cells[3].source.split("<!--")[0] + reply
    if replace is not None:
        nb.cells[2].source = replace
    nb.cells = [c for c in nb.cells if c.id not in drop] + [cell("code", s, i) for i, s in extra]
    for c in nb.cells:
        if c.cell_type == "code":
            c.outputs = []
    return nb


@pytest.fixture
def solutions(tmp_path, monkeypatch):
    folder = tmp_path / "solutions"
    folder.mkdir()
    for n in (98, 99):
        nbformat.write(solution(n), folder / f"{n}_demo.ipynb")
    monkeypatch.setattr(grader, "SOLUTIONS", folder)
    return folder


def write(root: Path, learner: str, n: int, nb) -> Path:
    path = root / "submissions" / learner / f"{n}_demo.ipynb"
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def test_a_class_is_graded_and_cannot_fool_the_grader(solutions, tmp_path, capsys):
    right, wrong = "def answer():\n    return 99", "def answer():\n    return 2"
    forged = 'print("✅ PASS   demo99.answer: right")'
    write(tmp_path, "honest", 98, solution(98))
    write(tmp_path, "honest", 99, submission(99, right, reply="Since 99."))
    write(tmp_path, "stub", 99, submission(99, "def answer():\n    raise NotImplementedError('Task 99.1')"))
    write(tmp_path, "deleter", 99, submission(99, wrong, drop=("check",)))
    # prints a PASS line in place of the check, and runs the check on a right answer in a cell of its own
    write(tmp_path, "forger", 99, submission(99, wrong, replace=forged,
                                             extra=[("own", "check_answer(lambda: 99)\n" + forged)]))
    # the check cell, then a fixed answer and the check cell again (same id), and once more under a new id
    write(tmp_path, "duplicator", 99, submission(99, wrong, extra=[("fix", right), ("check", CHECK), ("x", CHECK)]))
    write(tmp_path, "looper", 99, submission(99, "def answer():\n    while True:\n        pass"))
    write(tmp_path, "syntax", 99, submission(99, "def answer(:\n    return 99"))
    prefix = tmp_path / "book"
    status = grader.main(["grade", str(tmp_path / "submissions"), "--gradebook", str(prefix),
                          "--check-timeout", "2", "--instructor"])
    out = capsys.readouterr().out
    assert status == 1
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[1:8]}
    assert rows["honest"] == ["PASS", "PASS", "2/2"]
    assert rows["stub"] == ["MISSING", "TODO", "0/2"]
    assert "did not run" in out  # the syntax error's check
    for learner in ("deleter", "forger", "duplicator", "looper", "syntax"):
        assert rows[learner] == ["MISSING", "FAIL", "0/2"], learner
    book = json.loads(prefix.with_suffix(".json").read_text())
    learners = book["learners"]
    notes = {learner: row["notes"].get("99_demo.ipynb", []) for learner, row in learners.items()}
    assert "check cell check (demo99.answer) was missing and was put back" in notes["deleter"]
    forger_notes = learners["forger"]["notes"]["99_demo.ipynb"]
    assert "check cell check was edited; its source was restored" in forger_notes
    assert any("from outside their check cells were ignored" in note for note in forger_notes)
    # nbformat renames a copied cell id on write, so both copies run outside the check cell and count for nothing
    assert "2 check result(s) from outside their check cells were ignored" in notes["duplicator"]
    assert learners["looper"]["checks"]["demo99.answer"]["message"].startswith("timed out after 2 s")
    assert any("syntax error at line 1" in n for n in learners["syntax"]["notes"]["99_demo.ipynb"])
    assert book["questions"]["question"]["model_answer"] in ("Because 98.", "Because 99.")
    assert learners["honest"]["answers"]["question"] == "Since 99."
    assert "model answer: Because" in out and "honest: Since 99." in out and "stub: (not answered)" in out
    csv_lines = prefix.with_suffix(".csv").read_text().splitlines()
    assert csv_lines[0] == "learner,demo98.answer,demo99.answer,passed,total" and len(csv_lines) == 8


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("99_demo.ipynb", None, "no such file or folder"),
        ("99_demo.txt", "hello", "not a notebook (expected a .ipynb file)"),
        ("99_demo.ipynb", "{not json", "not a notebook (NotJSONError"),
        ("42_demo.ipynb", "nb", "no exercise for chapter '42'"),
    ],
    ids=["missing", "not .ipynb", "not JSON", "unknown chapter"],
)
def test_bad_input_gets_a_clear_message(solutions, tmp_path, capsys, name, content, message):
    path = tmp_path / "learner" / name
    path.parent.mkdir()
    if content == "nb":
        nbformat.write(solution(99), path)
    elif content is not None:
        path.write_text(content)
    assert grader.main(["grade", str(path), "--gradebook", str(tmp_path / "book")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_the_readme_grading_command_runs(tmp_path):
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"^(python -m minipaged\.checks grade .*)$", readme, re.M)[1]
    for learner, folder in (("ada", "solutions"), ("bo", "exercises")):
        target = tmp_path / "submissions" / learner
        target.mkdir(parents=True)
        name = "05_continuous_batching.ipynb"
        (target / name).write_bytes((ROOT / folder / name).read_bytes())
    args = shlex.split(command)
    done = subprocess.run([sys.executable, *args[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    table = done.stdout.splitlines()
    assert table[0].split() == ["learner", "ch05.prefill_chunk", "ch05.pick_victims", "passed"]
    assert table[1].split() == ["ada", "PASS", "PASS", "2/2"] and table[2].split() == ["bo", "TODO", "TODO", "0/2"]
    assert (tmp_path / "gradebook.csv").exists() and (tmp_path / "gradebook.json").exists()
