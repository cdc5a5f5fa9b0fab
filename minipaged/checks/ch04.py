"""Checks for chapter 04 (Triton paged decode): the learner's kernel against attention over gathered K/V.

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

# (seq_lens, num_heads, num_kv_heads, head_dim, block_size): partial last blocks, a
# single-token sequence, an exact multiple of the block size, then a GQA group.
CASES = [
    ([5, 19], 2, 2, 16, 8),
    ([1, 16, 23], 4, 2, 16, 4),
]


def paged_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size, *, dtype=torch.float32, seed=0, device=None):
    """A random pool with shuffled block tables. Every slot no sequence owns is NaN.

    A kernel that reads past a sequence's end (a missing mask) or through the
    wrong block therefore returns NaN or a wrong value instead of passing by luck.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    physical, used = torch.randperm(num_blocks, generator=gen), 0
    for seq, (n, nblk) in enumerate(zip(seq_lens, blocks_per_seq)):
        block_tables[seq, :nblk] = physical[used : used + nblk].int()
        slots = (block_tables[seq, :nblk, None].long() * block_size + torch.arange(block_size)).flatten()[:n]
        used += nblk
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    return tuple(t.to(device) for t in (q, k_cache, v_cache, block_tables, seq_lens))


def gathered_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=None):
    """Reference: copy each sequence's K/V out of its blocks into one contiguous tensor, then SDPA."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    out = torch.empty_like(q)
    for seq, seq_len in enumerate(seq_lens.tolist()):
        owned = block_tables[seq, : -(-seq_len // block_size)].long()
        k = k_cache[owned].flatten(0, 1)[:seq_len].transpose(0, 1).float()  # [kv_heads, tokens, dim]
        v = v_cache[owned].flatten(0, 1)[:seq_len].transpose(0, 1).float()
        attn = torch.nn.functional.scaled_dot_product_attention(q[seq, :, None].float(), k, v, scale=scale, enable_gqa=True)
        out[seq] = attn[:, 0].to(q.dtype)
    return out


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
    for seq_lens, num_heads, num_kv_heads, head_dim, block_size in CASES:
        case = paged_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size)
        what = f"decode with seq_lens={seq_lens}, block_size={block_size}, {num_heads} heads on {num_kv_heads} KV heads"
        try:
            out = decode(*case)
        except Exception as exc:
            todo = _not_implemented(exc)
            if todo is not None:
                raise todo from None
            raise
        if isinstance(out, torch.Tensor) and out.shape == case[0].shape and torch.isnan(out).any():
            raise CheckFailed(f"{what} returned NaN: a load read a slot past seq_len (mask it) or a block the sequence doesn't own")
        expect_tensor_close(out, gathered_attention(*case), what, atol=1e-5, rtol=1e-4)
    return f"{len(CASES)} batches (MHA and GQA, partial and single-token blocks, shuffled block tables)"
