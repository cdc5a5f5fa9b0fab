"""Checks for exercise 04: a sliding-window paged decode kernel in Triton.

Chapter 04 builds a kernel that reads every block of a sequence. With a sliding
window of ``W`` tokens the new token sees only positions ``seq_len - W ..
seq_len - 1``, so a good kernel never visits a block that lies wholly before the
window: a real sliding-window cache has already freed it. In these cases such
blocks' table entries point at a block of NaN that nobody owns, and a kernel that
visits them (or folds in a block whose tokens are all masked, which gives
``m = -inf`` and NaN) fails.

The learner's code lives inside a ``@triton.jit`` kernel, so a stub's ``raise
NotImplementedError`` never reaches the check directly: the interpreter wraps it
in its own error, and on a GPU the compiler rejects the ``raise`` before anything
runs. :func:`check_window_decode_kernel` therefore looks for the stub in the
kernel's source first, and digs a ``NotImplementedError`` out of whatever the
launch raised. The reference and the hidden cases are in ``minipaged.checks.instructor.ch04``.
"""

from __future__ import annotations

import ast
import inspect

import torch

from minipaged.attention import contiguous_attention
from minipaged.checks import CheckFailed, as_tensor, check, expect_tensor_close
from minipaged.testing import make_paged_case

# The package modules this exercise rebuilds: the grader flags a learner's cell that imports, subclasses or
# calls them (a flag for the instructor, not a verdict).
REBUILDS = ("minipaged.kernels",)

HINTS = {
    "4.1": [
        "a sliding window of W tokens: the new token at position seq_len - 1 sees positions seq_len - W .. seq_len - 1",
        "start the loop at the logical block that holds position max(seq_len - W, 0), and mask each token whose "
        "position is before it or at or after seq_len; query head h reads KV head h // GROUP",
        "the first visible position is seq_len - window, clamped at 0 with tl.maximum; integer-divide it by "
        "BLOCK_SIZE for the first block; a token counts when it is at or after that position and before seq_len",
    ],
}

HEAD_DIM = 16


def _stub_in(kernel) -> str | None:
    """The stub's message if the kernel's source still holds ``raise NotImplementedError``."""
    fn = getattr(kernel, "fn", kernel)
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return None
    for line in map(str.strip, source.splitlines()):
        if line.startswith("raise NotImplementedError"):
            try:
                return str(ast.literal_eval(line[len("raise NotImplementedError(") : -1]))
            except (ValueError, SyntaxError):
                return "replace the `raise NotImplementedError` in the kernel with your code"
    return None


def _not_implemented(exc: BaseException) -> NotImplementedError | None:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, NotImplementedError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def window_case(seq_lens, window, block_size, num_heads, num_kv_heads, device="cpu"):
    """A decode batch whose blocks wholly before each window point at a NaN block: the case and its block tables."""
    case = make_paged_case(seq_lens, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                           head_dim=HEAD_DIM, device=device)
    tables = case.block_tables.clone()
    nobody = int(tables[0, -1])  # a padding entry: a spare block of NaN
    for i, n in enumerate(seq_lens):
        tables[i, : max(n - window, 0) // block_size] = nobody  # freed when the window slid past them
    return case, tables


def _windowed(case, window) -> torch.Tensor:
    """Each sequence's new token attending to its last ``window`` tokens (a FAIL message's comparison)."""
    rows = [contiguous_attention(case.q[i : i + 1].double(), k[-window:].double(), v[-window:].double())
            for i, (k, v) in enumerate(zip(case.keys, case.values))]
    return torch.cat(rows).to(case.q.dtype)


def _label(c) -> str:
    return (f"decode with seq_lens={c['seq_lens']}, window={c['window']}, block_size={c['block_size']}, "
            f"{c['num_heads']} heads on {c['num_kv_heads']} KV heads")


@check("ch04.window_decode_kernel", hint=HINTS["4.1"][0], label=_label,
       summary="{n} batches (MHA and GQA, windows starting mid-block, freed blocks before the window)")
def check_window_decode_kernel(case, decode, kernel):
    """``decode(q, k_cache, v_cache, block_tables, seq_lens, window) -> out`` launches the learner's ``kernel``.

    ``case`` = {"seq_lens", "window", "block_size", "num_heads", "num_kv_heads"}.
    """
    stub = _stub_in(kernel)
    if stub:
        raise NotImplementedError(stub)
    paged, tables = window_case(case["seq_lens"], case["window"], case["block_size"], case["num_heads"],
                                case["num_kv_heads"], _device())
    try:
        out = decode(paged.q, paged.k_cache, paged.v_cache, tables, paged.seq_lens, case["window"])
    except Exception as exc:
        todo = _not_implemented(exc)
        if todo is not None:
            raise todo from None
        raise
    return out if isinstance(out, torch.Tensor) else repr(out)[:200]


@check_window_decode_kernel.judge
def _judge(case, got, want):
    out, expected = as_tensor(got), as_tensor(want)
    if out is None:
        raise CheckFailed(f"returned {got}, expected a torch.Tensor")
    try:
        expect_tensor_close(out, expected, "the output", atol=1e-5, rtol=1e-4)
    except CheckFailed:
        if case["num_heads"] != case["num_kv_heads"]:  # the MHA case before it passed with the same sequences
            raise CheckFailed("right with one query head per KV head but wrong under GQA: query head h must read "
                              "KV head h // GROUP") from None
        if out.shape == expected.shape and out.isnan().any():
            raise CheckFailed(
                "returned NaN: a block wholly before the window was visited (those blocks are freed: start the loop "
                "at the block that holds position seq_len - window), or a load read a slot past seq_len") from None
        paged, _ = window_case(case["seq_lens"], case["window"], case["block_size"], case["num_heads"],
                               case["num_kv_heads"], _device())
        for other in (case["window"] - 1, case["window"] + 1):
            if out.shape == expected.shape and torch.allclose(out, _windowed(paged, other).cpu(), atol=1e-5,
                                                              rtol=1e-4):
                raise CheckFailed(f"your kernel attends to the last {other} tokens, not the last "
                                  f"{case['window']}") from None
        raise
