"""Triton kernels, installed as ``minipaged.kernels``.

Import through ``minipaged.kernels`` only: importing ``minipaged`` first is
what switches Triton to its CPU interpreter when there is no GPU.
"""

import minipaged  # noqa: F401  (sets TRITON_INTERPRET before any @triton.jit)
from minipaged._triton import HAVE_TRITON, require_triton, unavailable
from minipaged.attention import AttentionBackend

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


def attention_backend() -> AttentionBackend:
    """These kernels as the ``"triton"`` attention backend (:mod:`minipaged.attention` registers it by name).

    Raises:
        TritonUnavailable: Triton is not installed (this package imports without it; its functions would
            fail at every call), with what to do instead.
    """
    require_triton("backend='triton'")
    return AttentionBackend(
        "triton",
        decode=paged_decode_attention,
        prefill=paged_prefill_attention,  # one launch for the whole batch, decode rows included
        write=write_kv,
        check=check_supported,
    )


__all__ = [
    "HAVE_TRITON", "attention_backend", "check_supported", "paged_decode_attention", "paged_prefill_attention",
    "supports", "vector_add", "write_kv",
]
