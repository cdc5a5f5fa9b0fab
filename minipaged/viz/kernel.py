"""Which program of a paged attention kernel reads which blocks: the grid and the tile loop, drawn (chapter 04).

A decode kernel's grid has one program per ``(sequence, KV head, split)``. Each program walks
its share of the sequence in tiles of ``tile`` tokens, and each tile loads the physical
blocks that the block table gives for the tile's tokens. :func:`program_reads` replays that
index arithmetic on the host, with the same formulas as
``minipaged.kernels.paged_attention._paged_decode_kernel`` (whole tiles per split); and
:func:`render_tile_loop` draws it as an SVG: one row per program, one frame per loop step,
and the pool underneath. Every KV head's program reads the same blocks (its own head's rows
of them), so a row stands for ``num_kv_heads`` programs.

For prefill, :func:`prefill_spans` replays the two ways to run a chunk's queries, one decode
program per query or one prefill program per query tile (the formulas of
``minipaged.kernels.prefill_attention``), and :func:`render_prefill_reads` draws the keys each
program reads, side by side.
"""

from __future__ import annotations

from minipaged.validation import check_int
from minipaged.viz.svg import FREE_COLOR, TEXT_COLOR, fmt, seq_color, svg_open, tint

CELL = 30  # width of one block cell, px
ROW = 34  # height of one program row, px
LABEL = 150  # width of the row labels, px
GAP = 10  # space between two loop steps, px


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _as_list(x) -> list:
    return x.tolist() if hasattr(x, "tolist") else list(x)


def program_reads(block_tables, seq_lens, block_size: int, tile: int, num_splits: int = 1) -> dict:
    """The physical blocks each program loads, loop step by loop step.

    Args:
        block_tables: ``[num_seqs, max_blocks_per_seq]`` (a tensor or nested lists): logical
            block -> physical block. Entries past a sequence's blocks are never read.
        seq_lens: each sequence's context length in tokens (>= 1).
        block_size: tokens per block.
        tile: tokens per loop step; ``block_size`` reads one block per step, the production
            kernel's ``KV_TILE`` (64) several, or part of one.
        num_splits: split-KV ranges per sequence. A sequence of ``T`` tiles gives each split
            ``ceil(T / num_splits)`` whole tiles, so the last splits may get none.

    Returns:
        ``{(seq, split): [[physical block, ...] per loop step]}``, in grid order.

    Raises:
        TypeError, ValueError: a size that is not a positive int, a ``seq_lens`` entry below 1,
            or ``seq_lens`` and ``block_tables`` of different lengths.
        IndexError: a sequence longer than its row of ``block_tables`` can hold.
    """
    block_size = check_int(block_size, "block_size", minimum=1)
    tile = check_int(tile, "tile", minimum=1)
    num_splits = check_int(num_splits, "num_splits", minimum=1)
    tables = [[int(b) for b in row] for row in _as_list(block_tables)]
    lens = [check_int(n, "seq_lens[i]", minimum=1) for n in _as_list(seq_lens)]
    if len(lens) != len(tables):
        raise ValueError(f"seq_lens has {len(lens)} entries but block_tables has {len(tables)} rows")
    reads = {}
    for seq, (seq_len, table) in enumerate(zip(lens, tables)):
        if _cdiv(seq_len, block_size) > len(table):
            raise IndexError(f"seq_lens[{seq}] = {seq_len} needs {_cdiv(seq_len, block_size)} blocks, "
                             f"but block_tables has room for {len(table)}")
        tiles_per_split = _cdiv(_cdiv(seq_len, tile), num_splits)
        for split in range(num_splits):
            start = split * tiles_per_split * tile
            end = min(start + tiles_per_split * tile, seq_len)
            steps = []
            for tile_start in range(start, end, tile):
                logical = range(tile_start // block_size, _cdiv(min(tile_start + tile, end), block_size))
                steps.append([table[b] for b in logical])
            reads[seq, split] = steps
    return reads


def _step_width(step) -> int:
    """px of one loop step's frame: a cell per block it loads, plus a margin."""
    return len(step) * CELL + 8


def _program_rows(reads: dict, top: int, num_splits: int) -> list[str]:
    """One row per program (a sequence, or a split of it): a frame per loop step around the blocks it loads."""
    parts = []
    for row, ((seq, split), steps) in enumerate(reads.items()):
        y = top + row * ROW
        color = seq_color(seq)
        label = f"seq {seq}" + (f", split {split}" if num_splits > 1 else "")
        parts.append(f'<text x="10" y="{fmt(y + 21)}" font-size="13" fill="{TEXT_COLOR}">{label}</text>')
        if not steps:
            parts.append(f'<text x="{LABEL}" y="{fmt(y + 21)}" font-size="12" fill="#666666">'
                         "no tiles: skips the loop, stores m = −inf, l = 0</text>")
        x = LABEL
        for k, step in enumerate(steps):
            parts.append(f'<rect x="{fmt(x)}" y="{fmt(y + 2)}" width="{fmt(_step_width(step))}" height="{ROW - 4}" '
                         f'rx="4" fill="none" stroke="{color}" stroke-width="2"><title>step {k}</title></rect>')
            for i, block in enumerate(step):
                cx = x + 4 + i * CELL
                parts.append(f'<rect x="{fmt(cx + 1)}" y="{fmt(y + 6)}" width="{CELL - 2}" height="{ROW - 12}" '
                             f'fill="{tint(color, 0.55)}"/>')
                parts.append(f'<text x="{fmt(cx + CELL / 2)}" y="{fmt(y + 22)}" font-size="12" text-anchor="middle" '
                             f'fill="{TEXT_COLOR}">{block}</text>')
            x += _step_width(step) + GAP
    return parts


def _pool_strip(num_blocks: int, reader: dict, pool_y: float) -> list[str]:
    """The pool under the programs: each block tinted with the colour of the sequence that reads it."""
    parts = [f'<text x="10" y="{fmt(pool_y + 20)}" font-size="13" fill="{TEXT_COLOR}">pool (block id)</text>']
    for block in range(num_blocks):
        cx = LABEL + block * CELL
        fill = tint(seq_color(reader[block]), 0.55) if block in reader else FREE_COLOR
        parts.append(f'<rect x="{fmt(cx + 1)}" y="{fmt(pool_y)}" width="{CELL - 2}" height="{CELL}" fill="{fill}" '
                     f'stroke="#999999" stroke-width="0.5"/>')
        parts.append(f'<text x="{fmt(cx + CELL / 2)}" y="{fmt(pool_y + 20)}" font-size="12" text-anchor="middle" '
                     f'fill="{TEXT_COLOR}">{block}</text>')
    return parts


def _tile_legend(lens: list[int], legend_y: float, num_rows: int, num_kv_heads: int) -> list[str]:
    """The key: a swatch per sequence, one for unread blocks, and the programs count."""
    parts = []
    x = 10.0
    for seq, n in enumerate(lens):
        parts.append(f'<rect x="{fmt(x)}" y="{fmt(legend_y - 11)}" width="14" height="14" '
                     f'fill="{tint(seq_color(seq), 0.55)}" stroke="{seq_color(seq)}" stroke-width="2"/>')
        text = f"seq {seq}: {n} tokens"
        parts.append(f'<text x="{fmt(x + 20)}" y="{fmt(legend_y)}" font-size="12" fill="{TEXT_COLOR}">{text}</text>')
        x += 30 + 7.5 * len(text)
    parts.append(f'<rect x="{fmt(x)}" y="{fmt(legend_y - 11)}" width="14" height="14" fill="{FREE_COLOR}" '
                 'stroke="#999999" stroke-width="0.5"/>')
    parts.append(f'<text x="{fmt(x + 20)}" y="{fmt(legend_y)}" font-size="12" fill="{TEXT_COLOR}">owned by nobody: '
                 "never read</text>")
    parts.append(f'<text x="10" y="{fmt(legend_y + 24)}" font-size="12" fill="{TEXT_COLOR}">each row runs once per '
                 f"KV head: {num_rows} rows × {num_kv_heads} KV heads = {num_rows * num_kv_heads} programs</text>")
    return parts


def render_tile_loop(
    block_tables, seq_lens, *, block_size: int, tile: int, num_blocks: int, num_splits: int = 1,
    num_kv_heads: int = 1, title: str | None = None,
) -> str:
    """An SVG of the grid and the tile loop: for each program, the physical blocks of each loop step.

    Args:
        block_tables, seq_lens, block_size, tile, num_splits: as for :func:`program_reads`.
        num_blocks: blocks in the pool, drawn in a strip under the programs; a block is tinted
            with the colour of the sequence that reads it, grey when nobody does.
        num_kv_heads: KV heads; each row stands for that many programs (one per KV head).
        title: a line above the picture (default: the sizes).

    Returns:
        A deterministic ``<svg class="minipaged-tile-loop">`` string.
    """
    num_blocks = check_int(num_blocks, "num_blocks", minimum=1)
    num_kv_heads = check_int(num_kv_heads, "num_kv_heads", minimum=1)
    reads = program_reads(block_tables, seq_lens, block_size, tile, num_splits)
    lens = _as_list(seq_lens)
    reader = {}
    for (seq, _), steps in reads.items():
        for block in (b for step in steps for b in step):
            if not 0 <= block < num_blocks:
                raise IndexError(f"block_tables holds block {block}, outside a pool of {num_blocks} blocks")
            reader[block] = seq
    splits = f"{num_splits} split" + ("s" if num_splits > 1 else "")
    title = title or (f"grid ({len(lens)} seqs, {num_kv_heads} KV heads, {splits}) · "
                      f"block_size {block_size} · tile {tile} tokens per loop step")
    rows_width = max((sum(_step_width(s) + GAP for s in steps) for steps in reads.values()), default=0)
    width = LABEL + max(rows_width, num_blocks * CELL, 420) + 20
    top = 46
    pool_y = top + len(reads) * ROW + 30
    height = pool_y + CELL + 70
    parts = [
        svg_open("minipaged-tile-loop", width, height, 0, f' data-programs="{len(reads) * num_kv_heads}"'),
        f'<text x="10" y="20" font-size="14" fill="{TEXT_COLOR}">{title}</text>',
        f'<text x="10" y="{top - 8}" font-size="12" fill="{TEXT_COLOR}">program</text>',
        f'<text x="{LABEL}" y="{top - 8}" font-size="12" fill="{TEXT_COLOR}">'
        "loop steps → (each frame: the physical blocks one step loads)</text>",
    ]
    parts += _program_rows(reads, top, num_splits)
    parts += _pool_strip(num_blocks, reader, pool_y)
    parts += _tile_legend(lens, pool_y + CELL + 24, len(reads), num_kv_heads)
    parts.append("</svg>")
    return "".join(parts)


def prefill_spans(seq_len: int, q_len: int, block_q: int) -> dict:
    """The keys each program reads for one sequence's chunk, both ways.

    Args:
        seq_len: the context length after the chunk (>= 1).
        q_len: the chunk's queries, the last ``q_len`` positions (``1 <= q_len <= seq_len``).
        block_q: queries per program of the prefill kernel.

    Returns:
        ``{"as_decode": [(queries, keys)], "prefill": [(queries, keys)]}``: per program, the
        range of chunk queries it serves and the number of keys it reads (always a prefix
        ``0 .. keys - 1`` of the context). As decode, query ``j`` is its own program over
        ``context_len + j + 1`` keys; the prefill kernel's tile ``t`` serves queries
        ``t * block_q ..`` and reads up to its last query's position.

    Raises:
        TypeError, ValueError: a size that is not an int in range.
    """
    seq_len = check_int(seq_len, "seq_len", minimum=1)
    q_len = check_int(q_len, "q_len", minimum=1)
    block_q = check_int(block_q, "block_q", minimum=1)
    if q_len > seq_len:
        raise ValueError(f"q_len must be in 1..seq_len={seq_len}, got {q_len}")
    context_len = seq_len - q_len
    as_decode = [(range(j, j + 1), context_len + j + 1) for j in range(q_len)]
    prefill = [
        (range(t * block_q, min(q_len, (t + 1) * block_q)), min(seq_len, context_len + (t + 1) * block_q))
        for t in range(_cdiv(q_len, block_q))
    ]
    return {"as_decode": as_decode, "prefill": prefill}


def render_prefill_reads(seq_len: int, q_len: int, *, block_q: int, block_size: int, title: str | None = None) -> str:
    """An SVG of the keys each program reads for one chunk: one decode program per query, against query tiles.

    Both panels share the axes: one row per query of the chunk, one column per key position,
    block boundaries as vertical lines. Left, each query is its own program and reads its own
    prefix. Right, one program per tile of ``block_q`` queries reads its keys **once** for
    all of them (the frame); inside it the causal mask hides the keys after each query (light).

    Args:
        seq_len, q_len, block_q: as for :func:`prefill_spans`.
        block_size: tokens per block, for the boundaries.
        title: a line above the picture (default: the sizes).

    Returns:
        A deterministic ``<svg class="minipaged-prefill-reads">`` string.
    """
    block_size = check_int(block_size, "block_size", minimum=1)
    spans = prefill_spans(seq_len, q_len, block_q)
    context_len = seq_len - q_len
    cell = max(4.0, min(12.0, 420 / seq_len))  # px per key
    row = max(4.0, min(12.0, 320 / q_len))  # px per query
    panel = seq_len * cell
    left, top, gap = 70.0, 64.0, 60.0
    width = left + 2 * panel + gap + 20
    height = top + q_len * row + 84
    decode_color, prefill_color = seq_color(0), seq_color(1)
    totals = {name: sum(keys for _, keys in programs) for name, programs in spans.items()}
    title = title or (f"a chunk of {q_len} queries after {context_len} tokens · block_size {block_size} · "
                      f"BLOCK_Q {block_q}")
    parts = [
        svg_open("minipaged-prefill-reads", width, height, 0,
                 f' data-as-decode="{totals["as_decode"]}" data-prefill="{totals["prefill"]}"'),
        f'<text x="10" y="20" font-size="14" fill="{TEXT_COLOR}">{title}</text>',
    ]
    for k, (name, label) in enumerate([("as_decode", f"prefill as decode: {q_len} programs"),
                                       ("prefill", f"prefill kernel: {len(spans['prefill'])} programs")]):
        x0 = left + k * (panel + gap)
        parts.append(f'<text x="{fmt(x0)}" y="{fmt(top - 26)}" font-size="13" fill="{TEXT_COLOR}">{label}</text>')
        parts.append(f'<text x="{fmt(x0)}" y="{fmt(top - 8)}" font-size="11" fill="#666666">'
                     f"key position → ({totals[name]} key reads per KV head)</text>")
        color = decode_color if name == "as_decode" else prefill_color
        for queries, keys in spans[name]:
            y, h = top + queries.start * row, len(queries) * row - 1
            if name == "prefill":  # what the program loads: the frame, masked keys light
                parts.append(f'<rect x="{fmt(x0)}" y="{fmt(y)}" width="{fmt(keys * cell)}" height="{fmt(h)}" '
                             f'fill="{tint(color, 0.85)}"/>')
            for j in queries:  # each query's visible keys, solid
                visible = (context_len + j + 1) * cell
                parts.append(f'<rect x="{fmt(x0)}" y="{fmt(top + j * row)}" width="{fmt(visible)}" '
                             f'height="{fmt(row - 1)}" fill="{tint(color, 0.25)}"/>')
            if name == "prefill":
                parts.append(f'<rect x="{fmt(x0)}" y="{fmt(y)}" width="{fmt(keys * cell)}" height="{fmt(h)}" '
                             f'fill="none" stroke="{color}" stroke-width="1.5"><title>queries {queries.start}..'
                             f"{queries.stop - 1}: {keys} keys, read once</title></rect>")
        for b in range(0, seq_len + 1, block_size):  # block boundaries
            x = x0 + b * cell
            parts.append(f'<line x1="{fmt(x)}" y1="{fmt(top)}" x2="{fmt(x)}" y2="{fmt(top + q_len * row)}" '
                         'stroke="#999999" stroke-width="0.5"/>')
        x = x0 + context_len * cell  # where the chunk starts
        parts.append(f'<line x1="{fmt(x)}" y1="{fmt(top - 4)}" x2="{fmt(x)}" y2="{fmt(top + q_len * row + 4)}" '
                     'stroke="#222222" stroke-width="1" stroke-dasharray="3,2"/>')
    parts.append(f'<text x="10" y="{fmt(top + 10)}" font-size="11" fill="{TEXT_COLOR}">query 0</text>')
    parts.append(f'<text x="10" y="{fmt(top + q_len * row)}" font-size="11" fill="{TEXT_COLOR}">'
                 f"query {q_len - 1}</text>")
    legend_y = top + q_len * row + 28
    legend = [
        "solid: the keys a query sees (causal: up to its own position); left, each row is a program of its own",
        "frame: the keys one prefill program loads, once for all its queries (light: masked for some of them)",
        "dashed: the chunk's first position; grey: block boundaries (each key's block comes from the block table)",
    ]
    for i, line in enumerate(legend):
        parts.append(f'<text x="10" y="{fmt(legend_y + 18 * i)}" font-size="12" fill="{TEXT_COLOR}">{line}</text>')
    parts.append("</svg>")
    return "".join(parts)


__all__ = ["prefill_spans", "program_reads", "render_prefill_reads", "render_tile_loop"]
