"""Counting the bytes a kernel loads, in Triton's CPU interpreter.

A GPU profiler reports the bytes a kernel moved; on a CPU the interpreter can say the
same, exactly. Every ``tl.load`` of an interpreted kernel ends in the interpreter's
``create_masked_load`` with the vector of addresses and the mask. :func:`count_loads`
wraps that call for the duration of a ``with`` block and adds up, per tensor, the bytes
of the unmasked lanes whose address falls inside the tensor's storage. A masked lane
reads no memory, so it is not counted. Chapter 04 uses it to confirm the K/V traffic
it derives from the launch grid and the tile loop. :func:`count_dots` counts the
``tl.dot`` calls the same way (exercise 04's check: the group's products are matrix products).
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch

from minipaged._triton import interpreted
from minipaged.validation import check_instance


@contextmanager
def count_loads(**tensors):
    """Count the bytes interpreted kernels load from each of ``tensors`` while the block runs.

    Args:
        tensors: ``name=tensor`` pairs (CPU tensors); a load is charged to the tensor whose
            storage holds its address. Two names may not share a storage.

    Yields:
        ``{name: bytes loaded}``, updated as kernels run and final when the block exits.

    Raises:
        RuntimeError: Triton is compiling for a GPU (``TRITON_INTERPRET`` is off), where
            the interpreter's loads cannot be observed.
        TypeError: a value is not a tensor.
    """
    _require_interpreter("count_loads")
    from triton.runtime import interpreter

    ranges = {}
    for name, t in tensors.items():
        storage = check_instance(t, name, torch.Tensor, "a torch.Tensor").untyped_storage()
        ranges[name] = (storage.data_ptr(), storage.data_ptr() + storage.nbytes())
    counts = dict.fromkeys(tensors, 0)
    builder = interpreter.interpreter_builder
    load = builder.create_masked_load

    def counting_load(ptrs, mask, *args):
        addresses = ptrs.data.astype(np.uint64)
        lanes = np.broadcast_to(mask.data, addresses.shape)
        itemsize = ptrs.get_element_ty().primitive_bitwidth // 8
        for name, (lo, hi) in ranges.items():
            counts[name] += int(((addresses >= lo) & (addresses < hi) & lanes).sum()) * itemsize
        return load(ptrs, mask, *args)

    builder.create_masked_load = counting_load  # an instance attribute shadows the class's method
    try:
        yield counts
    finally:
        del builder.create_masked_load


@contextmanager
def count_dots():
    """Count the ``tl.dot`` calls of interpreted kernels while the block runs.

    Yields:
        ``{"dots": calls}``, updated as kernels run and final when the block exits.

    Raises:
        RuntimeError: Triton is compiling for a GPU (``TRITON_INTERPRET`` is off).
    """
    _require_interpreter("count_dots")
    from triton.runtime import interpreter

    counts = {"dots": 0}
    builder = interpreter.interpreter_builder
    dot = builder.create_dot

    def counting_dot(*args):
        counts["dots"] += 1
        return dot(*args)

    builder.create_dot = counting_dot  # an instance attribute shadows the class's method
    try:
        yield counts
    finally:
        del builder.create_dot


def _require_interpreter(what: str) -> None:
    if not interpreted():
        raise RuntimeError(f"{what} needs Triton's interpreter (TRITON_INTERPRET=1): compiled kernels are hidden")


__all__ = ["count_dots", "count_loads"]
