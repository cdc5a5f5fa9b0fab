"""Step-by-step timelines (utilisation, fragmentation, queue lengths) as SVG, with event markers.

:func:`render_timeline` draws named series from a simulation's or an engine's
per-step history; :func:`history_series` flattens such a history (a list of
rows, each a dict or dataclass, possibly nested, or a dict of value lists)
into ``{"system.metric": [values]}``.
The root ``<svg>`` has ``class="minipaged-timeline"`` and a ``data-step``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from html import escape

from minipaged.viz.svg import PALETTE, TEXT_COLOR, fmt, svg_open

METRIC_COLORS = {
    "utilisation": "#4e79a7",
    "tail_waste": "#f28e2b",
    "external_fragmentation": "#e15759",
}


def _flatten(record, prefix="") -> dict:
    out = {}
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        record = dataclasses.asdict(record)
    for k, v in dict(record).items():
        name = f"{prefix}{k}"
        if isinstance(v, dict) or (dataclasses.is_dataclass(v) and not isinstance(v, type)):
            out.update(_flatten(v, name + "."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[name] = float(v)
    return out


def history_series(history) -> dict[str, list[float]]:
    """Numeric series from a history in either of the shapes the course uses.

    Accepts a mapping ``name -> list of numbers`` (nested mappings become
    ``"outer.inner"``) or a list of per-step records (dicts or dataclasses,
    nested ones flattened the same way). Non-numeric fields are dropped.
    """
    if history is None:
        return {}
    if hasattr(history, "items"):
        out = {}
        for k, v in history.items():
            if hasattr(v, "items"):
                for kk, vv in history_series(v).items():
                    out[f"{k}.{kk}"] = vv
            else:
                try:
                    vals = [float(x) for x in v]
                except (TypeError, ValueError):
                    continue
                out[str(k)] = vals
        return out
    records = [_flatten(r) for r in history]
    names: list[str] = []
    for r in records:
        names += [k for k in r if k not in names]
    return {n: [r.get(n, math.nan) for r in records] for n in names}


def default_series(history) -> list[str]:
    """The series a fragmentation timeline shows by default: utilisation and fragmentation fractions.

    Utilisation of every system, then external fragmentation of the systems
    where it is ever above zero. Falls back to every series when none of
    those names is present.
    """
    data = history_series(history)
    util = [n for n in data if split_series_name(n)[1] == "utilisation"]
    frag = [n for n in data if split_series_name(n)[1] == "external_fragmentation" and any(v > 0 for v in data[n])]
    return util + frag if util or frag else list(data)


def counter_events(history, name: str, kind: str) -> list[tuple[int, str]]:
    """``(index, kind)`` wherever the cumulative counter ``name`` goes up (a preemption, say)."""
    values = history_series(history).get(name, [])
    return [(i, kind) for i, (a, b) in enumerate(zip([0.0] + values, values)) if b > a]


def split_series_name(name: str) -> tuple[str, str]:
    """``"grow_in_place.utilisation"`` -> ("grow_in_place", "utilisation"); a bare name has system ""."""
    system, _, metric = name.rpartition(".")
    return system, metric


@dataclass(frozen=True)
class _Frame:
    """The plot area of a timeline and its scales: step ``i`` -> x, value ``v`` -> y."""

    n_steps: int
    ymin: float
    ymax: float
    plot_w: float
    plot_h: float
    left: int = 40
    top: int = 24

    def sx(self, i: float) -> float:
        return self.left + (self.plot_w * i / (self.n_steps - 1) if self.n_steps > 1 else self.plot_w / 2)

    def sy(self, v: float) -> float:
        return self.top + self.plot_h * (1 - (v - self.ymin) / ((self.ymax - self.ymin) or 1))


def _axes(fr: _Frame) -> list[str]:
    """The grid lines at every quarter of the value range, their labels, and the first and last step."""
    left, top, plot_w, plot_h = fr.left, fr.top, fr.plot_w, fr.plot_h
    parts = []
    for frac in (0, 0.25, 0.5, 0.75, 1):
        v = fr.ymin + (fr.ymax - fr.ymin) * frac
        y = fr.sy(v)
        parts.append(f'<line x1="{left}" y1="{fmt(y)}" x2="{left + plot_w}" y2="{fmt(y)}" stroke="#e4e4e4"/>')
        parts.append(
            f'<text x="{left - 4}" y="{fmt(y + 3)}" text-anchor="end" font-size="9" fill="#666">{fmt(v)}</text>'
        )
    parts.append(
        f'<text x="{left + plot_w}" y="{top + plot_h + 14}" text-anchor="end" font-size="9" fill="#666">'
        f"step {max(fr.n_steps - 1, 0)}</text>"
    )
    parts.append(f'<text x="{left}" y="{top + plot_h + 14}" font-size="9" fill="#666">step 0</text>')
    return parts


def _event_markers(fr: _Frame, events) -> list[str]:
    """A dashed vertical line per ``(step, kind)`` event (a preemption red), clamped into the plot."""
    parts = []
    for ev_step, kind in events:
        if fr.n_steps == 0:
            continue
        x = fr.sx(min(max(float(ev_step), 0), max(fr.n_steps - 1, 0)))
        color = "#d62728" if kind == "preempt" else "#7f7f7f"
        parts.append(
            f'<line class="event" data-kind="{escape(str(kind))}" data-step="{fmt(float(ev_step))}"'
            f' x1="{fmt(x)}" y1="{fr.top}" x2="{fmt(x)}" y2="{fr.top + fr.plot_h}" stroke="{color}"'
            f' stroke-width="1" stroke-dasharray="2,2"><title>{escape(str(kind))} at step {ev_step}</title></line>'
        )
    return parts


def _series_lines(fr: _Frame, data: dict, names: list[str], legend_cols: int, height: int) -> list[str]:
    """Each series as a polyline (coloured by metric, dashed by system) with its legend entry under the plot."""
    systems: list[str] = []
    for n in names:
        system = split_series_name(n)[0]
        if system not in systems:
            systems.append(system)
    dashes = ("", "6,3", "2,2", "8,3,2,3")
    parts = []
    for k, n in enumerate(names):
        system, metric = split_series_name(n)
        color = METRIC_COLORS.get(metric, PALETTE[k % len(PALETTE)])
        dash = dashes[systems.index(system) % len(dashes)]
        pts = " ".join(f"{fmt(fr.sx(i))},{fmt(fr.sy(v))}" for i, v in enumerate(data[n]) if math.isfinite(v))
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        parts.append(
            f'<polyline class="series" data-series="{escape(n)}" points="{pts}" fill="none" stroke="{color}"'
            f' stroke-width="1.8"{dash_attr}/>'
        )
        lx = fr.left + (k % legend_cols) * (fr.plot_w / legend_cols)
        ly = height + 14 * (k // legend_cols) + 2
        parts.append(
            f'<line x1="{fmt(lx)}" y1="{fmt(ly - 4)}" x2="{fmt(lx + 18)}" y2="{fmt(ly - 4)}" stroke="{color}"'
            f' stroke-width="2"{dash_attr}/>'
            f'<text x="{fmt(lx + 22)}" y="{fmt(ly)}" font-size="10" fill="{TEXT_COLOR}">{escape(n)}</text>'
        )
    return parts


def render_timeline(
    history,
    *,
    series: list[str] | None = None,
    events=(),
    width: int = 560,
    height: int = 200,
    title: str = "utilisation and fragmentation per step",
    step: int | None = None,
) -> str:
    """Series over steps as SVG polylines, with vertical markers for events.

    ``history`` is anything :func:`history_series` accepts. ``series`` picks
    and orders the names to draw (default: every series). The y axis runs
    from 0 to 1 (fractions) or to the largest value when a series exceeds 1.
    Series are coloured by metric and dashed by system, so ``paged.utilisation``
    and ``grow_in_place.utilisation`` share a colour and differ in dash.
    ``events`` is an iterable of ``(step, kind)`` pairs (``"preempt"`` is drawn red).
    """
    data = history_series(history)
    names = list(data) if series is None else [n for n in series if n in data]
    n_steps = max((len(data[n]) for n in names), default=0)
    finite = [v for n in names for v in data[n] if math.isfinite(v)]
    left, right, top, bottom = 40, 10, 24, 22
    fr = _Frame(n_steps, min([0.0] + finite), max([1.0] + finite), width - left - right, height - top - bottom,
                left, top)  # fmt: skip
    longest_name = max((len(n) for n in names), default=0)
    legend_cols = max(1, min(3, int((width - left - right) // (longest_name * 6.2 + 34))))
    total_h = height + 14 * math.ceil(len(names) / legend_cols)
    shown_step = n_steps if step is None else step
    parts = [
        svg_open("minipaged-timeline", width, total_h, shown_step, f' data-points="{n_steps}"'),
        f'<text class="caption" x="{left}" y="15" font-size="12" fill="{TEXT_COLOR}">{escape(title)}</text>',
        f'<rect x="{left}" y="{top}" width="{fr.plot_w}" height="{fr.plot_h}" fill="#fafafa" stroke="#ccc"/>',
        *_axes(fr),
        *_event_markers(fr, events),
        *_series_lines(fr, data, names, legend_cols, height),
    ]
    if not names:
        parts.append(
            f'<text x="{left + fr.plot_w / 2}" y="{top + fr.plot_h / 2}" text-anchor="middle" font-size="11"'
            f' fill="#999">no history yet</text>'
        )
    parts.append("</svg>")
    return "".join(parts)
