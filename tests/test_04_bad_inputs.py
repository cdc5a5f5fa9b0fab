"""Issue 11, chapter 04: the kernels say what they support, and what to do when they cannot run here."""

import os
import subprocess
import sys

import pytest
import torch

from minipaged.attention import write_kv
from minipaged.kernels import check_supported, paged_decode_attention, supports
from minipaged.kernels import write_kv as triton_write_kv
from minipaged.testing import make_paged_case

pytestmark = pytest.mark.ch04


@pytest.mark.parametrize("block_size, head_dim, dtype, ok", [
    (16, 32, torch.float32, True), (1, 16, torch.bfloat16, True), (3, 32, torch.float32, True),
    (48, 80, torch.float16, True), (12, 96, torch.float32, True), (256, 256, torch.float16, True),
    (16, 24, torch.float32, True), (16, 120, torch.float32, True), (16, 192, torch.float32, True),
    (0, 32, torch.float32, False), (257, 32, torch.float32, False), (512, 32, torch.float32, False),
    (16, 8, torch.float32, False), (16, 20, torch.float32, False), (16, 264, torch.float32, False),
    (16, 32, torch.float64, False),
])  # fmt: skip
def test_supports_is_the_kernels_own_limits(block_size, head_dim, dtype, ok):
    assert supports(block_size, head_dim, dtype) is ok
    if not ok:
        name = "dtype" if dtype == torch.float64 else "block_size" if head_dim == 32 else "head_dim"
        with pytest.raises((TypeError, ValueError), match=name):
            check_supported(block_size, head_dim, dtype)


@pytest.mark.parametrize("write", [write_kv, triton_write_kv])
def test_duplicate_slots_are_refused_by_both_write_backends(write):
    k_cache = torch.zeros(4, 16, 2, 16)
    key = torch.randn(2, 2, 16)
    with pytest.raises(ValueError, match="slot_mapping holds slot 7 more than once"):
        write(key, key, k_cache, k_cache.clone(), torch.tensor([7, 7]))


@pytest.mark.parametrize("scale, error", [(float("nan"), ValueError), ("x", TypeError)])
def test_the_kernel_checks_scale_like_the_torch_path(scale, error):
    case = make_paged_case([5, 20], block_size=8, num_heads=4, num_kv_heads=2, head_dim=16)
    with pytest.raises(error, match="scale"):
        paged_decode_attention(*case.decode_args, scale=scale)


def test_compiled_mode_without_a_gpu_says_what_to_do():
    code = (
        "import torch, minipaged.kernels as k\n"
        "try:\n"
        "    k.vector_add(torch.ones(4), torch.ones(4))\n"
        "except k.__dict__.get('TritonUnavailable', Exception) as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith("TritonUnavailable"), out.stdout + out.stderr
    assert "TRITON_INTERPRET=1" in out.stdout and "active drivers" not in out.stdout
