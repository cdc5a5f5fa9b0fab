"""Chapter 04 kernels behind ``backend="triton"``: the chapter-03 reference paths and the tiny model agree."""

import pytest
import torch

from minipaged.attention import paged_attention
from minipaged.generate import generate_contiguous, generate_paged
from minipaged.kernels import paged_decode_attention
from minipaged.model import LlamaForCausalLM
from minipaged.testing import make_paged_case

pytestmark = pytest.mark.ch04

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("backend", ["torch", "loop"])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_kernel_matches_the_pytorch_paged_paths(backend, num_splits):
    case = make_paged_case([1, 13, 40], block_size=8, num_heads=4, num_kv_heads=2, head_dim=32, device=DEVICE)
    expected = paged_attention(*case.decode_args, backend=backend)
    out = paged_decode_attention(*case.decode_args, num_splits=num_splits)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(paged_attention(*case.decode_args, backend="triton"), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size, prefill_chunk_size", [(8, None), (4, 4)])
def test_greedy_generation_through_triton_equals_the_contiguous_cache(block_size, prefill_chunk_size):
    model = LlamaForCausalLM(seed=0).to(DEVICE)
    prompts = [[5, 17, 3, 99, 42], [7] * 11, [300, 2, 1]]  # lengths that end mid-block
    expected = [generate_contiguous(model, p, 4) for p in prompts]
    got = generate_paged(
        model, prompts, 4, block_size=block_size, backend="triton", prefill_chunk_size=prefill_chunk_size
    )
    assert got == expected
