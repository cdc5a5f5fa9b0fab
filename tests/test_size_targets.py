"""Issue 22's size targets, kept by every later change: chapter 05's engine stays readable.

- ``engine.py`` is at most 350 lines;
- the core (every module chapter 05's ``Engine`` imports, directly or not, imports inside functions
  included, apart from validation, accounting, workload, clock and metrics) has at most 1,500 code
  lines (no blank lines, comments or docstrings);
- no function in ``minipaged/`` is longer than 60 lines, not counting its docstring (the Triton
  kernels in ``kernels/`` read as one story each and are excepted).
"""

import ast
import io
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "minipaged"
NOT_CORE = {"validation", "accounting", "workload", "clock", "metrics"}
MAX_ENGINE_LINES = 350
MAX_CORE_CODE_LINES = 1500
MAX_FUNCTION_LINES = 60


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value,
                                                                                                    str):  # fmt: skip
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def code_lines(path: Path) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    source = path.read_text()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - _docstring_lines(ast.parse(source)))


def module_file(name: str) -> Path | None:
    """The file of a ``minipaged`` module in this tree (None for the kernels package and anything else)."""
    parts = name.split(".")
    if parts[0] != "minipaged" or len(parts) < 2:
        return None
    path = PACKAGE.joinpath(*parts[1:])
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def imported_modules(path: Path) -> set[str]:
    """Every ``minipaged`` module a file imports, anywhere in it (``from x import y`` counts ``x`` and ``x.y``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("minipaged"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("minipaged"))
    return {name for name in found if module_file(name) is not None}


def core_modules() -> dict[str, int]:
    """The core's modules and their code lines."""
    seen, todo = set(), ["minipaged.engine"]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(imported_modules(module_file(name)) - seen)
    return {name: code_lines(module_file(name)) for name in sorted(seen) if name.split(".")[-1] not in NOT_CORE}


def long_functions() -> list[tuple[str, str, int]]:
    """(file, function, lines) of every function in the package over the limit, docstring not counted."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body
                has_doc = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                if has_doc and len(body) == 1:
                    continue
                start = body[1].lineno if has_doc else body[0].lineno
                n = node.end_lineno - start + 1
                if n > MAX_FUNCTION_LINES:
                    found.append((str(path.relative_to(PACKAGE.parent)), node.name, n))
    return found


def test_engine_py_reads_on_a_few_screens():
    n = len((PACKAGE / "engine.py").read_text().splitlines())
    assert n <= MAX_ENGINE_LINES, f"minipaged/engine.py has {n} lines, more than {MAX_ENGINE_LINES}"


def test_the_core_stays_small():
    core = core_modules()
    total = sum(core.values())
    table = "\n".join(f"{name:<32}{n:>6}" for name, n in core.items())
    assert total <= MAX_CORE_CODE_LINES, f"the core has {total} code lines, over {MAX_CORE_CODE_LINES}:\n{table}"


def test_chapter_05s_engine_does_not_reach_later_chapters():
    core = core_modules()
    for later in ("prefix_cache", "speculative", "disagg", "checkpoint", "generate", "beam_search", "llm"):
        assert f"minipaged.{later}" not in core, f"chapter 05's engine imports minipaged.{later}"


def test_no_function_is_longer_than_a_screen():
    assert long_functions() == []


@pytest.mark.parametrize("source, expected", [
    ('"""Doc."""\n\nimport os  # a comment\n\n\ndef f():\n    """Doc\n    more."""\n    return 1\n', 3),
    ("x = (1,\n     2)\n# only a comment\n", 2),
])  # fmt: skip
def test_code_lines_counts_code_only(tmp_path, source, expected):
    path = tmp_path / "m.py"
    path.write_text(source)
    assert code_lines(path) == expected
