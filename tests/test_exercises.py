"""Exercises are generated from the solutions, stay in sync, and run without a traceback."""

import re
from pathlib import Path

import nbformat
import pytest

from minipaged import exercises
from minipaged.checks import FAIL, PASS, TODO

pytestmark = pytest.mark.exercises

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))


def printed(nb) -> str:
    return "".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs)


def test_stub_replaces_the_solution_and_keeps_the_rest():
    source = (
        "def f(n, b):\n"
        '    """doc"""\n'
        "    ### BEGIN SOLUTION (Task 1.1) hint: round up\n"
        "    return (n + b - 1) // b\n"
        "    ### END SOLUTION\n"
        "x = 1"
    )
    stub = exercises.stub_code(source, "nb")
    assert "return (n + b - 1) // b" not in stub and "SOLUTION" not in stub
    assert "    raise NotImplementedError('Task 1.1 is not implemented yet. Hint: round up')" in stub
    assert stub.startswith("def f(n, b):\n") and stub.endswith("x = 1")
    namespace = {}
    exec(stub, namespace)
    with pytest.raises(NotImplementedError, match="Task 1.1"):
        namespace["f"](1, 2)


@pytest.mark.parametrize(
    "source, match",
    [
        ("### BEGIN SOLUTION\nx = 1\n", "never closed"),
        ("x = 1\n### END SOLUTION\n", "without BEGIN"),
        ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n", "inside another"),
    ],
)
def test_unbalanced_markers_are_reported(source, match):
    with pytest.raises(exercises.MarkerError, match=match):
        exercises.stub_code(source, "nb")


def test_make_exercise_clears_outputs_and_drops_solution_only_cells():
    nb = nbformat.v4.new_notebook()
    code = nbformat.v4.new_code_cell("### BEGIN SOLUTION\ny = 2\n### END SOLUTION", execution_count=3)
    code.outputs = [nbformat.v4.new_output("stream", text="2\n")]
    secret = nbformat.v4.new_code_cell("print('answer key')", metadata={"tags": ["solution-only"]})
    answer = nbformat.v4.new_markdown_cell("Why? <!-- BEGIN SOLUTION -->Because.<!-- END SOLUTION -->")
    nb.cells = [code, secret, answer]
    out = exercises.make_exercise(nb, "x.ipynb")
    assert out.cells[0].id == "exercise-banner"
    assert [c.cell_type for c in out.cells] == ["markdown", "code", "markdown"]
    assert out.cells[1].outputs == [] and out.cells[1].execution_count is None
    assert "Because" not in out.cells[2].source and "Your answer here" in out.cells[2].source
    assert nb.cells[0].outputs, "the solution itself must not be modified"


def test_a_solution_without_markers_is_refused():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 1")]
    with pytest.raises(exercises.MarkerError, match="nothing for the learner"):
        exercises.make_exercise(nb, "x.ipynb")


def test_exercises_are_in_sync_with_solutions():
    problems = exercises.stale_exercises()
    assert not problems, "\n".join(problems) + "\nrun: python -m minipaged.exercises"


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_committed_solutions_pass_their_checks(path):
    text = printed(nbformat.read(path, as_version=4))
    assert PASS in text, f"{path.name} shows no passing check"
    assert FAIL not in text and TODO not in text, f"{path.name} was committed with failing checks"


@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.name)
def test_shipped_exercise_runs_without_traceback(path):
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=300, allow_errors=True, resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [out for cell in nb.cells for out in cell.get("outputs", []) if out.output_type == "error"]
    assert not errors, f"{path.name} raised {errors[0].ename}: {errors[0].evalue}"
    if any("raise NotImplementedError(" in c.source for c in nb.cells if c.cell_type == "code"):
        assert TODO in printed(nb), f"{path.name} should report unimplemented tasks, not crash or pass"
    else:  # every task builds a piece of the package, which here (the repository) holds the model answers
        assert PASS in printed(nb) and FAIL not in printed(nb), f"{path.name} should pass on the model answers"


# ----------------------------------------------------------------- the chapters do not give the answers

NOTEBOOKS = ROOT / "notebooks"


def solution_lines(path) -> list[str]:
    """The lines between BEGIN and END SOLUTION markers, whitespace-normalised, long enough to mean something."""
    lines, inside = [], False
    for cell in nbformat.read(path, as_version=4).cells:
        for line in cell.source.splitlines():
            if "BEGIN SOLUTION" in line:
                inside = True
            elif "END SOLUTION" in line:
                inside = False
            elif inside:
                text = " ".join(line.split("#")[0].split()) if cell.cell_type == "code" else " ".join(line.split())
                if len(text) >= 20:
                    lines.append(text)
    return lines


def chapter_text(path) -> str:
    """Every source and every output of a chapter notebook, whitespace-normalised."""
    parts = []
    for cell in nbformat.read(path, as_version=4).cells:
        parts.append(cell.source)
        for out in cell.get("outputs", []):
            parts.append(out.get("text", ""))
            parts += [str(v) for v in out.get("data", {}).values()]
    return " ".join(" ".join(parts).split())


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_no_solution_line_appears_in_any_chapter(path):
    lines = solution_lines(path)
    assert lines, f"{path.name} has no solution lines to look for"
    for chapter in sorted(NOTEBOOKS.glob("*.ipynb")):
        text = chapter_text(chapter)
        leaked = [line for line in lines if line in text]
        assert not leaked, f"{chapter.name} shows solution lines of {path.name}: {leaked}"


def shown_code(chapter):
    """What a chapter shows: each ``show_source`` target and its class, and every function its code cells define."""
    import ast
    import inspect

    shown, namespace = [], {}
    for cell in nbformat.read(chapter, as_version=4).cells:
        if cell.cell_type != "code":
            continue
        source = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in cell.source.splitlines())
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                exec(compile(ast.Module([node], []), "imports", "exec"), namespace)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "show_source" and node.args:
                try:
                    target = eval(compile(ast.Expression(node.args[0]), "target", "eval"), namespace)
                except Exception:
                    continue
                target = getattr(target, "fn", target)  # a @triton.jit kernel's Python function
                shown.append(target)
                owner = inspect.getmodule(target)
                cls = getattr(owner, target.__qualname__.split(".")[0], None) if "." in target.__qualname__ else None
                if inspect.isclass(cls):
                    shown.append(cls)
            if isinstance(node, ast.FunctionDef):
                scope = dict(namespace)
                try:
                    exec(compile(ast.Module([node], []), "def", "exec"), scope)
                    shown.append(scope[node.name])
                except Exception:
                    continue
    return shown


def check_functions(chapter_number: str):
    import importlib

    try:
        module = importlib.import_module(f"minipaged.checks.ch{chapter_number}")
    except ModuleNotFoundError:
        return []
    return [getattr(module, name) for name in dir(module) if name.startswith("check_")]


CHAPTER_CHECKS = [
    (chapter, check)
    for chapter in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    if (ROOT / "solutions" / chapter.name).exists()
    for check in check_functions(chapter.name[:2])
]


@pytest.mark.parametrize("chapter, check", CHAPTER_CHECKS, ids=lambda x: getattr(x, "name", getattr(x, "__name__", "")))
def test_each_task_fails_on_the_code_its_chapter_shows(chapter, check, capsys):
    import inspect

    shown = shown_code(chapter)
    assert shown, f"{chapter.name} shows no code"
    arity = len(inspect.signature(check).parameters)
    for code in shown:
        args = [code] * arity
        if arity == 2:  # exercise 04: (launcher, kernel); the package's launcher on the code shown as its kernel
            args = [_launching(code), code]
        result = check(*args)
        assert result.status != PASS, f"{check.__name__} passes on {chapter.name}'s {getattr(code, '__name__', code)}"
    capsys.readouterr()


def _launching(kernel):
    """The package's ``launch_decode`` with ``kernel`` in place of its decode kernel."""
    from unittest import mock

    from minipaged.kernels import paged_attention

    def launch(*args):
        with mock.patch.object(paged_attention, "_paged_decode_kernel", kernel):
            return paged_attention.launch_decode(*args)

    return launch


def test_stubs_carry_only_the_first_hint_and_later_ones_come_on_request(capsys):
    from minipaged.checks import hint

    for path in EXERCISES:
        text = nbformat.read(path, as_version=4)
        for cell in text.cells:
            for task in set(re.findall(r"# Task (\d+\.\d+): your code here", cell.source)):
                stages = __import__(
                    f"minipaged.checks.ch{int(task.split('.')[0]):02d}", fromlist=["HINTS"]).HINTS[task]
                assert len(stages) >= 2, task
                assert f"Hint: {stages[0]}" in cell.source
                assert all(stage not in cell.source for stage in stages[1:]), task
                assert hint(task, 2).endswith(stages[1])
    with pytest.raises(ValueError, match="between 1 and"):
        hint("5.1", 9)
    capsys.readouterr()


def test_no_hint_is_a_solution_line():
    import importlib

    for path in SOLUTIONS:
        lines = solution_lines(path)
        module = importlib.import_module(f"minipaged.checks.ch{path.name[:2]}")
        for task, stages in getattr(module, "HINTS", {}).items():
            for stage in stages:
                assert not [line for line in lines if line in " ".join(stage.split())], (task, stage)


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_every_solution_has_a_model_answer_for_the_gradebook(path):
    from minipaged.checks.__main__ import load_exercise

    exercise = load_exercise(path)
    assert exercise.questions and all(answer for _, answer in exercise.questions.values())
    assert exercise.checks, f"{path.name}: the grader finds no check cell"


