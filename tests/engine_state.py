"""What a failed engine step must leave as it was: every piece of its bookkeeping, as plain values.

Shared by the fault tests of chapter 05 (test_05_faults.py) and chapter 08 (test_08_speculative.py).
"""

from minipaged.engine import Engine


def snapshot(engine: Engine) -> dict:
    """Every piece of bookkeeping a step may change, as plain values."""
    alloc, sched = engine.cache.allocator, engine.scheduler
    seqs = sorted(engine.requests.values(), key=lambda s: str(s.seq_id))
    return {
        "free_queue": alloc.free_queue() if hasattr(alloc, "free_queue") else list(alloc.free_block_ids),
        "refcounts": alloc.refcounts,
        "keys": [alloc.block_key(b) for b in range(alloc.num_blocks)] if hasattr(alloc, "block_key") else None,
        "waiting": [s.seq_id for s in sched.waiting],
        "running": [s.seq_id for s in sched.running],
        "seqs": [(s.seq_id, s.status, s.num_computed_tokens, list(s.token_ids), list(s.token_times), s.finish_time,
                  s.num_preemptions, [c.seq_id for c in s.pending_forks],
                  None if s.block_table is None else (list(s.block_table.blocks), s.block_table.num_tokens))
                 for s in seqs],
        "swap_space": sorted(map(str, engine.swap_space)),
        "clock": engine.clock.now(),
        "metrics": {k: v for k, v in vars(engine.metrics).items()
                    if k not in ("history", "_allocator") and not callable(v)},
        "history": list(engine.metrics.history),
    }
