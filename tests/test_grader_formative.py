"""Measurements a learner's process could falsify (issue 41, kinds 1 and 2).

The O(1) checks count operations, and the "vectorised" check counts torch calls, inside the learner's kernel,
where the learner's code can switch the counters off. Those checks are *formative*: the gradebook reports them
apart and does not count them in the mark. Every judge also compares the observation's shape with the
reference's, so a forged record that is empty or short FAILs, and chapter 04's work count is required wherever
the judge itself runs in Triton's interpreter.
"""

import pytest

from minipaged.checks import FAIL, PASS, ch02, ch03, ch04, ch06, expected
from minipaged.checks import __main__ as grader

pytestmark = pytest.mark.exercises

MEASURED = {"ch02.constant_time", "ch03.vectorised", "ch06.constant_time"}


def test_the_checks_measured_in_the_learners_process_are_formative_and_no_other():
    exercises = {}
    for number in ("01", "02", "03", "04", "05", "06", "07", "08", "09"):
        grader.find_exercise(grader.SOLUTIONS / f"{number}_x.ipynb", exercises)
    formative = {name for e in exercises.values() for name in e.formative}
    assert formative == MEASURED


@pytest.mark.parametrize("check, forged", [
    (ch02.check_constant_time, {"missing": [], "counts": []}),
    (ch02.check_constant_time, {"missing": [], "counts": [[1] * 11]}),
    (ch06.check_constant_time, {"counts": [[], []]}),
    (ch03.check_vectorised, []),
], ids=["ch02 empty", "ch02 one pool", "ch06 no calls", "ch03 no sizes"])
def test_a_forged_record_that_measures_nothing_fails(check, forged):
    cases, want = expected(check.name)
    got = dict(want, observations=[forged] * len(cases))
    result = check.verdict(cases, got, want, len(cases))
    assert result.status == FAIL and "incomplete" in result.message


def test_an_uncounted_kernel_run_fails_where_the_judge_is_interpreted(monkeypatch):
    cases, want = expected(ch04.check_decode_kernel.name)
    index = next(i for i, c in enumerate(cases) if c["kind"] == "kernel")
    observation = dict(want["observations"][index], k_bytes=None, v_bytes=None, dots=None)
    got = dict(want, observations=want["observations"][:index] + [observation] + want["observations"][index + 1:])
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    result = ch04.check_decode_kernel.verdict(cases, got, want, len(cases))
    assert result.status == FAIL and "outside Triton's interpreter" in result.message
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a learner's own run on a GPU: nothing to count, nothing asked
    assert ch04.check_decode_kernel.verdict(cases, got, want, len(cases)).status == PASS


def graded(learner: str, statuses: dict[str, str], exercise) -> grader.Graded:
    results = {name: grader.Outcome(status) for name, status in statuses.items()}
    return grader.Graded(learner, grader.SOLUTIONS / exercise.path.name, exercise, results)


def test_a_formative_check_is_reported_apart_and_not_counted():
    exercises = {}
    exercise = grader.find_exercise(grader.SOLUTIONS / "02_x.ipynb", exercises)
    names = exercise.checks
    assert "ch02.constant_time" in names and exercise.formative == ["ch02.constant_time"]
    all_pass = {name: PASS for name in names}
    only_formative_fails = dict(all_pass, **{"ch02.constant_time": FAIL})
    only_counted_fails = {name: FAIL if name != "ch02.constant_time" else PASS for name in names}
    book = grader.gradebook([graded("ada", only_formative_fails, exercise),
                             graded("bo", only_counted_fails, exercise)], seed=0)
    assert book["formative"] == ["ch02.constant_time"]
    ada, bo = book["learners"]["ada"], book["learners"]["bo"]
    assert (ada["passed"], ada["total"], ada["formative_passed"]) == (len(names) - 1, len(names) - 1, 0)
    assert (bo["passed"], bo["total"], bo["formative_passed"]) == (0, len(names) - 1, 1)
    table = grader.format_table(book)
    assert "ch02.constant_time (formative)" in table.splitlines()[0]
    assert "not counted in passed" in table.splitlines()[-1]
