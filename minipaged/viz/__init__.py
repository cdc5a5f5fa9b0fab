"""Widgets: pure renderers (state -> SVG string or matplotlib figure) under thin ipywidgets layers.

Renderers are plain functions, unit-tested without a browser. Every live
widget also has a static rendering so saved notebooks read on GitHub.
"""

from __future__ import annotations

import ast
import inspect
import textwrap


def show_source(obj, *, docstring: bool = True) -> None:
    """Display the package's own source for ``obj`` in a notebook, so text and code can't disagree.

    Args:
        obj: a function, class or method of the package (a ``@triton.jit`` kernel too).
        docstring: False keeps only the first line of ``obj``'s docstring, where the chapter's prose
            already says the rest: the code the argument needs, not a long dump.
    """
    from IPython.display import Markdown, display

    display(Markdown(f"```python\n{source_text(obj, docstring=docstring)}\n```"))


def source_text(obj, *, docstring: bool = True) -> str:
    """``obj``'s source as :func:`show_source` shows it."""
    obj = getattr(obj, "fn", obj)  # a @triton.jit kernel wraps its Python function in .fn
    lines = inspect.getsource(obj).rstrip().splitlines()
    if not docstring:
        tree = ast.parse(textwrap.dedent("\n".join(lines)))
        body = tree.body if inspect.ismodule(obj) else tree.body[0].body
        first = body[0] if body else None
        if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant) and isinstance(
                first.value.value, str):  # fmt: skip
            start, end = first.lineno - 1, first.end_lineno
            indent = lines[start][: len(lines[start]) - len(lines[start].lstrip())]
            summary = first.value.value.strip().splitlines()[0]
            lines[start:end] = [f'{indent}"""{summary} …"""']
    return "\n".join(lines)
