"""Triton kernels, installed as ``minipaged.kernels``.

Import through ``minipaged.kernels`` only: importing ``minipaged`` first is
what switches Triton to its CPU interpreter when there is no GPU.
"""

import minipaged  # noqa: F401  (sets TRITON_INTERPRET before any @triton.jit)
from minipaged._triton import HAVE_TRITON, unavailable

if HAVE_TRITON:
    from .vector_add import vector_add
else:
    vector_add = unavailable("vector_add")

__all__ = ["HAVE_TRITON", "vector_add"]
