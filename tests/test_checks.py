"""The check framework: one status line, never a traceback, and a grader that reads it back."""

import nbformat
import pytest
import torch

from minipaged.accounting import ceil_div
from minipaged.checks import CheckFailed, CheckResult, check, expect_close, expect_equal, expect_tensor_close
from minipaged.checks.__main__ import main as grade_main

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


def test_grader_executes_a_notebook_and_tabulates(tmp_path, capsys):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "from minipaged.checks import check, expect_equal\n"
            "@check('demo.one')\n"
            "def c(v):\n"
            "    expect_equal(v, 1, 'v')\n"
        ),
        nbformat.v4.new_code_cell("c(1)"),
        nbformat.v4.new_code_cell("raise RuntimeError('a broken cell does not stop grading')"),
        nbformat.v4.new_code_cell("c(2)"),
    ]
    path = tmp_path / "student.ipynb"
    nbformat.write(nb, path)
    assert grade_main(["grade", str(path)]) == 1
    out = capsys.readouterr().out
    assert "1/2 checks passed" in out
    assert "PASS                 demo.one" in out and "FAIL                 demo.one" in out


def test_stub_hint_is_not_repeated(capsys):
    def stub(n, b):
        raise NotImplementedError("Task 1.1 is not implemented yet. Hint: round up")

    check_ceil_div(stub)
    out = capsys.readouterr().out
    assert "Hint: round up" in out and "hint: a partly filled block" not in out
