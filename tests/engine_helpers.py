"""Engine test helpers shared by chapters 05, 06 and 08.

:func:`drive` runs requests through an engine as they arrive, with random aborts;
:func:`snapshot` is every piece of bookkeeping a failed step must leave as it was.
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


def drive(engine: Engine, requests: list, rng, add, abort_prob: float = 0.0, step=None, arrivals_per_step: int = 2):
    """Add requests a few per step, abort some at random, step until done; return the aborted request ids.

    Args:
        engine: the engine under test.
        requests: whatever ``add`` takes, one item per request.
        rng: a ``random.Random``, which picks the aborts.
        add: ``add(engine, i, request)`` queues request ``i``.
        abort_prob: the chance, per step, of aborting one unfinished request.
        step: what one step is (default ``engine.step``; a test may check state after it).
        arrivals_per_step: requests added before each step.
    """
    step = step or engine.step
    pending, aborted = list(enumerate(requests)), set()
    while pending or engine.has_unfinished():
        for _ in range(arrivals_per_step):
            if pending:
                add(engine, *pending.pop(0))
        live = [rid for rid, s in engine.requests.items() if not s.is_finished]
        if live and rng.random() < abort_prob:
            rid = rng.choice(live)
            engine.abort(rid)
            aborted.add(rid)
        if engine.has_unfinished():
            step()
    return aborted
