"""Chapter 03's reads figure: each slot read shows its logical position; held, unwritten slots are tail waste."""

import pytest
import torch

from minipaged.viz.reads import plot_reads

pytestmark = pytest.mark.ch03


def test_positions_land_in_the_slots_the_block_table_names():
    block_tables = torch.tensor([[0, 1, 5], [2, 3, 0], [4, 0, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([9, 7, 3])
    fig = plot_reads(block_tables, seq_lens, num_blocks=8, block_size=4, names="ABC")
    held, read = (im.get_array() for im in fig.axes[0].images)
    # A's token 8 is in block 5, offset 0 (slot 20); B's token 6 in block 3, offset 2 (slot 14)
    assert read[0, 20] == 8 and read[1, 14] == 6
    # A's last block holds slots 20..23: 21..23 are held but unwritten (tail waste), drawn grey
    assert [bool(read.mask[0, s]) for s in range(20, 24)] == [False, True, True, True]
    assert [held[0, s] == 0.0 for s in range(21, 24)] == [True, True, True]
    # a slot nobody holds is neither read nor grey
    assert bool(read.mask[0, 24]) and bool(held.mask[0, 24])
    assert int((~read.mask).sum()) == 9 + 7 + 3


def test_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="names"):
        plot_reads(torch.zeros(2, 1, dtype=torch.int32), torch.tensor([1, 1]), 2, 4, ["only one"])
