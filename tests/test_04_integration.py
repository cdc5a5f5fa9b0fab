"""Chapter 04 kernels behind ``backend="triton"``: the chapter-03 reference paths and the tiny model agree."""

import pytest
import torch

from minipaged.checks.ch04 import paged_case
from minipaged.kernels import paged_decode_attention

pytestmark = pytest.mark.ch04

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("backend", ["torch", "loop"])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_kernel_matches_the_pytorch_paged_paths(backend, num_splits):
    attention = pytest.importorskip("minipaged.attention")
    case = paged_case([1, 13, 40], 4, 2, 32, 8, device=DEVICE)
    expected = attention.paged_attention(*case, backend=backend)
    torch.testing.assert_close(paged_decode_attention(*case, num_splits=num_splits), expected, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(attention.paged_attention(*case, backend="triton"), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size, prefill_chunk_size", [(8, None), (4, 4)])
def test_greedy_generation_through_triton_equals_the_contiguous_cache(block_size, prefill_chunk_size):
    model_lib = pytest.importorskip("minipaged.model")
    model = model_lib.LlamaForCausalLM(seed=0).to(DEVICE)
    prompts = [[5, 17, 3, 99, 42], [7] * 11, [300, 2, 1]]  # lengths that end mid-block
    expected = [model_lib.generate_contiguous(model, p, 4) for p in prompts]
    got = model_lib.generate_paged(model, prompts, 4, block_size=block_size, backend="triton", prefill_chunk_size=prefill_chunk_size)
    assert got == expected
