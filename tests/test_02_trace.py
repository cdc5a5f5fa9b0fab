"""The trace simulator: a seeded trace, replayed step by step against all three allocators."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.trace import SYSTEMS, PoolStats, TraceSimulator, make_trace

pytestmark = pytest.mark.ch02


def test_trace_is_seeded_and_respects_its_bounds():
    a, b = make_trace(50, seed=3), make_trace(50, seed=3)
    assert a == b and a != make_trace(50, seed=4)
    assert [r.arrival for r in a] == sorted(r.arrival for r in a)
    assert all(16 <= r.prompt_len <= 128 and r.output_len >= 1 and r.prompt_len + r.output_len <= 512 for r in a)
    with pytest.raises(ValueError, match="prompt_min"):
        make_trace(prompt_min=0)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([0.1, 0.3, 1.0]), st.sampled_from([4, 16]))
def test_every_request_finishes_or_is_rejected_and_the_pools_end_empty(seed, rate, block_size):
    trace = make_trace(30, rate=rate, prompt_max=64, output_mean=40, max_len=128, seed=seed)
    sim = TraceSimulator(trace, num_slots=512, block_size=block_size, max_len=128, max_wait=20)
    history = sim.run()
    assert sim.done and sim.step() is False
    for name in SYSTEMS:
        last = history[-1][name]
        assert last.finished + last.rejected == len(trace)
        assert (last.running, last.waiting, last.reserved) == (0, 0, 0)
    assert sim.allocator.num_free == sim.allocator.num_blocks
    for row in history:
        paged, maxres, grow = row["paged"], row["max_reservation"], row["grow_in_place"]
        assert paged.internal_waste < block_size * max(paged.running, 1), "paged waste is only the tail blocks"
        assert paged.relocations == 0 and paged.external_fragmentation == 0.0
        assert maxres.running <= 512 // 128
        assert grow.internal_waste == 0
        assert all(s.reserved <= 512 for s in row.values())


def test_stepping_by_hand_equals_running_and_reset_replays():
    trace = make_trace(40, rate=0.3, seed=1)
    stepped = TraceSimulator(trace, num_slots=2048)
    steps = 0
    while stepped.step():
        steps += 1
        # The live view reads these between steps.
        assert set(stepped.tables) == {r.req_id for r in trace} & set(stepped.tables)
        assert stepped.allocator.num_used * 16 == stepped.history[-1]["paged"].reserved
    ran = TraceSimulator(trace, num_slots=2048)
    assert ran.run() == stepped.history
    assert len(stepped.history) == steps + 1
    first = stepped.history[:5]
    stepped.reset()
    assert stepped.history == [] and stepped.allocator.num_free == stepped.allocator.num_blocks
    for _ in range(5):
        stepped.step()
    assert stepped.history == first


def test_paging_serves_more_than_max_reservation_on_the_same_trace():
    sim = TraceSimulator(make_trace(120, rate=0.15, seed=0), num_slots=4096, block_size=16, max_len=512)
    sim.run()
    s = sim.summary()
    assert s["paged"]["rejected"] < s["max_reservation"]["rejected"]
    assert s["paged"]["mean running"] > s["max_reservation"]["mean running"]
    assert s["grow_in_place"]["relocations"] > 0 and s["grow_in_place"]["slots moved"] > 0
    assert s["paged"]["mean utilisation"] < 1.0, "tail blocks are not free: paging is not zero waste"
    assert isinstance(sim.history[0]["paged"], PoolStats)


def test_simulator_rejects_bad_arguments():
    with pytest.raises(ValueError, match="longer than max_len=64"):
        TraceSimulator(make_trace(5, max_len=512, seed=0), max_len=64)
    with pytest.raises(ValueError, match="must include 'paged'"):
        TraceSimulator(make_trace(5), systems=("grow_in_place",))
