"""``python -m minipaged.bench attention [--quick] [--repeats N]``: CPU decode attention, paged vs contiguous.

For each (batch, context) it times one decode step of attention, in one
process, interleaved so that load from other programs hits every method alike:

- ``sdpa``: the baseline. ``scaled_dot_product_attention`` on K/V that are already
  contiguous per sequence (``[batch, num_kv_heads, context, head_dim]``), the best
  layout a contiguous cache could offer.
- ``matmul``: the torch backend's own math (GQA as grouped matmuls, softmax) on
  that contiguous K/V, with no gather. ``torch / matmul`` is the cost of paging.
- ``torch``: ``paged_attention(backend="torch")`` through a block table whose blocks
  are a random permutation of the pool.
- ``loop``: ``paged_attention(backend="loop")``, the block-by-block reference
  (slow, so timed fewer times).

It prints median milliseconds and ratios to ``sdpa``. Decode attention is
memory-bound: every method reads all of K and V once, and the paged one also
copies them once into a gather buffer. Not a timed test; nothing asserts a speed.
On a machine shared with other busy processes, time with ``--threads 1``:
many small multi-threaded ops suffer from a descheduled thread far more than one
big one does, which distorts the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from minipaged.attention import paged_attention
from minipaged.bench import positive_int
from minipaged.testing import make_paged_case

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
GOAL = (32, 1024)  # batch, context: the case the torch backend is tuned for
FULL_CASES = [(1, 128), (1, 1024), (8, 128), (8, 1024), (32, 128), GOAL]
QUICK_CASES = [(4, 256), GOAL]


def make_case(batch: int, context: int, dtype=torch.float32, seed: int = 0):
    """A full paged pool with shuffled block tables, and the same K/V laid out contiguously for SDPA."""
    case = make_paged_case(
        [context] * batch,
        block_size=BLOCK_SIZE,
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=dtype,
        spare_blocks=0,
        extra_columns=0,
        fill=0.0,
        seed=seed,
    )
    k = torch.stack(case.keys).transpose(1, 2).contiguous()  # [batch, num_kv_heads, context, head_dim]
    v = torch.stack(case.values).transpose(1, 2).contiguous()
    return case.decode_args, (case.q[:, :, None, :], k, v)


def contiguous_matmul(q4, k, v):
    batch, num_heads, _, head_dim = q4.shape
    qg = q4.view(batch, NUM_KV_HEADS, num_heads // NUM_KV_HEADS, head_dim) * head_dim**-0.5
    return ((qg @ k.transpose(-1, -2)).softmax(-1) @ v).view(batch, num_heads, head_dim)


def time_case(batch: int, context: int, repeats: int, loop_repeats: int) -> dict:
    paged_args, (q4, k, v) = make_case(batch, context)
    runs = {
        "sdpa": lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)[:, :, 0],
        "matmul": lambda: contiguous_matmul(q4, k, v),
        "torch": lambda: paged_attention(*paged_args, backend="torch"),
        "loop": lambda: paged_attention(*paged_args, backend="loop"),
    }
    if not loop_repeats:
        del runs["loop"]
    expected = runs["sdpa"]()
    for name, fn in runs.items():  # also the warm-up
        err = (fn() - expected).abs().max().item()
        if err > 1e-4:
            raise AssertionError(f"{name} disagrees with sdpa at batch {batch}, context {context}: max error {err:.3g}")
    times = {name: [] for name in runs}
    for i in range(repeats):
        for name, fn in runs.items():
            if name == "loop" and i >= loop_repeats:
                continue
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    row = {"batch": batch, "context": context}
    row.update({name: statistics.median(ts) * 1e3 for name, ts in times.items()})
    return row


def format_table(rows: list[dict]) -> str:
    lines = [
        f"decode attention, fp32, {NUM_HEADS} query heads, {NUM_KV_HEADS} KV heads, head_dim {HEAD_DIM}, "
        f"block {BLOCK_SIZE}, {torch.get_num_threads()} threads; median ms",
        f"{'batch':>5} {'context':>7} {'sdpa':>8} {'matmul':>8} {'torch':>8} {'loop':>8}"
        f" {'torch/sdpa':>10} {'torch/matmul':>12} {'loop/sdpa':>9}",
    ]
    for r in rows:
        loop = r.get("loop")
        loop_ms, loop_ratio = (f"{loop:8.2f}", f"{loop / r['sdpa']:8.1f}x") if loop else (f"{'-':>8}", f"{'-':>9}")
        mark = "  <- goal" if (r["batch"], r["context"]) == GOAL else ""
        lines.append(
            f"{r['batch']:>5} {r['context']:>7} {r['sdpa']:8.2f} {r['matmul']:8.2f} {r['torch']:8.2f} {loop_ms}"
            f" {r['torch'] / r['sdpa']:9.2f}x {r['torch'] / r['matmul']:11.2f}x {loop_ratio}{mark}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m minipaged.bench attention",
        description="Time one CPU decode step of paged attention (torch and loop backends) against contiguous SDPA.",
    )
    parser.add_argument("--quick", action="store_true", help="two cases, few repeats (for the notebook)")
    parser.add_argument("--repeats", type=positive_int, default=None, help="timed runs per method (default 9, quick 5)")
    parser.add_argument("--no-loop", action="store_true", help="skip the slow block-by-block reference")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cases = QUICK_CASES if args.quick else FULL_CASES
    repeats = args.repeats if args.repeats is not None else (5 if args.quick else 9)
    loop_repeats = 0 if args.no_loop else (1 if args.quick else max(1, repeats // 3))
    rows = [time_case(b, n, repeats, loop_repeats) for b, n in cases]
    print(format_table(rows))
    return 0
