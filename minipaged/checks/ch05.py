"""Checks for exercise 05: the learner's scheduling step, inside the real engine.

The learner builds :class:`~minipaged.scheduler.Scheduler`'s ``_chunk`` and ``_schedule_running`` with
FCFS's ``victim`` (Task 5.1: running sequences first, decodes before prefill chunks, the token budget,
chunked prefill, preempting the youngest) and ``_admit`` (Task 5.2: first come, first served admission
of the waiting queue's head), in the package (:mod:`minipaged.pieces`). The probes run
:func:`~minipaged.checks.engine_run.run_engine` with ``scheduler=`` that class (or a subclass: the tests'
wrong ones), on a workload whose pool is small enough to preempt, and record
every step's plan as the scheduler made it: the state it started from, which sequences computed how many
tokens, who was preempted, who was admitted. Then the tokens and every request's TTFT and TPOT (the
engine's virtual clock). The judge compares them with the package's own scheduler on the same workload
and names the first step where they part, and which rule that step broke. Task 5.1's check runs before
Task 5.2 is built: its admissions are the reference run's, replayed step by step from the case.

Envelope: recompute preemption, no prefix caching, one sample per request, no speculation, FCFS.
The references and the workloads are on the instructor's side (``minipaged.checks.instructor.ch05``).
"""

from __future__ import annotations

from minipaged.checks import CheckFailed, _where, check
from minipaged.checks.engine_run import first_divergence, first_token_divergence, replay, run_engine
from minipaged.scheduler import Scheduler

# The package modules this exercise rebuilds in a notebook cell: none. Its pieces are holes in the learner's own
# minipaged/scheduler.py and request_queue.py (see minipaged.pieces).
REBUILDS = ()

HINTS = {
    "5.1": [
        "running sequences first, decodes before prefill chunks, all out of one token budget; when the pool cannot "
        "give a chunk its blocks, the youngest running sequence is preempted, which may be the one asking",
        "go through self.running decodes first (admission order within each kind); a chunk is the tokens the "
        "sequence has left to compute, cut to the budget left (and 0 if chunked_prefill is off and it would be cut)",
        "while the pool cannot give the chunk's new blocks (self.allocator.can_allocate), preempt the running "
        "sequence with the latest arrival_time (a tie: the later in self.running); a victim planned earlier in "
        "the step gives its tokens back (out.take_back); once the asker itself went, move on to the next",
    ],
    "5.2": [
        "first come, first served: only the head of the waiting queue may start, and if it does not fit, nobody "
        "behind it does",
        "the head's first chunk is every token it has left to compute, cut to the budget left, as for a running one "
        "(a preempted sequence lost its K/V: its prompt and its generated tokens); self.fits says whether its "
        "blocks, a seat and the watermark are there",
        "admitting is popleft, then self._start, then planning its chunk as for a running sequence (and keying its "
        "blocks with self._cache_blocks, which does nothing without prefix caching); stop at the first head that "
        "does not fit or when the budget is spent",
    ],
}

# The hint for each kind of failure the judge names (printed instead of the check's default).
FAILURE_HINTS = {
    "youngest": "the victim is the youngest running sequence, the one with the latest arrival_time, so that the "
                "oldest request always makes progress",
    "tie": "two running sequences arrived at the same time: on a tie the later admitted (later in self.running) is "
           "the younger, and goes first",
    "itself": "the sequence that needs a block may itself be the youngest: then it preempts itself and waits, and no "
              "older sequence is touched; move on to the next running sequence",
    "needless": "preempt only while the pool cannot give the blocks the chunk needs (self.allocator.can_allocate "
                "with the table's num_new_blocks), and stop as soon as it can",
    "take_back": "a victim planned earlier in the step is preempted with its chunk: take the chunk back out of the "
                 "plan (out.take_back), and its tokens go back to the budget",
    "decodes_first": "plan the running decodes before any prefill chunk: a decode is one token a user is waiting "
                     "for, a prefill chunk takes what the budget leaves",
    "budget": "every planned token counts against max_num_batched_tokens, a decode's too; a sequence gets at most "
              "what the budget has left",
    "chunk": "with chunked_prefill on, a prompt longer than the budget left runs the part that fits now (a chunk) "
             "and the rest in later steps",
    "no_chunking": "with chunked_prefill off, a prefill that does not fit the budget left waits whole (0 tokens) "
                   "instead of running a chunk",
    "too_many": "a sequence computes at most the tokens it has left: num_tokens - num_computed_tokens (a decode: 1)",
    "recompute": "a preempted sequence lost its K/V: when it is admitted again it recomputes all its tokens, its "
                 "prompt and the ones it generated (num_computed_tokens is 0)",
    "fcfs": "first come, first served: when the head of the waiting queue does not fit, nobody behind it is admitted "
            "in this step",
    "admit": "admit the head of the waiting queue whenever its first chunk fits (self.fits) and the budget is not "
             "spent, then the next head, and so on",
}


def _state(scheduler) -> dict:
    """What a step starts from: the running sequences in admission order, the waiting queue, the free blocks."""
    running = [[str(s.seq_id), s.arrival_time, s.num_computed_tokens, s.num_tokens, s.num_prompt_tokens]
               for s in scheduler.running]
    waiting = [[str(s.seq_id), s.num_computed_tokens, s.num_tokens, s.num_prompt_tokens] for s in scheduler.waiting]
    return {"running": running, "waiting": waiting, "free": scheduler.allocator.num_free}


def _recording(cls, record: list, admissions: dict | None):
    """``cls`` with every ``schedule()`` recorded into ``record``; with ``admissions``, its admission replayed.

    Also a block table class that notes which sequence last asked for blocks, so that each preemption is
    recorded with the sequence it made room for. Returns ``(scheduler class, block table class)``.

    Args:
        cls: the scheduler class.
        record: where each step's observation goes.
        admissions: ``{step: script entries}``, the reference run's admissions in
            :class:`~minipaged.checks.engine_run.ScriptedScheduler`'s form (Task 5.1's check, before ``_admit``
            is built), or None for ``cls``'s own.
    """
    from minipaged.blocks import BlockTable

    asker, victims = [None], []

    class AskingTable(BlockTable):
        def num_new_blocks(self, num_tokens):
            asker[0] = str(self.seq_id)
            return super().num_new_blocks(num_tokens)

    def _replayed_admit(self, out, budget):
        replay(self, admissions.get(str(len(record)), []), out)

    def _preempt(self, seq, out):
        victims.append([str(seq.seq_id), asker[0]])
        return cls._preempt(self, seq, out)

    def _schedule_running(self, out, budget):
        left[:] = [cls._schedule_running(self, out, budget)]
        return left[0]

    def schedule(self):
        before = _state(self)
        victims.clear()
        left[:] = [None]
        out = cls.schedule(self)
        record.append({"before": before,
                       "plan": [[str(s.seq_id), n] for s, n in zip(out.seqs, out.num_new_tokens)],
                       "preempted": [str(s.seq_id) for s in out.preempted], "victims": list(victims),
                       "admitted": [str(s.seq_id) for s in out.admitted], "budget_left": left[0]})
        return out

    left = [None]  # what _schedule_running returned in this step: the budget it left for admission
    methods = {"schedule": schedule, "_preempt": _preempt, "_schedule_running": _schedule_running}
    if admissions is not None:
        methods["_admit"] = _replayed_admit
    return type(cls.__name__, (cls,), methods), AskingTable


def _run(case, cls, admissions: dict | None) -> dict:
    """Run ``case`` on the engine with scheduler ``cls``; its schedule, tokens and latencies as plain data."""
    if not isinstance(cls, type) or not issubclass(cls, Scheduler):
        return {"not_a_scheduler": type(cls).__name__ if not isinstance(cls, type) else cls.__name__}
    record, engines, times = [], [], []

    def observe(engine, out):
        engines[:] = [engine]
        times.append(out.time)

    result = {"raised": None}
    try:
        scheduler, table = _recording(cls, record, admissions)
        run = run_engine(case, observe=observe, scheduler=scheduler, block_table=table)
    except NotImplementedError:
        raise
    except Exception as exc:  # the step it happened in is named by the judge
        result["raised"] = {"step": len(record) - (len(record) > len(times)),
                            "message": f"{type(exc).__name__}: {exc}{_where(exc)}"}
        run = {"tokens": {}, "finished": False}
    for obs, time in zip(record, times):
        obs["time"] = time
    result.update(steps=record, tokens=run["tokens"], finished=run["finished"])
    seqs = engines[0].seqs.values() if engines and result["raised"] is None else []
    result["latency"] = {str(s.seq_id): [s.first_token_time - s.arrival_time,
                                         (s.finish_time - s.first_token_time) / (s.num_output_tokens - 1)
                                         if s.num_output_tokens > 1 else None]
                         for s in seqs if s.finish_time is not None}
    return result


def _label(case) -> str:
    c = case["config"]
    off = "" if c.get("chunked_prefill", True) else ", chunked_prefill off"
    return (f"{case['name']} ({len(case['requests'])} requests, {c['num_blocks']} blocks of {c['block_size']}, "
            f"budget {c['max_num_batched_tokens']}{off})")


@check("ch05.schedule_running", hint=HINTS["5.1"][0], label=_label,
       summary=lambda cases, seen: f"{sum(len(s['steps']) for s in seen)} steps on {len(cases)} workloads: the "
                                   "running sequences' plans and victims equal the model answer's (its admissions "
                                   "replayed)")
def check_schedule_running(case, cls):
    """Task 5.1: ``cls``'s ``_schedule_running``, the reference's admissions replayed, on the engine, step by step."""
    return _run(case, cls, case["admissions"])


@check("ch05.scheduler", hint=HINTS["5.2"][0], label=_label,
       summary=lambda cases, seen: f"{sum(len(s['steps']) for s in seen)} steps on {len(cases)} workloads: plans, "
                                   "victims, admissions, tokens, TTFT and TPOT equal the model answer's")
def check_scheduler(case, cls):
    """Task 5.2: ``cls`` whole (``_schedule_running`` and ``_admit``) on the engine, step by step."""
    return _run(case, cls, None)


@check_schedule_running.judge
@check_scheduler.judge
def _judge(case, got, want) -> None:
    if "not_a_scheduler" in got:
        raise CheckFailed(f"got {got['not_a_scheduler']}, not a class: pass the Scheduler class itself "
                          "(Scheduler, not Scheduler(...))" if got["not_a_scheduler"] in ("type", "") else
                          f"{got['not_a_scheduler']} is not a subclass of minipaged.scheduler.Scheduler")
    steps, right = got["steps"], want["steps"]
    describe = lambda step, g, w: _diagnose(case, step, steps[step], right[step])  # noqa: E731
    mine, theirs = [_decisions(s) for s in steps], [_decisions(s) for s in right]
    raised = got["raised"]
    if raised is not None:  # the steps it planned (the last one perhaps the plan the engine choked on) first
        first_divergence(mine, theirs[: len(mine)], describe)
        agreed = " (your plan for that step agreed with the package's)" if raised["step"] < len(steps) else ""
        raise CheckFailed(f"step {raised['step']}: {raised['message']}{agreed}", "")
    first_divergence(mine, theirs, describe)
    if not got["finished"]:
        raise CheckFailed("the run had not finished after the engine's step limit")
    for step, (g, w) in enumerate(zip(steps, right)):
        if g["time"] != w["time"]:
            raise CheckFailed(f"step {step}: the engine's clock reads {g['time']!r} s, expected {w['time']!r} s "
                              "(the plans agree)")
    first_token_divergence(got["tokens"], want["tokens"])
    for seq_id, (ttft, tpot) in want["latency"].items():
        mine = got["latency"].get(seq_id)
        if mine != [ttft, tpot]:
            raise CheckFailed(f"request {seq_id}: (TTFT, TPOT) = {mine}, expected {[ttft, tpot]} (the engine's clock)")


def _decisions(obs: dict) -> dict:
    """What a step decided (the state it started from is context, not a decision)."""
    return {"plan": dict(sorted(map(tuple, obs["plan"]))), "preempted": obs["preempted"], "admitted": obs["admitted"],
            "budget_left": obs["budget_left"]}


def _diagnose(case, step: int, got: dict, want: dict) -> tuple[str, str]:
    """The message and hint for the first step where the learner's decisions differ from the reference's."""
    config = case["config"]
    budget = config["max_num_batched_tokens"]
    got_plan, want_plan = dict(map(tuple, got["plan"])), dict(map(tuple, want["plan"]))
    running = {row[0]: row for row in want["before"]["running"]}
    running_plan = {seq_id: n for seq_id, n in got_plan.items() if seq_id not in got["admitted"]}
    yours = running_plan if "admissions" in case else got_plan  # replayed admissions (Task 5.1) are not yours
    if sum(yours.values()) > budget:
        return (f"your plan {sorted(yours.items())} computes {sum(yours.values())} tokens, over the budget of {budget}",
                FAILURE_HINTS["budget"])
    for seq_id, n in got_plan.items():
        row = running.get(seq_id)
        left = row[3] - row[2] if row else None
        if left is not None and n > left:
            return (f"you planned {seq_id} for {n} tokens, but it has only {left} left to compute",
                    FAILURE_HINTS["too_many"])
    both = [s for s in got["preempted"] if s in got_plan]
    if both:
        return (f"{both[0]} is both preempted and in your plan {got['plan']}: a preempted sequence gives its tokens "
                "back", FAILURE_HINTS["take_back"])
    decodes = [s for s, row in running.items() if row[2] >= row[4] and row[3] - row[2] == 1]
    skipped = [s for s in decodes if s in want_plan and s not in got_plan and s not in got["preempted"]]
    if skipped:
        return (f"{skipped[0]} was decoding (1 token) and is not in your plan {got['plan']}, expected "
                f"{want['plan']}", FAILURE_HINTS["decodes_first"])
    unchunked = [seq_id for seq_id, row in running.items() if config.get("chunked_prefill", True)
                 and seq_id not in got_plan and seq_id not in got["preempted"]
                 and row[3] - row[2] > max(1, budget - sum(got_plan.values()))
                 and (seq_id in want_plan or seq_id in want["preempted"])]
    if unchunked:
        row = running[unchunked[0]]
        return (f"{unchunked[0]} has {row[3] - row[2]} tokens left to compute and is not in your plan "
                f"{got['plan']}; the package's computes a chunk of it (or preempts for one)", FAILURE_HINTS["chunk"])
    if got["preempted"] != want["preempted"]:
        return _diagnose_victims(step, got, want, running)
    if got["admitted"] != want["admitted"]:
        return _diagnose_admission(config, got, want)
    if got["budget_left"] != want["budget_left"] and got_plan == want_plan:
        return (f"your _schedule_running planned {sum(running_plan.values())} of the budget's {budget} tokens and "
                f"returned {got['budget_left']!r} as the budget left, expected {want['budget_left']!r}",
                FAILURE_HINTS["budget"])
    return _diagnose_plan(config, got_plan, want_plan, running, want["before"])


def _diagnose_victims(step, got, want, running) -> tuple[str, str]:
    mine, right = got["preempted"], want["preempted"]
    i = next(i for i in range(max(len(mine), len(right))) if mine[i: i + 1] != right[i: i + 1])
    base = f"you preempted {mine}, expected {right}"
    if i >= len(mine):
        return (f"{base}: {right[i]} had to go, the pool had {want['before']['free']} free blocks for the chunks "
                f"planned", FAILURE_HINTS["needless"])
    if i >= len(right):
        return f"{base}: the pool could give the blocks without preempting {mine[i]}", FAILURE_HINTS["needless"]
    g, w = running.get(mine[i]), running.get(right[i])
    if g is None or w is None:
        return base, FAILURE_HINTS["youngest"]
    if g[1] == w[1]:
        return (f"{base}: {mine[i]} and {right[i]} arrived at the same time, and {right[i]} was admitted later",
                FAILURE_HINTS["tie"])
    if [right[i], right[i]] in want["victims"] and g[1] < w[1]:
        return (f"{base}: {right[i]} is the youngest running sequence, and it needed the block itself; "
                f"{mine[i]} arrived before it", FAILURE_HINTS["itself"])
    return (f"{base}: {mine[i]} arrived at t={g[1]:.4f} s, before {right[i]} (t={w[1]:.4f} s), the youngest "
            "running sequence", FAILURE_HINTS["youngest"])


def _diagnose_admission(config, got, want) -> tuple[str, str]:
    mine, right = got["admitted"], want["admitted"]
    base = f"you admitted {mine}, expected {right}"
    queue = {row[0]: row for row in want["before"]["waiting"]}
    order = [row[0] for row in want["before"]["waiting"]]
    jumped = [s for s in mine if s not in right]
    if jumped:
        ahead = [s for s in order[: order.index(jumped[0])] if s not in mine] if jumped[0] in order else []
        if ahead:
            return f"{base}: {jumped[0]} jumped the queue ahead of {ahead[0]}, which did not fit", FAILURE_HINTS["fcfs"]
        row, n = queue.get(jumped[0]), dict(map(tuple, got["plan"])).get(jumped[0])
        if row and not config.get("chunked_prefill", True) and n is not None and n < row[2] - row[1]:
            return (f"{base}: {jumped[0]} has {row[2] - row[1]} tokens to compute, and you gave it a chunk of {n} "
                    "with chunked_prefill off", FAILURE_HINTS["no_chunking"])
        if row and row[2] > row[3] and n is not None and n <= row[3] - row[1] < row[2] - row[1]:
            return (f"{base}: {jumped[0]} was preempted, and its first chunk of {n} tokens leaves out the "
                    f"{row[2] - row[3]} it generated, which need recomputing too", FAILURE_HINTS["recompute"])
        return (f"{base}: {jumped[0]} did not fit (its first chunk's blocks, a seat, the watermark)",
                FAILURE_HINTS["admit"])
    return f"{base}: {[s for s in right if s not in mine][0]} fitted", FAILURE_HINTS["admit"]


def _diagnose_plan(config, got_plan, want_plan, running, before) -> tuple[str, str]:
    decodes = [s for s, row in running.items() if row[2] >= row[4] and row[3] - row[2] == 1]
    for seq_id in sorted(set(got_plan) | set(want_plan)):
        n, m = got_plan.get(seq_id, 0), want_plan.get(seq_id, 0)
        if n == m:
            continue
        row = running.get(seq_id)
        what = f"{seq_id} computes {n} tokens in your plan, {m} in the package's"
        if row is None:  # admitted in this step
            return what, FAILURE_HINTS["recompute"] if n < m else FAILURE_HINTS["chunk"]
        left = row[3] - row[2]
        if not config.get("chunked_prefill", True) and 0 < n < left:
            return f"{what}: chunked_prefill is off, and {left} tokens do not fit", FAILURE_HINTS["no_chunking"]
        if n == 0 and 0 < m < left:
            return f"{what}: {left} tokens are left and {m} fit the budget", FAILURE_HINTS["chunk"]
        if n < m and row[2] == 0 and row[3] > row[4]:
            return f"{what}: it was preempted, and all its {row[3]} tokens need recomputing", FAILURE_HINTS["recompute"]
        if n > m and any(s in decodes for s in want_plan if got_plan.get(s, 0) < want_plan[s]):
            return f"{what}: its chunk took budget the decodes needed", FAILURE_HINTS["decodes_first"]
        return f"{what} ({left} left to compute, {before['free']} free blocks)", FAILURE_HINTS["budget"]
    return f"your plan {sorted(got_plan.items())}, expected {sorted(want_plan.items())}", ""
