"""Exercise 04's check by mutation: a sliding-window kernel PASSes; known wrong ones FAIL with their reason.

One kernel with a ``MODE`` switch holds the reference (0) and the mistakes: visiting every block
(1), a window one token short (2), every query head on its own KV head (3), no window mask in the
first visited block (4).
"""

import minipaged  # noqa: F401, I001 (first: Triton's interpreter when there is no GPU)

import pytest
import torch
import triton
import triton.language as tl

from minipaged.checks import FAIL, PASS, TODO, ch04
from minipaged.kernels import paged_decode_attention
from minipaged.kernels.paged_attention import _paged_decode_kernel

pytestmark = pytest.mark.ch04


@triton.jit
def _window_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, sl_ptr, out_ptr, scale, window, s_qs, s_qh, s_kb, s_kt, s_kh, s_bt,
                   GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, MODE: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK_SIZE)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * s_qs + head * s_qh + dims).to(tl.float32)
    seq_len = tl.load(sl_ptr + seq)
    kv_head = head if MODE == 3 else head // GROUP
    first = tl.maximum(seq_len - window + 1, 0) if MODE == 2 else tl.maximum(seq_len - window, 0)
    lo = 0 if MODE == 1 else first // BLOCK_SIZE
    m_i = tl.full([], float("-inf"), tl.float32)
    l_i = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for logical in range(lo, tl.cdiv(seq_len, BLOCK_SIZE)):
        physical = tl.load(bt_ptr + seq * s_bt + logical).to(tl.int64)
        pos = logical * BLOCK_SIZE + offs
        valid = pos < seq_len if MODE == 4 else (pos >= first) & (pos < seq_len)
        rows = physical * s_kb + offs[:, None] * s_kt + kv_head * s_kh + dims[None, :]
        k = tl.load(k_ptr + rows, mask=valid[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + rows, mask=valid[:, None], other=0.0).to(tl.float32)
        scores = tl.where(valid, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    tl.store(out_ptr + seq * s_qs + head * s_qh + dims, (acc / l_i).to(out_ptr.dtype.element_ty))


def launcher(mode):
    def decode(q, k_cache, v_cache, block_tables, seq_lens, window):
        num_seqs, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        out = torch.empty_like(q)
        _window_kernel[(num_seqs, num_heads)](
            q, k_cache, v_cache, block_tables, seq_lens, out, head_dim**-0.5, window,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            GROUP=num_heads // num_kv_heads, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, MODE=mode,
        )
        return out

    return decode


def stub_kernel():
    # What the exercise generator leaves in the learner's kernel.
    raise NotImplementedError("Task 4.1 is not implemented yet. Hint: a sliding window")


def test_reference_passes(capsys):
    assert ch04.check_window_decode_kernel(launcher(0), _window_kernel).status == PASS
    assert capsys.readouterr().out.startswith("✅ PASS   ch04.window_decode_kernel")


@pytest.mark.parametrize(
    "mode, reason",
    [(1, "start the loop at the block"), (2, "attends to the last"), (3, "h // GROUP"), (4, "")],
    ids=["visits every block", "window one short", "wrong KV head", "no window mask"],
)
def test_mutant_fails_with_its_reason(mode, reason, capsys):
    result = ch04.check_window_decode_kernel(launcher(mode), _window_kernel)
    assert result.status == FAIL and reason in result.message, result.message
    assert "Traceback" not in capsys.readouterr().out


def test_the_chapters_kernel_does_not_answer_the_task():
    assert ch04.check_window_decode_kernel(paged_decode_attention, _paged_decode_kernel).status == FAIL


def test_stub_in_the_kernel_source_is_not_implemented_yet():
    result = ch04.check_window_decode_kernel(launcher(0), stub_kernel)
    assert result.status == TODO and "sliding window" in result.message


def test_not_implemented_wrapped_by_the_interpreter_is_found():
    def launch(*args):
        try:
            raise NotImplementedError("Task 4.1 is not implemented yet.")
        except NotImplementedError as exc:
            raise RuntimeError("interpreter error") from exc

    assert ch04.check_window_decode_kernel(launch, _window_kernel).status == TODO
