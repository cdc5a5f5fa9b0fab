"""Which program of a paged decode kernel reads which blocks: the grid and the tile loop, drawn (chapter 04).

A decode kernel's grid has one program per ``(sequence, KV head, split)``. Each program walks
its share of the sequence in tiles of ``tile`` tokens, and each tile loads the physical
blocks that the block table gives for the tile's tokens. :func:`program_reads` replays that
index arithmetic on the host, with the same formulas as
``minipaged.kernels.paged_attention._paged_decode_kernel`` (whole tiles per split); and
:func:`render_tile_loop` draws it as an SVG: one row per program, one frame per loop step,
and the pool underneath. Every KV head's program reads the same blocks (its own head's rows
of them), so a row stands for ``num_kv_heads`` programs.
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
            kernel's ``max(block_size, MIN_TILE)`` several.
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

    def step_width(step):
        return len(step) * CELL + 8

    rows_width = max((sum(step_width(s) + GAP for s in steps) for steps in reads.values()), default=0)
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
            parts.append(f'<rect x="{fmt(x)}" y="{fmt(y + 2)}" width="{fmt(step_width(step))}" height="{ROW - 4}" '
                         f'rx="4" fill="none" stroke="{color}" stroke-width="2"><title>step {k}</title></rect>')
            for i, block in enumerate(step):
                cx = x + 4 + i * CELL
                parts.append(f'<rect x="{fmt(cx + 1)}" y="{fmt(y + 6)}" width="{CELL - 2}" height="{ROW - 12}" '
                             f'fill="{tint(color, 0.55)}"/>')
                parts.append(f'<text x="{fmt(cx + CELL / 2)}" y="{fmt(y + 22)}" font-size="12" text-anchor="middle" '
                             f'fill="{TEXT_COLOR}">{block}</text>')
            x += step_width(step) + GAP
    parts.append(f'<text x="10" y="{fmt(pool_y + 20)}" font-size="13" fill="{TEXT_COLOR}">pool (block id)</text>')
    for block in range(num_blocks):
        cx = LABEL + block * CELL
        fill = tint(seq_color(reader[block]), 0.55) if block in reader else FREE_COLOR
        parts.append(f'<rect x="{fmt(cx + 1)}" y="{fmt(pool_y)}" width="{CELL - 2}" height="{CELL}" fill="{fill}" '
                     f'stroke="#999999" stroke-width="0.5"/>')
        parts.append(f'<text x="{fmt(cx + CELL / 2)}" y="{fmt(pool_y + 20)}" font-size="12" text-anchor="middle" '
                     f'fill="{TEXT_COLOR}">{block}</text>')
    legend_y = pool_y + CELL + 24
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
                 f"KV head: {len(reads)} rows × {num_kv_heads} KV heads = {len(reads) * num_kv_heads} programs</text>")
    parts.append("</svg>")
    return "".join(parts)


__all__ = ["program_reads", "render_tile_loop"]
