"""Optional Triton import.

``import minipaged`` must work where Triton has no wheels (macOS, Windows).
Kernel entry points defined without Triton raise :class:`TritonUnavailable`
with instructions instead of failing at import time.
"""

from __future__ import annotations

import os

try:
    import triton
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    triton = None
    _IMPORT_ERROR: ImportError | None = exc
else:
    _IMPORT_ERROR = None

HAVE_TRITON = triton is not None

INSTALL_HINT = (
    "Triton is not installed. On Linux run `pip install triton` (or `make lab`, "
    "which installs the pinned version). Triton publishes no wheels for macOS or "
    "Windows: use backend='torch' there, or run the course on Linux/WSL/Colab."
)


class TritonUnavailable(ImportError):
    """Raised when a Triton-backed function is called without Triton."""


def require_triton(what: str = "this function") -> None:
    if not HAVE_TRITON:
        raise TritonUnavailable(f"{what} needs Triton. {INSTALL_HINT}") from _IMPORT_ERROR


def interpreted() -> bool:
    """True when Triton kernels run in the CPU interpreter rather than compiled."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_device(device) -> None:
    """Raise :class:`TritonUnavailable` with advice when compiled kernels cannot run on ``device``.

    Outside the interpreter (``TRITON_INTERPRET=0``) Triton compiles for a GPU; given
    CPU tensors it fails deep inside with "0 active drivers". Say what to do instead.
    """
    if interpreted() or str(device).startswith("cuda"):
        return
    where = "there is no CUDA device" if not _cuda_available() else f"the tensors are on {device}"
    raise TritonUnavailable(
        f"TRITON_INTERPRET=0 asks Triton to compile for a GPU, but {where}. Either move the tensors to a "
        "CUDA device, or run the kernels in the CPU interpreter: unset TRITON_INTERPRET (minipaged then "
        "picks the interpreter when there is no GPU) or set TRITON_INTERPRET=1, before importing minipaged."
    )


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def unavailable(name: str):
    """A stand-in for a kernel wrapper that explains how to get Triton."""

    def stub(*args, **kwargs):
        require_triton(name)

    stub.__name__ = name
    stub.__doc__ = f"{name} needs Triton, which is not installed. {INSTALL_HINT}"
    return stub
