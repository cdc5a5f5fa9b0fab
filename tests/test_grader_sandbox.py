"""Each learner's kernel runs in the grader's sandbox (issue 41): what a learner's code tries from inside fails,
and the class around it is graded as before.

A class of three learners of exercise 01 (pure Python, so a kernel run is short): ``ann`` the attacker, graded
first, then ``bo`` (right) and ``cy`` (a wrong ``fixed_breakdown`` in the accounting.py they hand in). The
attacker's Task 1.3 cell tries the attack and keeps its right ``largest_max_len`` only if the attack failed: the
sandbox cannot be seen from the test except through the verdicts, so ``ann`` PASSes every check exactly when the
sandbox held.
"""

import os
import sys
import sysconfig
from pathlib import Path

import pytest
from test_grader import NO_WORKED_CELLS, RIGHT, WRONG_FIXED, grade, notebook, statuses, write

from minipaged.checks import sandbox

pytestmark = [pytest.mark.exercises,
              pytest.mark.skipif(os.geteuid() != 0 or not all(map(sandbox.shutil.which, sandbox.TOOLS)),
                                 reason="the sandbox needs root and bubblewrap (CI installs it)")]

ROOT = Path(__file__).resolve().parent.parent


def attacked(attack: str) -> str:
    """Task 1.3's cell: ``attack`` (which sets ``escaped``), then a right answer that is deleted if it escaped."""
    return f"escaped = []\n{attack}\n{RIGHT['01-09']}\nif escaped:\n    print(escaped)\n    del largest_max_len"


def grade_class(tmp_path, attack: str, *args: str, honest: str = "") -> dict:
    """Grade ann (``attack``), bo and cy (``honest`` before bo's and cy's right Task 1.3) one at a time; check that
    bo and cy get their verdicts, and return the gradebook."""
    write(tmp_path, "ann", notebook({"01-09": attacked(attack)}))
    write(tmp_path, "bo", notebook({"01-09": attacked(honest)}))
    write(tmp_path, "cy", notebook({"01-09": attacked(honest)}), pieces={"1.1": WRONG_FIXED})
    status, book, _ = grade(tmp_path, "--seed", "5", *args)
    assert status in (0, 1)
    assert statuses(book, "bo") == ["PASS"] * 3 and statuses(book, "cy") == ["FAIL", "PASS", "PASS"]
    return book


def test_the_repository_solutions_instructor_side_classmates_and_gradebook_are_not_there(tmp_path, monkeypatch):
    """Kind 11: nothing of the machine's files but the system's, the venv's and the learner's own package; none of
    the grader's environment but the few settings the sandbox passes."""
    monkeypatch.setenv("MINIPAGED_SECRET", "the grader's")
    paths = [ROOT / "README.md", ROOT / "solutions" / "01_kv_cache_memory.ipynb",
             ROOT / "minipaged" / "checks" / "instructor", ROOT / "kernels", tmp_path / "submissions" / "bo", tmp_path]
    attack = (f"import os, importlib.util, minipaged, minipaged.kernels\n"
              f"escaped += [p for p in {[str(p) for p in paths]!r} if os.path.exists(p)]\n"
              "escaped += [s.name for s in [importlib.util.find_spec('minipaged.checks.instructor')] if s]\n"
              "package = os.path.dirname(minipaged.__file__)\n"
              "escaped += [f for f in [minipaged.kernels.__file__] if not f.startswith(package + os.sep)]\n"
              "escaped += [k for k in os.environ if 'SECRET' in k]")
    book = grade_class(tmp_path, attack)
    assert statuses(book, "ann") == ["PASS"] * 3


def test_signals_reach_no_process_outside_the_kernels_namespace(tmp_path):
    """Kind 6: the grader's pid, its parent's and every pid the kernel can see but its own: none can be signalled
    (ProcessLookupError outside its PID namespace, PermissionError for the sandbox's init)."""
    attack = (f"import os, signal\n"
              f"for pid in {[os.getpid(), os.getppid()]!r} + [int(p) for p in os.listdir('/proc') if p.isdigit()]:\n"
              "    if pid != os.getpid():\n"
              "        try:\n"
              "            os.kill(pid, signal.SIGSTOP); escaped.append(pid)\n"
              "        except (ProcessLookupError, PermissionError):\n"
              "            pass")
    book = grade_class(tmp_path, attack)
    assert statuses(book, "ann") == ["PASS"] * 3


def test_the_package_and_the_venv_are_read_only(tmp_path):
    """Kind 5: the learner's package copy, a ``.pth`` in the venv's site-packages and Python itself refuse writes;
    the learners graded next see the package as it was."""
    targets = [os.path.join(sysconfig.get_paths()["purelib"], "zz_minipaged.pth"), os.path.join(sys.prefix, "x"),
               os.path.join(sys.base_prefix, "lib", "x.py")]
    attack = (f"import os, minipaged.checks\n"
              f"for path in {targets!r} + [minipaged.checks.__file__, minipaged.__file__]:\n"
              "    try:\n"
              "        with open(path, 'a') as f:\n"
              "            f.write('\\nimport os; os._exit(1)\\n')\n"
              "        escaped.append(path)\n"
              "    except OSError:\n"
              "        pass")
    book = grade_class(tmp_path, attack)
    assert statuses(book, "ann") == ["PASS"] * 3
    assert not Path(targets[0]).exists()


def test_there_is_no_network(tmp_path):
    """Kind 11: no route out (the kernel's namespace has only its own loopback)."""
    attack = ("import socket\n"
              "for host in ('1.1.1.1', '8.8.8.8', '10.0.0.1'):\n"
              "    try:\n"
              "        socket.create_connection((host, 53), timeout=2).close(); escaped.append(host)\n"
              "    except OSError:\n"
              "        pass")
    book = grade_class(tmp_path, attack)
    assert statuses(book, "ann") == ["PASS"] * 3


def test_the_kernel_runs_as_its_own_uid_under_the_limits(tmp_path):
    """The limits are set in the kernel, as uid 1000 with no capabilities (so RLIMIT_NPROC holds)."""
    limits = sandbox.Confinement(cpu_seconds=1, memory=1)
    attack = (f"import os, resource\n"
              f"want = {{'NPROC': {limits.processes}, 'FSIZE': {limits.file_size}, 'NOFILE': {limits.open_files},"
              f" 'CORE': 0}}\n"
              "limit = lambda name: resource.getrlimit(getattr(resource, 'RLIMIT_' + name))[0]\n"
              "escaped += [k for k, v in want.items() if limit(k) != v]\n"
              "escaped += [k for k in ('CPU', 'DATA') if limit(k) < 0]\n"
              f"escaped += [u for u in os.getresuid() + os.getresgid() if u != {sandbox.FIRST_UID}] + os.getgroups()\n"
              "escaped += [line for line in open('/proc/self/status') if line.startswith(('CapEff', 'CapPrm'))"
              " and int(line.split()[1], 16)]")
    book = grade_class(tmp_path, attack)
    assert statuses(book, "ann") == ["PASS"] * 3


def test_forking_is_bounded_by_the_process_limit(tmp_path):
    """Kind 11: a fork loop stops at RLIMIT_NPROC (checked first in the same cell: no limit, no loop)."""
    limit = sandbox.Confinement(cpu_seconds=1, memory=1).processes
    attack = (f"import os, resource, time\n"
              f"if resource.getrlimit(resource.RLIMIT_NPROC)[0] != {limit} or os.getuid() != {sandbox.FIRST_UID}:\n"
              "    escaped.append('no limit: not forking')\n"
              "else:\n"
              "    children = []\n"
              f"    for _ in range({4 * limit}):\n"
              "        try:\n"
              "            pid = os.fork()\n"
              "        except OSError:\n"
              "            break\n"
              "        if pid == 0:\n"
              "            time.sleep(1); os._exit(0)\n"
              "        children.append(pid)\n"
              "    for pid in children:\n"
              "        os.waitpid(pid, 0)\n"
              f"    escaped += [len(children)] if len(children) >= {limit} else []")
    book = grade_class(tmp_path, attack)
    assert statuses(book, "ann") == ["PASS"] * 3


def test_what_a_learner_writes_is_gone_for_the_next(tmp_path):
    """Kind 7: a startup file in the kernel's home that kills every later kernel, and files in its home, /tmp and
    working directory: the next learners' kernels (the same uid: one at a time) start clean."""
    attack = ("import os\n"
              "startup = os.path.expanduser('~/.ipython/profile_default/startup')\n"
              "os.makedirs(startup, exist_ok=True)\n"
              "open(os.path.join(startup, '00-kill.py'), 'w').write('import os; os._exit(1)')\n"
              "for path in ('~/left', '/tmp/left', '/dev/shm/left', 'left'):\n"
              "    open(os.path.expanduser(path), 'w').write('ann')")
    honest = ("import os\n"
              "escaped += [p for p in ('~/left', '/tmp/left', '/dev/shm/left', 'left',"
              " '~/.ipython/profile_default/startup/00-kill.py') if os.path.exists(os.path.expanduser(p))]")
    book = grade_class(tmp_path, attack, honest=honest)
    assert statuses(book, "ann") == ["PASS"] * 3


def test_a_check_past_its_limit_is_interrupted_and_the_kernel_goes_on(tmp_path):
    """A SIGINT to the kernel's process group would kill bwrap and the kernel with it: the sandboxed kernel is
    interrupted on its control channel, and the checks after the loop still run in it. (ann's notebook has no
    worked cells of chapter 01, which would call the loop too.)"""
    write(tmp_path, "ann", notebook(NO_WORKED_CELLS), pieces={"1.1": "while True:\n    pass"})
    write(tmp_path, "bo", notebook({}))
    status, book, _ = grade(tmp_path, "--check-timeout", "1.5")
    assert status == 1 and statuses(book, "ann") == ["FAIL", "PASS", "PASS"] and statuses(book, "bo") == ["PASS"] * 3
    timed_out = book["learners"]["ann"]["checks"]["ch01.fixed_breakdown"]["message"]
    assert timed_out.startswith("timed out after 1.5 s of CPU time")
    assert book["learners"]["ann"]["notes"]["01_kv_cache_memory.ipynb"] == [f"cell 4 {timed_out} and was interrupted"]
