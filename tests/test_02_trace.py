"""The trace simulator: a seeded workload, replayed step by step against all three allocators."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.trace import SYSTEMS, PoolStats, TraceSimulator
from minipaged.workload import Geometric, RequestSpec, Uniform, WorkloadPreset, make_workload

pytestmark = pytest.mark.ch02

SHORT = WorkloadPreset("short", Uniform(8, 64), Geometric(40, 1, 64))  # at most 128 tokens


def test_the_chapter_preset_keeps_every_request_within_512_tokens():
    trace = make_workload(300, 0.3, "tiny_geometric", seed=3)
    assert all(16 <= r.num_prompt_tokens <= 128 and 1 <= r.num_output_tokens <= 384 for r in trace)
    TraceSimulator(trace, num_blocks=256, block_size=16, max_len=512)  # no request is too long


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([0.1, 0.3, 1.0]), st.sampled_from([4, 16]))
def test_every_request_finishes_or_is_rejected_and_the_pools_end_empty(seed, rate, block_size):
    trace = make_workload(30, rate, SHORT, seed=seed)
    sim = TraceSimulator(trace, num_blocks=512 // block_size, block_size=block_size, max_len=128, max_wait=20)
    history = sim.run()
    assert sim.done and sim.step() is False
    for name in SYSTEMS:
        last = history[-1][name]
        assert last.finished + last.rejected == len(trace)
        assert (last.running, last.waiting, last.reserved) == (0, 0, 0)
    assert sim.allocator.num_free == sim.allocator.num_blocks
    for row in history:
        paged, maxres, grow = row["paged"], row["max_reservation"], row["grow_in_place"]
        assert paged.unfilled_slots < block_size * max(paged.running, 1), "paged waste is only the tail blocks"
        assert paged.relocations == 0 and paged.external_fragmentation == 0.0
        assert maxres.running <= 512 // 128
        assert grow.unfilled_slots == 0
        assert all(s.reserved <= 512 for s in row.values())


def test_arrivals_are_floored_to_steps():
    trace = [RequestSpec(0.0, 4, 2), RequestSpec(2.9, 4, 2), RequestSpec(3.0, 4, 2)]
    sim = TraceSimulator(trace, num_blocks=8, block_size=4, max_len=16)
    sim.run()
    running = sim.series("paged", "running")
    # request 0 runs at steps 0-1 (admitted at 0, two tokens); requests 1 and 2 both arrive at step 2 and 3
    assert running[:2] == [1, 1] and running[2] == 1 and running[3] == 2


def test_stepping_by_hand_equals_running_and_reset_replays():
    trace = make_workload(40, 0.3, "tiny_geometric", seed=1)
    stepped = TraceSimulator(trace, num_blocks=128)
    steps = 0
    while stepped.step():
        steps += 1
        # The live view reads these between steps: tables are keyed by seq_id, the request's index.
        assert set(stepped.tables) <= set(range(len(trace)))
        assert stepped.allocator.num_used * 16 == stepped.history[-1]["paged"].reserved
    ran = TraceSimulator(trace, num_blocks=128)
    assert ran.run() == stepped.history
    assert len(stepped.history) == steps + 1
    first = stepped.history[:5]
    stepped.reset()
    assert stepped.history == [] and stepped.allocator.num_free == stepped.allocator.num_blocks
    for _ in range(5):
        stepped.step()
    assert stepped.history == first


def test_paging_serves_more_than_max_reservation_on_the_same_trace():
    sim = TraceSimulator(make_workload(120, 0.15, "tiny_geometric", seed=0), num_blocks=256, block_size=16,
                         max_len=512)
    sim.run()
    s = sim.summary()
    assert s["paged"]["rejected"] < s["max_reservation"]["rejected"]
    assert s["paged"]["mean running"] > s["max_reservation"]["mean running"]
    assert s["grow_in_place"]["relocations"] > 0 and s["grow_in_place"]["slots moved"] > 0
    assert s["paged"]["mean utilisation"] < 1.0, "tail blocks are not free: paging is not zero waste"
    assert isinstance(sim.history[0]["paged"], PoolStats)


def test_contiguous_arenas_get_num_blocks_times_block_size_slots():
    sim = TraceSimulator(make_workload(5, math.inf, SHORT), num_blocks=20, block_size=8, max_len=128)
    assert {name: r.pool.capacity for name, r in sim.runs.items()} == dict.fromkeys(SYSTEMS, 160)


def test_simulator_rejects_bad_arguments():
    trace = make_workload(5, 1.0, "tiny_geometric", seed=0)
    with pytest.raises(ValueError, match="longer than max_len=64"):
        TraceSimulator(trace, max_len=64)
    with pytest.raises(ValueError, match="must include 'paged'"):
        TraceSimulator(trace, systems=("grow_in_place",))
    with pytest.raises(TypeError, match="num_blocks must be an int"):
        TraceSimulator(trace, num_blocks=256.0)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        TraceSimulator(trace, block_size=0)
    with pytest.raises(TypeError, match=r"trace\[0\] must be a RequestSpec"):
        TraceSimulator([(0, 4, 4)])
    with pytest.raises(ValueError, match="step_time must be > 0"):
        TraceSimulator(trace, step_time=0.0)
    with pytest.raises(TypeError, match="step_time must be a real number"):
        TraceSimulator(trace, step_time="1")


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 1_000), st.sampled_from([0.25, 0.5, 2.0, 4.0]))
def test_arrivals_are_seconds_and_step_time_maps_them_to_steps(seed, step_time):
    # The same trace on a clock step_time times as fast (each arrival scaled exactly) runs step for step alike.
    trace = make_workload(30, 0.3, SHORT, seed=seed)
    scaled = [RequestSpec(r.arrival_time * step_time, r.num_prompt_tokens, r.num_output_tokens) for r in trace]
    base = TraceSimulator(trace, num_blocks=32, block_size=8, max_len=128)
    fast = TraceSimulator(scaled, num_blocks=32, block_size=8, max_len=128, step_time=step_time)
    assert fast.run() == base.run()
    late = TraceSimulator([RequestSpec(2.5, 4, 2)], num_blocks=4, block_size=4, max_len=16, step_time=0.5)
    late.run()
    assert [row["paged"].running for row in late.history][:7] == [0, 0, 0, 0, 0, 1, 1]  # arrives at step 5
