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
launch raised.
"""

from __future__ import annotations

import ast
import inspect

import torch

from minipaged.attention import contiguous_attention
from minipaged.checks import CheckFailed, check, expect_tensor_close
from minipaged.testing import make_paged_case

HINTS = {
    "4.1": [
        "a sliding window of W tokens: the new token at position seq_len - 1 sees positions seq_len - W .. seq_len - 1",
        "start the loop at the logical block that holds position max(seq_len - W, 0), and mask each token whose "
        "position is before it or at or after seq_len; query head h reads KV head h // GROUP",
        "the first visible position is seq_len - window, clamped at 0 with tl.maximum; integer-divide it by "
        "BLOCK_SIZE for the first block; a token counts when it is at or after that position and before seq_len",
    ],
}

# (seq_lens, window, block_size); each case runs with MHA, then with a GQA group of 2.
CASES = [
    ([5, 19, 9], 6, 4),  # windows that start mid-block; block 0 of the long sequences is skipped
    ([1, 16, 23], 8, 8),  # a window longer than the sequence, one that starts on a boundary
]
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


def window_case(seq_lens, window, block_size, num_heads, num_kv_heads, device="cpu"):
    """A decode batch whose blocks wholly before each window point at a NaN block; and the expected output."""
    case = make_paged_case(seq_lens, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                           head_dim=HEAD_DIM, device=device)
    tables = case.block_tables.clone()
    nobody = int(tables[0, -1])  # a padding entry: a spare block of NaN
    for i, n in enumerate(seq_lens):
        tables[i, : max(n - window, 0) // block_size] = nobody  # freed when the window slid past them
    return case, tables, _windowed(case, window)


def _windowed(case, window) -> torch.Tensor:
    rows = [contiguous_attention(case.q[i : i + 1].double(), k[-window:].double(), v[-window:].double())
            for i, (k, v) in enumerate(zip(case.keys, case.values))]
    return torch.cat(rows).to(case.q.dtype)


@check("ch04.window_decode_kernel", hint=HINTS["4.1"][0], timeout=120)
def check_window_decode_kernel(decode, kernel):
    """``decode(q, k_cache, v_cache, block_tables, seq_lens, window) -> out`` launches the learner's ``kernel``."""
    stub = _stub_in(kernel)
    if stub:
        raise NotImplementedError(stub)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for seq_lens, window, block_size in CASES:
        for num_heads, num_kv_heads in [(2, 2), (4, 2)]:
            case, tables, expected = window_case(seq_lens, window, block_size, num_heads, num_kv_heads, device)
            what = (f"decode with seq_lens={seq_lens}, window={window}, block_size={block_size}, "
                    f"{num_heads} heads on {num_kv_heads} KV heads")
            try:
                out = decode(case.q, case.k_cache, case.v_cache, tables, case.seq_lens, window)
            except Exception as exc:
                todo = _not_implemented(exc)
                if todo is not None:
                    raise todo from None
                raise
            try:
                expect_tensor_close(out, expected, what, atol=1e-5, rtol=1e-4)
            except CheckFailed:
                if num_heads != num_kv_heads:  # the same sequences just passed with one query head per KV head
                    raise CheckFailed(f"{what}: right with one query head per KV head but wrong under GQA: query "
                                      "head h must read KV head h // GROUP") from None
                if isinstance(out, torch.Tensor) and out.shape == expected.shape and out.isnan().any():
                    raise CheckFailed(
                        f"{what} returned NaN: a block wholly before the window was visited (those blocks are "
                        "freed: start the loop at the block that holds position seq_len - window), or a load read "
                        "a slot past seq_len"
                    ) from None
                for other in (window - 1, window + 1):
                    if isinstance(out, torch.Tensor) and out.shape == expected.shape and torch.allclose(
                            out, _windowed(case, other), atol=1e-5, rtol=1e-4):
                        raise CheckFailed(f"{what}: your kernel attends to the last {other} tokens, "
                                          f"not the last {window}") from None
                raise
    return f"{2 * len(CASES)} batches (MHA and GQA, windows starting mid-block, freed blocks before the window)"
