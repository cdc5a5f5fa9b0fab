"""The chapter 05 engine dashboard: queues, the paged pool, block tables and the cache over time.

Pure renderers first, each a function of plain data:

- :func:`render_queues`: the waiting queue (front first; preempted requests
  marked) and the running batch, one chip per request with its progress.
- :func:`engine_series` / :func:`preemption_events`: the step history of
  :class:`minipaged.metrics.Metrics` as timeline series and markers, drawn by
  :func:`minipaged.viz.timeline.render_timeline`.
- :func:`render_dashboard`: everything above plus the block map, as one static
  HTML string (what a notebook shows when there is no kernel).

Then :class:`EngineDashboard`, the live widget: the chapter 02 block-map
controls (Step, Play/Pause, speed, Reset) over a
:class:`~minipaged.replay.Replay` of a workload, one engine step per click.

In a notebook::

    def make_engine():  # a fresh engine each time, so Reset can start over
        return Engine(model, EngineConfig(num_blocks=14, block_size=4, max_num_seqs=6))

    dash = EngineDashboard(make_engine, workload)  # workload: list of RequestSpec
    dash            # the live widget (mark the cell # NBVAL_IGNORE_OUTPUT)

and, in a later checked cell, a deterministic picture for readers without a kernel::

    for _ in range(20):
        dash.step()
    dash.static()
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape

from minipaged.replay import Replay
from minipaged.viz.blockmap import BlockMapView, PoolSnapshot, render_block_map
from minipaged.viz.svg import TEXT_COLOR, fmt, seq_color, svg_open, tint
from minipaged.viz.timeline import render_timeline

__all__ = [
    "RequestInfo",
    "EngineSnapshot",
    "render_queues",
    "engine_series",
    "preemption_events",
    "render_dashboard",
    "timelines",
    "EngineDashboard",
]

PREEMPT_COLOR = "#d62728"


# ---------------------------------------------------------------------------
# The state the dashboard draws
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestInfo:
    """One request as the dashboard shows it (a frozen copy of a :class:`~minipaged.sequence.Sequence`)."""

    seq_id: object
    status: str  # "waiting", "running", "preempted", "finished", "aborted"
    num_prompt_tokens: int
    num_tokens: int  # prompt + generated so far
    num_computed_tokens: int  # tokens whose K/V is in the cache
    max_tokens: int
    num_blocks: int = 0
    num_preemptions: int = 0

    @classmethod
    def from_sequence(cls, seq) -> RequestInfo:
        table = getattr(seq, "block_table", None)
        status = getattr(seq, "status", "waiting")
        return cls(
            seq_id=seq.seq_id,
            status=getattr(status, "value", str(status)),
            num_prompt_tokens=seq.num_prompt_tokens,
            num_tokens=seq.num_tokens,
            num_computed_tokens=seq.num_computed_tokens,
            max_tokens=seq.sampling_params.max_tokens,
            num_blocks=len(table.blocks) if table is not None else 0,
            num_preemptions=getattr(seq, "num_preemptions", 0),
        )

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine at the end of a step: its pool and block tables, its two queues and its counters."""

    pool: PoolSnapshot
    waiting: tuple[RequestInfo, ...]
    running: tuple[RequestInfo, ...]
    step: int = 0
    time: float = 0.0
    num_finished: int = 0
    num_preemptions: int = 0

    @classmethod
    def from_engine(cls, engine, step: int | None = None) -> EngineSnapshot:
        """Copy what the dashboard needs from an :class:`~minipaged.engine.Engine` (its public state only)."""
        sched = engine.scheduler
        step = engine.metrics.num_steps if step is None else step
        tables = {s.seq_id: s.block_table for s in sched.running if s.block_table is not None}
        finished = engine.metrics.num_finished  # a running total: finished requests may be forgotten
        return cls(
            pool=PoolSnapshot.from_allocator(engine.cache.allocator, tables, step=step),
            waiting=tuple(RequestInfo.from_sequence(s) for s in sched.waiting),
            running=tuple(RequestInfo.from_sequence(s) for s in sched.running),
            step=step,
            time=float(engine.clock.now()),
            num_finished=finished,
            num_preemptions=int(engine.metrics.num_preemptions),
        )


# ---------------------------------------------------------------------------
# Renderers
# ---------------------------------------------------------------------------

CHIP_W, CHIP_H, CHIP_GAP = 74, 34, 6


def _chip(req: RequestInfo, queue: str, x: float, y: float) -> str:
    """One request: its id, a bar of prompt vs generated tokens (computed part solid), its blocks."""
    color = seq_color(req.seq_id)
    sid = escape(str(req.seq_id))
    preempted = req.num_preemptions > 0
    total = max(req.num_prompt_tokens + req.max_tokens, 1)
    bar_w = CHIP_W - 8
    prompt_w = bar_w * req.num_prompt_tokens / total
    tokens_w = bar_w * min(req.num_tokens, total) / total
    computed_w = bar_w * min(req.num_computed_tokens, total) / total
    if queue == "running":
        bg, stroke, dash = tint(color), color, ""
    else:
        bg, stroke = "#ffffff", PREEMPT_COLOR if preempted else color
        dash = ' stroke-dasharray="4,2"' if preempted else ""
    parts = [
        f'<g class="req" data-seq="{sid}" data-queue="{queue}" data-status="{escape(req.status)}"'
        f' data-tokens="{req.num_tokens}" data-computed="{req.num_computed_tokens}"'
        f' data-blocks="{req.num_blocks}" data-preemptions="{req.num_preemptions}">',
        f"<title>request {sid}: {escape(req.status)}, prompt {req.num_prompt_tokens}, generated "
        f"{req.num_output_tokens}/{req.max_tokens}, {req.num_computed_tokens} tokens cached in {req.num_blocks} blocks"
        f"{f', preempted {req.num_preemptions}x' if preempted else ''}</title>",
        f'<rect class="chip" x="{fmt(x)}" y="{fmt(y)}" width="{CHIP_W}" height="{CHIP_H}" rx="4"'
        f' fill="{bg}" stroke="{stroke}" stroke-width="1.5"{dash}/>',
        f'<text x="{fmt(x + 4)}" y="{fmt(y + 12)}" font-size="10" font-weight="bold" fill="{color}">#{sid}</text>',
    ]
    right = f"{req.num_blocks} blk" if queue == "running" else (f"↺{req.num_preemptions}" if preempted else "")
    if right:
        fill = PREEMPT_COLOR if queue == "waiting" else "#555"
        parts.append(
            f'<text x="{fmt(x + CHIP_W - 4)}" y="{fmt(y + 12)}" text-anchor="end" font-size="9"'
            f' fill="{fill}">{right}</text>'
        )
    by = y + 18
    parts += [
        f'<rect class="bar-total" x="{fmt(x + 4)}" y="{fmt(by)}" width="{fmt(bar_w)}" height="5" fill="#eeeeee"/>',
        f'<rect class="bar-tokens" x="{fmt(x + 4)}" y="{fmt(by)}" width="{fmt(tokens_w)}" height="5"'
        f' fill="{color}" fill-opacity="0.35"/>',
        f'<rect class="bar-computed" x="{fmt(x + 4)}" y="{fmt(by)}" width="{fmt(computed_w)}" height="5"'
        f' fill="{color}"/>',
        f'<line x1="{fmt(x + 4 + prompt_w)}" y1="{fmt(by - 1)}" x2="{fmt(x + 4 + prompt_w)}" y2="{fmt(by + 6)}"'
        f' stroke="#333" stroke-width="1"/>',
        f'<text x="{fmt(x + 4)}" y="{fmt(y + 31)}" font-size="7.5" fill="#555">'
        f"{req.num_prompt_tokens}+{req.num_output_tokens}/{req.max_tokens}</text>",
        "</g>",
    ]
    return "".join(parts)


def render_queues(snapshot: EngineSnapshot, *, max_items: int = 12) -> str:
    """The running batch and the waiting queue (front on the left) as rows of request chips.

    A chip's bar spans prompt + max_tokens: the tick marks the end of the
    prompt, the pale part the tokens the request holds, the solid part those
    whose K/V is cached. Waiting requests that were preempted have a dashed red
    border and ``↺n``: they will recompute their tokens when re-admitted.
    Beyond ``max_items`` per row, a count says how many more there are.
    """
    snap = snapshot
    caption = (
        f"step {snap.step}, t = {snap.time:.3f} s: {len(snap.running)} running, {len(snap.waiting)} waiting, "
        f"{snap.num_finished} finished, {snap.num_preemptions} preemptions"
    )
    label_w = 64
    width = label_w + max_items * (CHIP_W + CHIP_GAP) + 70
    height = 20 + 2 * (CHIP_H + 14) + 8
    parts = [
        svg_open(
            "minipaged-queues",
            width,
            height,
            snap.step,
            f' data-running="{len(snap.running)}" data-waiting="{len(snap.waiting)}"',
        ),
        f'<text class="caption" x="4" y="14" font-size="12" fill="{TEXT_COLOR}">'
        f"{escape(caption)}</text>",
    ]
    for row, (queue, items) in enumerate((("running", snap.running), ("waiting", snap.waiting))):
        y = 22 + row * (CHIP_H + 14)
        parts.append(
            f'<text x="4" y="{fmt(y + CHIP_H / 2 + 4)}" font-size="11" fill="#555">{queue}</text>'
        )
        if not items:
            parts.append(
                f'<text x="{label_w}" y="{fmt(y + CHIP_H / 2 + 4)}" font-size="10" fill="#999">(empty)</text>'
            )
        for i, req in enumerate(items[:max_items]):
            parts.append(_chip(req, queue, label_w + i * (CHIP_W + CHIP_GAP), y))
        if len(items) > max_items:
            x = label_w + max_items * (CHIP_W + CHIP_GAP)
            parts.append(
                f'<text class="more" x="{fmt(x)}" y="{fmt(y + CHIP_H / 2 + 4)}" font-size="10" fill="#555">'
                f"+{len(items) - max_items} more</text>"
            )
    parts.append("</svg>")
    return "".join(parts)


def _field(record, name):
    return record[name] if isinstance(record, dict) else getattr(record, name)


def engine_series(history) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Two groups of series from :class:`~minipaged.metrics.StepRecord` history.

    Fractions of the pool: ``kv_usage`` (blocks in use / blocks in the pool)
    and ``token_occupancy`` (tokens held / token slots in the pool); the gap
    between them is the tail waste of the sequences' last blocks. Counts:
    ``running`` and ``waiting`` sequences.

    Args:
        history: step records (or dicts with the same fields).
    """
    fractions = {"kv_usage": [], "token_occupancy": []}
    counts = {"running": [], "waiting": []}
    for r in history:
        fractions["kv_usage"].append(float(_field(r, "kv_usage")))
        fractions["token_occupancy"].append(float(_field(r, "token_occupancy")))
        counts["running"].append(float(_field(r, "num_running")))
        counts["waiting"].append(float(_field(r, "num_waiting")))
    return fractions, counts


def preemption_events(history) -> list[tuple[int, str]]:
    """``(step index, "preempt")`` for every step that preempted at least one sequence."""
    return [(i, "preempt") for i, r in enumerate(history) if _field(r, "preemptions") > 0]


def timelines(history, step: int, extra_events=()) -> tuple[str, str]:
    """The dashboard's two timelines (pool fractions, sequence counts) of step records, marked at ``step``."""
    fractions, counts = engine_series(history)
    events = sorted(preemption_events(history) + list(extra_events), key=lambda e: e[0])
    cache = render_timeline(
        fractions, events=events, step=step, height=170,
        title="KV usage and token occupancy per step (gap: tail waste; red: preemption)",
    )  # fmt: skip
    load = render_timeline(counts, events=events, step=step, height=150, title="sequences running and waiting")
    return cache, load


def render_dashboard(snapshot: EngineSnapshot, history, *, columns: int | None = None, title: str = "engine") -> str:
    """The whole dashboard as one static HTML string: queues, block map and both timelines."""
    cache, load = timelines(history, snapshot.step)
    return (
        f'<div class="minipaged-dashboard-static"><p><b>{escape(title)}</b></p>'
        f"{render_queues(snapshot)}<br/>{render_block_map(snapshot.pool, columns=columns)}<br/>{cache}<br/>{load}</div>"
    )


# ---------------------------------------------------------------------------
# The live dashboard
# ---------------------------------------------------------------------------


class EngineDashboard(BlockMapView):
    """Live view of a continuous-batching engine: queues, pool and block tables, cache and load over time.

    ``engine`` is a function that builds a fresh :class:`~minipaged.engine.Engine`
    (then Reset starts over with a new one), or an engine (then Reset is not
    available). ``workload`` is a list of :class:`~minipaged.workload.RequestSpec`
    replayed through it by a :class:`~minipaged.replay.Replay`, one engine step
    per Step click or Play tick. A ``Replay`` may be passed instead of both.

    The controls are the chapter 02 block map's (Step, Play/Pause, ms/step,
    Reset). The widget's root has the CSS class ``minipaged-dashboard``; every
    SVG carries ``data-step``. ``static()`` returns the picture as HTML.
    """

    PANELS = ("queues", "map", "timeline", "load")
    CSS_CLASS = "minipaged-dashboard"

    def __init__(self, engine, workload=(), *, seed: int = 0, columns: int | None = None, interval: int = 300,
                 title: str = "continuous batching engine"):  # fmt: skip
        if isinstance(engine, Replay):
            source = engine
        elif hasattr(engine, "scheduler") and hasattr(engine, "step"):
            source = Replay(engine, workload, seed)
        elif callable(engine):
            source = lambda: Replay(engine(), workload, seed)  # noqa: E731
        else:
            raise TypeError(f"engine must be an Engine, a Replay or a function that builds an Engine, got {engine!r}")
        super().__init__(source, columns=columns, interval=interval, title=title)

    def engine_snapshot(self) -> EngineSnapshot:
        return EngineSnapshot.from_engine(self.sim.engine)

    def render(self) -> dict[str, str]:
        snap = self.engine_snapshot()
        history = self.sim.engine.metrics.history
        others = [e for e in self.events if e[1] != "preempt"]  # preemptions come from the step records
        cache, load = timelines(history, snap.step, others)
        return {
            "queues": render_queues(snap),
            "map": render_block_map(self.with_marks(snap.pool), columns=self._columns),
            "timeline": cache,
            "load": load,
        }

    def status_text(self) -> str:
        engine = self.sim.engine
        state = "finished" if self.finished else "running"
        return (
            f"step {engine.metrics.num_steps} · t = {engine.clock.now():.3f} s · "
            f"{engine.metrics.num_preemptions} preemptions · {state}"
        )
