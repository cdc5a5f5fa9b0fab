"""The grader decides every verdict itself, and one learner can neither fool it nor stop the class.

Each test grades a small class of exercise 01 (its checks are pure Python, so a kernel run is short): each
learner hands in the notebook and ``minipaged/accounting.py``, the handout's with Tasks 1.1 and 1.2 filled.
The attacks are the twelve kinds of issue 24; each must be refused (or flagged, for a copied solution) while
the other learners of the same class are graded correctly.
"""

import csv
import json
import os
import random
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest

from minipaged import accounting as acc
from minipaged.checks import __main__ as grader
from minipaged.checks import ch01, expected
from minipaged.checks.instructor import ch01 as ref01
from minipaged.exercises import find_holes, stub_source

pytestmark = pytest.mark.exercises

ROOT = Path(__file__).resolve().parent.parent
EXERCISE = ROOT / "exercises" / "01_kv_cache_memory.ipynb"
PIECE_FILE = "minipaged/accounting.py"  # what a learner of exercise 01 hands in beside the notebook
CHECKS = ["ch01.fixed_breakdown", "ch01.paged_breakdown", "ch01.largest_max_len"]

# Right answers written differently from the model answer: the bodies of Tasks 1.1 and 1.2 in accounting.py, and
# Task 1.3's cell. Each is shorter than copies.MIN_ITEMS, so that the classmates who all hand in the same one are
# not flagged as copies of each other (tests/test_grader_copies.py tests that flag).
RIGHT_PIECES = {
    "1.1": "fits = [n for i, n in enumerate(lengths) if (i + 1) * max_len * slot_bytes <= budget_bytes]\n"
           "kv = sum(min(n, max_len) for n in fits) * slot_bytes\n"
           "held = len(fits) * max_len * slot_bytes\n"
           "return Breakdown('fixed', len(fits), kv, 0, held - kv, 0, budget_bytes - held)",
    "1.2": "from itertools import accumulate\n"
           "row = BLOCK_TABLE_ENTRY_BYTES * -(-max_len // block_size)\n"
           "costs = [block_size * -(-min(n, max_len) // block_size) * slot_bytes + row for n in lengths]\n"
           "k = sum(1 for total in accumulate(costs) if total <= budget_bytes)\n"
           "kv = sum(min(n, max_len) for n in lengths[:k]) * slot_bytes\n"
           "held = sum(costs[:k]) - k * row\n"
           "return Breakdown('paged', k, kv, held - kv, 0, k * row, budget_bytes - held - k * row)",
}
RIGHT = {"01-09": "import functools\n"
                  "def largest_max_len(lengths, budget_bytes, block_size, slot_bytes, target):\n"
                  "    ok = lambda m: acc.paged_breakdown(lengths, budget_bytes, block_size, m, slot_bytes).num_seqs "
                  ">= target\n"
                  "    return functools.reduce(lambda lo, step: lo + step if ok(lo + step) else lo,\n"
                  "                            [2**i for i in range(63, -1, -1)], 0)"}
# A classic mistake of Task 1.1: a float quotient, which rounds up to one reservation too many at 2**57 bytes.
WRONG_FIXED = ("k = min(len(lengths), int(budget_bytes / (max_len * slot_bytes)))\n"
               "kv = sum(min(n, max_len) for n in lengths[:k]) * slot_bytes\n"
               "held = k * max_len * slot_bytes\n"
               "return Breakdown('fixed', k, kv, 0, held - kv, 0, budget_bytes - held)")
WRONG_LARGEST = "def largest_max_len(lengths, budget_bytes, block_size, slot_bytes, target):\n    return max(lengths)"
NO_WORKED_CELLS = {"01-12c": None, "01-13c": None}  # chapter 01's cases, which call the pieces outside a check


def notebook(cells: dict[str, str | None], extra: tuple = ()):
    """Exercise 01 with the cells of ``cells``' ids given those sources (None: the cell deleted) and Task 1.3's
    right otherwise; ``extra`` cells appended."""
    nb = nbformat.read(EXERCISE, as_version=4)
    nb.cells = [cell for cell in nb.cells if cells.get(cell.get("id"), "") is not None]
    for cell in nb.cells:
        if cell.get("id") in cells or cell.get("id") in RIGHT:
            cell.source = cells.get(cell.id, RIGHT.get(cell.id))
    for i, source in enumerate(extra):
        added = nbformat.v4.new_code_cell(source)
        added.id = f"extra-{i}"
        nb.cells.append(added)
    return nb


def accounting(pieces: dict[str, str]) -> str:
    """The handout's ``minipaged/accounting.py`` with the bodies of ``pieces`` (``{"1.1": body}``) in place of
    those tasks' stubs (the others stay stubs), and ``pieces["module"]`` appended, code run on import."""
    stubbed = stub_source((ROOT / PIECE_FILE).read_text(), PIECE_FILE).splitlines()
    out = []
    for line in stubbed:
        stub = re.match(r"(\s*)raise PieceNotBuilt\('01', '(\d\.\d)'", line)
        if stub and stub[2] in pieces:
            out[-1:] = [stub[1] + body for body in pieces[stub[2]].splitlines()]  # the comment above goes too
        else:
            out.append(line)
    return "\n".join(out + pieces.get("module", "").splitlines()) + "\n"


def write(root: Path, folder: str, nb, name: str = "01_kv_cache_memory.ipynb", pieces: dict | None = None) -> Path:
    """``submissions/<folder>/<name>``; with an exercise 01 notebook, its learner's ``minipaged/accounting.py`` (in
    the learner's folder, the first part of ``folder``) built of ``pieces`` over :data:`RIGHT_PIECES` (``{}``: no
    piece file handed in)."""
    path = root / "submissions" / folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    if name.startswith("01_") and pieces != {}:
        piece_file = root / "submissions" / folder.split("/")[0] / PIECE_FILE
        piece_file.parent.mkdir(parents=True, exist_ok=True)
        piece_file.write_text(accounting(RIGHT_PIECES | (pieces or {})))
    return path


def grade(tmp_path, *args) -> tuple[int, dict, str]:
    prefix = tmp_path / "book"
    status = grader.main(["grade", str(tmp_path / "submissions"), "--gradebook", str(prefix), *args])
    return status, json.loads(prefix.with_suffix(".json").read_text()), prefix.with_suffix(".csv").read_text()


def statuses(book: dict, learner: str) -> list[str]:
    return [book["learners"][learner]["checks"][name]["status"] for name in CHECKS]


def message(book: dict, learner: str, name: str) -> str:
    return book["learners"][learner]["checks"][name]["message"]


# Each attack below PASSed wrong code under the previous grader (kinds 1-7 of issue 24). An attack that replaced a
# task's function is now in the learner's accounting.py (a piece's body, or code run when it is imported), one
# that was a cell is a cell (Task 1.3's, or an extra one): {learner: (cells, extra cells, pieces)}.
EQ_LIAR = """class Yes(int):
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    __hash__ = int.__hash__

class Liar:
    def __getattr__(self, name): return Yes(0)
    def __eq__(self, other): return True
    def __ne__(self, other): return False
"""
SPY = """import builtins, json
_dumps = json.dumps
def dumps(obj, *a, **k):
    if isinstance(obj, dict) and 'observations' in obj:
        obj = dict(obj, end={'kind': 'done'}, observations=[0] * len(obj['observations']))
    return _dumps(obj, *a, **k)
json.dumps = dumps
_open = builtins.open
builtins.open = lambda *a, **k: (print('✅ PASS   ch01.fixed_breakdown'), _open(*a, **k))[1]
"""
LYING_ISINSTANCE = """import builtins, numbers, sys
_isinstance = builtins.isinstance
def lying_isinstance(value, kind):
    caller = sys._getframe(1).f_globals.get('__name__', '')
    if kind is numbers.Integral and caller.startswith('minipaged.checks'):
        return True
    return _isinstance(value, kind)
builtins.isinstance = lying_isinstance
"""
ATTACKS = {
    # 1: objects that say they are equal to anything
    "eq_liar": ({"01-09": EQ_LIAR + "def largest_max_len(*a):\n    return Yes(0)"}, (),
                {"1.1": EQ_LIAR + "return Liar()", "1.2": EQ_LIAR + "return Liar()"}),
    # 2: any secret in the environment (or the process's original environment block) signs forged PASS records
    "secret": ({}, (
        "import os, json, hmac, hashlib\n"
        "raw = open('/proc/self/environ', 'rb').read().decode(errors='replace').split('\\0')\n"
        "found = {k: v for k, _, v in (e.partition('=') for e in raw) if 'MINIPAGED' in k}\n"
        "found.update({k: v for k, v in os.environ.items() if 'MINIPAGED' in k})\n"
        f"for name in {CHECKS!r}:\n"
        "    print(f'✅ PASS   {name}: forged')\n"
        "    for key, value in found.items():\n"
        "        record = {'name': name, 'status': 'PASS', 'message': '', 'seq': 99}\n"
        "        record['sig'] = hmac.new(value.encode(), json.dumps(record).encode(), hashlib.sha256).hexdigest()\n"
        "        print(json.dumps(record))",
    ), {"1.1": WRONG_FIXED}),
    # 3: spying on the standard library while a check runs, and rewriting what it writes (from the piece file's
    # import on: every check's transcript is rewritten)
    "spy": ({}, (), {"1.1": WRONG_FIXED, "module": SPY}),
    # 4: running the solutions that ship with the course: the model notebook's Task 1.3, the repository's own
    # accounting.py (by its path on the grader's machine)
    "solutions": ({"01-09": "import json, pathlib, minipaged\n"
                   "paths = [pathlib.Path(minipaged.__file__).parents[1] / 'solutions' / '01_kv_cache_memory.ipynb',\n"
                   f"         pathlib.Path({str(ROOT / 'solutions' / '01_kv_cache_memory.ipynb')!r})]\n"
                   "try:\n"
                   "    for path in paths:\n"
                   "        for cell in json.loads(path.read_text())['cells']:\n"
                   "            if 'def largest_max_len' in ''.join(cell['source']):\n"
                   "                exec(''.join(cell['source']))\n"
                   "except OSError:\n    " + WRONG_LARGEST.replace("\n", "\n    ")}, (),
                  {"1.1": f"try:\n    source = open({str(ROOT / PIECE_FILE)!r}).read()\n"
                          "except OSError:\n" + "".join(f"    {line}\n" for line in WRONG_FIXED.splitlines())
                          + "model = {}\nexec(source, model)\n"
                          "return model['fixed_breakdown'](lengths, budget_bytes, max_len, slot_bytes)"}),
    # 5: builtins that lie only when a check calls them: every part of a Breakdown "is an int", a float one too
    "builtins": ({}, (), {"1.1": WRONG_FIXED.replace("budget_bytes - held)", "float(budget_bytes - held))"),
                          "module": LYING_ISINSTANCE}),
    # 7: the check's own reference, its case lists, the call stack
    "reference": ({"01-09": "import minipaged.checks as c\n"
                   "c.Check.transcript = lambda self, cases, answers: {'schema': c.SCHEMA, 'check': self.name, "
                   "'observations': [], 'end': {'kind': 'done'}}\n" + WRONG_LARGEST}, (),
                  {"1.1": "try:\n    from minipaged.checks.instructor import ch01 as ref\n"
                          "    return ref.SIDES['fixed_breakdown'].reference()[0](lengths, budget_bytes, max_len, "
                          "slot_bytes)\n"
                          "except ImportError:\n    return Breakdown('fixed', 0, 0, 0, 0, 0, budget_bytes)",
                   "1.2": "import inspect\n"
                          "for frame in inspect.stack():\n"
                          "    for value in [*frame.frame.f_locals.values(), *frame.frame.f_globals.values()]:\n"
                          "        if callable(value) and 'instructor' in str(getattr(value, '__module__', '')):\n"
                          "            return value(lengths, budget_bytes, block_size, max_len, slot_bytes)\n"
                          "return Breakdown('paged', 0, 0, 0, 0, 0, budget_bytes)"}),
}


def lookup_table() -> str:
    """Kind 6: Task 1.1's body answering every public case, as learned from FAIL messages; nothing for the rest."""
    table = {repr(list(case.values())): [(b := acc.fixed_breakdown(*case.values())).num_seqs, *b.parts().values()]
             for case in ref01.FIXED_CASES}
    return (f"TABLE = {table!r}\n"
            "key = repr([list(lengths), budget_bytes, max_len, slot_bytes])\n"
            "return Breakdown('fixed', *TABLE.get(key, [0, 0, 0, 0, 0, budget_bytes]))")


def piece_function(body: str, name: str = "fixed_breakdown"):
    """A piece's ``body`` as the function it is the body of, defined in the test (with accounting's names)."""
    namespace = dict(vars(acc))
    head = "def fixed_breakdown(lengths, budget_bytes, max_len, slot_bytes):\n"
    exec(head.replace("fixed_breakdown", name) + "".join(f"    {line}\n" for line in body.splitlines()), namespace)
    return namespace[name]


def test_attacks_are_refused_and_the_class_is_graded(tmp_path):
    write(tmp_path, "honest", notebook({}))
    for learner, (cells, extra, pieces) in ATTACKS.items():
        write(tmp_path, learner, notebook(cells, extra), pieces=pieces)
    write(tmp_path, "lookup", notebook({}), pieces={"1.1": lookup_table()})
    solution = nbformat.read(ROOT / "solutions" / "01_kv_cache_memory.ipynb", as_version=4)
    copied = {c.id: c.source.replace("good", "low").replace("bad", "high") for c in solution.cells
              if c.get("id") in RIGHT}
    model = {h.task: textwrap.dedent("\n".join(h.body)).replace("held", "have").replace("tokens", "used")
             for h in find_holes((ROOT / PIECE_FILE).read_text(), PIECE_FILE)}
    write(tmp_path, "copier", notebook(copied), pieces=model)
    status, book, _ = grade(tmp_path, "--jobs", "4", "--check-timeout", "20")
    assert status == 1
    assert statuses(book, "honest") == ["PASS"] * 3 and not book["learners"]["honest"]["flags"]
    assert statuses(book, "eq_liar") == ["FAIL"] * 3
    assert "return plain Python values" in message(book, "eq_liar", "ch01.largest_max_len")
    for learner in ("secret", "lookup", "builtins"):
        assert statuses(book, learner) == ["FAIL", "PASS", "PASS"], learner
    assert statuses(book, "spy") == ["FAIL"] * 3  # its rewritten transcripts are only wrong answers
    assert statuses(book, "solutions") == ["FAIL", "PASS", "FAIL"]
    assert statuses(book, "reference") == ["FAIL"] * 3
    assert "no answer came back" in message(book, "reference", "ch01.largest_max_len")
    # 6: the lookup table PASSes the learner's own (public) check, and fails the hidden cases without learning them
    cases, want = expected("ch01.fixed_breakdown")
    got = ch01.check_fixed_breakdown.transcript(cases, (piece_function(lookup_table()),))
    assert ch01.check_fixed_breakdown.verdict(cases, got, want, len(cases)).passed
    hidden = message(book, "lookup", "ch01.fixed_breakdown")
    assert hidden.startswith("hidden case") and "returned" not in hidden and "expected value is not shown" in hidden
    # 4 (flag): the model answer with identifiers renamed PASSes, and is flagged for a person to look at: its
    # paged_breakdown and its Task 1.3 (fixed_breakdown's model body is too short to judge)
    assert statuses(book, "copier") == ["PASS"] * 3
    flags = book["learners"]["copier"]["flags"]["01_kv_cache_memory.ipynb"]
    assert [f.split(" (")[0] for f in flags] == ["copy of the model answer: paged_breakdown",
                                                 "copy of the model answer: cell 01-09"], flags


def test_a_hung_kernel_is_killed_and_the_class_goes_on(tmp_path):
    """Kind 8: a loop that swallows KeyboardInterrupt; the grader interrupts, then kills, after 1.5 + 5 s."""
    hang = "while True:\n    try:\n        while True:\n            pass\n    except BaseException:\n        pass"
    for learner in ("ada", "bo"):
        write(tmp_path, learner, notebook({}))
    write(tmp_path, "hung", notebook({}), pieces={"1.2": hang})
    status, book, _ = grade(tmp_path, "--jobs", "3", "--check-timeout", "1.5")
    assert status == 1
    assert statuses(book, "ada") == statuses(book, "bo") == ["PASS"] * 3
    assert statuses(book, "hung") == ["PASS", "FAIL", "FAIL"]
    assert message(book, "hung", "ch01.paged_breakdown").startswith("timed out after 1.5 s of CPU time")
    assert "the kernel was killed" in message(book, "hung", "ch01.largest_max_len")


def test_a_dead_kernel_fails_its_notebook_and_the_class_goes_on(tmp_path):
    """Kind 9: ``os._exit(0)`` inside a check; that notebook FAILs with a note, the others are graded."""
    for learner in ("ada", "bo"):
        write(tmp_path, learner, notebook({}))
    write(tmp_path, "quitter", notebook({}), pieces={"1.2": "import os\nos._exit(0)"})
    status, book, _ = grade(tmp_path, "--jobs", "3")
    assert status == 1
    assert statuses(book, "ada") == statuses(book, "bo") == ["PASS"] * 3
    assert statuses(book, "quitter") == ["PASS", "FAIL", "FAIL"]
    assert message(book, "quitter", "ch01.paged_breakdown") == "the kernel died while this check ran"
    assert any("the kernel died" in n for n in book["learners"]["quitter"]["notes"]["01_kv_cache_memory.ipynb"])


def test_a_nested_folder_counts_for_the_first_folder_and_names_are_escaped(tmp_path):
    """Kinds 10 and 11: ``bo/ada/01_x.ipynb`` is bo's, not ada's; a learner called ``=SUM(1,2)`` stays text."""
    write(tmp_path, "ada", notebook({}))
    write(tmp_path, "bo/ada", notebook({}), pieces={"1.1": WRONG_FIXED})  # bo's accounting.py: bo/minipaged/
    write(tmp_path, "=SUM(1,2)", notebook({}))
    status, book, csv_text = grade(tmp_path, "--jobs", "3")
    assert status == 1
    assert statuses(book, "ada") == statuses(book, "=SUM(1,2)") == ["PASS"] * 3
    assert statuses(book, "bo") == ["FAIL", "PASS", "PASS"]
    rows = list(csv.reader(csv_text.splitlines()))
    assert ["'=SUM(1,2)", "PASS", "PASS", "PASS", "3", "3", ""] in rows and not any(r[0].startswith("=") for r in rows)


def test_collect_takes_the_first_folder_and_refuses_duplicates(tmp_path):
    root = tmp_path / "submissions"
    for rel in ("ada/01_a.ipynb", "bo/x/y/01_a.ipynb", "bo/01_b.ipynb", "cy/05_a.ipynb", "loose.ipynb"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("{}")
    found, errors = grader.collect([root])
    assert [(s.learner, s.path.relative_to(root).as_posix()) for s in found] == [("ada", "ada/01_a.ipynb"),
                                                                                 ("cy", "cy/05_a.ipynb")]
    duplicate = next(e for e in errors if "learner 'bo'" in e)
    assert str(root / "bo/x/y/01_a.ipynb") in duplicate and str(root / "bo/01_b.ipynb") in duplicate
    assert any("loose.ipynb" in e and "folder named after its learner" in e for e in errors)


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf", "soon"])
@pytest.mark.parametrize("option", ["--check-timeout", "--notebook-timeout"])
def test_bad_timeouts_are_input_errors(tmp_path, capsys, option, value):
    """Kind 12: a bad limit is exit status 2 with one line naming the option (a fraction like 2.5 is fine)."""
    with pytest.raises(SystemExit) as exit_:
        grader.main(["grade", str(tmp_path), option, value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and option in err and "Traceback" not in err
    assert grader.seconds("2.5") == 2.5


def test_csv_cells_that_a_spreadsheet_would_evaluate_are_escaped():
    assert [grader.csv_cell(v) for v in ("=1+1", "+1", "-1", "@A1", "\tx", "ada", 3)] == \
        ["'=1+1", "'+1", "'-1", "'@A1", "'\tx", "ada", "3"]


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("99_demo.ipynb", None, "no such file or folder"),
        ("01_demo.txt", "hello", "not a notebook (expected a .ipynb file)"),
        ("01_demo.ipynb", "{not json", "not a notebook (NotJSONError"),
        ("42_demo.ipynb", "nb", "no exercise for chapter '42'"),
    ],
    ids=["missing", "not .ipynb", "not JSON", "unknown chapter"],
)
def test_bad_input_gets_a_clear_message(tmp_path, capsys, name, content, message):
    path = tmp_path / "learner" / name
    path.parent.mkdir()
    if content == "nb":
        nbformat.write(notebook({}), path)
    elif content is not None:
        path.write_text(content)
    assert grader.main(["grade", str(path), "--gradebook", str(tmp_path / "book")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_restored_check_cells_and_hidden_cases_are_the_graders(tmp_path, capsys):
    """An edited check cell gets its source back, a deleted one is put back; the seed fixes the hidden cases."""
    edited = notebook({"01-10": None, "01-03": 'print("✅ PASS   ch01.fixed_breakdown: right")'})
    write(tmp_path, "dee", edited, pieces={"1.1": WRONG_FIXED})
    status, book, _ = grade(tmp_path, "--seed", "7")
    notes = book["learners"]["dee"]["notes"]["01_kv_cache_memory.ipynb"]
    assert status == 1 and statuses(book, "dee") == ["FAIL", "PASS", "PASS"] and book["seed"] == 7
    assert "check cell 01-03 was edited; its source was restored" in notes
    assert "check cell 01-10 (ch01.largest_max_len) was missing and was put back" in notes
    drawn = ref01.SIDES["fixed_breakdown"].hidden(random.Random("7:ch01.fixed_breakdown"))
    assert drawn == ref01.SIDES["fixed_breakdown"].hidden(random.Random("7:ch01.fixed_breakdown")) and len(drawn) == 10


def test_the_handout_has_no_answers_and_its_checks_agree(tmp_path, monkeypatch):
    """``release`` leaves out solutions/, tests/ and the instructor side; the handout's checks give the same lines."""
    from minipaged import exercises
    from minipaged.checks.instructor import ch07

    monkeypatch.setattr(ch07, "pool_ablation", lambda: {"preemptions": "more", "mean_running": "fewer",
                                                        "ttft_p99": "more", "tpot_p50": "fewer"})
    handout = tmp_path / "handout"
    exercises.release(handout)
    assert not (handout / "solutions").exists() and not (handout / "tests").exists()
    assert not (handout / "minipaged" / "checks" / "instructor").exists()
    assert "instructor" not in (handout / "pyproject.toml").read_text()
    assert "### BEGIN SOLUTION" not in (handout / PIECE_FILE).read_text()
    with pytest.raises(exercises.ReleaseError, match="not an empty folder"):
        exercises.release(handout)
    def source(body, name):
        return "def fixed_breakdown(lengths, budget_bytes, max_len, slot_bytes):\n".replace("fixed_breakdown", name) \
            + "".join(f"    {line}\n" for line in body.splitlines())

    script = ("from minipaged.accounting import Breakdown\nfrom minipaged.checks import ch01\n"
              f"{source(RIGHT_PIECES['1.1'], 'right')}{source(WRONG_FIXED, 'wrong')}"
              "ch01.check_fixed_breakdown(right); ch01.check_fixed_breakdown(wrong)\n"
              "import importlib.util; print(importlib.util.find_spec('minipaged.checks.instructor'))")
    done = subprocess.run([sys.executable, "-c", script], env={"PYTHONPATH": str(handout), "PATH": "/usr/bin"},
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    lines = done.stdout.splitlines()
    assert lines[0].startswith("✅ PASS   ch01.fixed_breakdown") and lines[-1] == "None", done.stderr
    assert lines[1] == str(ch01.check_fixed_breakdown(piece_function(WRONG_FIXED))).splitlines()[0]


def test_the_readme_grading_command_runs(tmp_path):
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"^(python -m minipaged\.checks grade .*)$", readme, re.M)[1]
    for learner, folder in (("ada", "solutions"), ("bo", "exercises")):
        target = tmp_path / "submissions" / learner
        target.mkdir(parents=True)
        name = "05_continuous_batching.ipynb"
        (target / name).write_bytes((ROOT / folder / name).read_bytes())
    for piece in ("scheduler.py", "request_queue.py"):  # ada's package files: the model answers
        (tmp_path / "submissions" / "ada" / "minipaged").mkdir(exist_ok=True)
        (tmp_path / "submissions" / "ada" / "minipaged" / piece).write_bytes((ROOT / "minipaged" / piece).read_bytes())
    args = shlex.split(command)
    done = subprocess.run([sys.executable, *args[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    table = done.stdout.splitlines()
    assert table[0].split() == ["learner", "ch05.schedule_running", "ch05.scheduler", "passed"]
    assert table[1].split() == ["ada", "PASS", "PASS", "2/2"] and table[2].split() == ["bo", "TODO", "TODO", "0/2"]
    assert (tmp_path / "gradebook.csv").exists() and (tmp_path / "gradebook.json").exists()


@pytest.mark.parametrize("jobs", [1, os.cpu_count() or 1])
def test_kernels_graded_at_once_share_the_cores(tmp_path, jobs):
    # Each kernel gets cores // jobs threads: oversubscribed, a learner's engine run can be several times slower
    # and time out with no fault of its own.
    # The sandboxed kernel cannot write where the test reads: its function exists only with the threads expected.
    want = max(1, (os.cpu_count() or 1) // jobs)
    threads = f"import torch\n{RIGHT['01-09']}\nif torch.get_num_threads() != {want}:\n    del largest_max_len"
    write(tmp_path, "a", notebook({"01-09": threads}))
    write(tmp_path, "b", notebook({"01-09": threads.replace(f"!= {want}", f"!= {want + 1}")}))
    status, book, _ = grade(tmp_path, "--jobs", str(jobs))
    assert statuses(book, "a") == ["PASS"] * 3 and statuses(book, "b") == ["PASS", "PASS", "FAIL"]


def test_without_bubblewrap_the_grader_refuses_unless_told_to_run_unsandboxed(tmp_path, capsys, monkeypatch):
    from minipaged.checks import sandbox

    write(tmp_path, "ada", notebook({}))
    monkeypatch.setattr(sandbox.shutil, "which", lambda tool: None if tool == "bwrap" else f"/usr/bin/{tool}")
    assert grader.main(["grade", str(tmp_path / "submissions"), "--gradebook", str(tmp_path / "book")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bwrap not found" in err and "apt-get install bubblewrap" in err
    assert not (tmp_path / "book.json").exists()
    status, book, _ = grade(tmp_path, "--unsandboxed")
    assert status == 0 and statuses(book, "ada") == ["PASS"] * 3
    assert "warning: --unsandboxed" in capsys.readouterr().err
