"""Exercise 05's workloads, hidden workloads and reference (the instructor's side of ``minipaged.checks.ch05``).

The reference is the package's own :class:`~minipaged.scheduler.Scheduler` (the model answer of its pieces).
Every workload runs in the exercise's envelope (recompute preemption, no prefix caching, n = 1, no
speculation, FCFS) on a pool small enough that sequences are preempted, some of them by themselves.
"""

from __future__ import annotations

import random

from minipaged.checks.engine_run import VOCAB_SIZE, with_script
from minipaged.checks.instructor import Side
from minipaged.scheduler import Scheduler


def _request(rng: random.Random, i: int, arrive: int, prompt_len: int, max_tokens: int) -> dict:
    return {"id": f"r{i}", "prompt": [rng.randrange(VOCAB_SIZE) for _ in range(prompt_len)], "max_tokens": max_tokens,
            "arrive": arrive, "abort": None, "n": 1, "cache_salt": None}


def poisson_requests(rng: random.Random, num_requests: int, rate: float, prompt_len: tuple[int, int],
                     max_tokens: tuple[int, int]) -> list[dict]:
    """Requests arriving as a Poisson process of ``rate`` per engine step (several may share a step).

    Args:
        rng: the generator (the grader's seed, for hidden workloads).
        num_requests: how many.
        rate: mean arrivals per step.
        prompt_len: the prompt lengths' range, both ends included.
        max_tokens: the output lengths' range, both ends included.
    """
    t, requests = 0.0, []
    for i in range(num_requests):
        requests.append(_request(rng, i, int(t), rng.randint(*prompt_len), rng.randint(*max_tokens)))
        t += rng.expovariate(rate)
    return requests


def _config(num_blocks, block_size, max_num_seqs, budget, watermark=0.0, chunked_prefill=True) -> dict:
    return {"num_blocks": num_blocks, "block_size": block_size, "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": budget, "watermark": watermark, "chunked_prefill": chunked_prefill,
            "preemption_mode": "recompute", "scheduling_policy": "fcfs"}


def public_cases() -> list[dict]:
    rng = random.Random(5)
    chapter = [_request(rng, 0, 0, 6, 14), _request(rng, 1, 1, 5, 12), _request(rng, 2, 2, 4, 12)]
    together = [_request(rng, i, 0, n, m) for i, (n, m) in enumerate([(9, 10), (20, 6), (3, 12), (7, 9)])]
    together += [_request(rng, 4, 3, 14, 5), _request(rng, 5, 3, 2, 8)]
    return [
        {"name": "chapter 05's pool that runs out", "config": _config(8, 4, 4, 8), "requests": chapter},
        {"name": "arrivals in the same step, a prompt longer than the budget", "config": _config(10, 4, 4, 12),
         "requests": together},
        {"name": "Poisson arrivals, seed 0", "config": _config(10, 4, 5, 16, watermark=0.1),
         "requests": poisson_requests(random.Random(0), 8, 0.8, (2, 18), (2, 10))},
        {"name": "Poisson arrivals, seed 1, chunked prefill off",
         "config": _config(12, 4, 4, 12, chunked_prefill=False),
         "requests": poisson_requests(random.Random(1), 9, 1.0, (4, 9), (2, 3))},
        {"name": "6 seats on a budget of 4 tokens a step", "config": _config(16, 4, 6, 4),
         "requests": [_request(rng, i, i // 3, 2 + i % 4, 4 + i) for i in range(6)]},
    ]


def hidden_cases(rng: random.Random) -> list[dict]:
    cases = []
    for chunked in (True, False):
        budget = rng.choice([8, 12, 16])
        config = _config(rng.randint(9, 14), 4, rng.randint(3, 5), budget, rng.choice([0.0, 0.1]), chunked)
        lengths = ((2, 24), (2, 14)) if chunked else ((2, budget // 2), (2, budget // 2))  # off: a recompute fits
        cases.append({"name": f"Poisson arrivals, a hidden seed{'' if chunked else ', chunked prefill off'}",
                      "config": config,
                      "requests": poisson_requests(rng, rng.randint(7, 10), rng.uniform(0.4, 1.0), *lengths)})
    return cases


def with_admissions(cases: list[dict]) -> list[dict]:
    """``cases``, each with ``"admissions"``: the reference run's admissions, ``{step: script entries}``.

    They are the end of each step's script (:func:`~minipaged.checks.engine_run.with_script`): the
    ``"start"`` of each admitted sequence and its first chunk, after the running pass. Task 5.1's check
    replays them, so that the learner's running pass is checked before their admission exists.
    """
    for case in cases:
        script = with_script(case)["script"]
        starts = {step: [e[0] for e in entries].index("start") for step, entries in script.items()
                  if any(e[0] == "start" for e in entries)}  # fmt: skip
        case["admissions"] = {step: script[step][first:] for step, first in starts.items()}
    return cases


def reference():
    return (Scheduler,)


SIDES = {
    "schedule_running": Side(lambda: with_admissions(public_cases()), lambda rng: with_admissions(hidden_cases(rng)),
                             reference),
    "scheduler": Side(public_cases, hidden_cases, reference),
}
