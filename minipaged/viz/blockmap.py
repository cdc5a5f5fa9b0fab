"""Pictures of the paged KV cache: pure renderers (state -> SVG string) and a live widget.

Two renderers, each a pure function of plain data, so they are unit-tested
without a browser and give the same bytes for the same state:

- :func:`render_block_map`: every sequence's *logical* blocks (one row per
  sequence) joined by coloured lines to the *physical* cells of the pool.
- :func:`render_pool`: the pool grid alone (free, used, shared, cached).

With prefix caching (chapter 06) a cell also shows whether its block holds a
cached key (a free block that keeps its key is *cached*: reusable by a hit
until it is evicted), and what happened to it in the last step: a prefix-cache
``hit``, a copy-on-write (``cow``, on the fresh copy) or an ``evict``.

The view also draws :func:`minipaged.viz.timeline.render_timeline` (utilisation
and fragmentation step by step) under them.

They read a :class:`PoolSnapshot`, a frozen copy of an allocator and its block
tables. :class:`BlockMapView` puts the renderers under ipywidgets controls
(Step, Play/Pause, speed, Reset) and redraws whenever the allocator publishes
an event, so it also follows a simulation that a notebook cell steps by hand.

Every SVG root carries a ``class`` (``minipaged-blockmap``, ``minipaged-pool``,
``minipaged-timeline``) and a ``data-step`` attribute; cells, logical blocks and
links carry ``data-*`` attributes. Tests (and the browser test) select on those.

In a notebook::

    view = BlockMapView(lambda: TraceSimulator(trace, num_blocks=32, block_size=8, max_len=64))
    view            # live: Step, Play/Pause, ms/step, Reset (mark the cell # NBVAL_IGNORE_OUTPUT)

    view.static()   # the same picture as plain HTML, for readers without a kernel
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from html import escape

from minipaged.viz.svg import (
    CACHED_COLOR,
    FREE_COLOR,
    MARK_COLORS,
    PALETTE,
    SHARED_COLOR,
    TEXT_COLOR,
    USED_COLOR,
    fmt,
    seq_color,
    svg_open,
    text_on,
    tint,
)
from minipaged.viz.timeline import counter_events, default_series, history_series, render_timeline, split_series_name

__all__ = ["PoolSnapshot", "render_block_map", "render_pool", "BlockMapView"]

# ---------------------------------------------------------------------------
# The state the renderers draw
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolSnapshot:
    """A frozen copy of a block pool and the block tables that point into it.

    ``tables`` maps a sequence id to its physical block ids in logical order;
    ``num_tokens`` maps it to how many tokens it holds. The order of
    ``tables`` is the order of rows in the picture. ``cached`` holds the ids
    of blocks that have a prefix-cache key, and ``marks`` maps a block id to
    the last event that touched it in this step (one of :data:`MARKS`).
    """

    num_blocks: int
    block_size: int
    refcounts: tuple[int, ...]
    tables: dict = field(default_factory=dict)
    num_tokens: dict = field(default_factory=dict)
    step: int = 0
    cached: frozenset = frozenset()
    marks: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.num_blocks < 0 or self.block_size < 1:
            raise ValueError(f"need num_blocks >= 0 and block_size >= 1, got {self.num_blocks}, {self.block_size}")
        if len(self.refcounts) != self.num_blocks:
            raise ValueError(f"refcounts has {len(self.refcounts)} entries for {self.num_blocks} blocks")
        object.__setattr__(self, "refcounts", tuple(int(r) for r in self.refcounts))
        object.__setattr__(self, "tables", {s: tuple(int(b) for b in bl) for s, bl in self.tables.items()})
        tokens = {s: int(self.num_tokens.get(s, len(bl) * self.block_size)) for s, bl in self.tables.items()}
        object.__setattr__(self, "num_tokens", tokens)
        for s, blocks in self.tables.items():
            for b in blocks:
                if not 0 <= b < self.num_blocks:
                    raise ValueError(f"table of seq {s!r} points at block {b}, outside 0..{self.num_blocks - 1}")
        object.__setattr__(self, "cached", frozenset(int(b) for b in self.cached))
        object.__setattr__(self, "marks", {int(b): str(k) for b, k in self.marks.items()})
        for b in (*self.cached, *self.marks):
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"cached or marked block {b} is outside 0..{self.num_blocks - 1}")
        for b, kind in self.marks.items():
            if kind not in MARKS:
                raise ValueError(f"mark of block {b} is {kind!r}; marks are {', '.join(MARKS)}")

    @classmethod
    def from_allocator(cls, allocator, tables=(), step: int = 0, cached=None, marks=None) -> PoolSnapshot:
        """Copy the state of ``allocator`` and its ``tables``.

        ``tables`` is a mapping ``seq_id -> BlockTable`` (or ``-> list of block
        ids``), or an iterable of ``BlockTable`` objects with a ``seq_id``.
        ``cached`` (block ids with a prefix-cache key) defaults to the blocks
        whose entry in the allocator's ``entries`` is set (chapter 06's
        prefix-caching allocator); ``marks`` maps block ids to this step's
        event kind.
        """
        if hasattr(tables, "items"):
            items = list(tables.items())
        else:
            items = [(getattr(t, "seq_id", i), t) for i, t in enumerate(tables)]
        block_size = allocator.block_size
        blocks, tokens = {}, {}
        for seq_id, table in items:
            if table is None:
                continue
            bl = list(getattr(table, "blocks", table))
            blocks[seq_id] = bl
            tokens[seq_id] = int(getattr(table, "num_tokens", len(bl) * block_size))
        refcounts = getattr(allocator, "refcounts", None)
        if refcounts is None:
            refcounts = [allocator.refcount(b) for b in range(allocator.num_blocks)]
        if cached is None:  # chapter 06's allocator keeps one prefix-cache entry (or None) per block
            cached = [b for b, entry in enumerate(getattr(allocator, "entries", ())) if entry is not None]
        return cls(allocator.num_blocks, block_size, tuple(refcounts), blocks, tokens, step,
                   frozenset(cached), dict(marks or {}))

    # -- derived quantities the pictures show --------------------------------

    def logical_fill(self, seq_id, logical_index: int) -> int:
        """Tokens of ``seq_id`` in its logical block ``logical_index`` (the tail block may be partial)."""
        rest = self.num_tokens[seq_id] - logical_index * self.block_size
        return max(0, min(self.block_size, rest))

    @property
    def owners(self) -> dict[int, list]:
        """Physical block id -> the sequences whose tables point at it, in row order."""
        out: dict[int, list] = {}
        for seq_id, blocks in self.tables.items():
            for b in blocks:
                if seq_id not in out.setdefault(b, []):
                    out[b].append(seq_id)
        return out

    @property
    def fills(self) -> tuple[int, ...]:
        """Tokens written in each physical block (the fullest view when sequences share it)."""
        fill = [0] * self.num_blocks
        for seq_id, blocks in self.tables.items():
            for i, b in enumerate(blocks):
                fill[b] = max(fill[b], self.logical_fill(seq_id, i))
        return tuple(fill)

    @property
    def num_used(self) -> int:
        return sum(1 for r in self.refcounts if r > 0)

    @property
    def num_shared(self) -> int:
        return sum(1 for r in self.refcounts if r > 1)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that keep their key: K/V a hit can still reuse, evicted only when the pool runs dry."""
        return sum(1 for b in self.cached if self.refcounts[b] == 0)

    @property
    def tail_waste(self) -> int:
        """Reserved but empty slots in the last block of every sequence (tail waste)."""
        return sum(len(bl) * self.block_size - self.num_tokens[s] for s, bl in self.tables.items())


# ---------------------------------------------------------------------------
# Pool grid (shared by render_pool and render_block_map)
# ---------------------------------------------------------------------------

CELL = 34  # px, one pool cell
GAP = 4
# What happened to a block in the last step, and the letter its cell shows.
MARKS = {"hit": "H", "cow": "C", "evict": "E"}


def _grid_columns(num_blocks: int, columns: int | None) -> int:
    if columns is not None:
        if columns < 1:
            raise ValueError(f"columns must be >= 1, got {columns}")
        return columns
    return max(1, min(16, math.ceil(math.sqrt(max(num_blocks, 1)) * 1.5)))


def _cell_xy(block_id: int, cols: int, x0: float, y0: float) -> tuple[float, float]:
    row, col = divmod(block_id, cols)
    return x0 + col * (CELL + GAP), y0 + row * (CELL + GAP)


def _cell_look(snap: PoolSnapshot, b: int, held_by: list, written: int) -> tuple[str, str, str, int, str]:
    """A pool cell's state (free, cached, shared, used), its bar and background colours, its fill and its border.

    ``written`` is the tokens its sequences wrote into it (``snap.fills[b]``).
    """
    ref = snap.refcounts[b]
    if ref == 0 and b in snap.cached:
        state, bar, bg = "cached", CACHED_COLOR, tint(CACHED_COLOR, 0.6)
    elif ref == 0:
        state, bar, bg = "free", FREE_COLOR, FREE_COLOR
    elif ref > 1 or len(held_by) > 1:
        state, bar = "shared", SHARED_COLOR
        bg = tint(bar)
    elif held_by:
        state, bar = "used", seq_color(held_by[0])
        bg = tint(bar)
    else:
        state, bar = "used", USED_COLOR
        bg = tint(bar, 0.5)
    fill = written if held_by else (snap.block_size if ref > 0 or state == "cached" else 0)
    if state == "shared":
        stroke = ' stroke="#333" stroke-width="2"'
    elif state == "cached":
        stroke = f' stroke="{CACHED_COLOR}" stroke-width="1.5" stroke-dasharray="3,2"'
    else:
        stroke = ' stroke="#999" stroke-width="1"'
    return state, bar, bg, fill, stroke


def _cell_labels(x: float, y: float, b: int, ref: int, frac: float, bar: str, mark: str | None, key: bool,
                 state: str, show_refcount: str) -> list[str]:  # fmt: skip
    """What is written on a pool cell: its id, its refcount, this step's mark and the key sign."""
    text_fill = text_on(bar) if frac >= 0.5 else TEXT_COLOR
    out = [
        f'<text class="block-id" x="{fmt(x + CELL / 2)}" y="{fmt(y + CELL / 2 + 4)}" text-anchor="middle"'
        f' font-size="11" fill="{text_fill}">{b}</text>'
    ]
    if show_refcount == "always" or (show_refcount == "shared" and ref > 1):
        out.append(
            f'<text class="refcount" x="{fmt(x + CELL - 3)}" y="{fmt(y + 10)}" text-anchor="end"'
            f' font-size="9" font-weight="bold" fill="{text_fill if frac >= 0.9 else TEXT_COLOR}">×{ref}</text>'
        )
    if mark:
        out.append(
            f'<circle class="mark" cx="{fmt(x + 7)}" cy="{fmt(y + 7)}" r="6" fill="{MARK_COLORS[mark]}"'
            f' stroke="#ffffff" stroke-width="1"/>'
            f'<text class="mark-letter" x="{fmt(x + 7)}" y="{fmt(y + 10)}" text-anchor="middle" font-size="8"'
            f' font-weight="bold" fill="#ffffff">{MARKS[mark]}</text>'
        )
    if key and state != "cached":
        out.append(
            f'<text class="key" x="{fmt(x + 3)}" y="{fmt(y + CELL - 3)}" font-size="8" fill="{CACHED_COLOR}"'
            ' font-weight="bold">#</text>'
        )
    return out


def _pool_cells(snap: PoolSnapshot, cols: int, x0: float, y0: float, show_refcount: str) -> list[str]:
    """SVG for every pool cell: background by state, a fill bar for tokens used, id and refcount."""
    owners, fills = snap.owners, snap.fills
    out = []
    for b in range(snap.num_blocks):
        x, y = _cell_xy(b, cols, x0, y0)
        ref = snap.refcounts[b]
        held_by = owners.get(b, [])
        state, bar, bg, fill, stroke = _cell_look(snap, b, held_by, fills[b])
        frac = fill / snap.block_size
        seqs = " ".join(escape(str(s)) for s in held_by)
        key = b in snap.cached
        mark = snap.marks.get(b)
        extra = (' data-cached="1"' if key else "") + (f' data-mark="{mark}"' if mark else "")
        classes = f"cell cell-{state}" + (f" mark-{mark}" if mark else "")
        notes = (", cached key" if key else "") + (f", {mark} this step" if mark else "")
        out.append(
            f'<g class="{classes}" data-block="{b}" data-refcount="{ref}" data-fill="{fill}"'
            f' data-seqs="{seqs}" data-state="{state}"{extra}>'
            f"<title>block {b}: {state}, refcount {ref}, {fill}/{snap.block_size} slots{notes}"
            f"{' (seq ' + seqs + ')' if seqs else ''}</title>"
            f'<rect class="bg" x="{fmt(x)}" y="{fmt(y)}" width="{CELL}" height="{CELL}" rx="3" fill="{bg}"{stroke}/>'
        )
        if frac > 0:
            h = CELL * frac
            out.append(
                f'<rect class="fill" x="{fmt(x)}" y="{fmt(y + CELL - h)}" width="{CELL}" height="{fmt(h)}"'
                f' rx="3" fill="{bar}" fill-opacity="0.85" data-fraction="{fmt(frac)}"/>'
            )
        out += _cell_labels(x, y, b, ref, frac, bar, mark, key, state, show_refcount)
        out.append("</g>")
    return out


def _legend(x: float, y: float, snap: PoolSnapshot, notes: tuple[str, ...] = ()) -> list[str]:
    """The key under a picture: the cell states and marks ``snap`` holds on one row at baseline ``y``, then notes.

    Only what the picture shows gets an entry: a pool without shared blocks has no "shared" swatch.
    """
    owners, fills = snap.owners, snap.fills
    states = {_cell_look(snap, b, owners.get(b, []), fills[b])[0] for b in range(snap.num_blocks)}
    items = [(label, color) for state, label, color in (
        ("free", "free", FREE_COLOR), ("used", "used (colour = sequence)", PALETTE[0]),
        ("shared", "shared (refcount > 1)", SHARED_COLOR), ("cached", "cached, free (# = has a key)", CACHED_COLOR),
    ) if state in states or (state == "cached" and snap.cached)]
    out, cx = ['<g class="legend">'], x
    for label, color in items:
        out.append(f'<rect x="{fmt(cx)}" y="{fmt(y - 9)}" width="10" height="10" fill="{color}" stroke="#999"/>')
        out.append(f'<text class="legend-item" x="{fmt(cx + 14)}" y="{fmt(y)}" font-size="10" fill="{TEXT_COLOR}">'
                   f"{escape(label)}</text>")
        cx += 14 + 6.2 * len(label) + 14
    for kind, letter in MARKS.items():
        if kind not in snap.marks.values():
            continue
        out.append(f'<circle cx="{fmt(cx + 5)}" cy="{fmt(y - 4)}" r="5" fill="{MARK_COLORS[kind]}"/>'
                   f'<text x="{fmt(cx + 5)}" y="{fmt(y - 1)}" text-anchor="middle" font-size="7" fill="#ffffff"'
                   f' font-weight="bold">{letter}</text>'
                   f'<text class="legend-item" x="{fmt(cx + 13)}" y="{fmt(y)}" font-size="10" fill="{TEXT_COLOR}">'
                   f"{kind}</text>")
        cx += 13 + 6.2 * len(kind) + 12
    for i, note in enumerate(notes, 1):
        out.append(f'<text class="note" x="{fmt(x)}" y="{fmt(y + LEGEND_LINE * i)}" font-size="10" fill="#555">'
                   f"{escape(note)}</text>")
    out.append("</g>")
    return out


LEGEND_LINE = 14  # px between the legend's rows
POOL_NOTES = ("The filled part of a cell is the share of its slots that hold tokens.",)
MAP_NOTES = (
    "Each row is a sequence's block table: the number in logical block i is the physical block it maps to,",
    "and a line joins the two. The filled part of a block is the share of its slots that hold tokens.",
)


def _prefix_caption(snap: PoolSnapshot, shared: bool = True) -> str:
    """The chapter 06 part of a caption: cached blocks and this step's marks (empty without prefix caching).

    ``shared`` adds the count of shared blocks; the pool's caption, which always has it, passes False.
    """
    if not snap.cached and not snap.marks:
        return ""
    counts = {kind: sum(1 for k in snap.marks.values() if k == kind) for kind in MARKS}
    return ((f", {snap.num_shared} shared" if shared else "")
            + f", {len(snap.cached)} cached ({snap.num_cached_free} free)"
            + "".join(f", {n} {kind}" for kind, n in counts.items() if n))


def render_pool(snapshot: PoolSnapshot, *, columns: int | None = None, show_refcount: str = "shared") -> str:
    """The physical pool as a grid: one cell per block, its fill bar showing tokens used.

    ``show_refcount`` is ``"shared"`` (label cells whose refcount is above 1),
    ``"always"`` or ``"never"``.
    """
    if show_refcount not in ("shared", "always", "never"):
        raise ValueError(f"show_refcount must be 'shared', 'always' or 'never', got {show_refcount!r}")
    snap = snapshot
    cols = _grid_columns(snap.num_blocks, columns)
    rows = max(1, math.ceil(snap.num_blocks / cols))
    x0, y0 = 8, 24
    width = max(x0 * 2 + cols * (CELL + GAP) - GAP, 780 if snap.cached or snap.marks else 460)
    height = y0 + rows * (CELL + GAP) - GAP + 28 + LEGEND_LINE * len(POOL_NOTES)
    head = (
        f"pool: {snap.num_used}/{snap.num_blocks} blocks used, {snap.num_shared} shared, "
        f"block_size {snap.block_size}{_prefix_caption(snap, shared=False)}"
    )
    parts = [
        svg_open("minipaged-pool", width, height, snap.step, f' data-used="{snap.num_used}"'),
        f'<text class="caption" x="{x0}" y="15" font-size="12" fill="{TEXT_COLOR}">{escape(head)}</text>',
        *_pool_cells(snap, cols, x0, y0, show_refcount),
        *_legend(x0, height - 8 - LEGEND_LINE * len(POOL_NOTES), snap, POOL_NOTES),
        "</svg>",
    ]
    return "".join(parts)


def _hover_style(seq_ids) -> str:
    """CSS that brings one sequence's links forward while the pointer is on its row (live views only).

    The links are drawn before the rows (beneath them), so the rule finds them from the picture's root.
    """
    rules = [".minipaged-blockmap .seq{cursor:default}"]
    for seq_id in seq_ids:
        sid = str(seq_id)
        if sid.replace("-", "").replace("_", "").isalnum():  # ids that need no CSS escaping
            rules.append(f'.minipaged-blockmap:has(.seq[data-seq="{sid}"]:hover) .link[data-seq="{sid}"]'
                         "{stroke-opacity:1;stroke-width:2.5}")
    return "<style>" + "".join(rules) + "</style>"


@dataclass(frozen=True)
class _MapLayout:
    """The geometry of :func:`render_block_map`: which rows it shows, the logical cells' size, where the pool is."""

    cols: int  # pool columns
    shown: list  # the sequences drawn as rows
    hidden: list  # the ones summarised in one line
    longest: int  # blocks in the longest shown table
    lcell: float  # px, a logical block's side
    pool_x0: float
    width: float
    height: float
    lgap: int = 3
    label_w: int = 78
    row_h: int = 28
    top: int = 48


TABLES_HEAD, POOL_HEAD = "block tables (logical → physical)", "physical pool (block id, fill, ×refcount)"


def text_width(text: str, font_size: float) -> float:
    """An upper bound of ``text``'s width in px in the pictures' monospace font (0.62 em a character)."""
    return 0.62 * font_size * len(text)


def _map_layout(snap: PoolSnapshot, columns: int | None, max_rows: int) -> _MapLayout:
    cols = _grid_columns(snap.num_blocks, columns)
    pool_rows = max(1, math.ceil(snap.num_blocks / cols))
    seq_ids = list(snap.tables)
    shown, hidden = seq_ids[:max_rows], seq_ids[max_rows:]
    longest = max((len(snap.tables[s]) for s in shown), default=0)
    # Logical cells shrink for long tables so the map keeps a readable width.
    pitch = min(25.0, max(9.0, 400 / max(longest, 1)))
    lcell, lgap, label_w, row_h, top = pitch - 3, 3, 78, 28, 48
    logical_w = label_w + max(longest, 1) * (lcell + lgap)
    pool_x0 = max(logical_w + 70, 8 + text_width(TABLES_HEAD, 10) + 20)  # never under the left column's title
    pool_w = cols * (CELL + GAP) - GAP
    prefix = bool(snap.cached or snap.marks)
    width = max(pool_x0 + max(pool_w, 270) + 10, 780 if prefix else 660)  # room for the caption and legend
    rows_h = max(len(shown), 1) * row_h + (row_h if hidden else 0)
    height = top + max(rows_h, pool_rows * (CELL + GAP)) + 30 + LEGEND_LINE * len(MAP_NOTES)
    return _MapLayout(cols, shown, hidden, longest, lcell, pool_x0, width, height, lgap, label_w, row_h, top)


def _map_head(snap: PoolSnapshot, lay: _MapLayout) -> list[str]:
    """The opening of the block map: the caption, the two column titles, the hover style, the logical indices."""
    caption = (f"step {snap.step}: {len(snap.tables)} sequences, {snap.num_used}/{snap.num_blocks} blocks used, "
               f"tail waste {snap.tail_waste} slots{_prefix_caption(snap)}")
    parts = [
        svg_open(
            "minipaged-blockmap",
            lay.width,
            lay.height,
            snap.step,
            f' data-used="{snap.num_used}" data-seqs="{len(snap.tables)}"',
        ),
        f'<text class="caption" x="8" y="16" font-size="12" fill="{TEXT_COLOR}">{escape(caption)}</text>',
        f'<text class="head" x="8" y="32" font-size="10" fill="#666">{TABLES_HEAD}</text>',
        f'<text class="head" x="{fmt(lay.pool_x0)}" y="32" font-size="10" fill="#666">{POOL_HEAD}</text>',
        _hover_style(lay.shown),
    ]
    if lay.longest and lay.lcell >= 14:  # the logical indices, once, above the rows
        parts.append('<g class="logical-index">' + "".join(
            f'<text x="{fmt(lay.label_w + i * (lay.lcell + lay.lgap) + lay.lcell / 2)}" y="{lay.top - 4}"'
            f' text-anchor="middle" font-size="8" fill="#666">{i}</text>' for i in range(lay.longest)) + "</g>")
    return parts


def _logical_block(lay: _MapLayout, sid: str, i: int, b: int, fill: int, frac: float, color: str,
                   x: float, y: float, block_size: int) -> list[str]:  # fmt: skip
    """Logical block ``i`` of one row: its box, its fill and the physical block its table entry names."""
    lcell = lay.lcell
    out = [
        f'<g class="lblock" data-seq="{sid}" data-logical="{i}" data-block="{b}" data-fill="{fill}">'
        f"<title>seq {sid} logical block {i} -> physical block {b} ({fill}/{block_size} slots)</title>"
        f'<rect x="{fmt(x)}" y="{fmt(y)}" width="{fmt(lcell)}" height="{fmt(lcell)}" rx="2"'
        f' fill="{tint(color)}" stroke="{color}"/>'
    ]
    if frac > 0:
        w = lcell * frac
        out.append(
            f'<rect class="fill" x="{fmt(x)}" y="{fmt(y)}" width="{fmt(w)}" height="{fmt(lcell)}" rx="2"'
            f' fill="{color}" data-fraction="{fmt(frac)}"/>'
        )
    if lcell >= 14:  # the table entry: which physical block this logical block is
        out.append(
            f'<text class="entry" x="{fmt(x + lcell / 2)}" y="{fmt(y + 15)}" text-anchor="middle"'
            f' font-size="9" fill="{text_on(color) if frac >= 0.5 else TEXT_COLOR}">{b}</text>'
        )
    out.append("</g>")
    return out


# A link from a logical block to its pool cell: strong enough to follow in a static picture, a little
# translucent so that a table entry it crosses stays readable.
LINK_WIDTH, LINK_OPACITY = 1.6, 0.8


def _map_row(snap: PoolSnapshot, lay: _MapLayout, row: int, seq_id) -> tuple[list[str], list[str]]:
    """One sequence's row of logical blocks, and the links from each to its pool cell."""
    color = seq_color(seq_id)
    y = lay.top + row * lay.row_h
    sid = escape(str(seq_id))
    n_tok = snap.num_tokens[seq_id]
    logical = [
        f'<g class="seq" data-seq="{sid}" data-color="{color}" data-tokens="{n_tok}">'
        f'<rect class="swatch" x="2" y="{fmt(y)}" width="4" height="{fmt(lay.lcell)}" fill="{color}"/>'
        f'<text class="label" x="10" y="{fmt(y + 13)}" font-size="11" fill="{TEXT_COLOR}" font-weight="bold">'
        f"seq {sid}</text>"
        f'<text x="10" y="{fmt(y + 24)}" font-size="8" fill="#555">{n_tok} tokens</text>'
    ]
    links = []
    for i, b in enumerate(snap.tables[seq_id]):
        x = lay.label_w + i * (lay.lcell + lay.lgap)
        fill = snap.logical_fill(seq_id, i)
        logical += _logical_block(lay, sid, i, b, fill, fill / snap.block_size, color, x, y, snap.block_size)
        cx, cy = _cell_xy(b, lay.cols, lay.pool_x0, lay.top)
        x1, y1 = x + lay.lcell / 2, y + lay.lcell
        x2, y2 = cx, cy + CELL / 2  # the middle of the cell's left edge
        links.append(
            f'<path class="link" data-seq="{sid}" data-logical="{i}" data-block="{b}" stroke="{color}"'
            f' d="M{fmt(x1)},{fmt(y1)} C{fmt(x1)},{fmt(y1 + 14)} {fmt(x2 - 60)},{fmt(y2)} {fmt(x2)},{fmt(y2)}"'
            f' fill="none" stroke-width="{LINK_WIDTH}" stroke-opacity="{LINK_OPACITY}"/>'
        )
    logical.append("</g>")
    return logical, links


def render_block_map(
    snapshot: PoolSnapshot,
    *,
    columns: int | None = None,
    show_refcount: str = "shared",
    max_rows: int = 24,
) -> str:
    """Logical blocks of every sequence (left) linked by colour and lines to physical cells (right).

    Each logical block shows its index and how full it is; the line from it
    ends on the pool cell its block table names. Sequences beyond ``max_rows``
    are summarised in one line so the picture keeps a readable height.
    """
    if show_refcount not in ("shared", "always", "never"):
        raise ValueError(f"show_refcount must be 'shared', 'always' or 'never', got {show_refcount!r}")
    snap = snapshot
    lay = _map_layout(snap, columns, max_rows)
    parts = _map_head(snap, lay)
    links, logical = [], []
    for row, seq_id in enumerate(lay.shown):
        row_logical, row_links = _map_row(snap, lay, row, seq_id)
        logical += row_logical
        links += row_links
    if lay.hidden:
        y = lay.top + len(lay.shown) * lay.row_h
        logical.append(
            f'<text class="more" x="8" y="{fmt(y + 15)}" font-size="10" fill="#666">'
            f"… and {len(lay.hidden)} more sequences</text>"
        )
    # Links run beneath the logical blocks and the pool cells, which are opaque: a line that crosses a
    # block never covers its id. Hovering a row (live views) brings its links forward.
    parts.append('<g class="links">' + "".join(links) + "</g>")
    parts += logical
    parts += _pool_cells(snap, lay.cols, lay.pool_x0, lay.top, show_refcount)
    parts += _legend(8, lay.height - 8 - LEGEND_LINE * len(MAP_NOTES), snap, MAP_NOTES)
    parts.append("</svg>")
    return "".join(parts)


# ---------------------------------------------------------------------------
# The live widget
# ---------------------------------------------------------------------------


def _default_snapshot(sim, step: int) -> PoolSnapshot:
    tables = getattr(sim, "tables", {})
    if callable(tables):
        tables = tables()
    return PoolSnapshot.from_allocator(sim.allocator, tables, step=step)


def _default_history(sim):
    return getattr(sim, "history", None)


class BlockMapView:
    """A live block map of a steppable simulation, with Step, Play/Pause, speed and Reset.

    ``source`` is either a simulation (an object with ``step()``, ``allocator``,
    ``tables`` and optionally ``history``) or a zero-argument function that
    builds one; with a function, Reset builds a fresh simulation, otherwise
    Reset calls ``sim.reset()`` when the simulation has one. ``step()`` ends
    the run by returning ``False`` or raising ``StopIteration``.

    The view subscribes to the allocator's events: whenever blocks come and go,
    outside a Step click too, the picture is redrawn. ``static()`` returns the
    current picture as plain HTML for notebooks read without a kernel, and the
    widget's own display carries the same HTML as a fallback.

    Subclasses (the chapter 05 dashboard) name their panels in ``PANELS`` and
    return one SVG per panel from :meth:`render`.
    """

    PANELS: tuple[str, ...] = ("map", "timeline")
    CSS_CLASS = "minipaged-blockmap-view"

    def __init__(
        self,
        source,
        *,
        snapshot=None,
        history=None,
        series: list[str] | None = None,
        columns: int | None = None,
        interval: int = 300,
        title: str = "block map",
    ):
        import ipywidgets as widgets

        if hasattr(source, "step") and not isinstance(source, type):  # a class is a factory
            self._factory, self.sim = None, source
        elif callable(source):
            self._factory, self.sim = source, source()
        else:
            raise TypeError(f"source must be a simulation with step() or a function that builds one, got {source!r}")
        self._snapshot_fn = snapshot or _default_snapshot
        self._history_fn = history or _default_history
        self._series, self._columns, self.title = series, columns, title
        self.steps = 0
        self.finished = False
        self.events: list[tuple[int, str]] = []  # (step, kind) of notable allocator events
        self.marks: dict[int, str] = {}  # block id -> hit / cow / evict in the last step
        self._in_step = False
        self._unsubscribe = None

        self.out = widgets.Output()
        self.step_button = widgets.Button(description="Step", icon="step-forward", tooltip="advance one step")
        self.reset_button = widgets.Button(description="Reset", icon="undo", tooltip="start again")
        self.play = widgets.Play(value=0, min=0, max=10**9, step=1, interval=interval, show_repeat=False)
        self.speed = widgets.IntSlider(value=interval, min=50, max=1500, step=50, description="ms/step")
        widgets.link((self.speed, "value"), (self.play, "interval"))
        self.status = widgets.HTML()
        self.panels = {name: widgets.HTML() for name in self.PANELS}
        self.step_button.add_class("minipaged-step")
        self.reset_button.add_class("minipaged-reset")
        self.play.add_class("minipaged-play")

        capture = self.out.capture()
        self.step_button.on_click(capture(lambda _b: self.step()))
        self.reset_button.on_click(capture(lambda _b: self.reset()))
        self.play.observe(capture(self._on_play), names="value")

        controls = widgets.HBox([self.step_button, self.play, self.speed, self.reset_button])
        self.widget = widgets.VBox(
            [controls, self.status, *(self.panels[name] for name in self.PANELS), self.out],
            layout=widgets.Layout(width="100%"),
        )
        self.widget.add_class(self.CSS_CLASS)
        self._subscribe()
        self.redraw()

    # -- state -----------------------------------------------------------------

    def snapshot(self) -> PoolSnapshot:
        return self.with_marks(self._snapshot_fn(self.sim, self.steps))

    def with_marks(self, snap: PoolSnapshot) -> PoolSnapshot:
        """``snap`` with this step's hit / cow / evict marks added."""
        return replace(snap, marks={**snap.marks, **self.marks}) if self.marks else snap

    def _subscribe(self):
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        allocator = getattr(self.sim, "allocator", None)
        if allocator is not None and hasattr(allocator, "subscribe"):
            self._unsubscribe = allocator.subscribe(self.out.capture()(self._on_event))

    def _on_event(self, event) -> None:
        kind = getattr(event, "kind", str(event))
        block_id = getattr(event, "block_id", None)
        if kind in MARKS and block_id is not None:
            self.marks[block_id] = kind  # drawn on the block's cell until the next step
        if kind not in ("allocate", "free", "incref", "decref", "hit"):
            self.events.append((self.steps, kind))  # preempt, cow, evict, fork ... become timeline markers
        if not self._in_step:  # someone stepped the simulation outside the widget
            self.redraw()

    # -- actions ---------------------------------------------------------------

    def step(self) -> bool:
        """Advance the simulation one step and redraw; False once it has finished."""
        if self.finished:
            return False
        self._in_step = True
        self.marks = {}
        try:
            more = self.sim.step()
        except StopIteration:
            more = False
        finally:
            self._in_step = False
        self.steps += 1
        if more is False:
            self.finished = True
            self.play.playing = False
            self.step_button.disabled = True
        self.redraw()
        return not self.finished

    def _on_play(self, change) -> None:
        if change["new"] > change["old"] and not self.finished:
            self.step()

    def reset(self) -> None:
        """Start the simulation again (a fresh one from the factory, or ``sim.reset()``)."""
        self.play.playing = False
        if self._factory is not None:
            self.sim = self._factory()
        elif hasattr(self.sim, "reset"):
            self.sim.reset()
        else:
            raise RuntimeError("this simulation has no reset(); pass a function that builds one instead")
        self.steps, self.finished, self.events, self.marks = 0, False, [], {}
        self.step_button.disabled = False
        with self.play.hold_trait_notifications():
            self.play.value = 0
        self._subscribe()
        self.redraw()

    # -- drawing -----------------------------------------------------------------

    def render(self) -> dict[str, str]:
        """One SVG per panel of the current state: the block map and the timeline."""
        snap = self.snapshot()
        block_map = render_block_map(snap, columns=self._columns)
        history = self._history_fn(self.sim)
        series = self._series if self._series is not None else default_series(history)
        events = list(self.events)
        for name in history_series(history):
            if split_series_name(name)[1] == "preempted" and split_series_name(name)[0] in ("", "paged"):
                events += counter_events(history, name, "preempt")
        timeline = render_timeline(history, series=series, events=sorted(events, key=lambda e: e[0]), step=self.steps)
        return {"map": block_map, "timeline": timeline}

    def status_text(self) -> str:
        return f"step {self.steps} · {'finished' if self.finished else 'running'}"

    def redraw(self) -> None:
        svgs = self.render()
        self.status.value = f"<b>{escape(self.title)}</b> · {escape(self.status_text())}"
        for name, html in svgs.items():
            self.panels[name].value = html

    def static(self):
        """The current picture as an ``IPython.display.HTML`` (readable without a kernel)."""
        from IPython.display import HTML

        return HTML(self._static_html())

    def _static_html(self) -> str:
        svgs = self.render()
        head = f"<p><b>{escape(self.title)}</b> · {escape(self.status_text())}</p>"
        return f'<div class="minipaged-static">{head}' + "<br/>".join(svgs[n] for n in self.PANELS) + "</div>"

    def close(self) -> None:
        """Stop listening to the allocator and close the widgets."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        self.play.playing = False
        self.widget.close()

    def _repr_mimebundle_(self, **kwargs):
        bundle = self.widget._repr_mimebundle_(**kwargs) or {}
        # JupyterLab shows the live widget; a viewer without widgets (GitHub) shows this picture.
        bundle = dict(bundle)
        bundle["text/html"] = self._static_html()
        return bundle
