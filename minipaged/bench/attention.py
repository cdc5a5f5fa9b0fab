"""``python -m minipaged.bench attention [--quick] [--repeats N]``: CPU decode attention, paged vs contiguous.

For each (batch, context) it times one decode step of attention, in one
process, interleaved so that load from other programs hits every method alike:

- ``sdpa``: the baseline. ``scaled_dot_product_attention`` on K/V that are already
  contiguous per sequence (``[batch, num_kv_heads, context, head_dim]``), the best
  layout a contiguous cache could offer.
- ``nogather``: the torch backend's own attention call
  (:func:`~minipaged.attention.gathered_attention`: the query viewed as each KV head's
  ``group`` rows, two batched matmuls around a softmax) on K/V laid out as the backend's
  gather buffer lays them out, but never gathered.
  ``torch / nogather`` is the cost of the gather alone: the same call on the same
  layout, minus the copy through the block tables.
- ``torch``: ``paged_attention(backend="torch", check=False)`` through a block table whose
  blocks are a random permutation of the pool: the call as the engine makes it at every layer
  but the first, the inputs checked once per step (see :func:`~minipaged.attention.paged_attention`).
- ``loop``: ``paged_attention(backend="loop")``, the block-by-block reference
  (slow, so timed fewer times).

It prints median milliseconds, ratios to ``sdpa`` and ``torch / nogather``. Decode attention is
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

from minipaged.attention import gathered_attention, paged_attention
from minipaged.cli import positive_int
from minipaged.testing import make_paged_case

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
GOAL = (32, 1024)  # batch, context: the case the torch backend is tuned for
FULL_CASES = [(1, 128), (1, 1024), (8, 128), (8, 1024), (32, 128), GOAL]
QUICK_CASES = [(4, 256), GOAL]


def make_case(batch: int, context: int, dtype=torch.float32, seed: int = 0):
    """A full paged pool with shuffled block tables, and the same K/V per sequence, never paged.

    Returns the paged attention's arguments and ``(q, k, v)`` with ``q`` ``[batch, num_heads,
    head_dim]`` and ``k``, ``v`` ``[batch, num_kv_heads, context, head_dim]`` (the gather buffer's layout).

    Args:
        batch, context: the number of sequences and each one's length.
        dtype: the K/V dtype.
        seed: the seed of the case.
    """
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
    k, v = (torch.stack(t).transpose(1, 2).contiguous() for t in (case.keys, case.values))
    return case.decode_args, (case.q, k, v)


def without_gather(q, k, v):
    """The torch backend's attention call on K/V that were never paged (its layout, no gather, no mask).

    Args:
        q: ``[batch, num_heads, head_dim]``.
        k, v: ``[batch, num_kv_heads, context, head_dim]``.
    """
    batch, num_heads, head_dim = q.shape
    qg = q.reshape(batch * NUM_KV_HEADS, num_heads // NUM_KV_HEADS, head_dim) * head_dim**-0.5
    k, v = (t.reshape(batch * NUM_KV_HEADS, -1, head_dim) for t in (k, v))
    return gathered_attention(qg, k, v).view(batch, num_heads, head_dim)


def time_case(batch: int, context: int, repeats: int, loop_repeats: int) -> dict:
    """Median milliseconds of each method on one case.

    Args:
        batch, context: the case.
        repeats: timed runs per method.
        loop_repeats: timed runs of the slow loop backend (0: skip it).
    """
    paged_args, (q, k, v) = make_case(batch, context)
    # sdpa's own layout, the gather buffer's too: [batch, num_kv_heads, context, head_dim], one query per head.
    q4 = q[:, :, None, :]
    runs = {
        "sdpa": lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)[:, :, 0],
        "nogather": lambda: without_gather(q, k, v),
        "torch": lambda: paged_attention(*paged_args, backend="torch", check=False),
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
        f"{'batch':>5} {'context':>7} {'sdpa':>8} {'nogather':>8} {'torch':>8} {'loop':>8}"
        f" {'torch/sdpa':>10} {'torch/nogather':>14} {'loop/sdpa':>9}",
    ]
    for r in rows:
        loop = r.get("loop")
        loop_ms, loop_ratio = (f"{loop:8.2f}", f"{loop / r['sdpa']:8.1f}x") if loop else (f"{'-':>8}", f"{'-':>9}")
        mark = "  <- goal" if (r["batch"], r["context"]) == GOAL else ""
        lines.append(
            f"{r['batch']:>5} {r['context']:>7} {r['sdpa']:8.2f} {r['nogather']:8.2f} {r['torch']:8.2f} {loop_ms}"
            f" {r['torch'] / r['sdpa']:9.2f}x {r['torch'] / r['nogather']:13.2f}x {loop_ratio}{mark}"
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
