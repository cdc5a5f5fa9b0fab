"""The smallest useful Triton kernel: ``out = x + y``.

Chapter 00 runs it to prove the toolchain works, chapter 04 uses it to
introduce program ids, offsets and masks.
"""

import torch
import triton
import triton.language as tl

from minipaged._triton import check_device


@triton.jit
def _vector_add_kernel(x_ptr, y_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    pid = tl.program_id(axis=0)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements  # the last program may run past the end
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x + y, mask=mask)


def vector_add(x: torch.Tensor, y: torch.Tensor, block: int = 256) -> torch.Tensor:
    """Elementwise ``x + y`` with a Triton kernel (1-D, same shape, dtype and device)."""
    if x.shape != y.shape or x.dim() != 1:
        raise ValueError(f"x and y must be 1-D with the same shape, got {tuple(x.shape)} and {tuple(y.shape)}")
    if x.dtype != y.dtype:
        raise TypeError(f"x and y must share a dtype, got {x.dtype} and {y.dtype}")
    if x.device != y.device:
        raise ValueError(f"x and y must be on the same device, got {x.device} and {y.device}")
    if block <= 0 or block & (block - 1):
        raise ValueError(f"block must be a power of two (tl.arange needs one), got {block}")
    check_device(x.device)
    x, y = x.contiguous(), y.contiguous()
    out = torch.empty_like(x)
    grid = (triton.cdiv(x.numel(), block),)
    _vector_add_kernel[grid](x, y, out, x.numel(), BLOCK=block)
    return out
