"""SumLattice laws (associative, commutative, idempotent) and delta delivery that never double-counts."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.lattice.sum_lattice import Delta, SumLattice, merged_value

ROWS, DIM = 6, 3

update = st.tuples(
    st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=4),
    st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=DIM * 4, max_size=DIM * 4),
)
history = st.lists(st.tuples(st.integers(0, 3), update), max_size=12)  # (origin, update)


def build(events) -> SumLattice:
    lat = SumLattice.zeros(ROWS, DIM)
    for origin, (rows, flat) in events:
        values = np.array(flat[: len(rows) * DIM]).reshape(len(rows), DIM)
        lat.accept(origin, np.array(rows), values)
    return lat


def replica_of(events, keep: list[bool]) -> SumLattice:
    """A replica that saw a prefix of each origin's updates (origins accept in their own order)."""
    lat = SumLattice.zeros(ROWS, DIM)
    full = build(events)
    for origin, state in full.origins.items():
        upto = state.seq if keep[origin % len(keep)] else state.seq // 2
        delta = full.delta_since(origin, 0)
        lat.apply(Delta(origin, 0, delta.updates[:upto]))
    return lat


def same(a: SumLattice, b: SumLattice) -> bool:
    return a.version() == b.version() and np.array_equal(a.value(), b.value())


def merged(*lats: SumLattice) -> SumLattice:
    out = SumLattice.zeros(ROWS, DIM)
    for lat in lats:
        out.merge(lat)
    return out


@given(history, st.lists(st.booleans(), min_size=3, max_size=3), st.lists(st.booleans(), min_size=3, max_size=3))
@settings(max_examples=80)
def test_merge_is_associative_commutative_and_idempotent(events, keep_a, keep_b):
    a = replica_of(events, keep_a)
    b = replica_of(events, keep_b)
    c = replica_of(events, [not k for k in keep_a])
    ab_c = merged(merged(a, b), c)
    a_bc = merged(a, merged(b, c))
    assert same(ab_c, a_bc)
    assert same(merged(a, b), merged(b, a))
    assert same(merged(a, a), merged(a))
    assert same(ab_c, build(events))  # the join of all replicas holds every update once


@given(history, st.randoms(use_true_random=False))
@settings(max_examples=80)
def test_duplicated_reordered_redelivered_deltas_never_double_count(events, rnd):
    origin_state = build(events)
    deltas = []
    for origin in origin_state.origins:
        ups = origin_state.delta_since(origin, 0).updates
        for start in range(len(ups) + 1):  # every contiguous slice, each possibly delivered twice
            for stop in range(start, len(ups) + 1):
                deltas.append(Delta(origin, start, ups[start:stop]))
    deltas = deltas * 2
    rnd.shuffle(deltas)
    replica = SumLattice.zeros(ROWS, DIM)
    progress = True
    while progress:  # keep delivering; gaps resolve once the preceding updates land
        progress = sum(replica.apply(d) for d in deltas) > 0
    assert same(replica, origin_state)


def test_bit_identical_values_on_replicas_that_replayed_the_same_updates():
    rng = np.random.default_rng(0)
    a = SumLattice.zeros(50, 4)
    for origin in (2, 0, 1):
        for _ in range(30):
            a.accept(origin, rng.integers(0, 50, 7), rng.standard_normal((7, 4)) * 1e-3)
    b = SumLattice.zeros(50, 4)
    for origin in (1, 2, 0):  # a different arrival order across origins
        b.apply(a.delta_since(origin, 0))
    assert a.value().tobytes() == b.value().tobytes()


def test_retries_with_an_explicit_seq_are_ignored_and_gaps_refused():
    lat = SumLattice.zeros(4, 1)
    assert lat.accept(7, np.array([1]), np.ones((1, 1)), seq=1) is not None
    assert lat.accept(7, np.array([1]), np.ones((1, 1)), seq=1) is None  # a retry
    with pytest.raises(ValueError, match="arrived before"):
        lat.accept(7, np.array([1]), np.ones((1, 1)), seq=3)
    assert lat.value()[1, 0] == 1.0


def test_delta_since_falls_back_when_the_log_is_truncated():
    lat = SumLattice.zeros(4, 1)
    for _ in range(5):
        lat.accept(0, np.array([0]), np.ones((1, 1)))
    lat.truncate_log(0, 3)
    assert lat.delta_since(0, 3).to_seq == 5
    assert lat.delta_since(0, 1) is None
    assert lat.delta_since(0, 5).updates == ()


def test_readers_merge_per_origin_totals_from_several_replicas():
    full = SumLattice.zeros(3, 1)
    for origin in (0, 1):
        for _ in range(3):
            full.accept(origin, np.array([0, 2]), np.ones((2, 1)))
    stale = SumLattice.zeros(3, 1)
    stale.apply(full.delta_since(0, 0))  # knows origin 0 only
    other = SumLattice.zeros(3, 1)
    other.apply(full.delta_since(1, 0))  # knows origin 1 only
    rows = np.array([0, 1, 2])
    value, version = merged_value(np.zeros((3, 1)), [stale.totals(rows), other.totals(rows)])
    assert version == {0: 3, 1: 3}
    np.testing.assert_array_equal(value[:, 0], [6, 0, 6])


def test_a_reader_merging_two_replicas_at_one_version_takes_the_one_that_gave_up_nothing():
    """One replica gave up update 2 (only a peer taken for dead had it) and took 3; the other holds all
    three. Both stand at seq 3: the reader took whichever replied first, and read 4 for 7."""
    fuller, gapped = SumLattice.zeros(1, 1), SumLattice.zeros(1, 1)
    for seq, value in ((1, 1.0), (2, 2.0), (3, 4.0)):
        fuller.accept(0, np.array([0]), np.full((1, 1), value), seq=seq)
    gapped.accept(0, np.array([0]), np.ones((1, 1)), seq=1)
    gapped.accept(0, np.array([0]), np.full((1, 1), 4.0), seq=3, skip=True)
    rows = np.array([0])
    for replies in ([gapped.totals(rows), fuller.totals(rows)], [fuller.totals(rows), gapped.totals(rows)]):
        value, version = merged_value(np.zeros((1, 1)), replies)
        assert version == {0: 3} and value[0, 0] == 7.0


def test_a_state_lacking_an_update_is_filled_from_the_log_and_then_covers_the_other():
    a, b = SumLattice.zeros(2, 1), SumLattice.zeros(2, 1)
    a.accept(0, np.array([0]), np.ones((1, 1)), seq=1)
    a.accept(0, np.array([1]), np.full((1, 1), 3.0), seq=3, skip=True)  # a gave up 2
    b.accept(0, np.array([0]), np.ones((1, 1)), seq=1)
    b.accept(0, np.array([1]), np.full((1, 1), 2.0), seq=2)  # b lacks 3: neither covers the other
    assert a.gaps() == {0: (2,)} and not a.merge_state(0, 2, b.origins[0].total)
    (two,) = b.logged(0, (2,))
    assert a.fill(0, two) and not a.fill(0, two)  # once
    assert a.gaps() == {} and b.merge_state(0, 3, a.origins[0].total, ())
    np.testing.assert_array_equal(a.value(), b.value())
    np.testing.assert_array_equal(a.value()[:, 0], [1.0, 5.0])
    assert a.delta_since(0, 0) is not None  # the filled log leads up to the state again
