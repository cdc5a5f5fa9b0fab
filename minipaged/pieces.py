"""The pieces a learner builds: holes in the learner's copy of the package, and what a hole raises.

In the repository each piece's body sits between a ``### BEGIN SOLUTION (Exercise NN, Task N.M)``
comment line and a ``### END SOLUTION`` line, which name the exercise and the task that build it.
The learner's handout (``python -m minipaged.exercises release DIR``, see :mod:`minipaged.exercises`)
has a stub there instead, which raises :class:`PieceNotBuilt`; the learner writes the body in that
file, and from then on the chapters, the checks and the capstone run on it. In a notebook, a cell
that reaches a stub prints one line naming the exercise that builds it, not a traceback
(:func:`show_unbuilt_pieces_briefly`, which ``import minipaged`` calls under IPython).
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys


class PieceNotBuilt(NotImplementedError):
    """A piece of the package that an exercise builds, reached before the learner built it.

    Args:
        exercise: the exercise that builds it, ``"08"``.
        task: its task, ``"8.1"``.
        piece: the function or method, ``"NgramSpeculator.schedule_drafts"``.
        path: the file to write it in, relative to the handout's root.
    """

    def __init__(self, exercise: str, task: str, piece: str, path: str):
        self.exercise, self.task, self.piece, self.path = exercise, task, piece, path
        super().__init__(f"{piece} is not built yet: exercise {exercise}, Task {task} builds it in {path}")


def unbuilt(fn) -> PieceNotBuilt | None:
    """The :class:`PieceNotBuilt` that ``fn``'s stub raises while its source still holds one, else None.

    For a piece that cannot raise where it runs: the body of a ``@triton.jit`` kernel (``fn`` itself, or its
    ``.fn``), which the compiler refuses to compile with a ``raise`` in it and the interpreter wraps in its own
    error. Its launcher asks first, and raises what this returns. The source is read once per function object.
    """
    args = _stub_arguments(getattr(fn, "fn", fn))
    return None if args is None else PieceNotBuilt(*args)


@functools.lru_cache(maxsize=64)
def _stub_arguments(fn) -> tuple[str, str, str, str] | None:
    """The arguments of the ``raise PieceNotBuilt(...)`` line in ``fn``'s source (what a release writes), if any."""
    try:
        lines = inspect.getsource(fn).splitlines()
    except (OSError, TypeError):
        return None
    for line in map(str.strip, lines):
        if line.startswith("raise PieceNotBuilt(") and line.endswith(")"):
            try:
                args = ast.literal_eval(line[len("raise PieceNotBuilt") :])
            except (ValueError, SyntaxError):
                continue
            if isinstance(args, tuple) and len(args) == 4 and all(isinstance(a, str) for a in args):
                return args
    return None


def show_unbuilt_pieces_briefly() -> None:
    """In IPython, print :class:`PieceNotBuilt` as its one line, without the traceback (no-op elsewhere)."""
    ipython = sys.modules.get("IPython")  # loaded by a kernel; a script never pays for importing it
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None:
        return

    def brief(shell, kind, value, traceback, tb_offset=None):
        print(f"⏳ {value}")

    shell.set_custom_exc((PieceNotBuilt,), brief)
