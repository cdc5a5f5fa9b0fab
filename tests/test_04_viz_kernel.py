"""Chapter 04's picture of the grid and the tile loop: program_reads replays the kernel's index arithmetic."""

import random
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.kernels import paged_decode_attention
from minipaged.kernels.paged_attention import KV_TILE
from minipaged.testing import make_paged_case
from minipaged.viz.kernel import prefill_programs, program_reads, render_prefill_grid, render_tile_loop

pytestmark = pytest.mark.ch04


def _cdiv(a, b):
    return -(-a // b)


@st.composite
def batches(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    seq_lens = draw(st.lists(st.integers(1, 80), min_size=1, max_size=4))
    width = max(_cdiv(n, block_size) for n in seq_lens) + draw(st.integers(0, 2))
    pool = list(range(len(seq_lens) * width))
    random.Random(draw(st.integers(0, 2**16))).shuffle(pool)
    tables = [pool[i * width : (i + 1) * width] for i in range(len(seq_lens))]
    tile = block_size * draw(st.sampled_from([1, 2, 4])) if draw(st.booleans()) else draw(st.integers(1, 40))
    return tables, seq_lens, block_size, tile, draw(st.integers(1, 6))


@settings(max_examples=200, deadline=None)
@given(batches())
def test_each_sequence_reads_its_own_blocks_in_order_split_into_whole_tiles(batch):
    tables, seq_lens, block_size, tile, num_splits = batch
    reads = program_reads(tables, seq_lens, block_size, tile, num_splits)
    assert list(reads) == [(s, p) for s in range(len(seq_lens)) for p in range(num_splits)]
    for seq, n in enumerate(seq_lens):
        owned = tables[seq][: _cdiv(n, block_size)]
        steps = [step for split in range(num_splits) for step in reads[seq, split]]
        assert len(steps) == _cdiv(n, tile)  # one loop step per tile, over all splits together
        assert all(len(reads[seq, split]) <= _cdiv(_cdiv(n, tile), num_splits) for split in range(num_splits))
        flat = [b for step in steps for b in step]
        if tile % block_size == 0:  # the kernel's case: a block never straddles two tiles
            assert flat == owned
        else:  # a straddling block is loaded by both of its tiles, nothing else repeats
            assert [b for i, b in enumerate(flat) if i == 0 or b != flat[i - 1]] == owned
        assert all(0 < len(step) <= _cdiv(tile, block_size) + 1 for step in steps)
        non_empty = [bool(reads[seq, split]) for split in range(num_splits)]
        assert non_empty == sorted(non_empty, reverse=True)  # only the last splits can be empty


def test_matches_the_kernel_a_block_it_says_nobody_reads_can_hold_nan():
    case = make_paged_case([150, 40, 100], block_size=16, num_heads=2, num_kv_heads=1, head_dim=16, spare_blocks=3)
    reads = program_reads(case.block_tables, case.seq_lens, 16, KV_TILE, num_splits=2)
    read = {b for steps in reads.values() for step in steps for b in step}
    assert torch.isnan(case.k_cache[sorted(set(range(case.k_cache.shape[0])) - read)]).all()
    out = paged_decode_attention(*case.decode_args, num_splits=2)
    assert torch.allclose(out, case.reference(), atol=1e-5)
    poisoned = case.k_cache.clone()
    poisoned[int(reads[2, 1][0][0])] = float("nan")  # a block the replay says split 1 of sequence 2 reads
    out = paged_decode_attention(case.q, poisoned, case.v_cache, case.block_tables, case.seq_lens, num_splits=2)
    assert out[2].isnan().all() and not out[:2].isnan().any()


def test_bad_arguments_name_themselves():
    tables, lens = [[0, 1], [2, 3]], [5, 8]
    with pytest.raises(TypeError, match="block_size"):
        program_reads(tables, lens, 4.0, 4)
    with pytest.raises(ValueError, match="tile"):
        program_reads(tables, lens, 4, 0)
    with pytest.raises(ValueError, match="num_splits"):
        program_reads(tables, lens, 4, 4, num_splits=0)
    with pytest.raises(ValueError, match="seq_lens"):
        program_reads(tables, [5], 4, 4)
    with pytest.raises(ValueError, match="seq_lens"):
        program_reads(tables, [0, 8], 4, 4)
    with pytest.raises(IndexError, match=r"seq_lens\[1\] = 9"):
        program_reads(tables, [5, 9], 4, 4)
    with pytest.raises(IndexError, match="pool of 3 blocks"):
        render_tile_loop(tables, lens, block_size=4, tile=4, num_blocks=3)
    with pytest.raises(TypeError, match="num_kv_heads"):
        render_tile_loop(tables, lens, block_size=4, tile=4, num_blocks=4, num_kv_heads=True)


def test_render_draws_every_block_each_program_reads_and_the_empty_split():
    tables, lens = torch.tensor([[7, 2, 5], [0, 3, 9]], dtype=torch.int32), torch.tensor([10, 3])
    svg = render_tile_loop(tables, lens, block_size=4, tile=4, num_blocks=10, num_splits=2, num_kv_heads=3)
    assert svg == render_tile_loop(tables, lens, block_size=4, tile=4, num_blocks=10, num_splits=2, num_kv_heads=3)
    assert svg.startswith("<svg") and svg.endswith("</svg>")
    assert 'data-programs="12"' in svg  # 2 seqs x 2 splits x 3 KV heads
    assert svg.count("<title>step") == 4  # seq 0: 3 tiles in splits of 2 and 1; seq 1: 1 tile
    assert "no tiles" in svg  # seq 1's second split
    cells = re.findall(r'text-anchor="middle" fill="#222222">(\d+)</text>', svg)
    assert cells[:4] == ["7", "2", "5", "0"]  # the steps' blocks, in program order, then the pool 0..9
    assert cells[4:] == [str(b) for b in range(10)]


# ---- prefill: which program reads which keys -----------------------------------------------


@settings(max_examples=100, deadline=None)
@given(seq_len=st.integers(1, 120), data=st.data(), group=st.sampled_from([1, 4, 5, 8, 64]))
def test_prefill_spans_cover_every_query_once_and_match_the_kernels_count(seq_len, data, group):
    from minipaged.kernels.prefill_attention import prefill_kv_tokens, query_tile
    from minipaged.viz.kernel import prefill_spans

    q_len = data.draw(st.integers(1, seq_len))
    block_q, _ = query_tile(group)
    spans = prefill_spans(seq_len, q_len, block_q)
    for programs in spans.values():
        assert [j for queries, _ in programs for j in queries] == list(range(q_len))  # each query once, in order
        for queries, keys in programs:  # a program reads up to its last query's position, and no further
            assert keys == seq_len - q_len + queries[-1] + 1
    totals = tuple(sum(keys for _, keys in spans[name]) for name in ("as_decode", "prefill"))
    assert totals == prefill_kv_tokens([seq_len], [q_len], group)


def test_render_prefill_reads_is_deterministic_and_states_the_totals():
    from minipaged.viz.kernel import render_prefill_reads

    svg = render_prefill_reads(40, 27, block_q=8, block_size=8)
    assert svg == render_prefill_reads(40, 27, block_q=8, block_size=8)
    assert 'data-as-decode="729"' in svg and 'data-prefill="127"' in svg  # 14+..+40 and 21+29+37+40
    assert svg.count("read once</title>") == 4  # one frame per query tile


@pytest.mark.parametrize("kwargs, error", [
    (dict(seq_len=5, q_len=6, block_q=2), ValueError), (dict(seq_len=5, q_len=0, block_q=2), ValueError),
    (dict(seq_len=5, q_len=2, block_q=1.5), TypeError),
])  # fmt: skip
def test_prefill_spans_rejects_bad_sizes(kwargs, error):
    from minipaged.viz.kernel import prefill_spans

    with pytest.raises(error):
        prefill_spans(**kwargs)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 70), min_size=1, max_size=6), st.sampled_from([1, 2, 4, 8, 16, 64]))
def test_prefill_programs_serve_every_query_exactly_once(lens, block_q):
    programs = prefill_programs(lens, block_q)
    assert len(programs) == sum(lens) // block_q + len(lens)  # the kernel's grid
    for seq, n in enumerate(lens):
        mine = [(t, q) for s, t, q in programs if s == seq]
        pids = [p for p, (s, _, _) in enumerate(programs) if s == seq]
        assert pids == list(range(pids[0], pids[0] + len(pids)))  # a sequence's programs are neighbours
        assert [t for t, _ in mine] == list(range(len(mine)))  # its tiles in order
        assert [j for _, q in mine for j in q] == list(range(n))  # every query once
        served = [q for _, q in mine if q]
        assert all(len(q) == block_q for q in served[:-1])  # whole tiles, then the partial last one
        assert len(served) == _cdiv(n, block_q) and len(mine) - len(served) in (0, 1)  # at most one to spare
        assert all(q for _, q in mine[: len(served)])  # the spare program, if any, comes last


def test_prefill_programs_of_the_chapters_batch_leave_two_programs_empty():
    # a chunk of 32, two decode rows, a prompt of 64, GROUP = 2 so BLOCK_Q = 32: 98 // 32 + 4 = 7 programs
    assert [(s, t, (q.start, q.stop)) for s, t, q in prefill_programs([32, 1, 1, 64], 32)] == [
        (0, 0, (0, 32)), (0, 1, (32, 32)), (1, 0, (0, 1)), (2, 0, (0, 1)),
        (3, 0, (0, 32)), (3, 1, (32, 64)), (3, 2, (64, 64))]
    with pytest.raises(ValueError, match="num_new_tokens"):
        prefill_programs([], 8)
    with pytest.raises(ValueError, match="num_new_tokens"):
        prefill_programs([3, 0], 8)


def test_prefill_grid_draws_each_program_and_its_rows():
    import xml.etree.ElementTree as ET

    lens, group, block_q, block_m = [27, 1, 1, 40], 2, 8, 16
    root = ET.fromstring(render_prefill_grid(lens, group=group, block_q=block_q, block_m=block_m))
    ns = "{http://www.w3.org/2000/svg}"
    boxes = [g for g in root.iter(ns + "g") if g.get("class") == "program"]
    programs = prefill_programs(lens, block_q)
    assert root.get("data-programs") == str(len(boxes)) == str(len(programs))
    assert root.get("data-empty") == str(sum(1 for *_, q in programs if not q))
    for g, (seq, q_tile, queries) in zip(boxes, programs, strict=True):
        assert (g.get("data-seq"), g.get("data-tile"), g.get("data-queries")) == (
            str(seq), str(q_tile), str(len(queries)))
        rows = [r for r in g.iter(ns + "rect") if "row" in r.get("class", "").split()]
        assert len(rows) == block_m
        assert sum("real" in r.get("class").split() for r in rows) == len(queries) * group
        dashed = g.find(ns + "rect").get("stroke-dasharray") is not None
        assert dashed == (not queries)
    with pytest.raises(ValueError, match="block_m"):
        render_prefill_grid(lens, group=4, block_q=8, block_m=16)
