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
program reads, side by side. :func:`prefill_programs` replays how one prefill launch over a mixed batch
gives each program its sequence and query tile (``_find_seq``), and :func:`render_prefill_grid` draws
it, with each program's rows as (query, query head).
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
        color = decode_color if name == "as_decode" else prefill_color
        parts += _prefill_panel(name, label, spans[name], totals[name], left + k * (panel + gap), top, cell, row,
                                color, seq_len, context_len, block_size)  # fmt: skip
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


def _prefill_panel(name: str, label: str, programs, total: int, x0: float, top: float, cell: float, row: float,
                   color: str, seq_len: int, context_len: int, block_size: int) -> list[str]:
    """One panel of :func:`render_prefill_reads`: its programs' reads, block boundaries and the chunk's start."""
    q_len = sum(len(queries) for queries, _ in programs)
    parts = [f'<text x="{fmt(x0)}" y="{fmt(top - 26)}" font-size="13" fill="{TEXT_COLOR}">{label}</text>',
             f'<text x="{fmt(x0)}" y="{fmt(top - 8)}" font-size="11" fill="#666666">'
             f"key position → ({total} key reads per KV head)</text>"]
    for queries, keys in programs:
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
    return parts


def prefill_programs(num_new_tokens, block_q: int) -> list[tuple[int, int, range]]:
    """Which sequence and query tile each program of one prefill launch serves, as the kernel finds them.

    The grid's first axis has ``sum(num_new_tokens) // block_q + num_seqs`` programs. Sequence ``i``'s
    tiles are the programs from ``query_start_loc[i] // block_q + i`` on, so program ``p`` belongs to the
    last sequence whose first program is ``<= p`` (``_find_seq``'s binary search), and it serves tile
    ``p`` minus that first program. The ``+ i`` leaves room for each sequence's partial last tile, so a
    sequence may get one program too many: that program's tile starts past the chunk, and it returns.

    Args:
        num_new_tokens: each sequence's query tokens in the launch (a chunk, 1 for a decode row, a prompt).
        block_q: queries per program (``query_tile(GROUP)[0]``).

    Returns:
        One ``(seq, q_tile, queries)`` per program, in program order: ``queries`` is the range of the
        sequence's query indices it serves, empty for a program that returns at once.

    Raises:
        TypeError, ValueError: a count that is not an int in range, or no sequence at all.
    """
    lens = [check_int(n, "num_new_tokens", minimum=1) for n in _as_list(num_new_tokens)]
    block_q = check_int(block_q, "block_q", minimum=1)
    if not lens:
        raise ValueError("num_new_tokens must name at least one sequence")
    starts = [sum(lens[:i]) for i in range(len(lens))]  # query_start_loc
    first = [start // block_q + i for i, start in enumerate(starts)]
    out = []
    for pid in range(sum(lens) // block_q + len(lens)):
        seq = max(i for i, f in enumerate(first) if f <= pid)
        q_tile = pid - first[seq]
        out.append((seq, q_tile, range(min(lens[seq], q_tile * block_q), min(lens[seq], (q_tile + 1) * block_q))))
    return out


def _grid_program(x: float, y: float, w: float, pid: int, seq: int, q_tile: int, queries: range, group: int,
                  block_q: int, block_m: int) -> list[str]:  # fmt: skip
    """One program's box: its id, what it serves, and a strip of its ``block_m`` rows (real, masked)."""
    color = seq_color(seq)
    empty = not queries
    look = (f'fill="{FREE_COLOR}" stroke="#999999" stroke-dasharray="4,3"' if empty
            else f'fill="{tint(color, 0.8)}" stroke="{color}"')
    box = f'<rect x="{fmt(x)}" y="{fmt(y)}" width="{fmt(w)}" height="58" rx="3" {look} stroke-width="1.5"/>'
    what = "empty: returns" if empty else f"seq {seq}, tile {q_tile}"
    served = "past the chunk" if empty else (f"query {queries.start}" if len(queries) == 1 else
                                             f"queries {queries.start}–{queries.stop - 1}")
    parts = [f'<g class="program" data-pid="{pid}" data-seq="{seq}" data-tile="{q_tile}"'
             f' data-queries="{len(queries)}">',
             box,
             f'<text x="{fmt(x + 5)}" y="{fmt(y + 14)}" font-size="11" font-weight="bold" fill="{TEXT_COLOR}">'
             f"program {pid}</text>",
             f'<text x="{fmt(x + 5)}" y="{fmt(y + 28)}" font-size="10" fill="{TEXT_COLOR}">{what}</text>',
             f'<text x="{fmt(x + 5)}" y="{fmt(y + 41)}" font-size="9" fill="#555555">{served}</text>']
    row_w = (w - 10) / block_m
    for r in range(block_m):  # row r: query q_tile·BLOCK_Q + r // GROUP, head kv_head·GROUP + r % GROUP
        real = r < block_q * group and q_tile * block_q + r // group < queries.stop
        fill = (color if r % group == 0 else tint(color, 0.45)) if real else "#dddddd"
        parts.append(f'<rect class="row{" real" if real else ""}" x="{fmt(x + 5 + r * row_w)}" y="{fmt(y + 46)}" '
                     f'width="{fmt(row_w)}" height="8" fill="{fill}"/>')
    parts.append("</g>")
    return parts


def render_prefill_grid(num_new_tokens, *, group: int, block_q: int, block_m: int, title: str | None = None) -> str:
    """An SVG of one prefill launch over a mixed batch: the packed queries, the programs, and their rows.

    Top, the batch's query tokens as the kernel gets them, packed one sequence after another. Under
    them, one box per program of the grid's first axis (:func:`prefill_programs`), joined to the
    queries it serves; a dashed box is a program whose tile starts past its chunk, which returns at
    once. Each box ends in a strip of its ``block_m`` rows: row ``r`` is query ``r // group`` of its
    tile and query head ``r % group`` of its KV head (dark, light), grey where the row is padding or
    past the chunk, masked. The second grid axis, the KV heads, repeats the picture per head.

    Args:
        num_new_tokens: as for :func:`prefill_programs`.
        group: query heads per KV head (GQA).
        block_q, block_m: the kernel's queries per program and rows per program (``query_tile(group)``).
        title: a line above the picture (default: the sizes).

    Returns:
        A deterministic ``<svg class="minipaged-prefill-grid">`` string.
    """
    group = check_int(group, "group", minimum=1)
    block_m = check_int(block_m, "block_m", minimum=1)
    programs = prefill_programs(num_new_tokens, block_q)
    if block_m < block_q * group:
        raise ValueError(f"block_m must hold block_q * group = {block_q * group} rows, got {block_m}")
    lens = [int(n) for n in _as_list(num_new_tokens)]
    num_tokens, box_w, pitch = sum(lens), 132.0, 140.0
    token_w = max(3.0, min(12.0, (len(programs) * pitch - 8) / num_tokens))
    left, strip_y, prog_y = 10.0, 58.0, 150.0
    width = left + max(len(programs) * pitch, num_tokens * token_w) + 10
    title = title or (f"one launch: grid ({num_tokens} // BLOCK_Q + {len(lens)} sequences, num_kv_heads) = "
                      f"({len(programs)}, num_kv_heads) · GROUP {group}, BLOCK_Q {block_q}, BLOCK_M {block_m}")
    parts = [svg_open("minipaged-prefill-grid", width, prog_y + 112, 0,
                      f' data-programs="{len(programs)}" data-empty="{sum(1 for *_, q in programs if not q)}"'),
             f'<text x="{left}" y="20" font-size="13" fill="{TEXT_COLOR}">{title}</text>',
             f'<text x="{left}" y="{fmt(strip_y - 8)}" font-size="11" fill="#666666">the packed query tokens '
             "(query_start_loc marks where each sequence starts)</text>"]
    start = 0
    for seq, n in enumerate(lens):  # the packed queries, one run per sequence
        x = left + start * token_w
        parts.append(f'<rect class="queries" data-seq="{seq}" x="{fmt(x)}" y="{fmt(strip_y)}" '
                     f'width="{fmt(n * token_w)}" height="18" fill="{tint(seq_color(seq), 0.3)}" stroke="#ffffff"/>'
                     f'<text x="{fmt(x + 2)}" y="{fmt(strip_y + 31)}" font-size="9" fill="{TEXT_COLOR}">'
                     f"{'seq ' + str(seq) if n * token_w >= 34 else seq}</text>")
        start += n
    starts = [sum(lens[:i]) for i in range(len(lens))]
    for pid, (seq, q_tile, queries) in enumerate(programs):
        x = left + pid * pitch
        if queries:  # a line from the queries it serves to the program
            mid = left + (starts[seq] + (queries.start + queries.stop) / 2) * token_w
            parts.append(f'<path class="serves" d="M{fmt(mid)},{fmt(strip_y + 36)} L{fmt(x + box_w / 2)},'
                         f'{fmt(prog_y - 2)}" stroke="{seq_color(seq)}" stroke-width="1.5" fill="none"/>')
        parts += _grid_program(x, prog_y, box_w, pid, seq, q_tile, queries, group, block_q, block_m)
    note_y = prog_y + 80
    for i, line in enumerate([
        f"the strip in a box is its {block_m} rows: row r is query tile·{block_q} + r // {group} and query head "
        f"kv_head·{group} + r % {group} (dark, light); grey rows are masked",
        "a dashed box has no queries left: each sequence gets room for a partial last tile, at most one program "
        "too many",
    ]):
        parts.append(f'<text x="{left}" y="{fmt(note_y + 15 * i)}" font-size="11" fill="{TEXT_COLOR}">{line}</text>')
    parts.append("</svg>")
    return "".join(parts)


__all__ = ["prefill_programs", "prefill_spans", "program_reads", "render_prefill_grid", "render_prefill_reads",
           "render_tile_loop"]
