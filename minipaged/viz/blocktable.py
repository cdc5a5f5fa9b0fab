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


def render_block_tables(snapshot: PoolSnapshot, *, highlight: tuple | None = None, title: str = "") -> str:
    """Logical blocks, block tables and physical blocks of every sequence, with one slot worked out.

    Args:
        snapshot: the pool and block tables to draw (keep it small: a few sequences, up to ~12 blocks).
        highlight: ``(seq_id, position)``: trace that token through its table and write out its slot.
        title: a caption above the picture.
    """
    snap, bsz = snapshot, snapshot.block_size
    worked = worked_slot(snap, *highlight) if highlight is not None else None
    hseq = highlight[0] if highlight is not None else None
    block_w = bsz * SLOT
    x_log, top = 12, 44 if title else 26
    x_tab = x_log + 62 + block_w + 56
    tab_w = 3 * 46
    x_phys = x_tab + tab_w + 90

    parts, arrows = [], []
    y = top
    table_rows = {}  # (seq, logical) -> y of that table row
    for seq_id, blocks in snap.tables.items():
        color, sid = seq_color(seq_id), escape(str(seq_id))
        n = snap.num_tokens[seq_id]
        parts.append(f'<g class="seq" data-seq="{sid}">'
                     f'<text x="{x_log}" y="{fmt(y + 12)}" font-size="12" font-weight="bold" fill="{TEXT_COLOR}">'
                     f'<tspan fill="{color}">■</tspan> seq {sid}: {n} tokens</text>')
        parts.append(f'<text x="{x_tab}" y="{fmt(y + 12)}" font-size="10" fill="#555">'
                     '<tspan>logical</tspan><tspan dx="12">physical</tspan><tspan dx="10">filled</tspan></text>')
        y += HEAD
        for i, b in enumerate(blocks):
            fill = snap.logical_fill(seq_id, i)
            parts.append(f'<text x="{x_log}" y="{fmt(y + SLOT / 2 + 4)}" font-size="10" fill="#555">block {i}</text>')
            for k in range(bsz):
                p = i * bsz + k
                is_worked = hseq == seq_id and worked is not None and p == highlight[1]
                parts.append(_slot_cell(x_log + 62 + k * SLOT, y, color, k < fill, str(p) if k < fill else "",
                                        f' data-seq="{sid}" data-pos="{p}"', is_worked))
            row_worked = hseq == seq_id and worked is not None and worked["logical"] == i
            stroke = f' stroke="{WORKED_COLOR}" stroke-width="2.5"' if row_worked else ' stroke="#999"'
            parts.append(
                f'<g class="table-row{" worked" if row_worked else ""}" data-seq="{sid}" data-logical="{i}"'
                f' data-block="{b}" data-filled="{fill}">'
                f'<rect x="{x_tab}" y="{fmt(y)}" width="{tab_w}" height="{SLOT}" fill="#ffffff"{stroke}/>'
                + "".join(f'<text x="{fmt(x_tab + 23 + j * 46)}" y="{fmt(y + SLOT / 2 + 4)}" text-anchor="middle"'
                          f' font-size="11" fill="{TEXT_COLOR}"{weight}>{v}</text>'
                          for j, (v, weight) in enumerate(((i, ""), (b, ' font-weight="bold"'), (fill, ""))))
                + "</g>"
            )
            table_rows[(seq_id, i)] = y
            y += ROW
        parts.append("</g>")
        y += 8
    left_h = y

    # physical blocks: every block of the pool, its slots labelled by the token they hold
    owner = {}
    for seq_id, blocks in snap.tables.items():
        for i, b in enumerate(blocks):
            owner[b] = (seq_id, i)
    parts.append(f'<text x="{x_phys}" y="{top - 6}" font-size="11" fill="#555">physical blocks (the pool)</text>')
    parts.append(f'<text x="{x_log}" y="{top - 6}" font-size="11" fill="#555">logical blocks (positions)</text>'
                 f'<text x="{x_tab}" y="{top - 6}" font-size="11" fill="#555">block tables</text>')
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
            is_worked = worked is not None and b == worked["block"] and k == worked["offset"]
            cell = _slot_cell(x_phys + k * SLOT, py, color, k < fill, label,
                              f' data-block="{b}" data-slot="{b * bsz + k}"', is_worked)
            if seq_id is None:
                cell = cell.replace('fill="#ffffff"', f'fill="{FREE_COLOR}"', 1)
            parts.append(cell)
        parts.append(f'<text x="{fmt(x_phys + block_w + 6)}" y="{fmt(py + SLOT / 2 + 4)}" font-size="9"'
                     f' fill="#555">slots {b * bsz}–{b * bsz + bsz - 1}</text>')
        if seq_id is not None:  # the table row that names this block points at it
            ty = table_rows[(seq_id, i)] + SLOT / 2
            x1, x2, y2 = x_tab + tab_w, x_phys - 20, py + SLOT / 2
            is_worked = worked is not None and b == worked["block"] and seq_id == hseq
            arrows.append(
                f'<path class="arrow{" worked" if is_worked else ""}" data-seq="{escape(str(seq_id))}"'
                f' data-block="{b}" d="M{fmt(x1)},{fmt(ty)} C{fmt(x1 + 40)},{fmt(ty)} {fmt(x2 - 40)},{fmt(y2)}'
                f' {fmt(x2)},{fmt(y2)}" fill="none" stroke="{WORKED_COLOR if is_worked else color}"'
                f' stroke-width="{2 if is_worked else 1.2}" marker-end="url(#bt-arrow)"/>'
            )
    right_h = top + snap.num_blocks * ROW
    height = max(left_h, right_h) + 12
    width = x_phys + block_w + 90

    notes = []
    if worked is not None:
        w, p = worked, highlight[1]
        sid = escape(str(hseq))
        notes = [
            f"token {p} of seq {sid}: logical block {p} // {bsz} = {w['logical']}, offset {p} % {bsz} = {w['offset']}",
            f"block table of seq {sid}, entry {w['logical']}: physical block {w['block']}",
            f"slot = {w['block']} · {bsz} + {w['offset']} = {w['slot']}",
        ]
    note_svg = "".join(
        f'<text class="worked-note" x="{x_log}" y="{fmt(height + 14 + 16 * k)}" font-size="12"'
        f' fill="{WORKED_COLOR if k == len(notes) - 1 else TEXT_COLOR}">{escape(t)}</text>'
        for k, t in enumerate(notes)
    )
    height += 16 * len(notes) + (10 if notes else 0)
    extra = f' data-slot="{worked["slot"]}"' if worked is not None else ""
    head = [
        svg_open("minipaged-blocktables", width, height, snap.step, extra),
        '<defs><marker id="bt-arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7"'
        ' markerUnits="userSpaceOnUse" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker></defs>',
    ]
    if title:
        head.append(f'<text class="caption" x="{x_log}" y="16" font-size="13" fill="{TEXT_COLOR}">'
                    f"{escape(title)}</text>")
    return "".join([*head, *parts, '<g class="arrows">', *arrows, "</g>", note_svg, "</svg>"])
