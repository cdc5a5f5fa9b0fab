"""Chapter 03's figure: which physical slots each sequence's attention reads through its block table.

One pure renderer, a batch's ``block_tables`` and ``seq_lens`` in, a matplotlib figure out.
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure

from minipaged.block_math import blocks_needed
from minipaged.viz import style


@style.styled
def plot_reads(block_tables, seq_lens, num_blocks: int, block_size: int, names: Sequence[str]) -> Figure:
    """One row per sequence, one cell per physical slot, coloured by the logical position read there.

    A slot the sequence holds in its last block but has not written yet (tail waste) is grey; a slot
    it does not hold is white.

    Args:
        block_tables: ``int [num_seqs, max_blocks_per_seq]``, logical block -> physical block, as
            :func:`minipaged.blocks.block_tables_tensor` stacks them.
        seq_lens: ``[num_seqs]``, each sequence's context length (how many of its row's slots count).
        num_blocks: blocks in the pool (the figure's width is ``num_blocks * block_size`` slots).
        block_size: slots per block.
        names: one label per sequence.
    """
    import numpy as np

    lens = [int(n) for n in seq_lens]
    if len(names) != len(lens) or len(block_tables) != len(lens):
        raise ValueError(f"names, block_tables and seq_lens need one entry per sequence; got "
                         f"{len(names)}, {len(block_tables)} and {len(lens)}")
    width = num_blocks * block_size
    position = np.full((len(lens), width), np.nan)
    held = np.zeros((len(lens), width), dtype=bool)
    for s, n in enumerate(lens):
        for j in range(blocks_needed(n, block_size)):
            b = int(block_tables[s][j])
            held[s, b * block_size : (b + 1) * block_size] = True
        for pos in range(n):
            position[s, int(block_tables[s][pos // block_size]) * block_size + pos % block_size] = pos
    fig, ax = style.figure(figsize=(9, 0.45 * len(lens) + 1.6))
    ax.grid(False)
    ax.imshow(np.where(held & np.isnan(position), 0.0, np.nan), cmap="Greys", vmin=-1, vmax=3, aspect="auto")
    im = ax.imshow(position, cmap="viridis", aspect="auto")
    for b in range(1, num_blocks):
        ax.axvline(b * block_size - 0.5, color="black", lw=1)
    light = np.nanmax(position) / 2 if not np.all(np.isnan(position)) else 0
    for s in range(len(lens)):
        for slot in np.flatnonzero(~np.isnan(position[s])):
            pos = int(position[s, slot])
            ax.text(slot, s, pos, ha="center", va="center", fontsize=8, color="white" if pos < light else "black")
    ax.set_yticks(range(len(lens)), [f"seq {n}" for n in names])
    ax.set_xticks([b * block_size + (block_size - 1) / 2 for b in range(num_blocks)],
                  [f"block {b}" for b in range(num_blocks)])
    ax.set_xlabel("physical slots, grouped by block (grey: held by the sequence, not yet written: tail waste)")
    fig.colorbar(im, ax=ax, label="logical position")
    ax.set_title("Which physical slots each sequence's query reads")
    return fig
