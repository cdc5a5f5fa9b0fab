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
  (gather through the block table, then attention), when that module is present
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

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# A Llama-3-8B-like layer: 32 query heads sharing 8 KV heads, head_dim 128.
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128


def make_decode_batch(batch, context_len, block_size, dtype, device, *, seed=0):
    """A shuffled pool holding ``batch`` sequences of ``context_len`` tokens, plus their block tables."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = -(-context_len // block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    # A random permutation: consecutive logical blocks land anywhere in the pool.
    block_tables = torch.randperm(num_blocks, generator=gen, device=device).view(batch, blocks_per_seq).int()
    seq_lens = torch.full((batch,), context_len, dtype=torch.int32, device=device)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen, device=device, dtype=dtype)
    return q, k_cache, v_cache, block_tables, seq_lens


def _torch_paged_attention():
    try:
        from minipaged.attention import paged_attention
    except ImportError:
        return None
    return lambda *args: paged_attention(*args, backend="torch")


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
    q, k_cache, v_cache, block_tables, seq_lens = make_decode_batch(2, 40, 16, torch.float32, "cpu")
    q, k_cache, v_cache = q[:, :4, :], k_cache[:, :, :1], v_cache[:, :, :1]  # 4 heads on 1 KV head: fast enough
    out = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens)
    k = k_cache[block_tables.long()].flatten(1, 2)[:, :40].transpose(1, 2)  # [batch, kv_heads, tokens, dim]
    v = v_cache[block_tables.long()].flatten(1, 2)[:, :40].transpose(1, 2)
    expected = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]
    err = (out - expected).abs().max().item()
    print(f"max abs error against SDPA on the gathered K/V: {err:.1e} ({'ok' if err < 1e-4 else 'WRONG'})")
    return 0 if err < 1e-4 else 1


def measure(provider, batch, context_len, block_size, dtype, torch_paged) -> tuple[float, float]:
    """Median milliseconds of one decode step, and the bytes it must move."""
    import triton.testing

    from minipaged.kernels import paged_decode_attention
    from minipaged.kernels.paged_attention import decode_bytes

    q, k_cache, v_cache, block_tables, seq_lens = make_decode_batch(batch, context_len, block_size, dtype, "cuda")
    nbytes = decode_bytes(q, k_cache, block_tables, seq_lens)
    # validate=False: no host sync, so the step can be replayed from a CUDA graph as an
    # engine would, and launch overhead does not hide the kernel's own bandwidth.
    if provider == "triton":
        fn = lambda: paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, validate=False)  # noqa: E731
    elif provider == "triton-unsplit":
        fn = lambda: paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, num_splits=1, validate=False)  # noqa: E731
    elif provider == "torch":  # it reads seq_lens on the host, so it cannot be graph-captured
        return triton.testing.do_bench(lambda: torch_paged(q, k_cache, v_cache, block_tables, seq_lens), return_mode="median"), nbytes
    else:  # "sdpa": the same tokens laid out contiguously per sequence, as a non-paged cache holds them
        k = k_cache[block_tables.long()].flatten(1, 2)[:, :context_len].transpose(1, 2).contiguous()
        v = v_cache[block_tables.long()].flatten(1, 2)[:, :context_len].transpose(1, 2).contiguous()
        fn = lambda: torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)  # noqa: E731
    return triton.testing.do_bench_cudagraph(fn, return_mode="median"), nbytes


def gpu_bench(dtype, block_size) -> int:
    torch_paged = _torch_paged_attention()
    copy_gbps = copy_bandwidth("cuda")
    print(f"device {torch.cuda.get_device_name()}: copy bandwidth {copy_gbps:.0f} GB/s (read + write)")
    print(f"layer: {NUM_HEADS} heads on {NUM_KV_HEADS} KV heads, head_dim {HEAD_DIM}, {dtype}, block_size {block_size}")
    if torch_paged is None:
        print("minipaged.attention is not importable: the 'torch' baseline is skipped")
    providers = ["triton", "triton-unsplit", "sdpa"] + (["torch"] if torch_paged else [])
    sweeps = [(1, c) for c in (512, 2048, 8192, 32768)] + [(16, c) for c in (512, 2048, 8192, 32768)]
    sweeps += [(b, 4096) for b in (1, 4, 64)]

    print("\nfraction of copy bandwidth (achieved GB/s of the Triton kernel in the last column)")
    print(f"{'batch':>5} {'context':>7} " + " ".join(f"{p:>14}" for p in providers) + f" {'triton GB/s':>12}")
    for batch, context_len in sweeps:
        row = {}
        for provider in providers:
            ms, nbytes = measure(provider, batch, context_len, block_size, dtype, torch_paged)
            row[provider] = nbytes / ms * 1e-6  # GB/s
        print(f"{batch:5d} {context_len:7d} " + " ".join(f"{row[p] / copy_gbps:14.0%}" for p in providers) + f" {row['triton']:12.0f}")

    ms, nbytes = measure("triton", 1, 32768, block_size, dtype, torch_paged)
    fraction = nbytes / ms * 1e-6 / copy_gbps
    verdict = "meets" if fraction >= 0.85 else "misses"
    print(f"\nlong-context decode (batch 1, 32768 tokens): {fraction:.0%} of copy bandwidth, {verdict} the 85% goal")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minipaged.bench kernel", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        return cpu_check()
    return gpu_bench(DTYPES[args.dtype], args.block_size)
