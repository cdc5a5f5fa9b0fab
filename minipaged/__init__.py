"""minipaged: PagedAttention built up chapter by chapter.

Importing the package decides how Triton kernels run *before* any
``@triton.jit`` function is defined: with no CUDA device we switch Triton to
its interpreter (``TRITON_INTERPRET=1``), so every kernel in the course runs
on a laptop CPU. An explicit ``TRITON_INTERPRET`` in the environment wins.

In a notebook, a piece of the package that an exercise builds and the learner has not built yet
(:mod:`minipaged.pieces`) reports itself in one line instead of a traceback.
"""

from __future__ import annotations

import os
import sys


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    # is_available() does not create a CUDA context, so this stays cheap.
    return torch.cuda.is_available()


if "TRITON_INTERPRET" not in os.environ and not _cuda_available():
    os.environ["TRITON_INTERPRET"] = "1"

__version__ = "0.1.0"

if "IPython" in sys.modules:  # in a notebook, a piece an exercise has yet to build says so in one line
    from minipaged.pieces import show_unbuilt_pieces_briefly

    show_unbuilt_pieces_briefly()
