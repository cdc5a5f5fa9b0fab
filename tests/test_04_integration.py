"""Chapter 04 kernels behind ``backend="triton"``: the chapter-03 reference paths and the tiny model agree."""

import re

import pytest
import torch

from minipaged.attention import paged_attention
from minipaged.engine import Engine
from minipaged.generate import generate_contiguous, generate_paged
from minipaged.kernels import paged_decode_attention
from minipaged.model import LlamaConfig, LlamaForCausalLM
from minipaged.scheduler import EngineConfig
from minipaged.sequence import SamplingParams
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


@pytest.mark.parametrize(
    "head_dim, heads, block_size", [(80, (5, 1), 12), (48, (4, 2), 3)], ids=["d80-g5-bs12", "d48-g2-bs3"]
)
def test_the_engine_on_triton_gives_the_torch_backends_greedy_tokens(head_dim, heads, block_size):
    """Head dims that are not powers of two, odd block sizes, chunked prefill mixed with decodes."""
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=heads[0],
                         num_key_value_heads=heads[1], head_dim=head_dim)
    model = LlamaForCausalLM(config, seed=1).to(DEVICE)
    prompts = [[5, 17, 3, 99, 42, 8, 8, 1, 250, 31, 7, 64, 2], [7] * 11, [300, 2, 1]]
    params = SamplingParams(max_tokens=5)
    outputs = {}
    for backend in ("torch", "triton"):
        engine_config = EngineConfig(num_blocks=24, block_size=block_size, max_num_batched_tokens=8, backend=backend)
        outputs[backend] = Engine(model, engine_config).generate(prompts, params)
    assert outputs["triton"] == outputs["torch"]
    assert outputs["torch"] == [generate_contiguous(model, p, 5) for p in prompts]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the benchmark times kernels instead")
def test_the_kernel_benchmark_on_a_cpu_checks_counts_and_prints_the_gpu_command(capsys):
    from minipaged.bench import kernel as bench

    assert bench.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "against contiguous attention" in out and "(ok)" in out
    # The interpreter's byte counts equal the counts from the grid, for both ways to prefill.
    counts = out.split("K/V bytes loaded in the interpreter")[1].split("\n")[0]
    kernel, from_grid, as_decode, as_decode_grid = [int(n) for n in re.findall(r"\b(\d+)\b(?![,\]])", counts)][-4:]
    assert kernel == from_grid and as_decode == as_decode_grid and kernel < as_decode
    assert bench.GPU_COMMAND in out and "tests/test_04_gpu.py" in bench.GPU_COMMAND
    with pytest.raises(SystemExit):
        bench.main(["--block-size", "0"])
