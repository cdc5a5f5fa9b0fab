"""The capstone's check: the learner's engine, built from their own pieces, serves the requests vLLM served.

The pieces are the package's, which in a learner's copy are theirs: the prefix-caching allocator on
the block allocator (exercises 06 on 02), the block table with its copy-on-write (02 and 06), the
``"torch"`` attention backend (03) and the scheduler (05). The probe assembles them into one
:class:`~minipaged.engine.Engine` and runs:

- **recorded** cases: the batches of ``notebooks/results/vllm_check.json``, which real vLLM served
  (``make vllm-check``), with the recorded limits (blocks of 32, vLLM's CPU size): SmolLM2-135M-Instruct's
  chats, which stop at its EOS, and the course model's prompts. The probe records each request's greedy
  tokens and the tokens its prefix-cache hit covered. The judge wants the tokens equal to vLLM's up to
  the first near-tie (a margin below the record's threshold, :func:`minipaged.near_ties.compare_tokens`)
  and the cached tokens equal to vLLM's. (In a learner's package no model engine is left to run
  beside theirs: its pieces are theirs.)
- a **preemption** case on the checks' float64 model (:mod:`minipaged.checks.engine_run`): a
  seeded workload on a pool so small that sequences are preempted and recomputed, with aborts;
  tokens and per-step schedules must equal the model answer's (the reference side's) exactly.
"""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path

import torch

from minipaged.checks import CheckFailed, check
from minipaged.checks.engine_run import engine_with, first_divergence, first_token_divergence, run_engine

# The package modules the capstone rebuilds in a notebook cell: none. It runs the pieces of exercises 02, 03, 05
# and 06, which the learner built in their own package files.
REBUILDS = ()

RECORD = Path(__file__).resolve().parents[2] / "notebooks" / "results" / "vllm_check.json"
MODELS = {"course model": "course", "SmolLM2-135M-Instruct": "smollm2-135m-instruct"}  # record name -> load_model's

HINTS = {
    "9.1": [
        "your pieces of exercises 02, 03, 05 and 06 run together here for the first time; if the run fails, look "
        "for what one piece assumes of another (a hook the prefix cache overrides, a table method the scheduler "
        "calls)",
        "find the piece: run the checks of exercises 02, 03, 05 and 06 again (a piece edited since may fail its "
        "own check now); if they all PASS, the message above names the first step, request or block where your "
        "engine parted from the model answer's, and the piece that decides it",
        "blocks of 32 and a 1,024-token budget are new here: batch 1's prompt fills three blocks and part of a "
        "fourth in one step, each of batch 2's prompts hits those three blocks (96 tokens) and computes only "
        "its partly filled last one, and in batch 3 the second chat hits the blocks the first fills in that "
        "same step (keys at allocation, chapter 06)",
    ],
}


@cache
def _record() -> dict:
    return json.loads(RECORD.read_text(encoding="utf-8"))


def recorded(name: str) -> dict:
    """The vLLM check's record of model ``name`` (``"course model"``, ``"SmolLM2-135M-Instruct"``)."""
    for model in _record()["models"]:
        if model["model"] == name:
            return model
    raise KeyError(f"{RECORD.name} holds no model called {name!r}")


def near_tie_threshold() -> float:
    """The record's near-tie threshold: a top-2 margin below it ends a comparison."""
    return float(_record()["near_tie_threshold"])


@cache
def _model(name: str):
    from minipaged.pretrained import load_model

    return load_model(MODELS[name])


def serve_recorded(name: str, max_tokens: int, allocator, block_table, scheduler, backend) -> list[dict]:
    """Serve the recorded batches of model ``name`` on one engine with the given pieces; one dict per request.

    Each request makes at most ``max_tokens`` tokens (a prefix of the recorded ones: greedy decoding
    does not look ahead). Its ``cached`` tokens are those its prefix-cache hit covered when it was first
    admitted: the tokens computed before its first chunk.

    Args:
        name: the record's model name.
        max_tokens: the cap on each request's new tokens.
        allocator, block_table, scheduler: the engine's seams.
        backend: an :class:`~minipaged.attention.AttentionBackend`, or None for the package's torch one.
    """
    from minipaged.sequence import SamplingParams

    record, model = recorded(name), _model(name)
    config = dict(record["limits"], block_size=32, watermark=0.0, keep_finished=True)
    batches: dict[int, list] = {}
    for r in record["requests"]:
        batches.setdefault(r["batch"], []).append(r)
    results = []
    seams = {"allocator": allocator, "block_table": block_table, "scheduler": scheduler}
    # All threads: SmolLM2's matmuls are big enough to share.
    with engine_with(model, config, backend, **seams) as engine, torch.no_grad():
        for batch in sorted(batches):
            ids = [engine.add_request(r["prompt_token_ids"], SamplingParams(
                max_tokens=min(max_tokens, r["max_tokens"]), ignore_eos=r["ignore_eos"])) for r in batches[batch]]
            cached = {}
            while engine.has_unfinished():
                out = engine.step()
                for seq_id in out.admitted:
                    seq = engine.seqs[seq_id]
                    if seq.num_preemptions == 0 and seq_id not in cached:
                        cached[seq_id] = seq.num_computed_tokens - out.scheduled[seq_id]
            results += [{"tokens": list(engine.seqs[i].output_token_ids), "cached": cached.get(i, 0)} for i in ids]
    return results


def _schedule(engine, out) -> dict:
    return {"ran": {str(k): v for k, v in out.scheduled.items()}, "preempted": [str(s) for s in out.preempted]}


def _label(case) -> str:
    if case["kind"] == "recorded":
        return f"{case['model']}'s recorded requests (up to {case['max_tokens']} tokens each)"
    return f"a preemption-heavy workload on the checks' model (seed {case['seed']})"


def _summary(cases, seen) -> str:
    parts = []
    for case, obs in zip(cases, seen):
        if case["kind"] != "recorded":
            parts.append(f"{len(obs['tokens'])} sequences under preemption as the model answer's, step for step")
            continue
        rows = vllm_comparisons(case["model"], case["max_tokens"], obs)
        compared, ties = sum(c["compared"] for c in rows), sum(c["near_tie"] is not None for c in rows)
        cached = sum(r["cached"] for r in obs["mine"])
        tie = f", {ties} stopped at a near-tie" if ties else ""
        parts.append(f"{case['model']}: {len(obs['mine'])} requests, {compared} tokens equal to vLLM's{tie}, "
                     f"{cached} cached tokens as vLLM's")
    return "; ".join(parts)


@check("ch09.your_engine", hint=HINTS["9.1"][0], label=_label, summary=_summary)
def check_your_engine(case, allocator, block_table, backend, scheduler):
    """``allocator``, ``block_table`` and ``scheduler`` are the engine's seams; ``backend`` an AttentionBackend."""
    seams = {"allocator": allocator, "block_table": block_table, "scheduler": scheduler}
    if case["kind"] == "recorded":
        mine = serve_recorded(case["model"], case["max_tokens"], backend=backend, **seams)
        return {"model": case["model"], "max_tokens": case["max_tokens"], "mine": mine}
    return run_engine(case["workload"], observe=_schedule, backend=backend, **seams)


def vllm_comparisons(model: str, max_tokens: int, obs: dict) -> list[dict]:
    """Each request's tokens against vLLM's record, up to the first near-tie (``near_ties.compare_tokens``).

    One ``{"compared", "near_tie", "first_difference"}`` per request, in the record's order. The near-ties
    are the record's: a margin that another CPU's rounding moves (by about 1e-5) past the threshold
    (1e-3) was within it there already, so this run's own margins would end no comparison sooner.

    Args:
        model: the record's model name.
        max_tokens: the cap the run had on each request's tokens.
        obs: the probe's observation of the recorded case (``mine`` is read).
    """
    from minipaged.near_ties import compare_tokens

    cap, threshold = max_tokens, near_tie_threshold()
    rows = []
    for r, m in zip(recorded(model)["requests"], obs["mine"]):
        theirs, margins = r.get("vllm_token_ids", r["token_ids"])[:cap], r["margins"][:cap]
        mine = list(m["tokens"])
        mine_margins = (margins + [math.inf] * len(mine))[: len(mine)]  # past the record's end: no near-tie
        c = compare_tokens(theirs, margins[: len(theirs)], mine, mine_margins, threshold)
        rows.append({"compared": c.compared, "near_tie": c.near_tie, "first_difference": c.first_difference})
    return rows


@check_your_engine.judge
def _judge(case, got, want):
    if case["kind"] != "recorded":
        if not got["finished"]:
            raise CheckFailed("the run did not finish: some request never completes (is a preempted sequence ever "
                              "admitted again?)", HINTS["9.1"][1])
        first_divergence(got["steps"], want["steps"], lambda step, g, w: (
            f"your engine ran {g['ran']} and preempted {g['preempted']}; the model answer's ran {w['ran']} and "
            f"preempted {w['preempted']}", HINTS["9.1"][1]))
        first_token_divergence(got["tokens"], want["tokens"])
        return
    requests = recorded(case["model"])["requests"]
    if len(got["mine"]) != len(requests):
        raise CheckFailed(f"{len(got['mine'])} results for {len(requests)} requests")
    for i, (r, m) in enumerate(zip(requests, got["mine"])):
        where = f"batch {r['batch']} ({r['kind']}), request {i}"
        if m["cached"] != r["vllm_cached_tokens"]:
            raise CheckFailed(f"{where}: your prefix cache covered {m['cached']} of its prompt's tokens, vLLM's "
                              f"covered {r['vllm_cached_tokens']}", HINTS["9.1"][2])
    for i, c in enumerate(vllm_comparisons(case["model"], case["max_tokens"], got)):
        if c["first_difference"] is not None:
            raise CheckFailed(f"request {i}: token {c['first_difference']} differs from vLLM's recorded one, before "
                              "any near-tie", HINTS["9.1"][1])
