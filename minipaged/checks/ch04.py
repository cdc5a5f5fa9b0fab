"""Checks for chapter 04 (Triton paged decode): the learner's kernel against contiguous attention.

The cases are :func:`minipaged.testing.make_paged_case`'s: shuffled block tables,
and NaN in every slot no sequence owns, so a kernel that reads past a sequence's
end (a missing mask) or through the wrong block returns NaN or a wrong value
instead of passing by luck.

The learner's code lives inside a ``@triton.jit`` kernel, so a stub's
``raise NotImplementedError`` never reaches the check directly: the
interpreter wraps it in its own error, and on a GPU the compiler rejects the
``raise`` before anything runs. :func:`check_paged_decode_kernel` therefore
looks for the stub in the kernel's source first, and digs a
``NotImplementedError`` out of whatever the launch raised.
"""

from __future__ import annotations

import ast
import inspect

import torch

from minipaged.checks import CheckFailed, check, expect_tensor_close
from minipaged.testing import make_paged_case

# (seq_lens, num_heads, num_kv_heads, head_dim, block_size): partial last blocks, a
# single-token sequence, an exact multiple of the block size, then a GQA group.
CASES = [
    ([5, 19], 2, 2, 16, 8),
    ([1, 16, 23], 4, 2, 16, 4),
]


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


@check(
    "ch04.paged_decode_kernel",
    hint="physical = tl.load(block_tables_ptr + seq * stride_bts + logical); mask tokens >= seq_len "
    "(other=0.0 on the loads, -inf on the scores); rescale l_i and acc by exp(m_i - m_new) before adding this block",
)
def check_paged_decode_kernel(decode, kernel):
    """``decode(q, k_cache, v_cache, block_tables, seq_lens) -> out`` launches the learner's ``kernel``."""
    stub = _stub_in(kernel)
    if stub:
        raise NotImplementedError(stub)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for seq_lens, num_heads, num_kv_heads, head_dim, block_size in CASES:
        case = make_paged_case(
            seq_lens,
            block_size=block_size,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            device=device,
        )
        what = f"decode with seq_lens={seq_lens}, block_size={block_size}, {num_heads} heads on {num_kv_heads} KV heads"
        try:
            out = decode(*case.decode_args)
        except Exception as exc:
            todo = _not_implemented(exc)
            if todo is not None:
                raise todo from None
            raise
        if isinstance(out, torch.Tensor) and out.shape == case.q.shape and torch.isnan(out).any():
            raise CheckFailed(
                f"{what} returned NaN: a load read a slot past seq_len (mask it) or a block the sequence doesn't own"
            )
        expect_tensor_close(out, case.reference(), what, atol=1e-5, rtol=1e-4)
    return f"{len(CASES)} batches (MHA and GQA, partial and single-token blocks, shuffled block tables)"
