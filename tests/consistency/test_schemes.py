"""Each slice of a table under its own model, changed during training.

As in ``test_bounds``, each worker owns a counter and adds 1 to it every
iteration; here every counter lies in a slice of its own, so a read of counter
``k`` at clock ``c`` must see at least ``c - bound(k)``, where ``bound(k)`` is
the bound its reader holds slice ``k`` to at that moment. Counting, not
agreement, checks the bound.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import shoal
from shoal.api.consistency import Consistency, consistency_from_dict
from shoal.client.worker import Worker
from shoal.consistency.schemes import SliceSchemes
from shoal.wire import bodies
from tests.support.cluster import ThreadCluster

WORKERS = 3
LOOSE = shoal.SSP(4)

# ----------------------------------------------------------------- pure


def test_a_table_starts_uniform_and_names_no_model():
    schemes = SliceSchemes("t", shoal.SSP(2), 4)
    assert schemes.uniform and schemes.named(np.array([0, 3])) is None
    assert schemes.bounds.tolist() == [2, 2, 2, 2] and not schemes.eager.any()


def test_a_message_is_held_to_the_tightest_model_of_the_slices_it_reads():
    schemes = SliceSchemes("t", shoal.SSP(4), 4)
    assert schemes.set(shoal.BSP(), [1], "exact") == []
    assert schemes.set(shoal.ESSP(2, lazy=shoal.LazyPull(timeout_ms=5.0)), [2], "exact") == [2]
    assert not schemes.uniform
    assert schemes.named(np.array([0, 0, 3])) is None  # only slices under the table's own model
    assert consistency_from_dict(schemes.named(np.array([0, 1]))) == shoal.BSP()
    # the tightest bound, eager if any slice is, and the lazy buffer of one that has it
    assert consistency_from_dict(schemes.named(np.array([2, 3]))) == shoal.ESSP(2, lazy=shoal.LazyPull(timeout_ms=5.0))
    assert consistency_from_dict(schemes.named(np.array([1, 2]))) == shoal.ESSP(0, lazy=shoal.LazyPull(timeout_ms=5.0))
    assert schemes.bound_for(np.array([0, 3])) == 4 and schemes.bound_for(np.array([3, 1])) == 0
    assert schemes.set(shoal.SSP(4), None, "exact") == [2]  # back to one model: eager stops on slice 2
    assert schemes.uniform and schemes.named(np.array([1, 2])) is None


@pytest.mark.parametrize("default, model, slices, locking, message", [
    (shoal.ASP(), shoal.SSP(1), None, "exact", "read under ASP"),
    (shoal.SSP(1), shoal.ASP(), None, "exact", "must be shoal.BSP"),
    (shoal.SSP(1), shoal.ESSP(1), None, "hogwild", "locking='exact'"),
    (shoal.SSP(1), shoal.BSP(), [4], "exact", "0..3, got 4"),
    (shoal.SSP(1), shoal.BSP(), [True], "exact", "got True"),
    (shoal.SSP(1), shoal.BSP(), "01", "exact", "list of slice numbers"),
])
def test_a_change_that_cannot_be_made_is_refused_and_changes_nothing(default, model, slices, locking, message):
    schemes = SliceSchemes("t", default, 4)
    with pytest.raises(shoal.ConfigError, match=message):
        schemes.set(model, slices, locking)
    assert schemes.uniform and schemes.models == [default] * 4


# --------------------------------------------------------- on a cluster


def _counting(per_slice: dict[int, Consistency], switch_at: int | None = None,
              switch_to: dict[int, Consistency] | None = None, per_node: int = 1,
              iterations: int = 12, straggle_s: float = 0.03, table_model: Consistency = LOOSE
              ) -> list[dict]:
    """Every worker reads all counters each clock and checks each against its slice's bound then."""

    def body(w: Worker) -> dict:
        counters = w.table("counters", WORKERS, 1, consistency=table_model, slices=WORKERS)
        rows = w.table("rows", 600, 4, consistency=table_model, slices=WORKERS)
        models = dict.fromkeys(range(WORKERS), table_model)
        for s, model in per_slice.items():
            counters.set_consistency(model, [s])
            models[s] = model
        rng = np.random.default_rng(w.rank)
        violations, lag = [], {s: 0 for s in range(WORKERS)}
        for _ in range(iterations):
            if w.clock == switch_at:
                for s, model in (switch_to or {}).items():
                    counters.set_consistency(model, [s])
                    models[s] = model
            clock = w.clock
            seen = counters.pull(np.arange(WORKERS))[:, 0]
            for s in range(WORKERS):
                assert counters.consistency_of(s) == models[s]
                if seen[s] < clock - models[s].bound:
                    violations.append((clock, s, seen.tolist()))
                lag[s] = max(lag[s], clock - int(seen[s]))
            keys = rng.integers(0, 600, 50)
            rows.push(keys, np.full((50, 4), 0.01, np.float32))
            counters.push_async([w.rank], [[1.0]])  # in flight across the switch
            if w.rank == WORKERS - 1:
                time.sleep(straggle_s)
            w.advance_clock()
        counters.set_consistency(shoal.BSP())  # every update of the clocks before this one, exactly once
        final = counters.pull(np.arange(WORKERS))[:, 0]
        return {"violations": violations, "lag": lag, "final": final.tolist(), "counters": dict(counters.counters)}

    with ThreadCluster(nodes=WORKERS // per_node, workers_per_node=per_node) as cluster:
        return cluster.run_workers(body)


@pytest.mark.parametrize("per_node", [1, WORKERS], ids=["remote", "co-located"])
def test_each_slice_holds_its_own_bound_with_a_straggler(per_node):
    """Counter 2 (the straggler's) under BSP, counter 1 under SSP(1), counter 0 under the table's
    SSP(4): no read breaks its slice's bound, and the loose slice is read staler than the tight
    bounds allow (so the per-slice bounds are what held reads, not one tight bound for all)."""
    results = _counting({2: shoal.BSP(), 1: shoal.SSP(1)}, per_node=per_node, iterations=14, straggle_s=0.05)
    for result in results:
        assert result["violations"] == []
        assert result["final"] == [14.0, 14.0, 14.0]  # every acknowledged push counted once
    # The straggler's own counter lags for nobody but it; the fast workers ran ahead of it.
    assert max(r["lag"][2] for r in results[:2]) <= 1  # BSP: the straggler's last push is one clock back
    assert max(r["lag"][1] for r in results) <= 2


@pytest.mark.parametrize("per_node", [1, WORKERS], ids=["remote", "co-located"])
def test_a_bound_tightened_during_training_holds_from_the_change_on(per_node):
    """Every counter starts under SSP(4) and is tightened to BSP at clock 6, with pushes in flight:
    each read before the change is within 4 clocks, each after it within 0 (the straggler's
    counter included), and every push lands once."""
    every = dict.fromkeys(range(WORKERS), shoal.BSP())
    for result in _counting({}, switch_at=6, switch_to=every, per_node=per_node):
        assert result["violations"] == []
        assert result["final"] == [12.0, 12.0, 12.0]
        assert result["counters"]["scheme_changes"] == WORKERS + 1  # and one to BSP for the final count


def test_slices_switched_to_essp_and_back_keep_their_bound_and_are_pushed_eagerly():
    """SSP(2) tables whose slices switch to ESSP(2) at clock 4 and back at clock 9: the cached rows
    of switched slices are forgotten (a server vouches only for rows it knows are cached), servers
    push rows eagerly meanwhile, and no read breaks the bound."""
    every = dict.fromkeys(range(WORKERS), shoal.ESSP(2))
    results = _counting({}, switch_at=4, switch_to=every, iterations=9, table_model=shoal.SSP(2))
    for result in results:
        assert result["violations"] == []
        assert result["final"] == [9.0, 9.0, 9.0]
    assert sum(r["counters"].get("eager_messages", 0) for r in results) > 0
    back = dict.fromkeys(range(WORKERS), shoal.SSP(2))

    def back_and_forth() -> list[dict]:
        return _counting(every, switch_at=5, switch_to=back, iterations=10, table_model=shoal.SSP(2))

    for result in back_and_forth():
        assert result["violations"] == []
        assert result["final"] == [10.0, 10.0, 10.0]


def test_only_bounded_static_tables_choose_a_model_per_slice():
    with ThreadCluster(nodes=2) as cluster:
        w = cluster.worker(0)
        free = w.table("free", 8, 1, consistency=shoal.ASP())
        with pytest.raises(shoal.ConfigError, match="read under ASP"):
            free.set_consistency(shoal.SSP(1))
        replicated = w.table("copies", 8, 1, replicas=2)
        with pytest.raises(shoal.ConfigError, match="only static tables"):
            replicated.set_consistency(shoal.SSP(1))
        bounded = w.table("bounded", 8, 1, consistency=shoal.SSP(2))
        with pytest.raises(shoal.ConfigError, match="0..1, got 2"):
            bounded.consistency_of(2)
        assert bounded.consistency_of(1) == shoal.SSP(2)


def test_a_server_vouches_only_for_the_slices_a_worker_reads_under_essp():
    """A server's eager message says "rows of these slices not resent did not change", for the rows
    it knows the worker caches: those read under ESSP. A worker reading some slices under SSP
    caches rows of them the server does not track, so the message must not vouch for those."""
    with ThreadCluster(nodes=2) as c:
        reader, other = c.worker(0, local_access=False), c.worker(1)
        table = reader.table("mixed", 16, 1, consistency=shoal.ESSP(1), slices=2)
        other.table("mixed", 16, 1, consistency=shoal.ESSP(1), slices=2)
        table.set_consistency(shoal.SSP(1), [1])
        key = np.array([12])  # slice 1, on node 1
        table.pull(key)
        shard = int(table.layout.route(key)[1][0])
        cache = table.access.cache
        assert cache is not None and shard == 1
        before = int(cache.rows.versions(key, np.array([shard]))[0])
        msg = bodies.Rows([0, 1], 1, "a test's series", reader.streams.handled(1)).to_message(
            table="mixed", epoch=table.layout.epoch, clock=before + 5,
            arrays=[np.zeros(0, np.int64), np.zeros((0, 1), np.float32)])
        msg.sender = 1
        cache.on_server_rows(msg)
        assert cache.rows.versions(key, np.array([shard]))[0] == before  # not vouched for
        assert cache.rows.shard_version[0] == before + 5  # slice 0 is read under ESSP


def test_a_staleness_past_the_clock_range_is_refused_with_a_config_error_and_changes_nothing():
    """Clocks are int64 (an intent's clocks past 2**62 are refused with ConfigError). SSP(2**63) was
    accepted by ``shoal.SSP``, and ``set_consistency`` with it raised a bare OverflowError (the bound
    did not fit the per-slice int64 array) after the model list was already changed: ``consistency_of``
    reported SSP(2**63) while reads were still held to the old bound. Creating a table with it failed
    the same way, after every server and the rendezvous had created the table. A staleness above 2**62
    is a ConfigError now."""
    with ThreadCluster(nodes=1) as c:
        w0 = c.worker(0)
        t = w0.table("t", 8, 1, consistency=shoal.SSP(1), slices=2)
        with pytest.raises(shoal.ShoalError):
            t.set_consistency(shoal.SSP(2**63), [0])
        assert t.consistency_of(0) == shoal.SSP(1)
        with pytest.raises(shoal.ShoalError):
            w0.table("u", 8, 1, consistency=shoal.SSP(2**63))
