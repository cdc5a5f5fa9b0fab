"""Exercises are generated from the solutions, stay in sync, and run without a traceback."""

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
    assert TODO in printed(nb), f"{path.name} should report unimplemented tasks, not crash or pass"
