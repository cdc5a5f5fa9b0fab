"""Triton kernels, installed as ``minipaged.kernels``.

Import through ``minipaged.kernels`` only: importing ``minipaged`` first is
what switches Triton to its CPU interpreter when there is no GPU.
"""

import minipaged  # noqa: F401  (sets TRITON_INTERPRET before any @triton.jit)
from minipaged._triton import HAVE_TRITON, unavailable

if HAVE_TRITON:
    from .cache_ops import write_kv
    from .paged_attention import check_supported, paged_decode_attention, supports
    from .prefill_attention import paged_prefill_attention
    from .vector_add import vector_add
else:
    vector_add = unavailable("vector_add")
    paged_decode_attention = unavailable("paged_decode_attention")
    paged_prefill_attention = unavailable("paged_prefill_attention")
    write_kv = unavailable("write_kv")
    check_supported = unavailable("check_supported")
    supports = unavailable("supports")

__all__ = [
    "HAVE_TRITON", "check_supported", "paged_decode_attention", "paged_prefill_attention", "supports", "vector_add",
    "write_kv",
]
