"""The notebooks are the product: committed executed, opening with goals and ending with a summary.

nbval (run by `make test`) re-executes them and compares outputs; these checks
cover what nbval can't see.
"""

import re
from pathlib import Path

import nbformat
import pytest

pytestmark = pytest.mark.notebooks

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))


def ids(path):
    return f"{path.parent.name}/{path.name}"


@pytest.mark.parametrize("path", CHAPTERS + SOLUTIONS + EXERCISES, ids=ids)
def test_opens_in_the_course_kernel(path):
    # Without a kernelspec JupyterLab asks the learner to pick a kernel.
    nb = nbformat.read(path, as_version=4)
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"
    assert re.fullmatch(r"\d\d_[a-z0-9_]+\.ipynb", path.name)


@pytest.mark.parametrize("path", CHAPTERS + SOLUTIONS, ids=ids)
def test_committed_with_outputs_from_a_clean_top_to_bottom_run(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    counts = [c.execution_count for c in code]
    assert counts == list(range(1, len(code) + 1)), f"re-run {path.name} top to bottom and commit it"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name} was committed with an error: {errors[0].ename}"


@pytest.mark.parametrize("path", CHAPTERS, ids=ids)
def test_chapter_opens_with_goals_and_ends_with_a_summary(path):
    markdown = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown"]
    assert "goals" in markdown[0].lower(), "the first cell states the chapter's goals"
    assert "summary" in markdown[-1].lower(), "the last markdown cell summarises"


@pytest.mark.parametrize("path", CHAPTERS, ids=ids)
def test_chapter_links_the_glossary_from_its_opening(path):
    first = nbformat.read(path, as_version=4).cells[0]
    assert first.cell_type == "markdown" and "[glossary](../GLOSSARY.md)" in first.source, (
        "end the first cell with: Terms in this chapter follow the course [glossary](../GLOSSARY.md).")


@pytest.mark.parametrize("path", CHAPTERS, ids=ids)
def test_chapter_has_a_figure(path):
    nb = nbformat.read(path, as_version=4)
    mimes = {m for c in nb.cells if c.cell_type == "code" for o in c.outputs for m in o.get("data", {})}
    assert mimes & {"image/png", "image/svg+xml", "text/html"}, "a picture says more than a table"


# A kernel a chapter writes in the open is the lesson itself, printed whole as the Triton tutorials print theirs.
WHOLE = {("04_triton_kernel.ipynb", "pf._paged_prefill_kernel")}
LONGEST_DUMP = 50  # the package's longest function (tests/test_size_targets.py), without its long docstring


@pytest.mark.parametrize("path", CHAPTERS, ids=ids)
def test_a_printed_source_is_the_lines_the_argument_needs(path):
    """No show_source dump longer than LONGEST_DUMP lines (docstring=False keeps a long docstring's first line)."""
    long = []
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type != "code" or "show_source" not in cell.source:
            continue
        targets = re.findall(r"show_source\(([\w.]+)", cell.source)
        for out in cell.get("outputs", []):
            text = out.get("data", {}).get("text/markdown", "")
            if text.count("\n") > LONGEST_DUMP and not any((path.name, t) in WHOLE for t in targets):
                long.append(f"{targets}: {text.count(chr(10))} lines")
    assert not long, f"{path.name} prints long sources: {long}"


def test_source_text_without_the_docstring_keeps_its_first_line_and_the_code():
    import minipaged
    from minipaged.disagg import transfer_kv
    from minipaged.viz import source_text

    whole, short = source_text(transfer_kv), source_text(transfer_kv, docstring=False)
    assert short.count("\n") < whole.count("\n") and short.splitlines()[0] == whole.splitlines()[0]
    first = transfer_kv.__doc__.strip().splitlines()[0]
    assert f'    """{first} …"""' in short.splitlines()[1]
    assert whole.splitlines()[-1] == short.splitlines()[-1]  # the body is untouched
    assert source_text(minipaged, docstring=False).startswith('"""minipaged:') and "…" in source_text(
        minipaged, docstring=False).splitlines()[0]  # fmt: skip
