"""Widgets: pure renderers (state -> SVG string or matplotlib figure) under thin ipywidgets layers.

Renderers are plain functions, unit-tested without a browser. Every live
widget also has a static rendering so saved notebooks read on GitHub.
"""

from __future__ import annotations

import inspect


def show_source(obj) -> None:
    """Display the package's own source for ``obj`` in a notebook, so text and code can't disagree."""
    from IPython.display import Markdown, display

    obj = getattr(obj, "fn", obj)  # a @triton.jit kernel wraps its Python function in .fn
    display(Markdown(f"```python\n{inspect.getsource(obj).rstrip()}\n```"))
