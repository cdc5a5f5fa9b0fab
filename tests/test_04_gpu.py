"""Chapter 04 on a GPU: the kernels compiled (not interpreted) at real sizes.

Everything here skips on a machine without CUDA, saying so: the interpreter suite
(test_04_kernels.py, test_04_prefill.py) covers the same logic on small shapes. On a
GPU these compile one kernel per (head_dim, block_size, group) they meet, so the
shapes are a sample, not the product. ``python -m minipaged.bench kernel`` prints the
command that runs this file together with the benchmarks. Bandwidth is the benchmark's to
report (a fraction of the copy bandwidth measured in the same run), not a timed test's.
"""

import pytest
import torch

from minipaged._triton import interpreted
from minipaged.testing import make_paged_case

pytestmark = [
    pytest.mark.ch04,
    pytest.mark.skipif(
        not torch.cuda.is_available() or interpreted(),
        reason="GPU-only: compiled kernels need a CUDA device (the interpreter tests cover the logic)",
    ),
]

TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# Llama-family head sizes, the power-of-two ones and the padded ones (Phi-2 80, Phi-3 96, 112, 120, 192).
SHAPES = [  # (head_dim, block_size, group, dtype)
    (64, 16, 1, torch.float16), (80, 12, 4, torch.bfloat16), (96, 48, 5, torch.float16),
    (112, 3, 8, torch.bfloat16), (120, 1, 4, torch.float16), (128, 16, 8, torch.bfloat16),
    (192, 128, 2, torch.float16), (256, 256, 4, torch.float16),
]  # fmt: skip


def _case(seq_lens, q_lens, head_dim, block_size, group, dtype):
    return make_paged_case(seq_lens, num_new_tokens=q_lens, block_size=block_size, num_heads=2 * group, num_kv_heads=2,
                           head_dim=head_dim, dtype=dtype, extra_columns=2, device="cuda")


def _error(case, out):
    assert torch.isfinite(out).all()
    return (out.double() - case.reference(dtype=torch.float64)).abs().max().item()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"d{s[0]}-bs{s[1]}-g{s[2]}-{str(s[3])[6:]}")
def test_compiled_decode_and_prefill(shape):
    from minipaged.kernels import paged_decode_attention, paged_prefill_attention

    head_dim, block_size, group, dtype = shape
    decode = _case([1, 700, 3000], None, head_dim, block_size, group, dtype)
    for num_splits in (1, 4, None):
        assert _error(decode, paged_decode_attention(*decode.decode_args, num_splits=num_splits)) <= TOLERANCE[dtype]
    prefill = _case([1000, 9, 300, 2048], [1000, 1, 77, 512], head_dim, block_size, group, dtype)
    assert _error(prefill, paged_prefill_attention(*prefill.prefill_args)) <= TOLERANCE[dtype]


def test_compiled_long_context_split_kv():
    from minipaged.kernels import paged_decode_attention

    case = _case([32768, 5], None, 128, 16, 4, torch.float16)
    assert _error(case, paged_decode_attention(*case.decode_args)) <= TOLERANCE[torch.float16]

