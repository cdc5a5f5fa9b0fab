"""The check framework: one status line, never a traceback, a time limit, plain data judged against the reference."""

import json
import random

import numpy as np
import pytest
import torch

from minipaged import checks
from minipaged.accounting import Breakdown
from minipaged.blocks import BlockAllocator
from minipaged.checks import (
    FAIL,
    PASS,
    SCHEMA,
    TODO,
    CheckFailed,
    CheckResult,
    NotPlainData,
    as_tensor,
    ch01,
    ch02,
    expect_close,
    expect_equal,
    expect_tensor_close,
    expected,
    find,
    instructor_side,
    plain,
    reference_transcript,
    same,
)
from minipaged.checks.instructor.ch01 import largest_max_len

pytestmark = pytest.mark.exercises


def fixed(lengths, budget, max_len, slot):
    """A right Task 1.1 (exercise 01's first check is the example), one reservation at a time unlike the package."""
    k = 0
    while k < len(lengths) and (k + 1) * max_len * slot <= budget:
        k += 1
    kv = sum(min(n, max_len) for n in lengths[:k]) * slot
    return Breakdown("fixed", k, kv, 0, k * max_len * slot - kv, 0, budget - k * max_len * slot)


def test_pass_prints_one_line(capsys):
    result = ch01.check_fixed_breakdown(fixed)
    assert result.passed and bool(result)
    assert capsys.readouterr().out == ("✅ PASS   ch01.fixed_breakdown: 8 budgets: exact fits, lengths past max_len, "
                                       "fewer lengths than reservations, 2**60 bytes\n")


def test_wrong_answer_names_the_case_and_gives_the_hint(capsys):
    result = ch01.check_fixed_breakdown(lambda ls, b, m, s: fixed(ls, b - 1, m, s) if b else fixed(ls, b, m, s))
    out = capsys.readouterr().out
    assert not result.passed and result.status == FAIL
    assert "fixed_breakdown([5, 12, 3, 9, 2, 7], budget_bytes=100, max_len=8, slot_bytes=2): the parts sum to" in out
    assert f"hint: {ch01.SPEC_HINTS['sum']}" in out and "Traceback" not in out


def test_not_implemented_is_its_own_status(capsys):
    def stub(lengths, budget, max_len, slot):
        raise NotImplementedError("Task 1.1 is not implemented yet.")

    result = ch01.check_fixed_breakdown(stub)
    assert result.status == TODO
    assert capsys.readouterr().out.startswith("⏳ NOT IMPLEMENTED YET   ch01.fixed_breakdown: Task 1.1")


def test_crash_in_learner_code_is_summarised_not_dumped(capsys):
    def crashes(lengths, budget, max_len, slot):
        return budget / undefined_name  # noqa: F821

    result = ch01.check_fixed_breakdown(crashes)
    out = capsys.readouterr().out
    assert result.status == FAIL
    assert "your code raised NameError" in out and "in crashes, line" in out and "Traceback" not in out


def test_a_crash_shows_the_arguments_the_learners_code_was_called_with(capsys):
    def outer(lengths, budget, max_len, slot):
        return inner(torch.zeros(2, 3), list(range(100)), max_len)

    def inner(t, long, b):
        return [long[b * 20] for _ in range(1)]  # IndexError: b is 8 in the first case (in a comprehension)

    result = ch01.check_fixed_breakdown(outer)
    assert result.status == FAIL
    # The innermost frame of the learner's code, with its arguments: a tensor by shape, a long value cut short.
    assert "(in inner, line" in result.message
    assert "called with t=tensor(shape=[2, 3], dtype=float32), long=[0, 1, 2," in result.message
    assert "..., b=8)" in result.message and len(result.message) < 400


def test_a_judge_gives_the_hint_for_its_own_failure():
    from minipaged.checks import Check

    def probe(case, fn):
        return fn(case)

    def judge(case, got, want):
        if got == want + 1:
            raise CheckFailed(f"off by one: {got}", hint="count from zero")
        expect_equal(got, want)

    c = Check("ch01.demo", probe, "the default hint", lambda case: f"case {case}", "{n} cases")
    c.judge(judge)
    want = c.transcript([1, 2], (lambda x: x,))
    off = c.verdict([1, 2], c.transcript([1, 2], (lambda x: x + 1,)), want, 2)
    assert off.status == FAIL and off.hint == "count from zero" and "off by one: 2" in off.message
    other = c.verdict([1, 2], c.transcript([1, 2], (lambda x: -x,)), want, 2)
    assert other.status == FAIL and other.hint == "the default hint"
    hidden = c.verdict([1, 2], c.transcript([1, 2], (lambda x: x + 1,)), want, 0)  # both cases hidden
    assert hidden.hint == "count from zero" and "off by one" not in hidden.message


def test_an_infinite_loop_times_out_inside_the_notebook_too(monkeypatch, capsys):
    monkeypatch.setenv(checks.TIMEOUT_ENV, "0.5")

    def loops(lengths, budget, max_len, slot):
        while True:
            try:
                pass
            except Exception:  # a learner's catch-all does not swallow the time limit
                pass

    result = ch01.check_fixed_breakdown(loops)
    assert result.status == FAIL and result.message.startswith("timed out after 0.5 s")
    assert ch01.check_fixed_breakdown(fixed).passed  # the alarm is gone afterwards


class Yes(int):
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = int.__hash__


class YesList(list):
    def __eq__(self, other):
        return True


@pytest.mark.parametrize("answer", [lambda *a: Yes(0), lambda *a: np.int64(largest_max_len(*a)),
                                    lambda *a: bool(largest_max_len(*a)), lambda *a: float(largest_max_len(*a))],
                         ids=["int subclass that equals anything", "numpy int", "bool", "float"])
def test_only_the_exact_type_passes(answer, capsys):
    """Kind 1: a value that says it is equal, or is equal only by Python's loose ``==``, is not an int (Task 1.3's
    answer, which its probe records as it is returned)."""
    assert ch01.check_largest_max_len(largest_max_len).passed
    assert ch01.check_largest_max_len(answer).status == FAIL


def test_a_list_that_equals_anything_is_refused(capsys):
    class Liar(BlockAllocator):  # allocate_many takes its blocks but returns a list that equals anything
        def allocate_many(self, num_blocks, seq_id=None):
            super().allocate_many(num_blocks, seq_id)
            return YesList()

    result = ch02.check_allocator(Liar)
    assert result.status == FAIL


def test_plain_data_is_checked_by_exact_type():
    assert plain((1, [2.5, "x", None, True], {"k": (3,)})) == [1, [2.5, "x", None, True], {"k": [3]}]
    for bad in (Yes(1), [Yes(1)], {1: 2}, np.float64(1.0), object(), YesList([1])):
        with pytest.raises(NotPlainData):
            plain(bad)
    deep = []
    for _ in range(checks.MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(NotPlainData, match="deeper"):
        plain(deep)
    t = torch.tensor([[1.5, float("nan")]], dtype=torch.bfloat16)
    back = as_tensor(json.loads(json.dumps(plain(t))))
    assert back.dtype == torch.bfloat16 and back.shape == t.shape and back[0, 0] == 1.5 and back[0, 1].isnan()
    assert as_tensor({"tensor": [1], "dtype": "os.system", "shape": [1]}) is None
    assert same([1, {"a": 2.0}], [1, {"a": 2.0}]) and not same(1, 1.0) and not same(True, 1) and not same([1], [1, 2])


@pytest.mark.parametrize("forged", [
    "PASS", None, [], {"schema": SCHEMA, "check": "ch01.other", "observations": [], "end": {"kind": "done"}},
    {"schema": SCHEMA, "check": "ch01.fixed_breakdown", "observations": {}, "end": {"kind": "done"}},
    {"schema": SCHEMA, "check": "ch01.fixed_breakdown", "observations": [], "end": {"kind": "passed"}},
    {"schema": SCHEMA, "check": "ch01.fixed_breakdown", "observations": [], "end": {"kind": "done"}},
], ids=["a word", "null", "a list", "another check", "observations not a list", "an unknown end", "empty"])
def test_a_forged_or_empty_transcript_fails_and_never_crashes(forged):
    cases, want = expected("ch01.fixed_breakdown")
    result = ch01.check_fixed_breakdown.verdict(cases, forged, want, len(cases))
    assert result.status == FAIL and result.message


def test_a_malformed_observation_fails_and_never_crashes():
    cases, want = expected("ch02.allocator")
    got = json.loads(json.dumps(want))
    got["observations"][0]["start"] = 3
    result = ch02.check_allocator.verdict(cases, got, want, len(cases))
    assert result.status == FAIL and "unexpected shape" in result.message


def test_a_hidden_case_fails_without_its_expected_value():
    """Kind 6: in grading, a hidden case's FAIL names its inputs but not the value the reference gave."""
    side = instructor_side("ch01.fixed_breakdown")
    public = side.public()
    hidden = [{"lengths": [5, 2**40, 7], "budget_bytes": 2**60 + 5, "max_len": 2**30, "slot_bytes": 2**20}]
    cases = public + hidden
    want = reference_transcript("ch01.fixed_breakdown", cases)
    table = {repr(c): fixed(*c.values()) for c in public}  # every public answer; none for the rest
    got = ch01.check_fixed_breakdown.transcript(cases, (lambda *a: table.get(repr(dict(zip(hidden[0], a))),
                                                                             Breakdown("fixed", 1, 0, 0, 0, 0, 0)),))
    result = ch01.check_fixed_breakdown.verdict(cases, got, want, len(public))
    assert result.status == FAIL and result.message.startswith(
        "hidden case 1 (fixed_breakdown([5, 1099511627776, 7], budget_bytes=1152921504606846981, max_len=1073741824, "
        "slot_bytes=1048576))")
    right = fixed(*hidden[0].values())
    assert "returned" not in result.message and f"{right.unused:,}" not in result.message
    assert str(right.num_seqs) not in result.message.split(")")[-1]
    assert ch01.check_fixed_breakdown.verdict(public, got | {"observations": got["observations"][:-1]},
                                              reference_transcript("ch01.fixed_breakdown", public), len(public)).passed


def test_the_kernels_entry_point_prints_one_parsable_transcript(capsys):
    cases, _ = expected("ch01.fixed_breakdown")
    checks.probe_json("@@m@@", "ch01.fixed_breakdown", json.dumps(cases), fixed)
    line = capsys.readouterr().out.strip()
    transcript = json.loads(line.removeprefix("@@m@@"))
    assert transcript["check"] == "ch01.fixed_breakdown" and len(transcript["observations"]) == len(cases)


def _check_names() -> list[str]:
    """Every check of every chapter module; the capstone's is left to tests/test_09_checks.py (it serves SmolLM2)."""
    import importlib
    from pathlib import Path

    names = []
    for path in sorted((Path(checks.__file__).parent).glob("ch[0-9][0-9].py")):
        module = importlib.import_module(f"minipaged.checks.{path.stem}")
        names += [v.name for v in vars(module).values() if isinstance(v, checks.Check) and v.name not in names]
    return [name for name in names if not name.startswith("ch09.")]


CHECK_NAMES = _check_names()


@pytest.mark.parametrize("name", CHECK_NAMES)
def test_the_reference_passes_its_public_and_hidden_cases(name):
    """Every hidden-case generator gives plain-data cases the reference can run, the same for the same seed."""
    side, check = instructor_side(name), find(name)
    for seed in range(3):
        hidden = side.hidden(random.Random(f"{seed}:{name}"))
        assert hidden == side.hidden(random.Random(f"{seed}:{name}")) and plain(hidden) == hidden
        cases = side.public() + hidden
        want = reference_transcript(name, cases)
        assert want["end"] == {"kind": "done"}, want["end"]
        assert check.verdict(cases, check.transcript(cases, side.reference()), want, len(side.public())).passed


def test_expect_helpers():
    expect_close(0.1 + 0.2, 0.3, "sum")
    with pytest.raises(CheckFailed, match="not a number"):
        expect_close("x", 1.0, "f()")
    with pytest.raises(CheckFailed, match="returned True, expected 1"):
        expect_equal(True, 1)
    expect_tensor_close(torch.ones(2), torch.ones(2), "t")
    with pytest.raises(CheckFailed, match="shape"):
        expect_tensor_close(torch.ones(3), torch.ones(2), "t")
    with pytest.raises(CheckFailed, match="dtype"):
        expect_tensor_close(torch.ones(2, dtype=torch.float64), torch.ones(2), "t")
    with pytest.raises(CheckFailed, match="max abs error"):
        expect_tensor_close(torch.tensor([1.0, float("nan")]), torch.ones(2), "t")


def test_result_str_hides_hint_on_pass():
    assert "hint" not in str(CheckResult("x", PASS, "ok", hint="h"))
    assert "hint: h" in str(CheckResult("x", FAIL, "bad", hint="h"))


def test_staged_hints(capsys):
    from minipaged.checks import ch05

    assert checks.hint("5.1") == f"Hint 1 of 3 for Task 5.1: {ch05.HINTS['5.1'][0]}"
    assert ch05.HINTS["5.1"][2] in checks.hint("5.1", 3)
    for bad, error in [(("10.1",), ValueError), (("5.9",), ValueError), (("5.1", 0), ValueError),
                       (("5.1", 1.0), TypeError)]:
        with pytest.raises(error):
            checks.hint(*bad)


def test_stub_hint_is_not_repeated(capsys):
    def stub(lengths, budget, max_len, slot):
        raise NotImplementedError("Task 1.1 is not implemented yet. Hint: admit in order")

    ch01.check_fixed_breakdown(stub)
    out = capsys.readouterr().out
    assert "Hint: admit in order" in out and f"hint: {ch01.HINTS['1.1'][0]}" not in out
