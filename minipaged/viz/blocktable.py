"""The block-table diagram (chapter 02): logical blocks, block tables and physical blocks side by side.

In the spirit of the vLLM paper's Figures 6 and 7: each sequence's tokens in
its *logical* blocks (left), its *block table* (middle: logical block ->
physical block, and how many of its slots are filled), and the *physical*
blocks of the pool where the tokens really are (right). One token can be
traced through the table with its slot worked out underneath:

    slot = block_table[p // B] * B + p % B

:func:`render_block_tables` is a pure function of a
:class:`~minipaged.viz.blockmap.PoolSnapshot`: the same state gives the same SVG.
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape

from minipaged.viz.blockmap import PoolSnapshot
from minipaged.viz.svg import FREE_COLOR, TEXT_COLOR, fmt, seq_color, svg_open, tint

__all__ = ["render_block_tables", "worked_slot"]

SLOT = 24  # px, one token slot
ROW = 30  # px between block rows
HEAD = 18  # px for a sequence's heading
WORKED_COLOR = "#d62728"


def worked_slot(snapshot: PoolSnapshot, seq_id, position: int) -> dict:
    """The slot of token ``position`` of ``seq_id``, with every step of the calculation.

    Args:
        snapshot: the pool and block tables.
        seq_id: a sequence of ``snapshot.tables``.
        position: the token's position in its sequence, ``0 <= position < num_tokens``.

    Returns:
        ``{"logical": p // B, "offset": p % B, "block": table[p // B], "slot": block * B + offset}``.
    """
    if seq_id not in snapshot.tables:
        raise ValueError(f"seq_id {seq_id!r} has no block table; known: {list(snapshot.tables)}")
    if isinstance(position, bool) or not isinstance(position, int):
        raise TypeError(f"position must be an int, got {type(position).__name__}")
    if not 0 <= position < snapshot.num_tokens[seq_id]:
        raise IndexError(f"position {position} is outside seq {seq_id!r}'s {snapshot.num_tokens[seq_id]} tokens")
    b = snapshot.block_size
    logical, offset = divmod(position, b)
    block = snapshot.tables[seq_id][logical]
    return {"logical": logical, "offset": offset, "block": block, "slot": block * b + offset}


def _slot_cell(x, y, color, filled: bool, label: str, attrs: str, worked: bool) -> str:
    fill = tint(color, 0.55) if filled else "#ffffff"
    dash = "" if filled else ' stroke-dasharray="3,2"'
    stroke = f' stroke="{WORKED_COLOR}" stroke-width="2.5"' if worked else f' stroke="{color}" stroke-width="1"'
    text = (f'<text x="{fmt(x + SLOT / 2)}" y="{fmt(y + SLOT / 2 + 4)}" text-anchor="middle" font-size="10"'
            f' fill="{TEXT_COLOR}">{escape(label)}</text>') if label else ""
    cls = "slot worked" if worked else "slot"
    return (f'<g class="{cls}"{attrs}><rect x="{fmt(x)}" y="{fmt(y)}" width="{SLOT}" height="{SLOT}"'
            f' fill="{fill}"{stroke}{dash}/>{text}</g>')


@dataclass(frozen=True)
class _Layout:
    """Where the three columns of :func:`render_block_tables` start, and what it traces."""

    snap: PoolSnapshot
    worked: dict | None  # worked_slot of the highlighted token, or None
    hseq: object  # the highlighted sequence, or None
    hpos: int | None  # the highlighted token's position, or None
    top: int
    x_log: int = 12
    tab_w: int = 3 * 46

    @property
    def block_w(self) -> int:
        return self.snap.block_size * SLOT

    @property
    def x_tab(self) -> int:
        return self.x_log + 62 + self.block_w + 56

    @property
    def x_phys(self) -> int:
        return self.x_tab + self.tab_w + 90


def _table_row(lay: _Layout, seq_id, sid: str, i: int, b: int, fill: int, y: float) -> str:
    """Row ``i`` of ``seq_id``'s block table: logical block, physical block, filled slots."""
    row_worked = lay.hseq == seq_id and lay.worked is not None and lay.worked["logical"] == i
    stroke = f' stroke="{WORKED_COLOR}" stroke-width="2.5"' if row_worked else ' stroke="#999"'
    return (
        f'<g class="table-row{" worked" if row_worked else ""}" data-seq="{sid}" data-logical="{i}"'
        f' data-block="{b}" data-filled="{fill}">'
        f'<rect x="{lay.x_tab}" y="{fmt(y)}" width="{lay.tab_w}" height="{SLOT}" fill="#ffffff"{stroke}/>'
        + "".join(f'<text x="{fmt(lay.x_tab + 23 + j * 46)}" y="{fmt(y + SLOT / 2 + 4)}" text-anchor="middle"'
                  f' font-size="11" fill="{TEXT_COLOR}"{weight}>{v}</text>'
                  for j, (v, weight) in enumerate(((i, ""), (b, ' font-weight="bold"'), (fill, ""))))
        + "</g>"
    )


def _sequences(lay: _Layout) -> tuple[list[str], dict, float]:
    """The left two columns: each sequence's logical blocks and its block table.

    Returns the SVG parts, the y of each table row by ``(seq_id, logical block)``, and the height used.
    """
    snap, bsz = lay.snap, lay.snap.block_size
    parts, table_rows, y = [], {}, lay.top
    for seq_id, blocks in snap.tables.items():
        color, sid = seq_color(seq_id), escape(str(seq_id))
        n = snap.num_tokens[seq_id]
        parts.append(f'<g class="seq" data-seq="{sid}">'
                     f'<text x="{lay.x_log}" y="{fmt(y + 12)}" font-size="12" font-weight="bold" fill="{TEXT_COLOR}">'
                     f'<tspan fill="{color}">■</tspan> seq {sid}: {n} tokens</text>')
        parts.append(f'<text x="{lay.x_tab}" y="{fmt(y + 12)}" font-size="10" fill="#555">'
                     '<tspan>logical</tspan><tspan dx="12">physical</tspan><tspan dx="10">filled</tspan></text>')
        y += HEAD
        for i, b in enumerate(blocks):
            fill = snap.logical_fill(seq_id, i)
            parts.append(f'<text x="{lay.x_log}" y="{fmt(y + SLOT / 2 + 4)}" font-size="10" fill="#555">'
                         f'block {i}</text>')
            for k in range(bsz):
                p = i * bsz + k
                is_worked = lay.hseq == seq_id and lay.worked is not None and p == lay.hpos
                parts.append(_slot_cell(lay.x_log + 62 + k * SLOT, y, color, k < fill, str(p) if k < fill else "",
                                        f' data-seq="{sid}" data-pos="{p}"', is_worked))
            parts.append(_table_row(lay, seq_id, sid, i, b, fill, y))
            table_rows[(seq_id, i)] = y
            y += ROW
        parts.append("</g>")
        y += 8
    return parts, table_rows, y


def _arrow(lay: _Layout, seq_id, b: int, color: str, ty: float, py: float) -> str:
    """The arrow from the table row that names physical block ``b`` to the block."""
    x1, x2, y2 = lay.x_tab + lay.tab_w, lay.x_phys - 20, py + SLOT / 2
    is_worked = lay.worked is not None and b == lay.worked["block"] and seq_id == lay.hseq
    return (
        f'<path class="arrow{" worked" if is_worked else ""}" data-seq="{escape(str(seq_id))}"'
        f' data-block="{b}" d="M{fmt(x1)},{fmt(ty)} C{fmt(x1 + 40)},{fmt(ty)} {fmt(x2 - 40)},{fmt(y2)}'
        f' {fmt(x2)},{fmt(y2)}" fill="none" stroke="{WORKED_COLOR if is_worked else color}"'
        f' stroke-width="{2 if is_worked else 1.2}" marker-end="url(#bt-arrow)"/>'
    )


def _physical(lay: _Layout, table_rows: dict) -> tuple[list[str], list[str]]:
    """The right column: every block of the pool, its slots labelled by the token they hold; plus the arrows."""
    snap, bsz, top, x_phys = lay.snap, lay.snap.block_size, lay.top, lay.x_phys
    owner = {}
    for seq_id, blocks in snap.tables.items():
        for i, b in enumerate(blocks):
            owner[b] = (seq_id, i)
    parts, arrows = [], []
    parts.append(f'<text x="{x_phys}" y="{top - 6}" font-size="11" fill="#555">physical blocks (the pool)</text>')
    parts.append(f'<text x="{lay.x_log}" y="{top - 6}" font-size="11" fill="#555">logical blocks (positions)</text>'
                 f'<text x="{lay.x_tab}" y="{top - 6}" font-size="11" fill="#555">block tables</text>')
    for b in range(snap.num_blocks):
        py = top + b * ROW
        parts.append(f'<text x="{fmt(x_phys - 6)}" y="{fmt(py + SLOT / 2 + 4)}" text-anchor="end" font-size="10"'
                     f' fill="#555">{b}</text>')
        seq_id, i = owner.get(b, (None, None))
        color = seq_color(seq_id) if seq_id is not None else "#bbbbbb"
        fill = snap.logical_fill(seq_id, i) if seq_id is not None else 0
        for k in range(bsz):
            p = i * bsz + k if seq_id is not None else None
            label = f"{seq_id}{p}" if seq_id is not None and k < fill else ""
            is_worked = lay.worked is not None and b == lay.worked["block"] and k == lay.worked["offset"]
            cell = _slot_cell(x_phys + k * SLOT, py, color, k < fill, label,
                              f' data-block="{b}" data-slot="{b * bsz + k}"', is_worked)
            if seq_id is None:
                cell = cell.replace('fill="#ffffff"', f'fill="{FREE_COLOR}"', 1)
            parts.append(cell)
        parts.append(f'<text x="{fmt(x_phys + lay.block_w + 6)}" y="{fmt(py + SLOT / 2 + 4)}" font-size="9"'
                     f' fill="#555">slots {b * bsz}–{b * bsz + bsz - 1}</text>')
        if seq_id is not None:  # the table row that names this block points at it
            arrows.append(_arrow(lay, seq_id, b, color, table_rows[(seq_id, i)] + SLOT / 2, py))
    return parts, arrows


def _worked_notes(lay: _Layout, y: float) -> tuple[str, int]:
    """The three lines under the picture that work out the highlighted slot; their SVG and height."""
    notes = []
    if lay.worked is not None:
        w, p, bsz = lay.worked, lay.hpos, lay.snap.block_size
        sid = escape(str(lay.hseq))
        notes = [
            f"token {p} of seq {sid}: logical block {p} // {bsz} = {w['logical']}, offset {p} % {bsz} = {w['offset']}",
            f"block table of seq {sid}, entry {w['logical']}: physical block {w['block']}",
            f"slot = {w['block']} · {bsz} + {w['offset']} = {w['slot']}",
        ]
    note_svg = "".join(
        f'<text class="worked-note" x="{lay.x_log}" y="{fmt(y + 14 + 16 * k)}" font-size="12"'
        f' fill="{WORKED_COLOR if k == len(notes) - 1 else TEXT_COLOR}">{escape(t)}</text>'
        for k, t in enumerate(notes)
    )
    return note_svg, 16 * len(notes) + (10 if notes else 0)


def render_block_tables(snapshot: PoolSnapshot, *, highlight: tuple | None = None, title: str = "") -> str:
    """Logical blocks, block tables and physical blocks of every sequence, with one slot worked out.

    Args:
        snapshot: the pool and block tables to draw (keep it small: a few sequences, up to ~12 blocks).
        highlight: ``(seq_id, position)``: trace that token through its table and write out its slot.
        title: a caption above the picture.
    """
    snap = snapshot
    worked = worked_slot(snap, *highlight) if highlight is not None else None
    hseq, hpos = highlight if highlight is not None else (None, None)
    lay = _Layout(snap, worked, hseq, hpos, top=44 if title else 26)
    parts, table_rows, left_h = _sequences(lay)
    physical, arrows = _physical(lay, table_rows)
    height = max(left_h, lay.top + snap.num_blocks * ROW) + 12
    width = lay.x_phys + lay.block_w + 90
    note_svg, notes_h = _worked_notes(lay, height)
    height += notes_h
    extra = f' data-slot="{worked["slot"]}"' if worked is not None else ""
    head = [
        svg_open("minipaged-blocktables", width, height, snap.step, extra),
        '<defs><marker id="bt-arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7"'
        ' markerUnits="userSpaceOnUse" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker></defs>',
    ]
    if title:
        head.append(f'<text class="caption" x="{lay.x_log}" y="16" font-size="13" fill="{TEXT_COLOR}">'
                    f"{escape(title)}</text>")
    return "".join([*head, *parts, *physical, '<g class="arrows">', *arrows, "</g>", note_svg, "</svg>"])
