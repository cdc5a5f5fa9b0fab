"""Decode bandwidth and prefill throughput: ``python -m minipaged.bench kernel [--dtype fp16] [--block-size 16]``.

Decode attention reads every cached K and V row once and does little arithmetic
per byte, so its speed limit is memory bandwidth. The fair yardstick is therefore
a device-to-device copy measured in the same run: the Triton kernel's achieved
GB/s divided by the copy's GB/s says how close it gets to the hardware. The goal
for long contexts is at least 85%.

Baselines, all moving the same K/V bytes:

* ``sdpa``  contiguous K/V per sequence, ``torch.nn.functional.scaled_dot_product_attention``
  (what a non-paged cache gets; equal lengths, so no padding is wasted)
* ``torch`` the vectorised PyTorch paged path, ``minipaged.attention`` backend ``"torch"``
  (gather through the block table, then attention)
* ``triton-unsplit`` the kernel with ``num_splits=1``, to show what split-KV adds

The Triton kernel and SDPA are timed replaying a CUDA graph (as an engine runs decode
steps); the ``torch`` path syncs with the host every call and is timed without one.
Graph replay does not flush the L2 cache, so small cases whose K/V fit in L2 can show
more than 100%: read the long-context rows.

Prefill is compute-heavy, so its yardstick is the best attention PyTorch has on the same
tokens: ``scaled_dot_product_attention`` with ``is_causal=True`` over each prompt's K/V laid
out contiguously. The table gives prompt tokens per second for the chunked-prefill kernel,
SDPA and (up to 2,048 tokens) the decode kernel run once per query, the stand-in the
prefill kernel replaced, and the kernel's throughput as a fraction of SDPA's.

On a CPU the kernels run in Triton's interpreter, which checks correctness and says
nothing about speed: the script then says what it would measure, runs a small
correctness check of both kernels, counts their K/V bytes in the interpreter, and prints
:data:`GPU_COMMAND`, the one command that runs the GPU tests and both benchmarks.
"""

from __future__ import annotations

import argparse

import torch

from minipaged.attention import paged_attention
from minipaged.cli import positive_int
from minipaged.testing import make_paged_case

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# A Llama-3-8B-like layer: 32 query heads sharing 8 KV heads, head_dim 128.
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
# The GPU tests, then both benchmarks on the short sweeps: under 5 minutes on one H100-class GPU.
GPU_COMMAND = (
    ".venv/bin/pytest tests/test_04_gpu.py -q -p no:cacheprovider -rs && "
    ".venv/bin/python -m minipaged.bench kernel --quick"
)


def make_decode_batch(batch, context_len, block_size, dtype, device, *, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS):
    """A shuffled pool holding ``batch`` sequences of ``context_len`` tokens: ``(case, decode args)``."""
    case = make_paged_case(
        [context_len] * batch,
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=HEAD_DIM,
        dtype=dtype,
        spare_blocks=0,
        extra_columns=0,
        fill=0.0,
        device=device,
    )
    return case, case.decode_args


def copy_bandwidth(device, nbytes=1 << 30) -> float:
    """GB/s of a device-to-device copy (bytes read + bytes written), the roofline for decode."""
    import triton.testing

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src))
    return 2 * nbytes / ms * 1e-6


def cpu_check() -> int:
    """What the interpreter can do: correctness of both kernels and their K/V bytes, no timings."""
    from minipaged.kernels import paged_decode_attention, paged_prefill_attention
    from minipaged.kernels.prefill_attention import prefill_as_decode, prefill_kv_tokens
    from minipaged.kernels.traffic import count_loads

    print("No CUDA device: Triton runs in its CPU interpreter, which checks correctness and counts bytes,")
    print("but says nothing about speed. On a GPU this script measures:")
    print("  decode:  GB/s of the kernel as a fraction of a device-to-device copy's (goal >= 85% at long context),")
    print("           against SDPA on contiguous K/V and the PyTorch paged path;")
    print("  prefill: prompt tokens/s of the chunked-prefill kernel against causal SDPA on contiguous K/V.")
    # 4 heads on 1 KV head: fast enough in the interpreter.
    case, args = make_decode_batch(2, 40, 16, torch.float32, "cpu", num_heads=4, num_kv_heads=1)
    err = (paged_decode_attention(*args) - case.reference()).abs().max().item()
    lens, q_lens = [48, 30], [48, 11]  # a whole prompt and a chunk that starts mid-block
    prefill = make_paged_case(lens, num_new_tokens=q_lens, block_size=16, num_heads=4, num_kv_heads=1, head_dim=16)
    with count_loads(k=prefill.k_cache, v=prefill.v_cache) as kernel_bytes:
        out = paged_prefill_attention(*prefill.prefill_args)
    with count_loads(k=prefill.k_cache, v=prefill.v_cache) as decode_bytes:
        prefill_as_decode(*prefill.prefill_args)
    err = max(err, (out - prefill.reference()).abs().max().item())
    print(f"\nmax abs error of decode and prefill against contiguous attention: {err:.1e} "
          f"({'ok' if err < 1e-4 else 'WRONG'})")
    row = 2 * 16 * 4  # K and V, one KV head, head_dim 16, fp32
    as_decode, tiles = prefill_kv_tokens(lens, q_lens, group=4)
    print(f"K/V bytes loaded in the interpreter for prompts {lens} (chunks {q_lens}): prefill kernel "
          f"{sum(kernel_bytes.values())} (counted from the grid: {tiles * row}), prefill as decode "
          f"{sum(decode_bytes.values())} ({as_decode * row})")
    print(f"\nOn a machine with a GPU, this runs the GPU tests and both benchmarks (sized for under 5 minutes):"
          f"\n  {GPU_COMMAND}")
    return 0 if err < 1e-4 else 1


def measure(provider, batch, context_len, block_size, dtype) -> tuple[float, float]:
    """Median milliseconds of one decode step, and the bytes it must move."""
    import triton.testing

    from minipaged.kernels import paged_decode_attention
    from minipaged.kernels.paged_attention import decode_bytes

    case, args = make_decode_batch(batch, context_len, block_size, dtype, "cuda")
    q, k_cache, _, block_tables, seq_lens = args
    nbytes = decode_bytes(q, k_cache, block_tables, seq_lens)
    # validate=False: no host sync, so the step can be replayed from a CUDA graph as an
    # engine would, and launch overhead does not hide the kernel's own bandwidth.
    if provider == "triton":
        fn = lambda: paged_decode_attention(*args, validate=False)  # noqa: E731
    elif provider == "triton-unsplit":
        fn = lambda: paged_decode_attention(*args, num_splits=1, validate=False)  # noqa: E731
    elif provider == "torch":  # it reads seq_lens on the host, so it cannot be graph-captured
        return triton.testing.do_bench(lambda: paged_attention(*args, backend="torch"), return_mode="median"), nbytes
    else:  # "sdpa": the same tokens laid out contiguously per sequence, as a non-paged cache holds them
        k = torch.stack(case.keys).transpose(1, 2).contiguous()  # [batch, num_kv_heads, context, head_dim]
        v = torch.stack(case.values).transpose(1, 2).contiguous()
        fn = lambda: torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)  # noqa: E731
    return triton.testing.do_bench_cudagraph(fn, return_mode="median"), nbytes


def measure_prefill(provider, batch, prompt_len, block_size, dtype) -> float:
    """Median milliseconds to attend ``batch`` whole prompts of ``prompt_len`` tokens (K/V already cached)."""
    import triton.testing

    from minipaged.kernels import paged_prefill_attention
    from minipaged.kernels.prefill_attention import prefill_as_decode

    case = make_paged_case([prompt_len] * batch, num_new_tokens=[prompt_len] * batch, block_size=block_size,
                           num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, dtype=dtype,
                           spare_blocks=0, extra_columns=0, fill=0.0, device="cuda")
    if provider == "as-decode":  # reads the query lengths on the host: no graph
        return triton.testing.do_bench(lambda: prefill_as_decode(*case.prefill_args), return_mode="median")
    if provider == "triton":
        fn = lambda: paged_prefill_attention(*case.prefill_args, validate=False)  # noqa: E731
    else:  # "sdpa": [batch, heads, tokens, head_dim], each prompt's K/V contiguous
        q = case.q.view(batch, prompt_len, NUM_HEADS, HEAD_DIM).transpose(1, 2)
        k = torch.stack(case.keys).transpose(1, 2).contiguous()
        v = torch.stack(case.values).transpose(1, 2).contiguous()
        fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    return triton.testing.do_bench_cudagraph(fn, return_mode="median")


def prefill_bench(dtype, block_size, quick) -> None:
    sweeps = [(1, 2048), (8, 512)] if quick else [(1, 256), (1, 2048), (1, 8192), (8, 512), (8, 2048), (32, 256)]
    print(f"\nprefill: prompt tokens per second (whole prompts, {dtype}, block_size {block_size})")
    print(f"{'batch':>5} {'prompt':>6} {'triton':>12} {'sdpa':>12} {'as-decode':>12} {'triton/sdpa':>12}")
    for batch, prompt_len in sweeps:
        providers = ["triton", "sdpa"] + (["as-decode"] if prompt_len <= 2048 and not quick else [])
        ms = {p: measure_prefill(p, batch, prompt_len, block_size, dtype) for p in providers}
        rate = {p: batch * prompt_len / ms[p] * 1e3 for p in providers}
        cells = " ".join(f"{rate[p]:12.3g}" if p in rate else f"{'-':>12}" for p in ("triton", "sdpa", "as-decode"))
        print(f"{batch:5d} {prompt_len:6d} {cells} {rate['triton'] / rate['sdpa']:12.0%}")


def gpu_bench(dtype, block_size, quick=False) -> int:
    copy_gbps = copy_bandwidth("cuda")
    print(f"device {torch.cuda.get_device_name()}: copy bandwidth {copy_gbps:.0f} GB/s (read + write)")
    print(f"layer: {NUM_HEADS} heads on {NUM_KV_HEADS} KV heads, head_dim {HEAD_DIM}, {dtype}, block_size {block_size}")
    providers = ["triton", "triton-unsplit", "sdpa", "torch"]
    if quick:
        sweeps = [(1, 2048), (1, 32768), (16, 8192), (64, 4096)]
    else:
        sweeps = [(1, c) for c in (512, 2048, 8192, 32768)] + [(16, c) for c in (512, 2048, 8192, 32768)]
        sweeps += [(b, 4096) for b in (1, 4, 64)]

    print("\nfraction of copy bandwidth (achieved GB/s of the Triton kernel in the last column)")
    print(f"{'batch':>5} {'context':>7} " + " ".join(f"{p:>14}" for p in providers) + f" {'triton GB/s':>12}")
    for batch, context_len in sweeps:
        row = {}
        for provider in providers:
            ms, nbytes = measure(provider, batch, context_len, block_size, dtype)
            row[provider] = nbytes / ms * 1e-6  # GB/s
        fractions = " ".join(f"{row[p] / copy_gbps:14.0%}" for p in providers)
        print(f"{batch:5d} {context_len:7d} {fractions} {row['triton']:12.0f}")

    ms, nbytes = measure("triton", 1, 32768, block_size, dtype)
    fraction = nbytes / ms * 1e-6 / copy_gbps
    verdict = "meets" if fraction >= 0.85 else "misses"
    print(f"\nlong-context decode (batch 1, 32768 tokens): {fraction:.0%} of copy bandwidth, {verdict} the 85% goal")
    prefill_bench(dtype, block_size, quick)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minipaged.bench kernel", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--quick", action="store_true", help="short sweeps (what GPU_COMMAND runs)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        return cpu_check()
    return gpu_bench(DTYPES[args.dtype], args.block_size, args.quick)
