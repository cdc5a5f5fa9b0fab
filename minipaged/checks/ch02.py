"""Checks for exercise 02: the learner's block allocator and block table, alone and inside the real engine.

- ``ch02.allocator`` drives the allocator through a script of calls (legal ones, and the classic
  wrong ones: a double free, an id outside the pool, a list with a bad id at its end) and records
  each call's outcome and the pool after it (``free_block_ids`` and the refcounts), once on the
  learner's class and once on the subclass :func:`with_side_queue` makes of it, shaped like chapter
  06's prefix cache (which must work on top of the learner's allocator in the capstone);
- ``ch02.constant_time`` counts the operations of allocate and free on two pool sizes: list and
  deque element touches plus the lines the learner's code runs. O(1) means the count does not grow
  with the pool;
- ``ch02.engine`` runs :class:`~minipaged.engine.Engine` with ``allocator=`` and ``block_table=``
  the learner's classes on a pool too small for its workload (preemptions) with aborts, and records
  after every step each table's blocks, the slots ``append_tokens`` returned, the free queue and
  the refcounts. The judge names the first step, sequence or block where they part from the
  package's run, then compares the greedy tokens.

The references (``minipaged.checks.instructor.ch02``) are the package's own ``BlockAllocator`` and
``BlockTable``.
"""

from __future__ import annotations

from collections import Counter, deque

from minipaged.block_math import blocks_needed
from minipaged.blocks import AllocatorBase
from minipaged.checks import CheckFailed, _where, check, outcome, plain, same
from minipaged.checks.engine_run import first_divergence, first_token_divergence, run_engine
from minipaged.checks.op_count import instrument, judge_growth, measured

# The package modules this exercise rebuilds in a notebook cell: none. Its pieces are holes in the learner's own
# minipaged/blocks.py (see minipaged.pieces), so the notebook imports the package's classes: they are the learner's.
REBUILDS = ()

HINTS = {
    "2.1": [
        "one deque of free block ids and one refcount per block; check everything a call needs before it changes "
        "anything",
        "allocate takes from the left of free_block_ids (_take_free_block); a block goes back on the right "
        "(_put_free_block) only when its refcount reaches 0",
        "allocate_many compares num_blocks with num_free first; free_sequence checks every id and counts repeats "
        "(collections.Counter) against the refcounts before it frees any",
    ],
    "2.2": [
        "a table takes a new block only when a token lands past its last block: it needs ceil(num_tokens / B) "
        "blocks",
        "_num_new_blocks(n) is ceil((num_tokens + n) / B) minus the blocks it holds (never below 0), plus the copy "
        "when _shares_last_block(n); append_tokens compares it with num_free before it changes the table",
        "position p lives at slot blocks[p // B] * B + p % B: work out each new position's slot on its own and "
        "return them as an int64 tensor; release hands every block to free_sequence and empties the table",
    ],
    "2.3": [
        "O(1): no call may look at every block of the pool",
        "popleft and append on a deque are O(1); a scan of the refcounts, `x in deque`, list.pop(0), remove(), "
        "count() and min() walk the whole container",
        "tell a free block by its refcount (one list index), never by searching the free queue",
    ],
}

SIDE_QUEUE_HINT = ("a subclass may keep free blocks elsewhere: ask self.num_free (never len(free_block_ids)), take "
                   "every block with self._take_free_block and give it back with self._put_free_block")
ALLOCATOR_METHODS = ("allocate", "allocate_many", "free", "free_sequence", "incref", "refcount", "num_free",
                     "_take_free_block", "_put_free_block")  # fmt: skip
ALLOCATOR_STATE = ("free_block_ids", "_refcounts")  # rollback (minipaged.rollback) reads _refcounts too
TABLE_METHODS = ("num_new_blocks", "append_tokens", "release", "take_pending_copies", "num_blocks", "tail_waste")

_CALLS = {
    "allocate": lambda alloc, arg: alloc.allocate(arg),
    "allocate_many": lambda alloc, arg: alloc.allocate_many(arg, "many"),
    "incref": lambda alloc, arg: alloc.incref(arg, "sharer"),
    "free": lambda alloc, arg: alloc.free(arg),
    "free_sequence": lambda alloc, arg: alloc.free_sequence(list(arg)),
    "refcount": lambda alloc, arg: alloc.refcount(arg),
    "num_free": lambda alloc, arg: alloc.num_free,
}


def _missing(cls, names) -> list[str]:
    return [name for name in names if not hasattr(cls, name)]


def _allocator_missing(cls) -> list[str]:
    base = [] if isinstance(cls, type) and issubclass(cls, AllocatorBase) else ["AllocatorBase as its base class"]
    return base + _missing(cls, ALLOCATOR_METHODS)


def _state(alloc) -> dict:
    """The pool: every free block in the order it is handed out (a side queue's last), and the refcounts."""
    free = list(alloc.free_block_ids) + list(getattr(alloc, "_ch02_side_queue", ()))
    return {"free": plain(free), "refcounts": plain(list(alloc._refcounts))}


def with_side_queue(cls: type) -> type:
    """``cls`` shaped as chapter 06's prefix cache is: freed odd blocks wait in a second queue, taken last.

    The subclass overrides only ``num_free`` and the two hooks, as the prefix cache does; an allocator
    that asks ``self.num_free`` and moves every block through ``_take_free_block`` and
    ``_put_free_block`` behaves the same under it as the package's does.

    Args:
        cls: the allocator class.
    """

    class SideQueue(cls):
        def __init__(self, num_blocks, block_size):
            super().__init__(num_blocks, block_size)
            self._ch02_side_queue = deque()

        @property
        def num_free(self):
            return super().num_free + len(self._ch02_side_queue)

        def _take_free_block(self, seq_id):
            if self.free_block_ids:
                return super()._take_free_block(seq_id)
            return self._ch02_side_queue.popleft()

        def _put_free_block(self, block_id):
            if block_id % 2:
                self._ch02_side_queue.append(block_id)
                return {}
            return super()._put_free_block(block_id)

    return type(cls.__name__, (SideQueue,), {})


def run_script(alloc, ops: list) -> list[dict]:
    """Make each call of ``ops`` (``[name, arg]``) on ``alloc``; per call, its outcome, the pool after it, its events.

    An event is recorded as ``[kind, block_id, seq_id, info, num_free]``, ``num_free`` as a subscriber
    saw it when the event reached it: a call made of several changes is heard of once it is complete.

    Args:
        alloc: the allocator under test.
        ops: the script, ``[["allocate", seq_id], ["free", block_id], ...]`` (see ``_CALLS``).
    """
    heard: list = []
    alloc.subscribe(lambda e: heard.append(plain([e.kind, e.block_id, e.seq_id, dict(e.info), alloc.num_free])))
    steps = []
    for op in ops:
        heard.clear()
        steps.append(dict(outcome(_CALLS[op[0]], alloc, op[1] if len(op) > 1 else None), **_state(alloc),
                          events=list(heard)))  # fmt: skip
    return steps


def _call_text(op) -> str:
    return "num_free" if op[0] == "num_free" else f"{op[0]}({op[1]!r})"


def _allocator_label(case) -> str:
    side = ", as a subclass with a second free queue (chapter 06's shape)" if case.get("side_queue") else ""
    return f"a pool of {case['num_blocks']} blocks, {len(case['ops'])} calls{side}"


@check("ch02.allocator", hint=HINTS["2.1"][0], label=_allocator_label,
       summary=lambda cases, seen: f"{sum(len(c['ops']) for c in cases)} calls, on your class and on a subclass "
                                   "shaped like chapter 06's: pool order, shared blocks, all or nothing, errors "
                                   "before any change")
def check_allocator(case, cls):
    """``case`` = {"num_blocks", "block_size", "ops", "side_queue"}: ``cls(num_blocks, block_size)``, then ``ops``.

    With ``side_queue``, the allocator runs as :func:`with_side_queue` subclasses it (chapter 06's shape).
    """
    missing = _allocator_missing(cls)
    if missing:
        return {"missing": missing}
    alloc = (with_side_queue(cls) if case.get("side_queue") else cls)(case["num_blocks"], case["block_size"])
    missing = _missing(alloc, ALLOCATOR_STATE)
    if missing:
        return {"missing": missing}
    return {"missing": [], "start": _state(alloc), "steps": run_script(alloc, case["ops"])}


def _missing_failure(missing: list[str], what: str) -> CheckFailed:
    return CheckFailed(f"your {what} has no {', '.join(missing)}; the engine needs it",
                       "keep the package's names: free_block_ids (a deque), _refcounts (a list), and the methods the "
                       "exercise's opening cell lists")  # fmt: skip


@check_allocator.judge
def _judge_allocator(case, got, want):
    if got["missing"]:
        raise _missing_failure(got["missing"], "allocator")
    if not same(got["start"], want["start"]):
        raise CheckFailed(f"a new pool of {case['num_blocks']} blocks has free_block_ids {got['start']['free']} and "
                          f"refcounts {got['start']['refcounts']}; expected every block free, 0 first, refcount 0",
                          "__init__: free_block_ids = deque(range(num_blocks)) and one refcount of 0 per block")
    before = want["start"]
    for i, (op, g, w) in enumerate(zip(case["ops"], got["steps"], want["steps"])):
        try:
            _judge_call(f"call {i + 1}, {_call_text(op)},", op, before, g, w)
        except CheckFailed as exc:
            if not case.get("side_queue"):
                raise
            raise CheckFailed(f"{exc} (under a subclass that keeps freed odd blocks in a second free queue, as "
                              "chapter 06's prefix cache does)", SIDE_QUEUE_HINT) from None
        before = w
    if len(got["steps"]) != len(want["steps"]):
        raise CheckFailed("the probe's record of the script is incomplete")


def _judge_call(where: str, op, before: dict, g: dict, w: dict) -> None:
    """Raise :class:`CheckFailed` if one scripted call's outcome or the pool after it differs from the reference's."""
    kind = op[0]
    state = {"free": g["free"], "refcounts": g["refcounts"]}
    if "raised" in w:
        want_exc = w["raised"][0]
        if "raised" not in g:
            raise CheckFailed(f"{where} with {len(before['free'])} free blocks returned {g.get('returned')!r}; "
                              f"expected {want_exc} ({w['message'][:120]})", _raise_hint(kind, want_exc))  # fmt: skip
        if want_exc not in g["raised"]:
            raise CheckFailed(f"{where} raised {g['raised'][0]} ({g.get('message', '')[:100]}); expected {want_exc}",
                              _raise_hint(kind, want_exc))  # fmt: skip
        if not same(state, {"free": before["free"], "refcounts": before["refcounts"]}):
            changed = [b for b, (x, y) in enumerate(zip(g["refcounts"], before["refcounts"])) if x != y]
            raise CheckFailed(f"{where} raised {want_exc} as it should, but it had already changed the pool "
                              f"(the refcounts of blocks {changed or 'none'}, free_block_ids {g['free']} instead of "
                              f"{before['free']})", _all_or_nothing_hint(kind))  # fmt: skip
        return
    if "raised" in g:
        raise CheckFailed(f"{where} raised {g['raised'][0]}: {g.get('message', '')[:120]}; expected it to return "
                          f"{w.get('returned')!r}", HINTS["2.1"][0])  # fmt: skip
    if not same(g.get("returned"), w.get("returned")):
        hint = ("a block comes off the LEFT of free_block_ids (popleft): the block freed longest ago goes first"
                if kind in ("allocate", "allocate_many") else HINTS["2.1"][1])
        raise CheckFailed(f"{where} returned {g.get('returned')!r}, expected {w.get('returned')!r} (free_block_ids "
                          f"was {before['free']})", hint)  # fmt: skip
    if not same(state, {"free": w["free"], "refcounts": w["refcounts"]}):
        raise _state_failure(where, state, w, before)
    if "events" in w and not same(g.get("events"), w["events"]):
        raise CheckFailed(f"{where} published the events {_events_text(g.get('events'))}; expected "
                          f"{_events_text(w['events'])}", EVENTS_HINT)  # fmt: skip


EVENTS_HINT = ("publish each change after it with self.emit(kind, block_id, seq_id, ...): allocate; incref and decref "
               "with refcount=; free (back in the pool) with what _put_free_block returned; a call made of several "
               "changes holds them (with self.hold_events():) so that they are heard once it is complete")


def _events_text(events) -> str:
    """``[kind, block_id, seq_id, info, num_free]`` records as ``allocate(3, 'A') [num_free 2 when heard]``."""
    if not events:
        return "none"
    return ", ".join(f"{k}({b!r}, {s!r}{''.join(f', {n}={v!r}' for n, v in info.items())}) [heard with {f} free]"
                     for k, b, s, info, f in events)[:300]


def _raise_hint(kind: str, exc: str) -> str:
    if exc == "OutOfBlocks":
        return "compare the request with num_free first and raise OutOfBlocks when it does not fit"
    if exc == "IndexError":
        return "an id outside 0 .. num_blocks - 1 is an IndexError, raised before anything changes"
    if kind == "free_sequence":
        return ("check the whole list first: an id that is free, or appears more often than its refcount, is a "
                "BlockError (count repeats with collections.Counter)")
    return "a block whose refcount is 0 is free: freeing or sharing it again is a BlockError"


def _all_or_nothing_hint(kind: str) -> str:
    if kind == "allocate_many":
        return "all or nothing: check num_blocks <= num_free before taking the first block"
    return "validate the whole list (range, free blocks, repeats against refcounts) before freeing any block of it"


def _state_failure(where: str, got: dict, want: dict, before: dict) -> CheckFailed:
    """Name the first block whose refcount or place in the free queue differs after a call."""
    for block in got["free"]:
        if 0 <= block < len(got["refcounts"]) and want["refcounts"][block] > 0:
            return CheckFailed(f"{where} put block {block} back in free_block_ids, but it still has "
                               f"{want['refcounts'][block]} holder(s) (refcount {before['refcounts'][block]} before)",
                               "free drops ONE reference; the block goes back to the pool only when its refcount "
                               "reaches 0")  # fmt: skip
    for block, (g, w) in enumerate(zip(got["refcounts"], want["refcounts"])):
        if g != w:
            was = before["refcounts"][block]
            hint = ("free drops exactly one reference per call (one per id in a list), whether or not others still "
                    "hold the block" if g > w and was > w else HINTS["2.1"][1])
            return CheckFailed(f"{where} left block {block} with refcount {g}, expected {w} (it was {was})", hint)
    hint = "a block whose refcount reaches 0 joins the RIGHT end of free_block_ids (_put_free_block), once"
    return CheckFailed(f"{where} left free_block_ids {got['free']}, expected {want['free']}", hint)


# ---------------------------------------------------------------------------
# O(1): operations counted on two pool sizes
# ---------------------------------------------------------------------------

def _count_ops(cls, num_blocks: int, block_size: int) -> list[int]:
    """Operations of each measured call, on a nearly empty pool and then on a nearly full one."""
    alloc = cls(num_blocks, block_size)
    instrument(alloc)
    counts = []

    def measure(fn, *args):
        result, ops = measured(fn, *args)
        counts.append(ops)
        return result

    a = measure(alloc.allocate, "a")
    many = measure(alloc.allocate_many, 3, "b")
    measure(alloc.incref, a, "c")
    measure(alloc.free, a, "c")
    measure(alloc.free, a, "a")
    measure(alloc.free_sequence, many, "b")
    alloc.allocate_many(num_blocks, "d")  # not measured: the pool is full, then its last 3 blocks are free
    alloc.free_sequence([num_blocks - 3, num_blocks - 2, num_blocks - 1], "d")
    measure(alloc.free, num_blocks // 2, "d")
    measure(alloc.allocate, "e")
    measure(alloc.free_sequence, [0, 1], "d")
    measure(alloc.allocate_many, 2, "f")
    measure(lambda: alloc.num_free)
    return counts


CONSTANT_TIME_CALLS = ["allocate() on a nearly empty pool", "allocate_many(3)", "incref(block)",
                       "free(block) with another holder", "free(block), its last holder", "free_sequence of 3 blocks",
                       "free(block) on a nearly full pool", "allocate() on a nearly full pool",
                       "free_sequence of 2 blocks on a nearly full pool", "allocate_many(2) on a nearly full pool",
                       "num_free"]  # fmt: skip


@check("ch02.constant_time", hint=HINTS["2.3"][0], formative=True,
       label=lambda c: f"pools of {c['sizes'][0]} and {c['sizes'][1]} blocks",
       summary=lambda cases, seen: f"{len(CONSTANT_TIME_CALLS)} calls cost the same on pools of "
                                   f"{cases[0]['sizes'][0]} and {cases[0]['sizes'][1]} blocks")
def check_constant_time(case, cls):
    """``case`` = {"sizes": [small, large], "block_size"}: the operations of each call of the plan, on each size."""
    missing = _allocator_missing(cls)
    if missing:
        return {"missing": missing}
    return {"missing": [], "counts": [_count_ops(cls, n, case["block_size"]) for n in case["sizes"]]}


@check_constant_time.judge
def _judge_constant_time(case, got, want):
    if got["missing"]:
        raise _missing_failure(got["missing"], "allocator")
    judge_growth(CONSTANT_TIME_CALLS, case["sizes"], got["counts"], _cost_hint)


def _cost_hint(call: str) -> str:
    if call == "num_free":
        return "num_free is len(free_block_ids), not a count over the refcounts"
    if "allocate" in call:
        return ("take the next free block with popleft() on a deque and keep num_free = len(free_block_ids): never "
                "search or count the refcounts, never pop(0) a list")
    return "tell a free block by its refcount (one index); never search free_block_ids for it"


# ---------------------------------------------------------------------------
# The engine on the learner's allocator and table
# ---------------------------------------------------------------------------


def _engine_label(case) -> str:
    cfg, requests = case["config"], case["requests"]
    aborts = sum(r.get("abort") is not None for r in requests)
    return (f"the engine on a pool of {cfg['num_blocks']} blocks of {cfg['block_size']}, {len(requests)} requests "
            f"({aborts} aborted)")


@check("ch02.engine", hint=HINTS["2.2"][0], label=_engine_label,
       summary=lambda cases, seen: f"{len(cases)} runs of the engine on your allocator and table: every step's "
                                   "blocks, slots, free queue and refcounts, and every token, as the model answer's")
def check_engine(case, allocator, block_table):
    """``case``: a :func:`~minipaged.checks.engine_run.run_engine` case; the learner's allocator and table classes.

    A run that raises keeps the steps before it, and the appends of the step that raised, for the judge.
    """
    missing = _allocator_missing(allocator) + [f"{n} (on the table)" for n in _missing(block_table, TABLE_METHODS)]
    if missing:
        return {"missing": missing}
    log, steps, pools = [], [], []

    def observe(engine, out):
        alloc = engine.cache.allocator
        pools[:] = [alloc]
        tables = [[str(s.seq_id), list(s.block_table.blocks), s.block_table.num_tokens]
                  for s in engine.scheduler.running]  # fmt: skip
        steps.append(plain({"appends": list(log), "tables": tables, **_state(alloc),
                            "preempted": [str(s) for s in out.preempted]}))  # fmt: skip
        log.clear()
        return None

    try:
        run = run_engine(case, observe=observe, allocator=allocator, block_table=_recorded(block_table, log))
    except NotImplementedError:
        raise
    except Exception as exc:  # the step that raised: what it appended so far, and where the learner's code raised
        return {"missing": [], "steps": steps, "error": f"{type(exc).__name__}: {exc}{_where(exc)}",
                "appends": plain(log)}  # fmt: skip
    final = _state(pools[0]) if pools else None  # after the run: an abort after the last step included
    return {"missing": [], "steps": steps, "error": None, "tokens": run["tokens"], "finished": run["finished"],
            "final": final}  # fmt: skip


def _recorded(block_table: type, log: list) -> type:
    """The learner's table class with each ``append_tokens`` recorded.

    An entry: ``[seq_id, tokens before, n, blocks before, num_new_blocks(n), slots, their dtype, blocks after]``
    (the last three None while the call has not returned).
    """
    import torch

    def append_tokens(self, num_tokens):
        entry = [str(self.seq_id), self.num_tokens, num_tokens, len(self.blocks), self.num_new_blocks(num_tokens),
                 None, None, None]  # fmt: skip
        log.append(entry)
        slots = block_table.append_tokens(self, num_tokens)
        if not isinstance(slots, torch.Tensor):
            raise TypeError(f"{block_table.__name__}.append_tokens({num_tokens}) returned a {type(slots).__name__}; "
                            "return the new tokens' slots as a torch.Tensor of int64")  # fmt: skip
        entry[5:] = [[int(s) for s in slots.tolist()], str(slots.dtype), list(self.blocks)]
        return slots

    return type(block_table.__name__, (block_table,), {"append_tokens": append_tokens})


@check_engine.judge
def _judge_engine(case, got, want):
    if got["missing"]:
        raise _missing_failure(got["missing"], "allocator or table")
    B, steps = case["config"]["block_size"], got["steps"]
    if got["error"] is not None:
        first_divergence(steps, want["steps"][: len(steps)], _describe_step(B))
        for append in got["appends"]:
            problem = _append_problem(append, B)
            if problem:
                raise CheckFailed(f"step {len(steps)}: {problem[0]}", problem[1])
        if got["error"].startswith("OutOfBlocks") and len(want["steps"]) > len(steps):
            went = want["steps"][len(steps)]["preempted"]
            released = f" (it released {', '.join(went)})" if went else ""
            raise CheckFailed(f"step {len(steps)}: your code raised {got['error']}; the model answer's pool met the "
                              f"same calls in this step{released} with the blocks they needed: blocks went missing "
                              "from yours", "release() must hand every block of the table to free_sequence, and a "
                              "block whose refcount reaches 0 goes back to the pool")  # fmt: skip
        raise CheckFailed(f"step {len(steps)}: your code raised {got['error']}", HINTS["2.2"][1])
    first_divergence(steps, want["steps"], _describe_step(B))
    try:
        first_token_divergence(got["tokens"], want["tokens"])
    except CheckFailed as exc:
        raise CheckFailed(f"every step's bookkeeping agrees, but {exc}", HINTS["2.2"][2]) from None
    if not got["finished"]:
        raise CheckFailed("the run did not finish", HINTS["2.2"][0])
    final = got["final"]
    leaked = [b for b, count in enumerate(final["refcounts"]) if count] if final else []
    if leaked or (final and sorted(final["free"]) != list(range(len(final["refcounts"])))):
        raise CheckFailed(f"after the run, with every request finished or aborted, blocks {leaked} are still held "
                          f"and free_block_ids is {final['free']}: they leaked",
                          "release() must hand every block of the table to free_sequence")  # fmt: skip


def _describe_step(block_size: int):
    def describe(step, g, w) -> tuple[str, str]:
        for append in g["appends"]:
            problem = _append_problem(append, block_size)
            if problem:
                return problem
        return _holders_problem(g) or _reference_difference(g, w)

    return describe


def _append_problem(append, B: int) -> tuple[str, str] | None:
    """What is wrong with one recorded ``append_tokens`` call (None: nothing)."""
    seq, start, n, held, said, slots, dtype, blocks = append
    call = f"sequence {seq}'s append_tokens({n}) (tokens {start} .. {start + n - 1})"
    need = blocks_needed(start + n, B)
    boundary = ("a table needs ceil(num_tokens / block_size) blocks: a new one exactly when a token lands past the "
                "last block (num_new_blocks: ceil((num_tokens + n) / B) - len(blocks))")  # fmt: skip
    if said != max(0, need - held):
        early = "early" if said > max(0, need - held) else "late"
        return (f"with {start} tokens in {held} blocks of {B}, num_new_blocks({n}) said {said}, expected "
                f"{max(0, need - held)}: {start + n} tokens need {need} block(s), so it asks for a new block too "
                f"{early}", boundary)
    if slots is None:
        return None
    if len(blocks) != need:
        late = len(blocks) < need
        return (f"after {call} its table holds {len(blocks)} blocks for {start + n} tokens; blocks of {B} need {need}, "
                f"so a new block came one token too {'late' if late else 'early'}", boundary)
    right = [blocks[p // B] * B + p % B for p in range(start, start + n)]
    if dtype != "torch.int64":
        return (f"{call} returned {dtype.removeprefix('torch.')} slots; the cache write and the attention metadata "
                "take int64", "return torch.tensor(slots, dtype=torch.int64)")
    if slots != right:
        i = next((i for i, (a, b) in enumerate(zip(slots, right)) if a != b), min(len(slots), len(right)))
        if i >= len(right) or i >= len(slots):
            return (f"{call} returned {len(slots)} slots, expected {n}", HINTS["2.2"][2])
        p = start + i
        message = (f"{call} gave position {p} slot {slots[i]}, expected {right[i]} = block {blocks[p // B]} * {B} + "
                   f"{p % B} (blocks {blocks})")
        if i > 0 and slots[i] == slots[i - 1] + 1 and p % B == 0:
            return (message + f": the slots run on past the end of block {blocks[(p - 1) // B]}",
                    "slots are contiguous only inside a block: position p is in logical block p // B, which the "
                    "table maps to any physical block")  # fmt: skip
        return message, HINTS["2.2"][2]
    return None


def _holders_problem(g) -> tuple[str, str] | None:
    """The first block whose refcount is not the number of tables that hold it (or that is free and held)."""
    held = Counter(b for _, blocks, _ in g["tables"] for b in blocks)
    owners = {b: seq for seq, blocks, _ in g["tables"] for b in blocks}
    free = Counter(g["free"])
    for block, count in enumerate(g["refcounts"]):
        if held[block] and (count == 0 or block in free):
            return (f"block {block} is free (refcount {count}, in free_block_ids: {block in free}) while sequence "
                    f"{owners[block]}'s table holds it", "a block returns to the pool only when its refcount "
                    "reaches 0, that is when no table holds it any more")  # fmt: skip
        if count != held[block]:
            if held[block] == 0:
                return (f"block {block} has refcount {count} but no running sequence's table holds it: it leaked "
                        "(a finished, aborted or preempted sequence did not give it back)",
                        "release() must hand every block of the table to free_sequence")  # fmt: skip
            return (f"block {block} has refcount {count} but {held[block]} table(s) hold it", HINTS["2.1"][1])
        if count == 0 and free[block] != 1:
            where = "twice" if free[block] > 1 else "not"
            return (f"block {block} has refcount 0 but is {where} in free_block_ids",
                    "a block whose refcount reaches 0 joins free_block_ids once (_put_free_block)")
    return None


def _reference_difference(g, w) -> tuple[str, str]:
    mine, right = {s: (b, n) for s, b, n in g["tables"]}, {s: (b, n) for s, b, n in w["tables"]}
    if g["preempted"] != w["preempted"]:
        return (f"the scheduler preempted {g['preempted'] or 'nobody'}, expected {w['preempted'] or 'nobody'}: "
                "your num_new_blocks or num_free told it a different number of blocks",
                "num_new_blocks(n) counts only the blocks appending n tokens adds; num_free is len(free_block_ids)")
    if g["free"] != w["free"]:
        return (f"free_block_ids is {g['free']}, expected {w['free']}",
                "allocate takes from the left, a freed block joins on the right, and free_sequence frees in table "
                "order (logical block 0 first)")  # fmt: skip
    for seq in right:
        if mine.get(seq) != right[seq]:
            got = mine.get(seq, "no table")
            return (f"sequence {seq}'s table is {got} (blocks, tokens), expected {right[seq]}", HINTS["2.2"][1])
    return (f"the step's record differs: got {g}, expected {w}", HINTS["2.2"][0])
