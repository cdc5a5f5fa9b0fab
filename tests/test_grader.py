"""The grader decides every verdict itself, and one learner can neither fool it nor stop the class.

Each test grades a small class of exercise 01 notebooks (its checks are pure Python, so a kernel run
is short). The attacks are the twelve kinds of issue 24; each must be refused (or flagged, for a
copied solution) while the other learners of the same class are graded correctly.
"""

import csv
import json
import os
import random
import re
import shlex
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from minipaged.checks import __main__ as grader
from minipaged.checks import ch01, expected
from minipaged.checks.instructor import ch01 as ref01

pytestmark = pytest.mark.exercises

ROOT = Path(__file__).resolve().parent.parent
EXERCISE = ROOT / "exercises" / "01_kv_cache_memory.ipynb"
CHECKS = ["ch01.blocks_that_fit", "ch01.new_blocks", "ch01.best_block_size"]

# Right answers written differently from the model solution (so they are not flagged as copies).
RIGHT = {
    "01-03": "def blocks_that_fit(b, L, h, d, s, B):\n    return b // (2 * L * h * d * s * B)",
    "01-06": "def new_blocks(n, k, b):\n    return (n + k + b - 1) // b - (n + b - 1) // b",
    "01-09": "def best_block_size(lengths, candidates):\n"
             "    return min(candidates, key=lambda b: (sum(-(-n // b) * b for n in lengths), -b))",
}
WRONG_NEW = "def new_blocks(n, k, b):\n    return (n + k) // b - n // b"


def notebook(cells: dict[str, str], extra: tuple = ()):
    """Exercise 01 with the task cells replaced by ``cells`` (the others right); ``extra`` cells appended."""
    nb = nbformat.read(EXERCISE, as_version=4)
    for cell in nb.cells:
        if cell.get("id") in RIGHT:
            cell.source = cells.get(cell.id, RIGHT[cell.id])
    for i, source in enumerate(extra):
        added = nbformat.v4.new_code_cell(source)
        added.id = f"extra-{i}"
        nb.cells.append(added)
    return nb


def write(root: Path, folder: str, nb, name: str = "01_kv_cache_memory.ipynb") -> Path:
    path = root / "submissions" / folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def grade(tmp_path, *args) -> tuple[int, dict, str]:
    prefix = tmp_path / "book"
    status = grader.main(["grade", str(tmp_path / "submissions"), "--gradebook", str(prefix), *args])
    return status, json.loads(prefix.with_suffix(".json").read_text()), prefix.with_suffix(".csv").read_text()


def statuses(book: dict, learner: str) -> list[str]:
    return [book["learners"][learner]["checks"][name]["status"] for name in CHECKS]


def message(book: dict, learner: str, name: str) -> str:
    return book["learners"][learner]["checks"][name]["message"]


# Each attack below PASSed wrong code under the previous grader (kinds 1-7 of issue 24).
EQ_LIAR = """class Yes(int):
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    __hash__ = int.__hash__

class YesList(list):
    def __eq__(self, other): return True
    def __ne__(self, other): return False
"""
ATTACKS = {
    # 1: objects that say they are equal to anything
    "eq_liar": ({"01-03": EQ_LIAR + "def blocks_that_fit(*a):\n    return Yes(0)",
                 "01-06": EQ_LIAR + "def new_blocks(*a):\n    return Yes(0)",
                 "01-09": EQ_LIAR + "def best_block_size(lengths, candidates):\n    return Yes(candidates[0])"}, ()),
    # 2: any secret in the environment (or the process's original environment block) signs forged PASS records
    "secret": ({"01-06": WRONG_NEW}, (
        "import os, json, hmac, hashlib\n"
        "raw = open('/proc/self/environ', 'rb').read().decode(errors='replace').split('\\0')\n"
        "found = {k: v for k, _, v in (e.partition('=') for e in raw) if 'MINIPAGED' in k}\n"
        "found.update({k: v for k, v in os.environ.items() if 'MINIPAGED' in k})\n"
        "for name in ['ch01.blocks_that_fit', 'ch01.new_blocks', 'ch01.best_block_size']:\n"
        "    print(f'✅ PASS   {name}: forged')\n"
        "    for key, value in found.items():\n"
        "        record = {'name': name, 'status': 'PASS', 'message': '', 'seq': 99}\n"
        "        record['sig'] = hmac.new(value.encode(), json.dumps(record).encode(), hashlib.sha256).hexdigest()\n"
        "        print(json.dumps(record))",
    )),
    # 3: spying on the standard library while a check runs, and rewriting what it writes
    "spy": ({"01-06": WRONG_NEW + "\nimport builtins, json\n_dumps = json.dumps\n"
             "def dumps(obj, *a, **k):\n"
             "    if isinstance(obj, dict) and 'observations' in obj:\n"
             "        obj = dict(obj, end={'kind': 'done'}, observations=[0] * len(obj['observations']))\n"
             "    return _dumps(obj, *a, **k)\n"
             "json.dumps = dumps\n_open = builtins.open\n"
             "builtins.open = lambda *a, **k: (print('✅ PASS   ch01.new_blocks'), _open(*a, **k))[1]"}, ()),
    # 4: running the solutions that ship with the course
    "solutions": ({"01-06": "import json, pathlib, minipaged\n"
                   "path = pathlib.Path(minipaged.__file__).parents[1] / 'solutions' / '01_kv_cache_memory.ipynb'\n"
                   "try:\n"
                   "    for cell in json.loads(path.read_text())['cells']:\n"
                   "        if 'def new_blocks' in ''.join(cell['source']):\n"
                   "            exec(''.join(cell['source']))\n"
                   "except OSError:\n" + "    " + WRONG_NEW.replace("\n", "\n    ")}, ()),
    # 5: builtins that lie only when a check calls them
    "builtins": ({"01-09": "import builtins, sys\n_min = builtins.min\n"
                  "def best_block_size(lengths, candidates):\n    return candidates[0]\n"
                  "def lying_min(*a, **k):\n"
                  "    caller = sys._getframe(1).f_globals.get('__name__', '')\n"
                  "    if caller.startswith('minipaged.checks') and len(a) == 1 and 'key' in k:\n"
                  "        return list(a[0])[0]\n"
                  "    return _min(*a, **k)\n"
                  "builtins.min = lying_min"}, ()),
    # 7: the check's own reference, its case lists, the call stack
    "reference": ({"01-03": "try:\n    from minipaged.checks.instructor.ch01 import fit as blocks_that_fit\n"
                   "except ImportError:\n    from minipaged.checks import ch01\n"
                   "    blocks_that_fit = getattr(ch01, '_fit', lambda *a: 0)",
                   "01-06": "import inspect\n" + WRONG_NEW + "\n"
                   "def new_blocks(n, k, b, _wrong=new_blocks):\n"
                   "    for frame in inspect.stack():\n"
                   "        ref = frame.frame.f_globals.get('new_blocks')\n"
                   "        if ref is not None and ref is not new_blocks and 'instructor' in ref.__module__:\n"
                   "            return ref(n, k, b)\n"
                   "    return _wrong(n, k, b)",
                   "01-09": "import minipaged.checks as c\n"
                   "c.Check.transcript = lambda self, cases, answers: {'schema': c.SCHEMA, 'check': self.name, "
                   "'observations': [], 'end': {'kind': 'done'}}\n"
                   "def best_block_size(lengths, candidates):\n    return candidates[0]"}, ()),
}


def lookup_table() -> str:
    """Kind 6: every public case's answer, as learned from FAIL messages; 0 for anything else."""
    table = {tuple(case): ref01.new_blocks(*case) for case in ref01.NEW_BLOCK_CASES}
    return f"TABLE = {table!r}\ndef new_blocks(n, k, b):\n    return TABLE.get((n, k, b), 0)"


def test_attacks_are_refused_and_the_class_is_graded(tmp_path):
    write(tmp_path, "honest", notebook({}))
    for learner, (cells, extra) in ATTACKS.items():
        write(tmp_path, learner, notebook(cells, extra))
    write(tmp_path, "lookup", notebook({"01-06": lookup_table()}))
    solution = nbformat.read(ROOT / "solutions" / "01_kv_cache_memory.ipynb", as_version=4)
    copied = {c.id: c.source.replace("per_block", "size").replace("held", "have") for c in solution.cells
              if c.get("id") in RIGHT}
    write(tmp_path, "copier", notebook(copied))
    status, book, _ = grade(tmp_path, "--jobs", "4", "--check-timeout", "20")
    assert status == 1
    assert statuses(book, "honest") == ["PASS"] * 3 and not book["learners"]["honest"]["flags"]
    assert statuses(book, "eq_liar") == ["FAIL"] * 3
    assert "return plain Python values" in message(book, "eq_liar", "ch01.new_blocks")
    for learner in ("secret", "solutions", "lookup"):
        assert statuses(book, learner) == ["PASS", "FAIL", "PASS"], learner
    assert statuses(book, "spy") == ["PASS", "FAIL", "FAIL"]  # its rewritten transcripts are only wrong answers
    assert statuses(book, "builtins") == ["PASS", "PASS", "FAIL"]
    assert statuses(book, "reference") == ["FAIL", "FAIL", "FAIL"]
    assert "no answer came back" in message(book, "reference", "ch01.best_block_size")
    # 6: the lookup table PASSes the learner's own (public) check, and fails the hidden cases without learning them
    cases, want = expected("ch01.new_blocks")
    namespace = {}
    exec(lookup_table(), namespace)
    got = ch01.check_new_blocks.transcript(cases, (namespace["new_blocks"],))
    assert ch01.check_new_blocks.verdict(cases, got, want, len(cases)).passed
    hidden = message(book, "lookup", "ch01.new_blocks")
    assert hidden.startswith("hidden case") and "returned" not in hidden and "expected value is not shown" in hidden
    # 4 (flag): the model solution with identifiers renamed PASSes, and is flagged for a person to look at
    assert statuses(book, "copier") == ["PASS"] * 3
    assert len(book["learners"]["copier"]["flags"]["01_kv_cache_memory.ipynb"]) == 3


def test_a_hung_kernel_is_killed_and_the_class_goes_on(tmp_path):
    """Kind 8: a loop that swallows KeyboardInterrupt; the grader interrupts, then kills, after 1.5 + 5 s."""
    hang = ("def new_blocks(n, k, b):\n    while True:\n        try:\n            while True:\n                pass\n"
            "        except BaseException:\n            pass")
    for learner in ("ada", "bo"):
        write(tmp_path, learner, notebook({}))
    write(tmp_path, "hung", notebook({"01-06": hang}))
    status, book, _ = grade(tmp_path, "--jobs", "3", "--check-timeout", "1.5")
    assert status == 1
    assert statuses(book, "ada") == statuses(book, "bo") == ["PASS"] * 3
    assert statuses(book, "hung") == ["PASS", "FAIL", "FAIL"]
    assert message(book, "hung", "ch01.new_blocks").startswith("timed out after 1.5 s of CPU time")
    assert "the kernel was killed" in message(book, "hung", "ch01.best_block_size")


def test_a_dead_kernel_fails_its_notebook_and_the_class_goes_on(tmp_path):
    """Kind 9: ``os._exit(0)`` inside a check; that notebook FAILs with a note, the others are graded."""
    for learner in ("ada", "bo"):
        write(tmp_path, learner, notebook({}))
    write(tmp_path, "quitter", notebook({"01-06": "import os\ndef new_blocks(n, k, b):\n    os._exit(0)"}))
    status, book, _ = grade(tmp_path, "--jobs", "3")
    assert status == 1
    assert statuses(book, "ada") == statuses(book, "bo") == ["PASS"] * 3
    assert statuses(book, "quitter") == ["PASS", "FAIL", "FAIL"]
    assert message(book, "quitter", "ch01.new_blocks") == "the kernel died while this check ran"
    assert any("the kernel died" in n for n in book["learners"]["quitter"]["notes"]["01_kv_cache_memory.ipynb"])


def test_a_nested_folder_counts_for_the_first_folder_and_names_are_escaped(tmp_path):
    """Kinds 10 and 11: ``bo/ada/01_x.ipynb`` is bo's, not ada's; a learner called ``=SUM(1,2)`` stays text."""
    write(tmp_path, "ada", notebook({}))
    write(tmp_path, "bo/ada", notebook({"01-06": WRONG_NEW}))
    write(tmp_path, "=SUM(1,2)", notebook({}))
    status, book, csv_text = grade(tmp_path, "--jobs", "3")
    assert status == 1
    assert statuses(book, "ada") == statuses(book, "=SUM(1,2)") == ["PASS"] * 3
    assert statuses(book, "bo") == ["PASS", "FAIL", "PASS"]
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
    edited = notebook({"01-06": WRONG_NEW})
    edited.cells = [c for c in edited.cells if c.get("id") != "01-10"]
    for cell in edited.cells:
        if cell.get("id") == "01-07":
            cell.source = 'print("✅ PASS   ch01.new_blocks: right")'
    write(tmp_path, "dee", edited)
    status, book, _ = grade(tmp_path, "--seed", "7")
    notes = book["learners"]["dee"]["notes"]["01_kv_cache_memory.ipynb"]
    assert status == 1 and statuses(book, "dee") == ["PASS", "FAIL", "PASS"] and book["seed"] == 7
    assert "check cell 01-07 was edited; its source was restored" in notes
    assert "check cell 01-10 (ch01.best_block_size) was missing and was put back" in notes
    drawn = ref01.SIDES["new_blocks"].hidden(random.Random("7:ch01.new_blocks"))
    assert drawn == ref01.SIDES["new_blocks"].hidden(random.Random("7:ch01.new_blocks")) and len(drawn) == 13


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
    with pytest.raises(exercises.ReleaseError, match="not an empty folder"):
        exercises.release(handout)
    script = (f"{RIGHT['01-06']}\n{WRONG_NEW.replace('new_blocks', 'wrong')}\nfrom minipaged.checks import ch01\n"
              "ch01.check_new_blocks(new_blocks); ch01.check_new_blocks(wrong)\n"
              "import importlib.util; print(importlib.util.find_spec('minipaged.checks.instructor'))")
    done = subprocess.run([sys.executable, "-c", script], env={"PYTHONPATH": str(handout), "PATH": "/usr/bin"},
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    lines = done.stdout.splitlines()
    assert lines[0].startswith("✅ PASS   ch01.new_blocks") and lines[-1] == "None", done.stderr
    namespace = {}
    exec(WRONG_NEW, namespace)
    assert lines[1] == str(ch01.check_new_blocks(namespace["new_blocks"])).splitlines()[0]


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
    threads = f"import torch\n{RIGHT['01-03']}\nif torch.get_num_threads() != {want}:\n    del blocks_that_fit"
    write(tmp_path, "a", notebook({"01-03": threads}))
    write(tmp_path, "b", notebook({"01-03": threads.replace(f"!= {want}", f"!= {want + 1}")}))
    status, book, _ = grade(tmp_path, "--jobs", str(jobs))
    assert statuses(book, "a") == ["PASS"] * 3 and statuses(book, "b") == ["FAIL", "PASS", "PASS"]


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
