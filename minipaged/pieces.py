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


def show_unbuilt_pieces_briefly() -> None:
    """In IPython, print :class:`PieceNotBuilt` as its one line, without the traceback (no-op elsewhere)."""
    ipython = sys.modules.get("IPython")  # loaded by a kernel; a script never pays for importing it
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None:
        return

    def brief(shell, kind, value, traceback, tb_offset=None):
        print(f"⏳ {value}")

    shell.set_custom_exc((PieceNotBuilt,), brief)
