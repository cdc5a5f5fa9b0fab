"""The check framework: one status line, never a traceback, a time limit, signed records for the grader."""

import json

import pytest
import torch

from minipaged import checks
from minipaged.accounting import ceil_div
from minipaged.checks import CheckFailed, CheckResult, check, expect_close, expect_equal, expect_tensor_close

pytestmark = pytest.mark.exercises


@check("demo.ceil_div", hint="a partly filled block is still a block")
def check_ceil_div(fn):
    for n, b in [(0, 4), (1, 4), (4, 4), (5, 4), (37, 16)]:
        expect_equal(fn(n, b), ceil_div(n, b), f"ceil_div({n}, {b})")
    return "5 cases"


def test_pass_prints_one_line(capsys):
    result = check_ceil_div(ceil_div)
    assert result.passed and bool(result)
    assert capsys.readouterr().out == "✅ PASS   demo.ceil_div: 5 cases\n"


def test_wrong_answer_names_the_case_and_gives_the_hint(capsys):
    result = check_ceil_div(lambda n, b: n // b)
    out = capsys.readouterr().out
    assert not result.passed and result.status == "FAIL"
    assert "ceil_div(1, 4) returned 0, expected 1" in out
    assert "hint: a partly filled block is still a block" in out
    assert "Traceback" not in out


def test_not_implemented_is_its_own_status(capsys):
    def stub(n, b):
        raise NotImplementedError("Task 1.1 is not implemented yet.")

    result = check_ceil_div(stub)
    out = capsys.readouterr().out
    assert result.status == "NOT IMPLEMENTED YET"
    assert out.startswith("⏳ NOT IMPLEMENTED YET   demo.ceil_div: Task 1.1")


def test_crash_in_learner_code_is_summarised_not_dumped(capsys):
    def crashes(n, b):
        return n / undefined_name  # noqa: F821

    result = check_ceil_div(crashes)
    out = capsys.readouterr().out
    assert result.status == "FAIL"
    assert "your code raised NameError" in out and "in crashes, line" in out
    assert "Traceback" not in out


def test_expect_helpers():
    expect_close(0.1 + 0.2, 0.3, "sum")
    with pytest.raises(CheckFailed, match="not a number"):
        expect_close("x", 1.0, "f()")
    expect_tensor_close(torch.ones(2), torch.ones(2), "t")
    with pytest.raises(CheckFailed, match="shape"):
        expect_tensor_close(torch.ones(3), torch.ones(2), "t")
    with pytest.raises(CheckFailed, match="dtype"):
        expect_tensor_close(torch.ones(2, dtype=torch.float64), torch.ones(2), "t")
    with pytest.raises(CheckFailed, match="max abs error"):
        expect_tensor_close(torch.tensor([1.0, float("nan")]), torch.ones(2), "t")


def test_result_str_hides_hint_on_pass():
    assert "hint" not in str(CheckResult("x", "PASS", "ok", hint="h"))
    assert "hint: h" in str(CheckResult("x", "FAIL", "bad", hint="h"))


def test_an_infinite_loop_times_out_inside_the_notebook_too(monkeypatch, capsys):
    monkeypatch.setenv(checks.TIMEOUT_ENV, "0.5")

    def loops(n, b):
        while True:
            try:
                pass
            except Exception:  # a learner's catch-all does not swallow the time limit
                pass

    result = check_ceil_div(loops)
    assert result.status == "FAIL" and result.message.startswith("timed out after 0.5 s")
    assert check_ceil_div(ceil_div).passed  # the alarm is gone afterwards


def test_results_are_recorded_signed_only_for_the_grader(tmp_path, monkeypatch, capsys):
    path = tmp_path / "results.jsonl"
    monkeypatch.setattr(checks, "_RESULTS", str(path))
    monkeypatch.setattr(checks, "_SECRET", b"")
    check_ceil_div(ceil_div)
    assert not path.exists(), "no secret, no record"
    monkeypatch.setattr(checks, "_SECRET", b"k")
    check_ceil_div(ceil_div)
    check_ceil_div(lambda n, b: 0)
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert (first["status"], second["status"]) == ("PASS", "FAIL") and second["seq"] > first["seq"]
    assert first["sig"] == checks.sign(b"k", first) != checks.sign(b"other", first)
    forged = dict(second, status="PASS")
    assert forged["sig"] != checks.sign(b"k", forged)


def test_staged_hints(capsys):
    from minipaged.checks import ch05

    assert checks.hint("5.1") == f"Hint 1 of 3 for Task 5.1: {ch05.HINTS['5.1'][0]}"
    assert ch05.HINTS["5.1"][2] in checks.hint("5.1", 3)
    for bad, error in [(("9.1",), ValueError), (("5.9",), ValueError), (("5.1", 0), ValueError),
                       (("5.1", 1.0), TypeError)]:
        with pytest.raises(error):
            checks.hint(*bad)


def test_stub_hint_is_not_repeated(capsys):
    def stub(n, b):
        raise NotImplementedError("Task 1.1 is not implemented yet. Hint: round up")

    check_ceil_div(stub)
    out = capsys.readouterr().out
    assert "Hint: round up" in out and "hint: a partly filled block" not in out
