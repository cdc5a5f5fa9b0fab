"""The learner's package has holes (issue 40): each piece an exercise builds is a stub in the handout.

A piece's body is marked in the repository (``### BEGIN SOLUTION (Exercise NN, Task N.M)``); ``release``
writes a stub there that raises ``PieceNotBuilt``; ``reveal`` fills one exercise's pieces of a handout
with the model answers, the way a learner fills them (in the file); the grader grades the piece files a
learner hands in.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from test_exercises import chapter_text

from minipaged import exercises
from minipaged.checks import __main__ as grader
from minipaged.exercises import ROOT, MarkerError, ReleaseError, find_holes, package_holes, stub_source
from minipaged.pieces import PieceNotBuilt, show_unbuilt_pieces_briefly

pytestmark = pytest.mark.exercises

SOURCE = '''"""A module with two pieces."""

from __future__ import annotations

import math


class Pool:
    def grow(self, n):
        """Grow by ``n``."""
        n = int(n)  # given: stays in the handout
        ### BEGIN SOLUTION (Exercise 02, Task 2.1)
        self.size = getattr(self, "size", 0) + n
        return math.ceil(self.size / 4)
        ### END SOLUTION


def double(x):
    ### BEGIN SOLUTION (Exercise 02, Task 2.2)
    return x * 2
    ### END SOLUTION
'''


def test_a_stub_keeps_what_is_given_and_names_the_exercise_task_piece_and_file():
    out = stub_source(SOURCE, "minipaged/pool.py")
    assert "self.size" not in out and "x * 2" not in out
    assert "n = int(n)  # given: stays in the handout" in out and '"""Grow by ``n``."""' in out
    lines = out.splitlines()
    stub = next(i for i, line in enumerate(lines) if "your code here" in line)  # the import stays with its raise
    assert lines[stub + 1].strip() == "from minipaged.pieces import PieceNotBuilt"
    assert lines[stub + 2].strip().startswith("raise PieceNotBuilt('02', '2.1', 'Pool.grow'")
    assert not any(line.startswith("from minipaged.pieces") for line in lines)  # none at the top to go unused
    namespace = {}
    exec(compile(out, "pool.py", "exec"), namespace)
    with pytest.raises(PieceNotBuilt) as raised:
        namespace["Pool"]().grow(3)
    assert (raised.value.exercise, raised.value.task, raised.value.piece) == ("02", "2.1", "Pool.grow")
    assert str(raised.value) == "Pool.grow is not built yet: exercise 02, Task 2.1 builds it in minipaged/pool.py"
    with pytest.raises(PieceNotBuilt, match=r"^double is not built yet: exercise 02, Task 2\.2"):
        namespace["double"](1)
    assert isinstance(raised.value, NotImplementedError)  # what the checks report as NOT IMPLEMENTED YET
    assert stub_source("x = 1\n", "m.py") == "x = 1\n"  # a file without pieces is left as it is


MIXED = SOURCE.replace("(Exercise 02, Task 2.2)", "(Exercise 06, Task 6.1)")  # a file with two exercises' pieces
THEIRS = '''import math


class Pool:
    def _add(self, n):  # a helper of the learner's own
        self.size = getattr(self, "size", 0) + n

    def grow(self, n):
        self._add(int(n))
        return -(-self.size // 4)


def double(x):
    return x  # exercise 06 not done yet
'''


def test_one_exercises_pieces_are_stubbed_or_taken_from_a_learner_with_the_classes_around_them():
    only_06 = stub_source(MIXED, "minipaged/pool.py", ("06",))
    assert "self.size = getattr" in only_06 and "x * 2" not in only_06 and "PieceNotBuilt('06', '6.1'" in only_06
    assert exercises.lay_pieces(SOURCE, THEIRS, ("02",), "m.py") == THEIRS  # every piece is 02's: the file is theirs
    laid = exercises.lay_pieces(MIXED, THEIRS, ("02",), "m.py")
    namespace = {}
    exec(compile(laid, "pool.py", "exec"), namespace)
    assert namespace["Pool"]().grow(5) == 2 and "_add" in vars(namespace["Pool"])  # theirs, with their helper
    assert namespace["double"](3) == 6  # exercise 06's piece stays the reference's
    assert exercises.lay_pieces(MIXED, "def (", ("02",), "m.py") == "def ("  # a file that does not parse is theirs
    assert exercises.graded_pieces("02") == ("02",) and exercises.graded_pieces("09") == ("02", "03", "05", "06")


SHARED = '''class Table:
    def grow(self, n):
        ### BEGIN SOLUTION (Exercise 02, Task 2.1)
        return n + 1
        ### END SOLUTION

    def copy(self):
        ### BEGIN SOLUTION (Exercise 06, Task 6.5)
        return "copied"
        ### END SOLUTION
'''
SHARED_THEIRS = '''class Table:
    def grow(self, n):
        return n  # exercise 02, wrong

    def copy(self):
        return self._copy_helper()

    def _copy_helper(self):  # theirs
        return "copied"
'''


def test_a_class_with_two_exercises_pieces_is_theirs_for_the_graded_one_and_the_model_answer_for_the_other():
    laid = exercises.lay_pieces(SHARED, SHARED_THEIRS, ("06",), "m.py")
    namespace = {}
    exec(compile(laid, "table.py", "exec"), namespace)
    table = namespace["Table"]()
    assert table.copy() == "copied" and table.grow(1) == 2  # their 06 method with their helper; 02's is the model's
    graded_02 = {}
    exec(compile(exercises.lay_pieces(SHARED, SHARED_THEIRS, ("02",), "m.py"), "table.py", "exec"), graded_02)
    assert graded_02["Table"]().grow(1) == 1  # grading 02 takes their (wrong) grow


BEGIN = "    ### BEGIN SOLUTION (Exercise 02, Task 2.1)"
END = "    ### END SOLUTION"


@pytest.mark.parametrize("source, match", [
    (f"def f():\n{BEGIN}\n    return 1\n", "line 2: BEGIN SOLUTION is never closed"),
    (f"def f():\n{BEGIN}\n{BEGIN}\n    return 1\n{END}\n{END}\n", "line 3: BEGIN SOLUTION inside another"),
    (f"def f():\n    return 1\n{END}\n", "line 3: END SOLUTION without BEGIN"),
    (f"if True:\n{BEGIN}\n    x = 1\n{END}\n", "line 2: a BEGIN SOLUTION marker must sit inside a function"),
])  # fmt: skip
def test_bad_markers_are_refused_with_the_file_and_line(source, match):
    with pytest.raises(MarkerError, match=f"^m.py, {match}"):
        find_holes(source, "m.py")


def test_the_package_marks_the_pieces_of_exercises_01_02_05_06_07_and_08():
    holes = {h.piece: h for hs in package_holes(ROOT).values() for h in hs}
    assert {"NgramSpeculator.schedule_drafts", "rollback_drafts"} <= set(holes)
    assert {(h.exercise, h.task) for h in holes.values() if "rollback" in h.piece or "draft" in h.piece} == {
        ("08", "8.1")}
    assert {(h.exercise, h.task) for h in holes.values() if h.piece.startswith(("BlockAllocator.", "BlockTable."))} == {
        ("02", "2.1"), ("02", "2.2"), ("06", "6.5")}
    assert holes["BlockTable._copy_on_write"].exercise == "06"
    assert {(h.exercise, h.task) for h in holes.values() if h.piece.startswith("PrefixCachingAllocator.")} == {
        ("06", "6.2"), ("06", "6.3"), ("06", "6.4")}
    assert (holes["block_keys"].task, holes["extra_keys"].task) == ("6.1", "6.1")
    assert {(h.exercise, h.task) for h in holes.values() if h.piece.startswith(("Scheduler.", "FCFSQueue."))} == {
        ("05", "5.1"), ("05", "5.2")}
    assert [(h.piece, h.exercise, h.task) for h in holes.values() if h.exercise == "07"] == [
        ("min_utilization", "07", "7.1")]  # plan, its forward arithmetic, stays given: the chapter teaches it
    assert {h.piece: (h.exercise, h.task) for h in holes.values() if h.exercise == "01"} == {
        "fixed_breakdown": ("01", "1.1"), "paged_breakdown": ("01", "1.2")}
    assert exercises.piece_files() == ["minipaged/accounting.py", "minipaged/attention.py", "minipaged/blocks.py",
                                       "minipaged/planner.py", "minipaged/prefix_cache.py",
                                       "minipaged/request_queue.py", "minipaged/scheduler.py",
                                       "minipaged/speculative.py", "kernels/paged_attention.py"]


def test_the_package_marks_exercise_03s_pieces():
    """The "torch" backend's decode (with the gather plan it reads) and prefill; their given neighbours stay."""
    holes = [h for hs in package_holes(ROOT).values() for h in hs if h.exercise == "03"]
    assert [(h.piece, h.task) for h in holes] == [("_gather_plan", "3.1"), ("_paged_decode_torch", "3.1"),
                                                  ("_paged_prefill_torch", "3.2")]  # fmt: skip


def test_the_package_marks_exercise_04s_kernel_and_its_launcher_reports_the_stub():
    holes = [h for hs in package_holes(ROOT).values() for h in hs if h.exercise == "04"]
    assert [(h.piece, h.task) for h in holes] == [("attend_tile", "4.1"), ("_paged_decode_kernel", "4.1")]
    source = (ROOT / "kernels" / "paged_attention.py").read_text()
    stubbed = stub_source(source, "kernels/paged_attention.py")
    assert "raise PieceNotBuilt('04', '4.1', '_paged_decode_kernel', 'kernels/paged_attention.py')" in stubbed
    assert "raise PieceNotBuilt('04', '4.1', 'attend_tile', 'kernels/paged_attention.py')" in stubbed
    assert "def store_partials(" in stubbed and "def load_kv_tile(" in stubbed  # given, around the piece


def test_unbuilt_reads_a_stub_in_a_kernels_source_where_a_raise_cannot_run(tmp_path, monkeypatch):
    from minipaged.pieces import unbuilt

    module = tmp_path / "stubbed_kernel.py"
    module.write_text(stub_source(SOURCE, "minipaged/pool.py").replace("class Pool", "class Pool2"))
    monkeypatch.syspath_prepend(str(tmp_path))
    import stubbed_kernel

    todo = unbuilt(stubbed_kernel.double)
    assert isinstance(todo, PieceNotBuilt) and (todo.exercise, todo.task, todo.piece) == ("02", "2.2", "double")
    assert unbuilt(stubbed_kernel.double) is not todo  # a fresh exception each time: a raise keeps no old traceback
    assert unbuilt(test_unbuilt_reads_a_stub_in_a_kernels_source_where_a_raise_cannot_run) is None
    assert unbuilt(len) is None  # no source: nothing to find


def test_in_a_notebook_an_unbuilt_piece_prints_one_line_not_a_traceback(capsys):
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        show_unbuilt_pieces_briefly()
        shell.run_cell("from minipaged.pieces import PieceNotBuilt\n"
                       "raise PieceNotBuilt('08', '8.1', 'rollback_drafts', 'minipaged/speculative.py')")
        out = capsys.readouterr()
        assert out.out == ("⏳ rollback_drafts is not built yet: exercise 08, Task 8.1 builds it in "
                           "minipaged/speculative.py\n")
        assert "Traceback" not in out.out + out.err
        shell.run_cell("raise ValueError('other errors keep their traceback')")
        assert "Traceback" in capsys.readouterr().out
    finally:
        InteractiveShell.clear_instance()


# ----------------------------------------------------------------- the handout


@pytest.fixture(scope="module")
def handout(tmp_path_factory):
    target = tmp_path_factory.mktemp("release") / "handout"
    exercises.release(target)
    return target


def _normalized(path: Path) -> str:
    """A file's text, whitespace-normalised; a notebook's sources and saved outputs."""
    if path.suffix == ".ipynb":
        return chapter_text(path)
    return " ".join(path.read_text(errors="replace").split())


def test_no_line_of_any_piece_is_anywhere_in_the_handout(handout):
    pieces = package_holes(ROOT)
    bodies = {" ".join(line.split("#")[0].split()) for holes in pieces.values() for hole in holes for line in hole.body}
    bodies = {line for line in bodies if len(line) >= 25}  # shorter ones (`table = seq.block_table`) say nothing
    given = set()  # a line the package also has outside every piece (`n = check_int(num_tokens, ...)`) is no answer
    for path in sorted((ROOT / "minipaged").rglob("*.py")) + sorted((ROOT / "kernels").rglob("*.py")):
        spans = {(h.start, h.end) for h in pieces.get(path, [])}
        given |= {" ".join(line.split("#")[0].split()) for number, line in enumerate(path.read_text().splitlines(), 1)
                  if not any(a <= number <= b for a, b in spans)}  # fmt: skip
    bodies -= given
    assert len(bodies) >= 10
    scanned = 0
    for path in sorted(handout.rglob("*")):
        if path.is_file() and path.suffix in (".py", ".ipynb", ".md", ".json", ".toml", ".txt", ".cfg"):
            text = _normalized(path)
            leaked = sorted(line for line in bodies if line in text)
            assert not leaked, f"{path.relative_to(handout)} holds lines of a piece: {leaked[:3]}"
            scanned += 1
    assert scanned > 100


SPECULATOR = ("from minipaged.checks import ch08\nfrom minipaged.speculative import NgramSpeculator\n"
              "ch08.check_speculator(NgramSpeculator)\n")
ALLOCATOR = ("from minipaged.checks import ch02\nfrom minipaged.blocks import BlockAllocator, BlockTable\n"
             "ch02.check_allocator(BlockAllocator)\nch02.check_engine(BlockAllocator, BlockTable)\n")
PREFIX_CACHE = ("from minipaged.checks import ch06\nfrom minipaged.blocks import BlockTable\n"
                "from minipaged.prefix_cache import PrefixCachingAllocator, block_keys\n"
                "ch06.check_block_keys(block_keys)\nch06.check_prefix_cache(PrefixCachingAllocator)\n"
                "ch06.check_cow_table(BlockTable)\n")


def _run_checks(package: Path, script: str = SPECULATOR) -> list[str]:
    """A script of checks (exercise 08's by default) on ``package``'s own pieces, run as a learner's kernel would."""
    done = subprocess.run([sys.executable, "-c", script], env={"PYTHONPATH": str(package), "PATH": "/usr/bin"},
                          capture_output=True, text=True, timeout=300, cwd=package)  # fmt: skip
    return done.stdout.splitlines() or [done.stderr]


def test_untouched_stubs_do_not_pass_and_reveal_fills_them_as_a_learner_would(handout, tmp_path):
    """A check reports the first piece it meets that is not built: its own exercise's, or an earlier one's that its
    engine runs on (exercise 08's speculator runs in an engine with 02's allocator and 05's scheduler)."""
    lines = [line for line in _run_checks(handout, ALLOCATOR) if not line.startswith(" ")]  # verdicts, no hints
    assert lines[0].startswith("⏳ NOT IMPLEMENTED YET   ch02.allocator"), lines
    assert "exercise 02, Task 2.1 builds it in minipaged/blocks.py" in lines[0]
    assert lines[1].startswith("⏳ NOT IMPLEMENTED YET   ch02.engine"), lines  # the scheduler is replayed: 02's own
    assert "exercise 02, Task 2." in lines[1]
    lines = [line for line in _run_checks(handout, PREFIX_CACHE) if not line.startswith(" ")]
    assert lines[0].startswith("⏳ NOT IMPLEMENTED YET   ch06.block_keys"), lines
    assert "exercise 06, Task 6.1 builds it in minipaged/prefix_cache.py" in lines[0]
    assert all(line.startswith("⏳ NOT IMPLEMENTED YET   ch06.") for line in lines[1:3]), lines
    workspace = tmp_path / "workspace"
    shutil.copytree(handout, workspace)
    assert _run_checks(workspace)[0].startswith("⏳ NOT IMPLEMENTED YET   ch08.speculator")
    first = _run_checks(workspace)[0]  # the first unbuilt piece its engine meets: an earlier exercise's
    assert "is not built yet: exercise 0" in first and "exercise 08" not in first, first
    for earlier in ("2", "3", "5", "6"):
        assert exercises.main(["reveal", earlier, str(workspace)]) == 0
    lines = _run_checks(workspace)
    assert lines[0].startswith("⏳ NOT IMPLEMENTED YET   ch08.speculator"), lines
    assert "exercise 08, Task 8.1 builds it in minipaged/speculative.py" in lines[0]
    mine = workspace / "minipaged" / "speculative.py"
    mine.write_text(mine.read_text().replace("raise PieceNotBuilt('08', '8.1', 'rollback_drafts'",
                                             "return 0  # a wrong try\n    raise PieceNotBuilt('08', '8.1', "
                                             "'rollback_drafts'"))  # fmt: skip
    assert exercises.main(["reveal", "08", str(workspace)]) == 0
    assert _run_checks(workspace)[0].startswith("✅ PASS   ch08.speculator"), _run_checks(workspace)
    assert "a wrong try" not in mine.read_text() and "### BEGIN SOLUTION" not in mine.read_text()
    record = json.loads((workspace / exercises.REVEALED).read_text())
    assert [(r["exercise"], r["pieces"][:2]) for r in record] == [
        ("02", ["BlockAllocator.allocate", "BlockAllocator.allocate_many"]),
        ("03", ["_gather_plan", "_paged_decode_torch"]),
        ("05", ["FCFSQueue.victim", "Scheduler._chunk"]),
        ("06", ["BlockTable._copy_on_write", "extra_keys"]),
        ("08", ["rollback_drafts", "NgramSpeculator.schedule_drafts"])]
    assert exercises.main(["reveal", "09", str(workspace)]) == 2  # builds no piece: one line, nothing written


def _check_attention(package: Path) -> list[str]:
    """Exercise 03's checks on ``package``'s own "torch" backend, run as a learner's kernel would."""
    script = ("from minipaged.checks import ch03\nfor check in (ch03.check_paged_attention, ch03.check_vectorised, "
              "ch03.check_engine):\n    check('torch')\n")
    done = subprocess.run([sys.executable, "-c", script], env={"PYTHONPATH": str(package), "PATH": "/usr/bin"},
                          capture_output=True, text=True, timeout=300, cwd=package)  # fmt: skip
    return [line for line in done.stdout.splitlines() if not line.startswith(" ")] or [done.stderr]


def test_exercise_03s_untouched_stubs_are_not_implemented_and_reveal_makes_them_pass(handout, tmp_path):
    """Tasks 3.1 and 3.2 in the handout's minipaged/attention.py: every check names the exercise (the engine's, the
    first piece it meets: exercise 02's allocator), then PASSes once 02 and 03 are done; no check needs exercise 05."""
    lines = _check_attention(handout)
    assert len(lines) == 3 and all(line.startswith("⏳ NOT IMPLEMENTED YET   ch03.") for line in lines), lines
    assert all("exercise 03, Task 3." in line and "minipaged/attention.py" in line for line in lines[:2]), lines
    assert "exercise 02, Task 2." in lines[2], lines
    workspace = tmp_path / "workspace"
    shutil.copytree(handout, workspace)
    assert exercises.main(["reveal", "02", str(workspace)]) == 0
    assert exercises.main(["reveal", "03", str(workspace)]) == 0
    lines = _check_attention(workspace)
    assert [line.split(":")[0] for line in lines] == ["✅ PASS   ch03.paged_attention", "✅ PASS   ch03.vectorised",
                                                      "✅ PASS   ch03.engine"], lines  # fmt: skip
    record = json.loads((workspace / exercises.REVEALED).read_text())
    assert record[-1]["pieces"] == ["_gather_plan", "_paged_decode_torch", "_paged_prefill_torch"]


def test_release_refuses_a_target_inside_what_it_copies_and_an_unwritable_one(tmp_path, capsys):
    inside = ROOT / "notebooks" / "handout"
    with pytest.raises(ReleaseError, match=r"inside notebooks/, which the handout copies"):
        exercises.release(inside)
    assert not inside.exists()
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    assert exercises.main(["release", str(blocker / "handout")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {blocker / 'handout'}: cannot write the handout there")


def test_the_grader_grades_the_piece_files_a_learner_hands_in(tmp_path):
    """Exercise 08's notebook and, for ada, her minipaged/speculative.py (the model answer) and a blocks.py with
    exercise 02 not done (exercise 08 is graded on the model allocator); bo hands in no piece file."""
    notebook = ROOT / "exercises" / "08_beyond.ipynb"
    for learner in ("ada", "bo"):
        (tmp_path / "submissions" / learner).mkdir(parents=True)
        shutil.copy(notebook, tmp_path / "submissions" / learner / notebook.name)
    (tmp_path / "submissions" / "ada" / "minipaged").mkdir()
    shutil.copy(ROOT / "minipaged" / "speculative.py", tmp_path / "submissions" / "ada" / "minipaged")
    blocks = ROOT / "minipaged" / "blocks.py"
    (tmp_path / "submissions" / "ada" / "minipaged" / "blocks.py").write_text(
        stub_source(blocks.read_text(), "minipaged/blocks.py"))
    (tmp_path / "submissions" / "bo" / "minipaged").mkdir()
    (tmp_path / "submissions" / "bo" / "minipaged" / "checks.py").write_text("raise SystemExit  # not a piece file")
    prefix = tmp_path / "book"
    grader.main(["grade", str(tmp_path / "submissions"), "--gradebook", str(prefix)])
    book = json.loads(prefix.with_suffix(".json").read_text())
    ada, bo = (book["learners"][name]["checks"]["ch08.speculator"] for name in ("ada", "bo"))
    assert ada["status"] == "PASS", ada
    assert bo["status"] == "NOT IMPLEMENTED YET" and "exercise 08, Task 8.1" in bo["message"], bo


# exercise: its notebooks' name, its checks, and the exercises whose pieces its chapter runs on
FILLED = {"01": ("01_kv_cache_memory.ipynb", ["ch01.fixed_breakdown", "ch01.paged_breakdown"], ["01"]),
          "02": ("02_blocks_and_block_tables.ipynb", ["ch02.allocator", "ch02.engine", "ch02.constant_time"], ["02"]),
          "03": ("03_paged_attention_pytorch.ipynb", ["ch03.paged_attention", "ch03.vectorised", "ch03.engine"],
                 ["02", "03"]),
          "04": ("04_triton_kernel.ipynb", ["ch04.decode_kernel", "ch04.prefill_kernel"], ["02", "03", "04"]),
          "05": ("05_continuous_batching.ipynb", ["ch05.schedule_running", "ch05.scheduler"], ["02", "03", "05"]),
          "06": ("06_prefix_sharing_cow.ipynb", ["ch06.block_keys", "ch06.prefix_cache", "ch06.constant_time",
                                                 "ch06.cow_table"], ["02", "03", "05", "06"]),
          "07": ("07_tradeoffs.ipynb", ["ch07.min_utilization"], ["02", "03", "05", "06", "07"]),
          "08": ("08_beyond.ipynb", ["ch08.speculator"], ["02", "03", "05", "06", "08"])}


@pytest.mark.parametrize("exercise", FILLED)
def test_the_handout_filled_the_learners_way_runs_the_chapter_and_the_exercise(handout, tmp_path, exercise):
    """One exercise's pieces revealed into the handout's files: its chapter gives its committed outputs (nbval) on
    them, and the exercise runs to the end with every check PASSing."""
    name, checks, needs = FILLED[exercise]
    workspace = tmp_path / "workspace"
    shutil.copytree(handout, workspace)
    for number in needs:
        assert exercises.main(["reveal", number, str(workspace)]) == 0
    env = {"PYTHONPATH": str(workspace), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "OMP_NUM_THREADS": "2"}
    python = sys.executable
    if exercise == "04":  # minipaged.kernels is the handout's kernels/ only in an environment of the handout's own
        assert exercises.main(["workspace", str(workspace)]) == 0  # (under PYTHONPATH, the repository's install
        python = str(workspace / ".venv" / "bin" / "python")  # maps it to the repository's own)
        del env["PYTHONPATH"]
    done = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval",
                           "--nbval-current-env", "--nbval-sanitize-with", str(ROOT / "nbval_sanitize.cfg"),
                           f"notebooks/{name}"], cwd=workspace, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    ran = tmp_path / "ran.ipynb"
    done = subprocess.run([python, "-m", "nbconvert", "--to", "notebook", "--execute",
                           "--allow-errors", "--output", str(ran), f"exercises/{name}"], cwd=workspace,
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    nb = nbformat.read(ran, as_version=4)
    errors = [out for cell in nb.cells for out in cell.get("outputs", []) if out.output_type == "error"]
    assert not errors, errors[0]
    printed = "".join(out.get("text", "") for cell in nb.cells for out in cell.get("outputs", []))
    assert all(f"✅ PASS   {check}" in printed for check in checks), printed[-2000:]


def test_a_workspace_has_an_environment_of_its_own_whose_package_is_the_handouts(handout, tmp_path):
    """``make learner``'s workspace: the repository's editable install (the answers) is not what it imports."""
    target = tmp_path / "workspace"
    shutil.copytree(handout, target)
    assert exercises.main(["workspace", str(target)]) == 0
    probe = ("import jupyterlab, ipykernel, torch\nimport minipaged, minipaged.kernels, minipaged.speculative as s\n"
             "print(minipaged.__file__)\nprint(minipaged.kernels.__file__)\n"
             "try:\n    s.rollback_drafts(None, 0, 0, 0)\nexcept NotImplementedError as exc:\n"
             "    print(type(exc).__name__)\n")  # fmt: skip
    done = subprocess.run([str(target / ".venv" / "bin" / "python"), "-c", probe], env={"PATH": "/usr/bin:/bin"},
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.stdout.splitlines() == [str(target / "minipaged" / "__init__.py"),
                                        str(target / "kernels" / "__init__.py"), "PieceNotBuilt"], done.stderr
    for tool in ("jupyterlab", "nbconvert"):  # what `make learner` starts, and what runs a notebook from a shell
        done = subprocess.run([str(target / ".venv" / "bin" / "python"), "-m", tool, "--version"], cwd=target,
                              env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert done.returncode == 0 and done.stdout.strip(), (tool, done.stderr[-500:])
    jupyter = target / ".venv" / "bin" / "jupyter"  # `jupyter nbconvert` finds its subcommand, run by the workspace
    assert jupyter.read_text().startswith(f"#!{target / '.venv' / 'bin' / 'python'}\n")
    done = subprocess.run([str(jupyter), "nbconvert", "--version"], cwd=target, capture_output=True, text=True,
                          env={"PATH": f"{target / '.venv' / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path)}, timeout=120)
    assert done.returncode == 0 and done.stdout.strip(), done.stderr[-500:]
    mine = target / "minipaged" / "speculative.py"
    mine.write_text(mine.read_text() + "# the learner's work\n")
    assert exercises.main(["workspace", str(target)]) == 0  # reopened: the work is kept
    assert mine.read_text().endswith("# the learner's work\n")
