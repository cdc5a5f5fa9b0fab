"""Any file, any name, any transcript (issue 41, kinds 8 to 10): the grader reads only regular files of a
bounded size, prints every name and message escaped, and FAILs one learner's unreadable answer instead of
failing the run. In each class the other learners are graded as usual."""

import json
import os
import threading

import nbformat
import pytest
from test_grader import CHECKS, ROOT, WRONG_FIXED, grade, notebook, statuses, write

from minipaged.checks import SCHEMA, CheckFailed, check, expect_close, handin
from minipaged.checks import __main__ as grader

pytestmark = pytest.mark.exercises

NAME = "01_kv_cache_memory.ipynb"


def test_a_file_that_is_not_a_regular_notebook_is_its_learners_row_and_the_class_is_graded(tmp_path):
    """Kind 8: a FIFO and a link to ``/dev/zero`` named like notebooks, a link to a classmate's notebook, and a
    notebook whose ``nbformat_minor`` is not a number; each is a row of "could not be graded", exit 2."""
    honest = write(tmp_path, "ada", notebook({}))
    fifo = tmp_path / "submissions" / "fifo" / NAME
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    for learner, target in (("zero", "/dev/zero"), ("linker", honest)):
        (tmp_path / "submissions" / learner).mkdir()
        (tmp_path / "submissions" / learner / NAME).symlink_to(target)
    bad = json.loads(honest.read_text())
    bad["nbformat_minor"] = "x"
    (tmp_path / "submissions" / "minor").mkdir()
    (tmp_path / "submissions" / "minor" / NAME).write_text(json.dumps(bad))

    status, book, csv_text = grade(tmp_path, "--jobs", "2")
    assert status == 2
    assert statuses(book, "ada") == ["PASS"] * 3
    why = {"fifo": "a FIFO", "zero": "a symbolic link", "linker": "a symbolic link", "minor": "not a notebook"}
    for learner, reason in why.items():
        assert statuses(book, learner) == [grader.UNGRADED] * 3, learner
        assert reason in book["learners"][learner]["checks"][CHECKS[0]]["message"], learner
        assert f"{learner},UNGRADED,UNGRADED,UNGRADED,0,3" in csv_text.replace("\r", "")


def test_a_piece_file_that_is_not_a_regular_file_makes_that_exercise_ungraded(tmp_path):
    """Kind 8 in the package files a learner hands in: a FIFO where ``minipaged/blocks.py`` goes never blocks."""
    exercise02 = nbformat.read(ROOT / "exercises" / "02_blocks_and_block_tables.ipynb", as_version=4)
    write(tmp_path, "ada", notebook({}))
    write(tmp_path, "fifo", exercise02, "02_blocks_and_block_tables.ipynb", pieces={})
    (tmp_path / "submissions" / "fifo" / "minipaged").mkdir()
    os.mkfifo(tmp_path / "submissions" / "fifo" / "minipaged" / "blocks.py")
    status, book, _ = grade(tmp_path, "--jobs", "2")
    assert status == 2
    assert statuses(book, "ada") == ["PASS"] * 3
    row = book["learners"]["fifo"]["checks"]
    checks02 = [name for name in book["checks"] if name.startswith("ch02.")]
    assert checks02 and all(row[name]["status"] == grader.UNGRADED for name in checks02)
    assert "a FIFO" in row[checks02[0]]["message"]


def test_reading_refuses_what_is_too_big_and_gives_up_on_a_stalled_read(tmp_path, monkeypatch):
    path = tmp_path / "big.ipynb"
    path.write_bytes(b"x" * 11)
    assert handin.read_handed_in(path, limit=11) == b"x" * 11
    with pytest.raises(grader.GradeError, match="more than the 10 bytes"):
        handin.read_handed_in(path, limit=10)
    stalled = threading.Event()

    def stall(*args, **kwargs):  # an open that does not return until the test ends (a stalled network mount)
        stalled.wait()
        raise OSError("gone")

    monkeypatch.setattr(handin.os, "open", stall)
    try:
        with pytest.raises(grader.GradeError, match="could not be read within 0.2 s"):
            handin.read_handed_in(path, timeout=0.2)
    finally:
        stalled.set()


ESCAPE = "\x1b[2K\x1b[1Gada      PASS"


def test_a_name_with_terminal_codes_is_printed_escaped(tmp_path, capsys):
    """Kind 9: a learner folder named with escape codes cannot repaint a row, in the table, the details or CSV."""
    write(tmp_path, "ada", notebook({}))
    write(tmp_path, ESCAPE, notebook({}), pieces={"1.1": WRONG_FIXED})
    status, book, csv_text = grade(tmp_path, "--jobs", "2")
    assert status == 1
    assert statuses(book, ESCAPE) == ["FAIL", "PASS", "PASS"]  # the JSON keeps the name as it is
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x1b" not in csv_text
    assert "\\x1b[2K\\x1b[1Gada" in out and "\\x1b[2K\\x1b[1Gada" in csv_text


def test_shown_escapes_every_character_a_terminal_would_act_on():
    assert handin.shown("bo") == "bo" and handin.shown("Zoë 李") == "Zoë 李"
    assert handin.shown("a\nb\rc\x07\u202ed") == "a\\nb\\rc\\x07\\u202ed"


DEEP = ("import builtins\n_print = builtins.print\n"
        "def deep(*a, **k):\n"
        "    if a and isinstance(a[0], str) and a[0].startswith('@@minipaged-transcript-'):\n"
        "        a = (a[0][:a[0].index('@@', 2) + 2] + '[' * 100_000 + ']' * 100_000,)\n"
        "    return _print(*a, **k)\n"
        "builtins.print = deep\n")


def test_a_transcript_nested_past_the_parser_fails_its_learner_not_the_run(tmp_path):
    """Kind 10: a transcript JSON cannot decode is a FAIL for that learner; the run exits 1, not 3."""
    write(tmp_path, "ada", notebook({}))
    write(tmp_path, "deep", notebook({"01-01": DEEP + notebook({}).cells[2].source}))  # before every check
    status, book, _ = grade(tmp_path, "--jobs", "2")
    assert status == 1
    assert statuses(book, "ada") == ["PASS"] * 3
    assert statuses(book, "deep") == ["FAIL"] * 3
    assert "nested too deep to decode" in book["learners"]["deep"]["checks"][CHECKS[0]]["message"]


@check("test_grader_files.ratio")
def check_ratio(case, fn):
    return fn(case)


@check_ratio.judge
def _(case, got, want):
    expect_close(got, want, f"ratio({case})")


@pytest.mark.parametrize("observation, words", [(10**400, "too large"), ([[[]]], "not a number"),
                                                ({"a": 1}, "not a number")])
def test_an_observation_no_judge_expects_is_a_fail_with_a_reason(observation, words):
    """Kind 10: ``10**400`` where a float goes (``float()`` overflows) is a FAIL, not an exception."""
    want = {"schema": SCHEMA, "check": check_ratio.name, "observations": [0.5], "end": {"kind": "done"}}
    got = dict(want, observations=[observation])
    result = check_ratio.verdict([2], got, want, 1)
    assert result.status == grader.FAIL and words in result.message


def test_expect_close_names_an_integer_too_large_for_a_float():
    with pytest.raises(CheckFailed, match="too large to compare as a float"):
        expect_close(10**400, 1.0, "x")
