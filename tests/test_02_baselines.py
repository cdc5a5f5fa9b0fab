"""Contiguous baselines: max reservation and grow-in-place over a first-fit slot arena."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.contiguous import GrowInPlace, MaxReservation, PagedPool

pytestmark = pytest.mark.ch02


def check_arena(arena):
    taken = [0] * arena.capacity
    for e in arena.extents.values():
        for s in range(e.start, e.start + e.reserved):
            assert taken[s] == 0, f"slot {s} is in two extents"
            taken[s] = 1
        assert e.num_tokens <= e.reserved
    assert bytes(taken) == bytes(arena.taken)
    assert 0.0 <= arena.external_fragmentation <= 1.0


def test_max_reservation_fits_capacity_over_max_len_sequences():
    arena = MaxReservation(100, max_len=30)
    assert all(arena.admit(i, 5) for i in range(3))
    assert not arena.admit(3, 1), "90 of 100 slots are reserved: a 4th sequence cannot fit"
    assert arena.failed_admissions == 1
    assert (arena.num_tokens, arena.reserved_slots) == (15, 90)
    for _ in range(25):
        assert arena.grow(0)
    with pytest.raises(ValueError, match="already holds max_len=30"):
        arena.grow(0)
    arena.release(1)
    assert arena.admit(3, 1) and arena.extents[3].start == 30  # first fit reuses the hole
    assert arena.relocations == 0
    # The 10 slots past the last whole reservation can never hold a sequence.
    assert arena.free_slots == 10 and arena.external_fragmentation == 1.0
    with pytest.raises(ValueError, match="exceeds max_len"):
        arena.admit(9, 31)


def test_grow_in_place_relocates_when_the_next_slot_is_taken():
    arena = GrowInPlace(20)
    assert arena.admit("a", 4) and arena.admit("b", 3)  # a: 0-3, b: 4-6
    assert arena.grow("b")  # slot 7 is free: in place
    assert arena.extents["b"].start == 4 and arena.relocations == 0
    assert arena.grow("a")  # slot 4 is b's: move a (4 tokens) to 8-12
    assert arena.extents["a"].start == 8 and arena.extents["a"].reserved == 5
    assert (arena.relocations, arena.slots_moved) == (1, 4)
    check_arena(arena)


def test_grow_in_place_fails_on_external_fragmentation_and_keeps_state():
    arena = GrowInPlace(12)
    for i in range(6):
        assert arena.admit(i, 2)  # i holds slots 2i, 2i+1
    arena.release(0)
    arena.release(5)  # free: 0-1 and 10-11, four slots in two runs
    assert arena.free_slots == 4 and arena.largest_free_run == 2
    assert arena.external_fragmentation == pytest.approx(0.5)
    assert arena.unusable_free(3) == 1.0 and arena.unusable_free(2) == 0.0
    assert not arena.admit("big", 3), "4 slots are free, but no 3 in a row"
    before = (bytes(arena.taken), {k: (e.start, e.reserved) for k, e in arena.extents.items()})
    assert arena.grow(2) is False  # 4-5 is walled in by 1 and 3, and no free run of 3 exists
    assert before == (bytes(arena.taken), {k: (e.start, e.reserved) for k, e in arena.extents.items()})
    assert arena.grow(4) and arena.extents[4].start == 8  # slot 10 is free: in place
    assert arena.grow(1)  # slot 4 is taken; its own range plus 0-1 makes a run of 4: move down, overlapping
    assert arena.extents[1].start == 0 and (arena.relocations, arena.slots_moved) == (1, 2)
    check_arena(arena)


def test_admitting_twice_and_bad_sizes_are_errors():
    arena = GrowInPlace(8)
    arena.admit("a", 2)
    with pytest.raises(ValueError, match="already admitted"):
        arena.admit("a", 2)
    with pytest.raises(ValueError, match="num_tokens must be >= 1"):
        arena.admit("b", 0)
    with pytest.raises(ValueError, match="max_len must be in 1..8"):
        MaxReservation(8, 9)
    with pytest.raises(ValueError, match="num_slots must be >= 1"):
        GrowInPlace(0)
    with pytest.raises(TypeError, match="num_slots must be an int"):
        GrowInPlace(8.0)
    with pytest.raises(TypeError, match="max_len must be an int"):
        MaxReservation(8, 4.0)
    with pytest.raises(TypeError, match="num_tokens must be an int"):
        arena.admit("c", 2.0)
    pool = PagedPool(4, 2)
    pool.admit("a", 3)
    with pytest.raises(ValueError, match="already admitted"):
        pool.admit("a", 1)
    assert pool.capacity == 8 and pool.reserved_slots == 4


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "grow", "grow", "grow", "release"]), st.integers(0, 5),
                          st.integers(1, 6)), max_size=60))
def test_arena_extents_stay_disjoint_and_match_the_slot_map(operations):
    for arena in (GrowInPlace(32), MaxReservation(32, 8), PagedPool(8, 4)):
        for kind, seq, n in operations:
            live = seq in (arena.extents if hasattr(arena, "extents") else arena.tables)
            if kind == "admit" and not live:
                arena.admit(seq, n)
            elif kind == "grow" and live:
                if isinstance(arena, MaxReservation) and arena.extents[seq].num_tokens == 8:
                    continue
                tokens = arena.num_tokens
                assert arena.num_tokens == tokens + 1 if arena.grow(seq) else arena.num_tokens == tokens
            elif kind == "release" and live:
                arena.release(seq)
            if hasattr(arena, "extents"):
                check_arena(arena)
                if isinstance(arena, GrowInPlace):
                    assert arena.num_tokens == arena.reserved_slots, "grow-in-place holds no unfilled slot"
            else:
                assert arena.reserved_slots - arena.num_tokens < arena.allocator.block_size * max(arena.num_seqs, 1)
                assert arena.external_fragmentation == 0.0
        assert arena.reserved_slots <= arena.capacity
