"""Time limits count the kernel's CPU time, so a busy machine does not fail correct work (issue 41).

The reference answer of exercise 02 is graded twice: on the machine as it is, to learn what each check costs,
then beside two busy processes with a limit that is less than the loaded checks' wall-clock time but more than
their CPU time. Every check must PASS; and since the loaded runs took longer than the limit, a wall-clock limit
would have failed them, so the test can tell the two kinds of limit apart. A loop that computes forever still
times out, and a cell that only waits is stopped by the wall-clock backstop.
"""

import json
import shutil
import subprocess
import sys
import time

import pytest
from test_grader import NO_WORKED_CELLS, ROOT, grade, notebook, statuses, write

from minipaged.checks import WALL_FACTOR, timeout_message
from minipaged.checks import __main__ as grader
from minipaged.checks.cpu_time import tree_cpu_seconds

pytestmark = pytest.mark.exercises

EXERCISE = "02_blocks_and_block_tables.ipynb"


def reference_class(tmp_path):
    folder = tmp_path / "submissions" / "ref"
    (folder / "minipaged").mkdir(parents=True)
    shutil.copy(ROOT / "solutions" / EXERCISE, folder / EXERCISE)
    shutil.copy(ROOT / "minipaged" / "blocks.py", folder / "minipaged" / "blocks.py")


def record_runs(monkeypatch) -> list[tuple[str, float, float]]:
    """Each probe run's (status, CPU seconds per thread, wall seconds), as the grader runs them."""
    runs = []
    run = grader.Kernel.run

    async def recorded(self, code, limit, wall=None):
        root = self.km.provisioner.pid
        cpu, start = tree_cpu_seconds(root), time.monotonic()
        result = await run(self, code, limit, wall)
        if "_minipaged_probe" in code:
            runs.append((result.status, (tree_cpu_seconds(root) - cpu) / self.threads, time.monotonic() - start))
        return result

    monkeypatch.setattr(grader.Kernel, "run", recorded)
    return runs


def test_the_reference_passes_on_a_busy_machine_under_a_limit_its_wall_clock_time_exceeds(tmp_path, monkeypatch):
    reference_class(tmp_path)
    runs = record_runs(monkeypatch)
    status, book, _ = grade(tmp_path, "--jobs", "1")
    assert status == 0, book["learners"]["ref"]["checks"]
    limit = 1.5 * max(cpu for _, cpu, _ in runs) + 0.05  # half as much again as the dearest check's CPU time
    runs.clear()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        status, book, _ = grade(tmp_path, "--jobs", "1", "--check-timeout", f"{limit:.3f}")
    finally:
        for process in busy:
            process.kill()
            process.wait()
    assert status == 0, json.dumps(book["learners"]["ref"]["checks"])
    assert all(status == "ok" for status, _, _ in runs), (limit, runs)
    assert max(wall for _, _, wall in runs) > limit, (limit, runs)  # a wall-clock limit would have failed this run


def test_a_loop_runs_out_of_cpu_time_and_a_wait_runs_into_the_backstop(tmp_path):
    # Task 1.1's piece; the notebooks leave out chapter 01's worked cells, which would loop or wait too.
    write(tmp_path, "loop", notebook(NO_WORKED_CELLS), pieces={"1.1": "while True:\n    pass"})
    write(tmp_path, "wait", notebook(NO_WORKED_CELLS), pieces={"1.1": "import time\ntime.sleep(3600)"})
    status, book, _ = grade(tmp_path, "--jobs", "2", "--check-timeout", "0.5")
    assert status == 1
    assert statuses(book, "loop") == statuses(book, "wait") == ["FAIL", "PASS", "PASS"]
    loop_message = book["learners"]["loop"]["checks"]["ch01.fixed_breakdown"]["message"]
    assert loop_message.startswith("timed out after 0.5 s of CPU time")
    assert book["learners"]["wait"]["checks"]["ch01.fixed_breakdown"]["message"] == timeout_message(0.5, False, 1)
    assert f"after {0.5 * WALL_FACTOR:g} s" in timeout_message(0.5, False, 1)


def test_the_cpu_time_of_a_tree_counts_its_children():
    spin = "import time\\nend = time.process_time() + 0.5\\nwhile time.process_time() < end: pass"
    child = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', "
                              f"'{spin}']); import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 30
        while tree_cpu_seconds(child.pid) < 0.5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tree_cpu_seconds(child.pid) >= 0.5  # the grandchild's 0.5 s, reaped by its parent, still counts
    finally:
        child.kill()
        child.wait()
