"""Compiled kernels against plain numpy references."""

from __future__ import annotations

import ast
import subprocess
import sys
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from shoal.storage import kernels

rows_and_grads = st.integers(1, 50).flatmap(
    lambda n: st.tuples(
        arrays(np.int64, st.integers(0, 60), elements=st.integers(0, n - 1)),
        st.just(n),
    )
)


@given(rows_and_grads, st.integers(1, 5))
@settings(max_examples=60, deadline=None)
def test_add_rows_matches_np_add_at(case, dim):
    rows, n = case
    rng = np.random.default_rng(len(rows))
    grads = rng.standard_normal((len(rows), dim)).astype(np.float32)
    got = np.zeros((n, dim), np.float32)
    want = np.zeros((n, dim), np.float32)
    kernels.add_rows(got, rows, grads, -0.5)
    np.add.at(want, rows, -0.5 * grads)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@given(rows_and_grads, st.integers(1, 5))
@settings(max_examples=60, deadline=None)
def test_sum_duplicates_gives_distinct_sorted_rows_and_their_sums(case, dim):
    rows, n = case
    grads = np.arange(len(rows) * dim, dtype=np.float64).reshape(len(rows), dim)
    urows, sums = kernels.sum_duplicates(rows, grads)
    want_rows = np.unique(rows)
    np.testing.assert_array_equal(urows, want_rows)
    want = np.zeros((n, dim))
    np.add.at(want, rows, grads)
    np.testing.assert_allclose(sums, want[want_rows])


@given(arrays(np.int64, st.integers(0, 200), elements=st.integers(0, 4)))
def test_partition_by_owner_is_a_stable_grouping(owners):
    order, starts = kernels.partition_by_owner(owners, 5)
    assert sorted(order.tolist()) == list(range(len(owners)))
    for o in range(5):
        part = order[starts[o] : starts[o + 1]]
        assert (owners[part] == o).all()
        assert (np.diff(part) > 0).all()


@settings(max_examples=200, deadline=None)
@given(arrays(np.int64, st.integers(0, 30), elements=st.integers(-5, 40)),
       arrays(np.int64, st.integers(0, 30), elements=st.integers(-5, 40)))
def test_any_shared_says_what_isin_says(a, b):
    assert kernels.any_shared(a, b) == bool(np.isin(a, b).any()) == kernels.any_shared(b, a)


def test_any_shared_at_the_ends_of_the_shorter_and_beyond_them():
    few = np.array([7, 3, 11], np.int64)
    assert kernels.any_shared(few, np.arange(11, 1000, dtype=np.int64))  # the largest of the few
    assert kernels.any_shared(few, np.arange(-1000, 4, dtype=np.int64))  # the smallest
    assert not kernels.any_shared(few, np.array([0, 2, 4, 5, 6, 8, 12, 10**12], np.int64))
    assert not kernels.any_shared(np.empty(0, np.int64), few)


@given(arrays(np.int64, st.integers(0, 20), elements=st.integers(0, 19), unique=True), st.integers(0, 2**20))
def test_take_changes_returns_and_clears_exactly_the_changed_or_marked_rows(rows, seed):
    rng = np.random.default_rng(seed)
    changed = (rng.random(20) < 0.3).astype(np.uint8)
    base = rng.integers(-8, 8, (20, 3)).astype(np.float32)  # each row as of its last sync
    values = base + np.where(changed[:, None] == 1, rng.integers(-4, 4, (20, 3)), 0).astype(np.float32)
    values[np.flatnonzero(changed)[:1]] = base[np.flatnonzero(changed)[:1]]  # changed by zero: taken all the same
    marked = rng.random(len(rows)) < 0.2
    base_before, values_before, changed_before = base.copy(), values.copy(), changed.copy()
    want = rows[(changed_before[rows] == 1) | marked]
    taken, deltas, moved = kernels.take_changes(values, base, changed, _unpinned(20), _unpinned(20),
                                                np.zeros_like(values), rows, marked)
    np.testing.assert_array_equal(taken, want)
    np.testing.assert_array_equal(deltas, values_before[want] - base_before[want])
    assert moved == bool(deltas.any())  # a sync of rows changed by zero only refreshes
    np.testing.assert_array_equal(values, values_before)  # a sync leaves the replica's rows as they are
    np.testing.assert_array_equal(base[want], values[want])  # ... and sends each change once
    assert not changed[rows].any()
    kept = np.setdiff1d(np.arange(20), want)
    np.testing.assert_array_equal(base[kept], base_before[kept])
    untouched = np.setdiff1d(np.arange(20), rows)
    np.testing.assert_array_equal(changed[untouched], changed_before[untouched])


@given(arrays(np.int64, st.integers(0, 20), elements=st.integers(0, 19), unique=True), st.integers(0, 2**20))
def test_receive_replicas_takes_exactly_the_absent_rows_as_replicas_of_the_owners_rows(rows, seed):
    rng = np.random.default_rng(seed)
    presence = rng.choice([kernels.ABSENT, kernels.OWNED, kernels.REPLICA], 20).astype(np.uint8)
    values, base = rng.random((20, 3), dtype=np.float32), rng.random((20, 3), dtype=np.float32)
    owner_rows = rng.random((len(rows), 3), dtype=np.float32)
    presence_before, values_before, base_before = presence.copy(), values.copy(), base.copy()
    taken = np.empty(len(rows), np.int64)
    count = kernels.receive_replicas(values, base, presence, rows, owner_rows, taken)
    fresh = presence_before[rows] == kernels.ABSENT
    np.testing.assert_array_equal(taken[:count], rows[fresh])  # in the order they came
    np.testing.assert_array_equal(values[rows[fresh]], owner_rows[fresh])
    np.testing.assert_array_equal(base[rows[fresh]], owner_rows[fresh])  # no change made here yet
    assert (presence[rows[fresh]] == kernels.REPLICA).all()
    others = np.setdiff1d(np.arange(20), rows[fresh])  # rows here already (owned, or a replica): left alone
    np.testing.assert_array_equal(presence[others], presence_before[others])
    np.testing.assert_array_equal(values[others], values_before[others])
    np.testing.assert_array_equal(base[others], base_before[others])


@given(arrays(np.int64, st.integers(1, 20), elements=st.integers(0, 19), unique=True), st.integers(0, 2**20),
       st.booleans())
def test_add_owned_and_read_adds_and_reads_as_add_present_and_read_present_or_changes_nothing(rows, seed, usual):
    rng = np.random.default_rng(seed)
    presence = np.full(20, kernels.OWNED, np.uint8)
    waits = np.zeros(20, np.bool_)
    if not usual:  # one row is not owned here (absent, or a replica), or waits for a state
        odd = rows[rng.integers(len(rows))]
        if rng.random() < 0.5:
            presence[odd] = rng.choice([kernels.ABSENT, kernels.REPLICA])
        else:
            waits[odd] = True
    values = rng.integers(-8, 8, (20, 3)).astype(np.float32)
    pinned, arrived = (rng.random(20) < 0.3).astype(np.uint8), (rng.random(20) < 0.3).astype(np.uint8)
    incoming = rng.integers(-4, 4, (20, 3)).astype(np.float32)
    deltas = rng.integers(-4, 4, (len(rows), 3)).astype(np.float32)
    state = [a.copy() for a in (values, arrived, incoming)]
    out = np.zeros((len(rows), 3), np.float32)
    done = kernels.add_owned_and_read(values, presence, pinned, arrived, incoming, waits, rows, deltas, out)
    assert done == usual
    if not usual:  # nothing changed: the caller takes the long way
        for after, before in zip((values, arrived, incoming), state, strict=True):
            np.testing.assert_array_equal(after, before)
        return
    want_values, want_arrived, want_incoming = state
    kernels.add_present(want_values, np.zeros(20, np.uint8), presence, pinned, want_arrived, want_incoming, rows,
                        deltas, 1.0, np.empty(len(rows), np.int64))
    want_out = np.empty_like(out)
    kernels.read_present(want_values, presence, want_arrived, want_incoming, rows, want_out, np.empty(len(rows),
                                                                                                     np.int64))
    for got, want in zip((values, arrived, incoming, out), (want_values, want_arrived, want_incoming, want_out),
                         strict=True):
        np.testing.assert_array_equal(got, want)


def test_add_present_marks_the_replica_rows_it_changes_and_no_others():
    values = np.zeros((4, 2), np.float32)
    changed = np.zeros(4, np.uint8)
    presence = np.array([kernels.OWNED, kernels.REPLICA, kernels.ABSENT, kernels.REPLICA], np.uint8)
    absent_at = np.full(3, -1, np.int64)
    absent = kernels.add_present(values, changed, presence, _unpinned(4), _unpinned(4), np.zeros_like(values),
                                 np.array([0, 1, 2]), np.ones((3, 2), np.float32), 0.5, absent_at)
    assert absent == 1 and absent_at[0] == 2
    np.testing.assert_array_equal(changed, [0, 1, 0, 0])
    np.testing.assert_array_equal(values, [[0.5, 0.5], [0.5, 0.5], [0, 0], [0, 0]])


def test_read_present_gathers_present_rows_in_order_and_lists_the_absent_positions():
    values = np.arange(8, dtype=np.float32).reshape(4, 2)
    presence = np.array([kernels.OWNED, kernels.ABSENT, kernels.REPLICA, kernels.ABSENT], np.uint8)
    out = np.full((4, 2), -1, np.float32)
    absent_at = np.full(4, -1, np.int64)
    absent = kernels.read_present(values, presence, _unpinned(4), np.zeros_like(values), np.array([3, 2, 1, 0]), out,
                                  absent_at)
    assert absent == 2
    np.testing.assert_array_equal(absent_at[:absent], [0, 2])
    np.testing.assert_array_equal(out, [[-1, -1], [4, 5], [-1, -1], [0, 1]])


def test_gather_and_place_are_inverse_orders():
    src = np.arange(40, dtype=np.float32).reshape(10, 4)
    rows = np.array([9, 0, 5])
    out = np.empty((3, 4), np.float32)
    kernels.gather_rows(src, rows, out)
    np.testing.assert_array_equal(out, src[rows])
    back = np.zeros((3, 4), np.float32)
    kernels.place_rows(back, np.array([2, 0, 1]), out)
    np.testing.assert_array_equal(back, out[[1, 2, 0]])


def test_first_out_of_range_and_nonfinite_rows():
    assert kernels.first_out_of_range(np.array([0, 5, 9]), 10) == -1
    assert kernels.first_out_of_range(np.array([0, 10, -1]), 10) == 1
    vals = np.array([[1, 2], [np.nan, 0], [0, np.inf], [3, 4]], np.float32)
    np.testing.assert_array_equal(kernels.nonfinite_rows(vals), [False, True, True, False])


@given(arrays(np.float64, st.integers(1, 300), elements=st.sampled_from([0.0, 1e-9, 0.5, 1.0, 3.0, 1e6])))
@settings(max_examples=80, deadline=None)
def test_alias_table_holds_exactly_the_normalised_weights(weights):
    if not weights.sum() > 0:
        weights[0] = 1.0
    prob, alias = kernels.alias_table(weights)
    n = weights.shape[0]
    assert ((prob >= 0) & (prob <= 1 + 1e-12)).all() and ((alias >= 0) & (alias < n)).all()
    mass = prob.copy()  # each column keeps prob[k] for itself and gives the rest to alias[k]
    np.add.at(mass, alias, 1.0 - prob)
    np.testing.assert_allclose(mass / n, weights / weights.sum(), atol=1e-9)


def test_alias_draws_follow_the_weights_and_never_a_zero_weight_key():
    weights = np.array([0.0, 1.0, 2.0, 0.0, 5.0, 0.5])
    prob, alias = kernels.alias_table(weights)
    uniforms = (np.arange(600_000) + 0.5) / 600_000  # evenly spread: frequencies without sampling noise
    counts = np.bincount(kernels.alias_draw(prob, alias, uniforms), minlength=weights.shape[0])
    assert counts[0] == counts[3] == 0
    np.testing.assert_allclose(counts / counts.sum(), weights / weights.sum(), atol=1e-5)
    assert kernels.alias_draw(prob, alias, np.array([0.0, np.nextafter(1.0, 0.0)])).tolist()[1] < 6


def test_seeded_initialisation_depends_only_on_seed_and_key():
    keys = np.array([3, 1000, 7], dtype=np.int64)
    a = np.empty((3, 64))
    b = np.empty((1, 64))
    kernels.seeded_normal(np.uint64(42), keys, a, 0.0, 1.0)
    kernels.seeded_normal(np.uint64(42), keys[1:2], b, 0.0, 1.0)
    np.testing.assert_array_equal(a[1], b[0])
    big = np.empty((20000, 8))
    kernels.seeded_normal(np.uint64(1), np.arange(20000, dtype=np.int64), big, 0.0, 2.0)
    assert abs(big.mean()) < 0.03 and abs(big.std() - 2.0) < 0.03
    uni = np.empty((20000, 8))
    kernels.seeded_uniform(np.uint64(1), np.arange(20000, dtype=np.int64), uni, -1.0, 3.0)
    assert uni.min() >= -1.0 and uni.max() < 3.0 and abs(uni.mean() - 1.0) < 0.03


def test_any_nonfinite_finds_nan_and_inf_in_either_float_width():
    for dtype in (np.float32, np.float64):
        clean = np.random.default_rng(0).standard_normal((100, 7)).astype(dtype)
        assert not kernels.any_nonfinite(clean)
        for bad in (np.nan, np.inf, -np.inf):
            dirty = clean.copy()
            dirty[63, 5] = bad
            assert kernels.any_nonfinite(dirty)
    assert not kernels.any_nonfinite(np.array([[np.finfo(np.float32).max, -0.0, 1e-45]], np.float32))


def test_any_nonfinite_reads_vectors_blocks_and_strided_views_as_they_are():
    every_other = np.ones((10, 8), np.float32)
    every_other[3, 1] = np.nan
    assert not kernels.any_nonfinite(every_other[:, ::2])  # the NaN is not in this view
    assert kernels.any_nonfinite(every_other[:, 1::2])
    assert kernels.any_nonfinite(np.array([1.0, np.inf]))
    assert kernels.any_nonfinite(np.full((2, 3, 4), -np.inf, np.float32))
    assert not kernels.any_nonfinite(np.ones((0, 5), np.float32))


def test_initialisers_can_leave_trailing_columns_at_zero():
    from shoal.api.config import TableSpec
    from shoal.api.initializers import Normal
    from shoal.storage.initialize import fill_initial

    full = np.empty((5, 8), np.float32)
    part = np.empty((5, 8), np.float32)
    fill_initial(TableSpec("t", 5, 8, init=Normal(std=1.0)), np.arange(5), full)
    fill_initial(TableSpec("t", 5, 8, init=Normal(std=1.0, columns=3)), np.arange(5), part)
    assert (part[:, 3:] == 0).all() and (part[:, :3] != 0).all()


@pytest.mark.parametrize("init", ["uniform", "normal"])
def test_initialisers_can_leave_the_rows_of_later_keys_at_zero(init):
    """``keys=n``: the rows of keys below ``n`` drawn as without it, the others zero, in any key order
    (one table of two kinds of rows, as word2vec's input and output rows)."""
    from shoal.api.config import TableSpec
    from shoal.api.errors import ConfigError
    from shoal.api.initializers import Normal, Uniform, initializer_from_dict, initializer_to_dict
    from shoal.storage.initialize import fill_initial

    make = (lambda **kw: Uniform(-1.0, 1.0, **kw)) if init == "uniform" else (lambda **kw: Normal(std=1.0, **kw))
    keys = np.array([7, 2, 5, 0, 3, 6])
    full = np.empty((6, 4), np.float32)
    part = np.empty((6, 4), np.float32)
    fill_initial(TableSpec("t", 8, 4, init=make()), keys, full)
    fill_initial(TableSpec("t", 8, 4, init=make(keys=4, columns=2)), keys, part)
    below = keys < 4
    assert (part[~below] == 0).all()
    assert (part[below][:, :2] == full[below][:, :2]).all() and (part[below][:, :2] != 0).all()
    assert (part[:, 2:] == 0).all()
    assert initializer_from_dict(initializer_to_dict(make(keys=4))) == make(keys=4)
    for bad in (-1, 2.5, True):
        with pytest.raises(ConfigError, match="keys"):
            make(keys=bad)


def test_numba_loads_at_the_first_kernel_call_not_at_import():
    """The launcher, the servers and the workers import the kernels' modules; numba (about 1 s of a
    process's start with its first call) must wait for a kernel to run, and then kernels that call
    kernels (the seeded initialisers) must be compiled calls that give the same rows."""
    script = """
import sys
import numpy as np
import shoal.client.worker, shoal.launch.cli, shoal.launch.server_main
from shoal.storage import jit, kernels
from shoal.placement import kernels as routing
assert "numba" not in sys.modules and not jit.is_loaded()
out = np.zeros((3, 4))
kernels.seeded_normal(np.uint64(7), np.arange(3), out, 0.0, 1.0)
assert "numba" in sys.modules and jit.is_loaded()
assert type(kernels.seeded_normal).__name__ == "CPUDispatcher"  # the stand-in replaced by its compiled form
assert type(routing.range_locate).__name__ == "CPUDispatcher"
print(repr(out.tolist()))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    again = np.zeros((3, 4))
    kernels.seeded_normal(np.uint64(7), np.arange(3), again, 0.0, 1.0)
    assert ast.literal_eval(done.stdout.strip()) == again.tolist()


def test_the_first_kernel_call_does_not_import_scipy_linalg_but_blas_still_works():
    """numba checked for BLAS at its first compilation by importing scipy.linalg, 0.2-0.3 s of every
    process's first kernel call that no kernel of Shoal's needed."""
    pytest.importorskip("scipy")
    script = """
import sys
import numba
import numpy as np
from shoal.storage import kernels
kernels.gather_rows(np.zeros((4, 2), np.float32), np.arange(2), np.empty((2, 2), np.float32))
assert "scipy.linalg" not in sys.modules, "the first kernel call imported scipy.linalg"
dot = numba.njit(lambda a, b: np.dot(a, b))  # an application's kernel using BLAS
assert dot(np.ones((3, 3)), np.ones(3)).tolist() == [3.0, 3.0, 3.0]
assert "scipy.linalg" in sys.modules
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_pin_in_place_gives_each_present_row_not_held_elsewhere_and_marks_the_replicas_changed():
    presence = np.array([kernels.OWNED, kernels.REPLICA, kernels.ABSENT, kernels.REPLICA, kernels.OWNED], np.uint8)
    changed = np.zeros(5, np.uint8)
    pinned = np.array([0, 0, 0, 0, 1], np.uint8)  # row 4: another hold's, in place 1
    holds = np.array([0, 77, 0, 0], np.int64)
    arrived = np.array([1, 0, 0, 0, 1], np.uint8)  # row 0: a change beside it, from a hold that ended
    values = np.ones((5, 2), np.float32)
    incoming = np.full((5, 2), 2.0, np.float32)
    rows = np.array([1, 0, 2, 1, 3, 4])
    slots, absent_at = np.full(6, 99, np.int64), np.full(6, 99, np.int64)
    absent, replicas, hold = kernels.pin_in_place(values, presence, changed, pinned, holds, arrived, incoming, 5,
                                                  rows, slots, absent_at)
    assert (absent, replicas, hold) == (2, 3, 2)
    np.testing.assert_array_equal(holds, [0, 77, 5, 0])
    np.testing.assert_array_equal(absent_at[:absent], [2, 5])
    np.testing.assert_array_equal(slots, [1, 0, -1, 1, 3, -1])
    np.testing.assert_array_equal(pinned, [2, 2, 0, 2, 1])
    np.testing.assert_array_equal(changed, [0, 1, 0, 1, 0])  # written in place or not: synced next time
    np.testing.assert_array_equal(values[:, 0], [3, 1, 1, 1, 1])  # the kernel reads the row with what arrived
    np.testing.assert_array_equal(arrived, [0, 0, 0, 0, 1])  # another hold's row: left beside it
    kernels.release(pinned, holds, 2, slots)
    np.testing.assert_array_equal(pinned, [0, 0, 0, 0, 1])
    np.testing.assert_array_equal(holds, [0, 77, 0, 0])


def test_pin_in_place_pins_nothing_when_every_place_for_a_hold_is_taken():
    pinned, holds = np.zeros(2, np.uint8), np.array([0, 7, 8], np.int64)
    slots, absent_at = np.full(2, 99, np.int64), np.full(2, 99, np.int64)
    got = kernels.pin_in_place(np.zeros((2, 1), np.float32), np.ones(2, np.uint8), np.zeros(2, np.uint8), pinned,
                               holds, np.zeros(2, np.uint8), np.zeros((2, 1), np.float32), 5, np.arange(2), slots,
                               absent_at)
    assert got[2] == 0 and not pinned.any()
    np.testing.assert_array_equal(holds, [0, 7, 8])


def test_writes_to_a_held_row_wait_beside_it_are_read_with_it_and_go_in_with_its_next_write():
    presence = np.array([kernels.OWNED, kernels.REPLICA, kernels.OWNED], np.uint8)
    changed = np.zeros(3, np.uint8)
    pinned, holds, arrived = np.zeros(3, np.uint8), np.zeros(3, np.int64), np.zeros(3, np.uint8)
    values = np.ones((3, 2), np.float32)
    incoming = np.full((3, 2), np.nan, np.float32)  # never read where nothing arrived
    slots, absent_at = np.empty(2, np.int64), np.empty(2, np.int64)
    *_, hold = kernels.pin_in_place(values, presence, changed, pinned, holds, arrived, incoming, 9, np.array([0, 1]),
                                    slots, absent_at)
    values[[0, 1]] += 10.0  # the kernel's writes, with no lock
    kernels.add_present(values, changed, presence, pinned, arrived, incoming, np.array([0, 2, 0]),
                        np.ones((3, 2), np.float32), 1.0, absent_at)  # another writer: rows 0 (twice) and 2
    kernels.add_present(values, changed, presence, pinned, arrived, incoming, np.array([0]),
                        np.full((1, 2), 0.5, np.float32), 1.0, absent_at)
    np.testing.assert_array_equal(values, [[11, 11], [11, 11], [2, 2]])  # the held value untouched
    out = np.empty((3, 2), np.float32)
    kernels.read_present(values, presence, arrived, incoming, np.array([0, 1, 2]), out, absent_at)
    np.testing.assert_array_equal(out, [[13.5, 13.5], [11, 11], [2, 2]])
    kernels.release(pinned, holds, hold + 1, np.array([0, 1]))  # another hold lets go of nothing of this one
    np.testing.assert_array_equal(pinned, [hold, hold, 0])
    kernels.release(pinned, holds, hold, np.array([0, 1, -1, 0]))  # key 0 twice
    np.testing.assert_array_equal(pinned, 0)
    np.testing.assert_array_equal(values[0], [11, 11])  # letting go (with no lock) writes nothing but the pins
    kernels.read_present(values, presence, arrived, incoming, np.array([0, 1, 2]), out, absent_at)
    np.testing.assert_array_equal(out, [[13.5, 13.5], [11, 11], [2, 2]])  # let go: what arrived is still read
    kernels.add_present(values, changed, presence, pinned, arrived, incoming, np.array([0]),
                        np.ones((1, 2), np.float32), 1.0, absent_at)
    np.testing.assert_array_equal(values[0], [14.5, 14.5])  # the next write folded it in, once
    assert arrived[0] == 0


def test_a_sync_leaves_a_held_replica_marked_changed_and_folds_what_arrived_beside_a_let_go_one():
    base = np.zeros((2, 2), np.float32)
    values = np.ones((2, 2), np.float32)
    changed = np.ones(2, np.uint8)
    pinned, arrived = np.array([1, 0], np.uint8), np.array([0, 1], np.uint8)
    incoming = np.full((2, 2), 3.0, np.float32)  # row 1: a local push while it was held, now let go
    taken, deltas, _ = kernels.take_changes(values, base, changed, pinned, arrived, incoming, np.array([0, 1]),
                                            np.zeros(2, np.bool_))
    np.testing.assert_array_equal(deltas, [[1, 1], [4, 4]])
    np.testing.assert_array_equal(changed, [1, 0])  # the held row's kernel writes on: its rest goes next time
    np.testing.assert_array_equal(values[1], [4, 4])
    np.testing.assert_array_equal(arrived, [0, 0])
    np.testing.assert_array_equal(base, values)


def test_a_held_replica_takes_its_owners_answer_and_its_sync_beside_its_value():
    presence = np.array([kernels.REPLICA], np.uint8)
    base = np.full((1, 2), 5.0, np.float32)
    values = base + 1.0  # a change since the last sync
    changed = np.ones(1, np.uint8)
    pinned, holds, arrived = np.ones(1, np.uint8), np.array([0, 3], np.int64), np.zeros(1, np.uint8)
    incoming = np.zeros((1, 2), np.float32)
    taken, deltas, _ = kernels.take_changes(values, base, changed, pinned, arrived, incoming, np.array([0]),
                                            np.zeros(1, np.bool_))
    np.testing.assert_array_equal(deltas, [[1, 1]])
    values += 2.0  # the kernel writes on
    gone = np.empty(1, np.int64)
    went = kernels.apply_synced(values, base, changed, presence, pinned, arrived, incoming, np.array([0]),
                                np.full((1, 2), 20.0, np.float32), np.ones(1, np.uint8), gone)
    assert went == 0 and presence[0] == kernels.REPLICA  # a held replica does not go
    np.testing.assert_array_equal(values, [[8, 8]])  # left to the kernel
    np.testing.assert_array_equal(base, [[20, 20]])
    out = np.empty((1, 2), np.float32)
    kernels.read_present(values, presence, arrived, incoming, np.array([0]), out, gone)
    np.testing.assert_array_equal(out, [[22, 22]])  # the owner's row plus the change since the sync
    taken, deltas, _ = kernels.take_changes(values, base, changed, pinned, arrived, incoming, np.array([0]),
                                            np.ones(1, np.bool_))
    np.testing.assert_array_equal(deltas, [[2, 2]])
    kernels.receive_rows(values, base, changed, presence, pinned, arrived, incoming, np.array([0]),
                         np.full((1, 2), 30.0, np.float32))  # it comes to be owned here, still held
    assert presence[0] == kernels.OWNED and changed[0] == 0
    kernels.release(pinned, holds, 1, np.array([0]))
    assert kernels.fold_arrived(values, pinned, arrived, incoming) == 0
    np.testing.assert_array_equal(values, [[30, 30]])  # every change was sent in a sync before


def test_give_unheld_copies_and_lets_go_of_the_rows_not_held_and_keeps_the_held():
    values = np.arange(6, dtype=np.float32).reshape(3, 2)
    presence = np.full(3, kernels.OWNED, np.uint8)
    pinned, arrived = np.array([0, 1, 0], np.uint8), np.array([1, 1, 0], np.uint8)
    incoming = np.full((3, 2), 10.0, np.float32)
    out = np.zeros((3, 2), np.float32)
    kept_at = np.empty(3, np.int64)
    kept = kernels.give_unheld(values, presence, pinned, arrived, incoming, np.array([2, 1, 0]), out, kept_at)
    assert kept == 1 and kept_at[0] == 1
    np.testing.assert_array_equal(out[[0, 2]], [[4, 5], [10, 11]])  # row 0 with what arrived beside it
    np.testing.assert_array_equal(presence, [kernels.ABSENT, kernels.OWNED, kernels.ABSENT])
    np.testing.assert_array_equal(arrived, [0, 1, 0])  # nothing left beside a row that went


def test_a_hold_letting_go_without_the_lock_loses_no_write_of_a_writer_that_takes_it():
    """A hold pins under the row lock, writes with none and lets go with none, over and over, while a
    writer on another thread adds to the same rows under the lock (the server's path, which finds each
    row pinned or not): every add of either lands once. (A release that folded what arrived, racing
    the writer, lost or doubled an add in most runs of this test.)"""
    num_rows, dim, rounds, repeat = 256, 32, 4000, 8
    values = np.zeros((num_rows, dim), np.float32)
    incoming = np.zeros_like(values)
    presence = np.full(num_rows, kernels.OWNED, np.uint8)
    changed, pinned, arrived = (np.zeros(num_rows, np.uint8) for _ in range(3))
    holds = np.zeros(4, np.int64)
    rows = np.arange(num_rows, dtype=np.int64)
    lock = threading.Lock()
    ones = np.ones((repeat * num_rows, dim), np.float32)  # long kernels on both sides: they overlap more

    def holder() -> None:
        slots, absent_at = np.empty(num_rows, np.int64), np.empty(num_rows, np.int64)
        for _ in range(rounds):
            with lock:
                *_, hold = kernels.pin_in_place(values, presence, changed, pinned, holds, arrived, incoming, 1, rows,
                                                slots, absent_at)
            kernels.add_rows(values, np.tile(slots, repeat), ones, 1.0)  # no row is held elsewhere: all valid
            kernels.release(pinned, holds, hold, slots)

    def writer() -> None:
        absent_at = np.empty(repeat * num_rows, np.int64)
        for _ in range(rounds):
            with lock:
                kernels.add_present(values, changed, presence, pinned, arrived, incoming, np.tile(rows, repeat), ones,
                                    1.0, absent_at)

    threads = [threading.Thread(target=holder), threading.Thread(target=writer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    out = np.empty_like(values)
    kernels.read_present(values, presence, arrived, incoming, rows, out, np.empty(num_rows, np.int64))
    np.testing.assert_array_equal(out, np.full_like(out, 2 * repeat * rounds))
    assert kernels.fold_arrived(values, pinned, arrived, incoming) == 0
    np.testing.assert_array_equal(values, out)


def test_apply_synced_sets_replicas_to_the_owners_rows_plus_their_pending_change_and_drops_the_unchanged():
    base = np.array([[5, 5], [5, 5], [7, 7], [3, 3]], np.float32)  # the rows as the sync left
    values = base + np.array([[0, 0], [1, 1], [0, 0], [2, 2]], np.float32)  # changes made since
    changed = np.array([0, 1, 0, 0], np.uint8)
    presence = np.array([kernels.REPLICA, kernels.REPLICA, kernels.OWNED, kernels.REPLICA], np.uint8)
    owner_rows = np.array([[10, 10], [20, 20], [30, 30], [40, 40]], np.float32)
    drop = np.array([1, 1, 1, 0], np.uint8)
    gone = np.full(4, -1, np.int64)
    went = kernels.apply_synced(values, base, changed, presence, _unpinned(4), _unpinned(4), np.zeros_like(values),
                                np.array([0, 1, 2, 3]), owner_rows, drop, gone)
    # row 2 is owned here (no longer a replica): untouched; row 1 changed since: kept for the next sync
    np.testing.assert_array_equal(values, [[10, 10], [21, 21], [7, 7], [42, 42]])
    np.testing.assert_array_equal(base[[1, 3]], owner_rows[[1, 3]])  # what the next sync's change is counted from
    assert went == 1 and gone[0] == 0
    np.testing.assert_array_equal(presence, [kernels.ABSENT, kernels.REPLICA, kernels.OWNED, kernels.REPLICA])


def _unpinned(n: int) -> np.ndarray:
    return np.zeros(n, np.uint8)
