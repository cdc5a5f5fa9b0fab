"""Decode-kernel bandwidth: ``python -m minipaged.bench kernel [--dtype fp16] [--block-size 16]``.

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

On a CPU the kernels run in Triton's interpreter, which checks correctness and says
nothing about speed: the script then runs one tiny correctness check and exits.
"""

from __future__ import annotations

import argparse

import torch

from minipaged.attention import paged_attention
from minipaged.bench import positive_int
from minipaged.testing import make_paged_case

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# A Llama-3-8B-like layer: 32 query heads sharing 8 KV heads, head_dim 128.
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128


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
    from minipaged.kernels import paged_decode_attention

    print("No CUDA device: Triton runs in its CPU interpreter, which checks correctness only.")
    print("Bandwidth numbers need a GPU; running one tiny correctness check instead.")
    # 4 heads on 1 KV head: fast enough in the interpreter.
    case, args = make_decode_batch(2, 40, 16, torch.float32, "cpu", num_heads=4, num_kv_heads=1)
    err = (paged_decode_attention(*args) - case.reference()).abs().max().item()
    print(f"max abs error against contiguous attention: {err:.1e} ({'ok' if err < 1e-4 else 'WRONG'})")
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


def gpu_bench(dtype, block_size) -> int:
    copy_gbps = copy_bandwidth("cuda")
    print(f"device {torch.cuda.get_device_name()}: copy bandwidth {copy_gbps:.0f} GB/s (read + write)")
    print(f"layer: {NUM_HEADS} heads on {NUM_KV_HEADS} KV heads, head_dim {HEAD_DIM}, {dtype}, block_size {block_size}")
    providers = ["triton", "triton-unsplit", "sdpa", "torch"]
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
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minipaged.bench kernel", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    parser.add_argument("--block-size", type=positive_int, default=16)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        return cpu_check()
    return gpu_bench(DTYPES[args.dtype], args.block_size)
