"""Chapter 00: what is this machine, and does the Triton toolchain work?"""

from __future__ import annotations

import platform
import sys
from dataclasses import dataclass, field

import torch

from minipaged import _triton


@dataclass
class EnvReport:
    python: str
    platform: str
    torch: str
    triton: str | None
    numpy: str
    device: str
    triton_mode: str  # "compiled", "interpreted" or "unavailable"
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        rows = [
            ("python", self.python),
            ("platform", self.platform),
            ("torch", self.torch),
            ("triton", self.triton or "not installed"),
            ("numpy", self.numpy),
            ("device", self.device),
            ("triton mode", self.triton_mode),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"{k:<{width}} : {v}" for k, v in rows]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def device_name() -> str:
    if torch.cuda.is_available():
        return f"cuda ({torch.cuda.get_device_name(0)})"
    return "cpu"


def report() -> EnvReport:
    """Versions, device, and how Triton kernels will run here."""
    import numpy

    if not _triton.HAVE_TRITON:
        mode = "unavailable"
        notes = [_triton.INSTALL_HINT]
    elif _triton.interpreted():
        mode = "interpreted"
        notes = ["Triton kernels run in the CPU interpreter: correct, but slow. Use small shapes."]
    else:
        mode = "compiled"
        notes = []
    return EnvReport(
        python=sys.version.split()[0],
        platform=f"{platform.system()} {platform.machine()}",
        torch=torch.__version__,
        triton=_triton.triton.__version__ if _triton.HAVE_TRITON else None,
        numpy=numpy.__version__,
        device=device_name(),
        triton_mode=mode,
        notes=notes,
    )


def kernels_run_here(report: EnvReport, cell: str) -> bool:
    """True when Triton can run kernels here; otherwise print one line saying ``cell`` is skipped.

    Chapter 00's kernel cells ask this first, so that the chapter runs top to bottom where Triton is not
    installed (macOS, Windows) and says plainly what it skipped, instead of stopping at a traceback.

    Args:
        report: what :func:`report` returned.
        cell: what the calling cell would have shown, for the message ("the smoke test").
    """
    if not isinstance(report, EnvReport):
        raise TypeError(f"report must be an EnvReport from env.report(), got {type(report).__name__}")
    if not isinstance(cell, str) or not cell:
        raise TypeError(f"cell must be a non-empty str naming what the cell shows, got {cell!r}")
    if report.triton_mode != "unavailable":
        return True
    print(f"Skipped {cell}: Triton is not installed here (the report's note says how to get it).")
    return False


class ToolchainError(RuntimeError):
    """The Triton smoke test produced wrong numbers."""


def smoke_test(n: int = 1000, device: str | None = None) -> torch.Tensor:
    """Run a tiny Triton kernel and check it against torch; raise if it is wrong.

    A kernel can return without an error and still be wrong, so the values are
    checked, not just that the call returned. (A kernel created before
    ``TRITON_INTERPRET`` was set does raise: "0 active drivers" on a CPU.)
    """
    from minipaged.kernels import vector_add

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(n, generator=gen).to(device) + 1.0  # >= 1 so all-zeros can't pass
    y = torch.rand(n, generator=gen).to(device)
    out = vector_add(x, y)
    expected = x + y
    if not torch.any(out != 0):
        raise ToolchainError(
            "The Triton kernel returned all zeros: it ran without an error, but the toolchain here "
            "is broken. Check the report's triton mode, and that torch and triton are the versions "
            "pinned in constraints.txt."
        )
    if not torch.allclose(out, expected):
        bad = (out != expected).sum().item()
        raise ToolchainError(f"The Triton kernel is wrong at {bad} of {n} elements.")
    return out
