"""Output (issue 41, kind 9): one huge print neither lifts the grader's memory nor stops its learner's grading.

A message from a kernel bigger than ``MAX_MESSAGE`` is dropped by ZeroMQ before the grader reads it; the grader
notices that the cell's output stopped, connects to the kernel anew, and grades the cells after it as usual.
"""

import json
import resource
import subprocess
import sys

import nbformat
import pytest

from minipaged.checks import __main__ as grader

pytestmark = pytest.mark.exercises

NAME = "07_tradeoffs.ipynb"


def test_a_huge_print_is_dropped_and_the_class_is_graded(tmp_path):
    nb = nbformat.read(grader.ROOT / "exercises" / NAME, as_version=4)
    for learner in ("ada", "big"):
        (tmp_path / "submissions" / learner).mkdir(parents=True)
        if learner == "big":
            cell = nbformat.v4.new_code_cell('print("x" * 300_000_000)')
            cell.id = "huge-print"
            nb.cells.insert(2, cell)
        nbformat.write(nb, tmp_path / "submissions" / learner / NAME)
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    done = subprocess.run([sys.executable, "-m", "minipaged.checks", "grade", str(tmp_path / "submissions"),
                           "--gradebook", str(tmp_path / "book"), "--jobs", "2"], capture_output=True, text=True,
                          timeout=600)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB: the largest child waited for so far
    assert done.returncode == 1, done.stderr[-2000:]
    book = json.loads((tmp_path / "book.json").read_text())
    statuses = {learner: [c["status"] for c in row["checks"].values()] for learner, row in book["learners"].items()}
    assert statuses["big"] == statuses["ada"] == ["NOT IMPLEMENTED YET"] * 3  # the untouched exercise, graded
    assert any("was dropped" in note for note in book["learners"]["big"]["notes"][NAME])
    assert peak == before or peak < 700 * 2**10, f"the grader reached {peak / 2**10:.0f} MiB"
