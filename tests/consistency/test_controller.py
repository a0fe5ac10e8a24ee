"""The synchronisation controller as a pure decision: clocks in, serve or hold out."""

from __future__ import annotations

import numpy as np
import pytest

from shoal.api.consistency import ASP, BSP, ESSP, SSP, LazyPull
from shoal.api.errors import ConfigError
from shoal.consistency.cache import RowCache
from shoal.consistency.clocks import FINISHED, ClockTable
from shoal.consistency.controller import ShardController
from shoal.consistency.staleness import StalenessHistogram


class FakeTime:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_clock_table_tracks_the_slowest_worker():
    clocks = ClockTable.fresh(3)
    assert not clocks.observe(0, 2)
    assert not clocks.observe(1, 1)
    assert clocks.observe(2, 5)  # now every worker is at >= 1
    assert clocks.slowest == 1
    assert not clocks.observe(1, 0)  # clocks never go back
    assert clocks.behind(2) == [1]
    assert clocks.finish(1) and clocks.slowest == 2
    assert clocks.clocks[1] == FINISHED


@pytest.mark.parametrize("model, bound", [(BSP(), 0), (SSP(1), 1), (SSP(3), 3), (ESSP(2), 2)])
def test_a_read_at_clock_c_waits_for_every_worker_to_reach_c_minus_bound(model, bound):
    clocks = ClockTable.fresh(2)
    ctl: ShardController[str] = ShardController(model, clocks)
    clocks.observe(0, 5)
    assert ctl.admit("read", 0, 5) is (bound >= 5)
    for slow in range(1, 6):
        clocks.observe(1, slow)
        released = ctl.release()
        assert released == (["read"] if slow == 5 - bound and bound < 5 else [])


def test_asp_never_holds():
    clocks = ClockTable.fresh(2)
    ctl: ShardController[str] = ShardController(ASP(), clocks)
    clocks.observe(0, 100)
    assert ctl.admit("read", 0, 100)


def test_held_pulls_come_back_in_arrival_order():
    clocks = ClockTable.fresh(2)
    ctl: ShardController[int] = ShardController(BSP(), clocks)
    clocks.observe(0, 3)
    for i in range(4):
        assert not ctl.admit(i, 0, 3)
    clocks.observe(1, 3)
    assert ctl.release() == [0, 1, 2, 3]
    assert ctl.waiting_for() == {}


def test_lazy_pull_waits_for_aggregation_then_pushes_then_timeout():
    now = FakeTime()
    clocks = ClockTable.fresh(2)
    ctl: ShardController[str] = ShardController(SSP(2, lazy=LazyPull(max_pushes=3, timeout_ms=50)), clocks, now)
    clocks.observe(0, 4)
    clocks.observe(1, 3)
    # The bound (slowest >= 2) is met, but worker 0 is ahead: its rows are about to change.
    assert not ctl.admit("a", 0, 4)
    assert ctl.stats.held_lazily == 1
    clocks.observe(1, 4)  # iteration 3 fully aggregated
    assert ctl.release() == ["a"] and ctl.stats.released_by_aggregation == 1

    clocks.observe(0, 5)
    assert not ctl.admit("b", 0, 5)
    for _ in range(2):
        ctl.on_push()
    assert ctl.release() == []
    ctl.on_push()
    assert ctl.release() == ["b"] and ctl.stats.released_by_pushes == 1

    clocks.observe(0, 6)
    assert not ctl.admit("c", 0, 6)
    assert ctl.next_deadline() == pytest.approx(100.05)
    now.t += 0.049
    assert ctl.release() == []
    now.t += 0.002
    assert ctl.release() == ["c"] and ctl.stats.released_by_timeout == 1


def test_lazy_wait_starts_when_the_bound_is_met():
    now = FakeTime()
    clocks = ClockTable.fresh(2)
    ctl: ShardController[str] = ShardController(SSP(1, lazy=LazyPull(timeout_ms=10)), clocks, now)
    clocks.observe(0, 5)
    assert not ctl.admit("x", 0, 5)  # needs slowest >= 4
    assert ctl.stats.held_by_bound == 1 and ctl.next_deadline() is None
    clocks.observe(1, 4)
    assert ctl.release() == [] and ctl.next_deadline() == pytest.approx(100.01)
    now.t += 0.02
    assert ctl.release() == ["x"]


def test_row_cache_versions_and_eager_bumps():
    cache = RowCache(10, 2, np.dtype(np.float32), num_shards=2)
    keys, shards = np.array([1, 7]), np.array([0, 1])
    np.testing.assert_array_equal(cache.versions(keys, shards), [-1, -1])
    cache.store(np.array([1, 7]), np.ones((2, 2), np.float32), 3, epoch=0, seen=5)
    cache.store(np.array([7]), np.zeros((1, 2), np.float32), 2, epoch=0, seen=4)  # older: ignored
    np.testing.assert_array_equal(cache.read(np.array([7])), 1.0)
    cache.bump([1], 6)
    np.testing.assert_array_equal(cache.versions(keys, shards), [3, 6])
    np.testing.assert_array_equal(cache.versions(np.array([8]), np.array([1])), [-1])  # never cached


def test_row_cache_keeps_the_most_recent_rows_and_the_larger_version():
    cache = RowCache(4, 1, np.dtype(np.float32), num_shards=1)
    key = np.array([2])
    cache.store(key, np.full((1, 1), 1.0, np.float32), 5, epoch=3, seen=10)
    # A reply the slice's previous owner sent before the move (a lower epoch) is older, whatever its clock.
    assert cache.store(key, np.full((1, 1), 9.0, np.float32), 8, epoch=2, seen=50).size == 0
    # A reply sent again from a server's memory of replies carries the seen it had then: older.
    assert cache.store(key, np.full((1, 1), 9.0, np.float32), 8, epoch=3, seen=9).size == 0
    # As recent: a reply does not replace what is held, rows a server pushed do (its bump relies on them).
    assert cache.store(key, np.full((1, 1), 9.0, np.float32), 8, epoch=3, seen=10).size == 0
    assert cache.store(key, np.full((1, 1), 2.0, np.float32), 4, epoch=3, seen=10, pushed=True).size == 1
    # Newer rows hold every update the older did: the larger version stands (a fenced server's may be lower).
    assert cache.version[2] == 5 and cache.read(key)[0, 0] == 2.0
    cache.add(np.array([2, 2]), np.ones((2, 1), np.float32), -0.5)  # this worker's own push, twice
    assert cache.read(key)[0, 0] == 1.0
    cache.drop(key)
    np.testing.assert_array_equal(cache.versions(key, np.array([0])), [-1])


def test_staleness_histogram_summary():
    h = StalenessHistogram()
    h.record(np.array([0, 0, 1, 3]))
    h.record(2, reads=4)
    assert h.total == 8 and h.max() == 3
    assert h.mean() == pytest.approx((1 + 3 + 8) / 8)
    assert h.as_dict()["counts"] == {"0": 2, "1": 1, "2": 4, "3": 1}


def test_asp_takes_no_lazy_pull_buffer():
    # It was taken, and held ASP reads of a worker ahead of the slowest for the buffer's whole timeout.
    with pytest.raises(ConfigError, match="ASP reads never wait"):
        ASP(lazy=LazyPull(timeout_ms=3000))
