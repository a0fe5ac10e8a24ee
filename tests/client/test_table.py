"""Pull, push and push_pull through real servers (threads, in-process transport)."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

import shoal
from shoal.api.config import Limits, TableSpec, Timeouts
from shoal.client.ticks import TICK_QUIET_S
from shoal.storage.initialize import fill_initial
from shoal.transport.faulty import Faults, FaultyTransport
from shoal.transport.zmq_transport import ZmqTransport
from tests.support.cluster import ThreadCluster


@pytest.fixture
def cluster():
    with ThreadCluster(nodes=3) as c:
        yield c


def initial(spec: TableSpec, keys: np.ndarray) -> np.ndarray:
    out = np.empty((len(keys), spec.dim), dtype=spec.dtype)
    fill_initial(spec, keys, out)
    return out


@pytest.mark.parametrize("mapping", ["range", "hash", "round_robin"])
@pytest.mark.parametrize("local_access", [True, False])
def test_pull_returns_rows_in_caller_order_for_every_mapping(cluster, mapping, local_access):
    w = cluster.worker(0, local_access=local_access)
    t = w.table("emb", 1000, 8, init=shoal.Normal(std=1.0), mapping=mapping)
    keys = np.array([999, 0, 500, 3, 3, 777, 1])
    np.testing.assert_array_equal(t.pull(keys), initial(t.spec, keys))


def test_initial_values_do_not_depend_on_the_number_of_servers():
    spec_rows = []
    for nodes in (1, 2, 3):
        with ThreadCluster(nodes=nodes) as c:
            t = c.worker(0).table("emb", 500, 4, init=shoal.Uniform(-1, 1), mapping="hash")
            spec_rows.append(t.pull(np.arange(500)))
    np.testing.assert_array_equal(spec_rows[0], spec_rows[1])
    np.testing.assert_array_equal(spec_rows[0], spec_rows[2])


@pytest.mark.parametrize("local_access", [True, False])
def test_duplicate_keys_in_one_push_are_summed(cluster, local_access):
    w = cluster.worker(0, local_access=local_access)
    t = w.table("counts", 100, 2)
    keys = np.array([5, 5, 5, 60, 99, 60])
    t.push(keys, np.ones((6, 2), np.float32))
    got = t.pull(np.array([5, 60, 99, 0]))
    np.testing.assert_array_equal(got[:, 0], [3, 2, 1, 0])


def test_sgd_runs_where_the_rows_live(cluster):
    w = cluster.worker(0)
    t = w.table("w", 90, 3, init=shoal.Constant(1.0), optimizer=shoal.optim.SGD(lr=0.5))
    keys = np.array([0, 45, 89])  # one key on each node
    t.push(keys, np.full((3, 3), 2.0, np.float32))
    np.testing.assert_allclose(t.pull(keys), 0.0)


def test_adagrad_sums_duplicates_before_one_step(cluster):
    w = cluster.worker(0)
    opt = shoal.optim.Adagrad(lr=0.1, eps=1e-10)
    t = w.table("a", 10, 1, init=shoal.Constant(0.0), optimizer=opt)
    t.push(np.array([3, 3]), np.array([[1.0], [2.0]], np.float32))
    g = 3.0
    np.testing.assert_allclose(t.pull([3])[0, 0], -0.1 * g / np.sqrt(g * g), rtol=1e-6)


def test_adam_keeps_a_step_count_per_key(cluster):
    w = cluster.worker(0)
    opt = shoal.optim.Adam(lr=0.01)
    t = w.table("adam", 20, 2, optimizer=opt)
    for _ in range(3):
        t.push([1], np.ones((1, 2), np.float32))
    t.push([15], np.ones((1, 2), np.float32))
    # After one step with bias correction, Adam moves by ~lr whatever the gradient scale.
    np.testing.assert_allclose(t.pull([15])[0], -0.01, rtol=1e-3)
    np.testing.assert_allclose(t.pull([1])[0], -0.03, rtol=1e-3)


@pytest.mark.parametrize("local_access", [True, False])
def test_push_pull_returns_the_updated_rows(cluster, local_access):
    w = cluster.worker(0, local_access=local_access)
    t = w.table("pp", 300, 4)
    keys = np.array([299, 0, 150, 0])
    rows = t.push_pull(keys, np.ones((4, 4), np.float32))
    np.testing.assert_array_equal(rows[:, 0], [1, 2, 1, 2])


def test_async_calls_are_all_in_flight_before_waiting(cluster):
    w = cluster.worker(0, local_access=False)
    t = w.table("async", 1000, 4)
    keys = np.arange(1000)
    pushes = [t.push_async(keys, np.ones((1000, 4), np.float32)) for _ in range(5)]
    pull = t.pull_async(keys)
    assert all(isinstance(f, shoal.Future) for f in pushes)
    for f in pushes:
        assert f.wait() is None
    w.wait_all()
    np.testing.assert_array_equal(t.pull(keys), 5.0)
    assert pull.wait().shape == (1000, 4)


def test_pull_into_a_given_output_array(cluster):
    w = cluster.worker(0)
    t = w.table("out", 100, 3, init=shoal.Constant(2.0))
    out = np.zeros((4, 3), np.float32)
    assert t.pull([1, 50, 99, 2], out=out) is out
    np.testing.assert_array_equal(out, 2.0)
    with pytest.raises(shoal.ShapeError):
        t.pull([1, 2], out=np.zeros((3, 3), np.float32))


def test_batches_larger_than_the_message_limit_are_split():
    with ThreadCluster(nodes=2, limits=Limits(max_message_bytes=8192)) as c:
        w = c.worker(0, local_access=False)
        t = w.table("big", 5000, 16)
        keys = np.arange(5000)
        t.push(keys, np.ones((5000, 16), np.float32))  # ~320 KB, 40x the limit
        np.testing.assert_array_equal(t.pull(keys), 1.0)
        # Parts as large as the limit allows: a limit smaller than the room once kept for a header
        # used to send every key alone (10,000 requests, which ran into the request timeout when the
        # machine was busy).
        assert t.counters["requests"] < 300  # 56 keys a part (keys and a row each, twice, in 7,168 bytes)


def test_empty_batches_are_fine(cluster):
    w = cluster.worker(0)
    t = w.table("empty", 10, 2)
    assert t.pull(np.array([], dtype=np.int64)).shape == (0, 2)
    t.push(np.array([], dtype=np.int64), np.zeros((0, 2), np.float32))


@pytest.mark.parametrize("local_access", [True, False])
def test_bad_arguments_fail_with_typed_errors_and_change_nothing(cluster, local_access):
    w = cluster.worker(0, local_access=local_access)
    t = w.table("bad", 100, 2, init=shoal.Constant(1.0))
    with pytest.raises(shoal.KeyRangeError):
        t.pull([0, 100])
    with pytest.raises(shoal.KeyRangeError):
        t.push([-1], np.ones((1, 2), np.float32))
    with pytest.raises(shoal.ShapeError):
        t.push([1, 2], np.ones((3, 2), np.float32))
    with pytest.raises(shoal.DTypeError):
        t.push([1], np.ones((1, 2), np.int32))
    with pytest.raises(shoal.DTypeError):
        t.pull(np.array([1.5]))
    with pytest.raises(shoal.NonFiniteError):
        t.push([1, 60], np.array([[1, 1], [np.nan, 1]], np.float32))
    np.testing.assert_array_equal(t.pull(np.arange(100)), 1.0)


def test_float64_gradients_are_converted_for_a_float32_table(cluster):
    t = cluster.worker(0).table("conv", 10, 2)
    t.push([3], np.ones((1, 2), np.float64))
    np.testing.assert_array_equal(t.pull([3]), 1.0)


def test_skip_policy_drops_only_the_bad_rows(cluster):
    t = cluster.worker(0).table("skip", 100, 2, nonfinite="skip")
    keys = np.array([1, 60, 90])
    rows = t.push_pull(keys, np.array([[1, 1], [np.inf, 0], [2, 2]], np.float32))
    np.testing.assert_array_equal(rows[:, 0], [1, 0, 2])


def test_a_table_created_twice_must_have_the_same_spec(cluster):
    """The error names only the fields that differ (it printed both whole specs, ~450 characters each)."""
    a, b = cluster.worker(0), cluster.worker(1)
    a.table("same", 10, 2)
    assert b.table("same", 10, 2).dim == 2
    a.table("differs", 10, 2)
    with pytest.raises(shoal.TableError) as raised:
        b.table("differs", 10, 3, optimizer=shoal.optim.SGD(lr=0.1))
    message = str(raised.value)
    assert "dim 2 there, 3 asked here" in message and "optimizer Sum() there, SGD(lr=0.1) asked here" in message
    assert "num_keys" not in message and "mapping" not in message and len(message) < 400, message
    with pytest.raises(shoal.TableError, match="created by this worker with a different spec: dim 2 before, 4 now$"):
        a.table("same", 10, 4)


def test_workers_that_create_different_tables_are_warned_of_it(caplog):
    """A misspelt table name trains a model of its own on the workers that use it: once all workers
    have met at a barrier, the rendezvous names the tables only some of them created."""
    with ThreadCluster(nodes=2, workers_per_node=1) as c:
        def body(w):
            w.table("shared", 10, 2)
            w.table("embeddings" if w.rank == 0 else "embedings", 10, 2)
            with caplog.at_level(logging.WARNING, logger="shoal.cluster.rendezvous"):
                w.barrier()
                w.barrier()  # warned once, not at every barrier

        c.run_workers(body)
    warnings = [r.getMessage() for r in caplog.records if r.name == "shoal.cluster.rendezvous"]
    assert sorted(warnings) == [
        "table 'embeddings' was created by worker(s) [0] only, not by [1] (they created 'embedings'): each "
        "worker must create the same tables, or the workers that differ train separate models",
        "table 'embedings' was created by worker(s) [1] only, not by [0] (they created 'embeddings'): each "
        "worker must create the same tables, or the workers that differ train separate models",
    ], warnings


def test_workers_on_different_nodes_see_each_others_pushes():
    with ThreadCluster(nodes=2, workers_per_node=2) as c:
        def body(w):
            t = w.table("shared", 64, 1)
            t.push(np.arange(64), np.full((64, 1), w.rank + 1, np.float32))
            w.barrier()
            return t.pull(np.arange(64))[:, 0]

        for rows in c.run_workers(body):
            np.testing.assert_array_equal(rows, 1 + 2 + 3 + 4)


def test_a_call_whose_keys_are_all_local_sends_no_message():
    with ThreadCluster(nodes=2) as c:
        w = c.worker(0)
        t = w.table("local", 100, 4)  # range mapping: keys 0..49 live on node 0
        before = c.servers[0].stats["messages"] + c.servers[1].stats["messages"]
        for _ in range(10):
            t.push(np.arange(50), np.ones((50, 4), np.float32))
            t.pull(np.arange(50))
        after = c.servers[0].stats["messages"] + c.servers[1].stats["messages"]
        assert after == before
        np.testing.assert_array_equal(c.workers[0].tables["local"].pull(np.arange(50)), 10.0)
        t.pull(np.arange(100))
        assert c.servers[1].stats["op_pull"] == 1 and c.servers[0].stats.get("op_pull", 0) == 0


@pytest.mark.parametrize("kind", [{}, {"replicas": 2}, {"techniques": "relocation"}],
                         ids=["static", "replicated", "adaptive"])
def test_a_future_is_done_only_once_its_requests_are_answered(kind):
    """Every kind of table gives the same honest future: ``done()`` is False while a request is in
    flight (replicated and adaptive futures said True at once)."""
    slow = FaultyTransport(ZmqTransport(), Faults(delay_s=0.3))
    with ThreadCluster(nodes=2, transport=slow) as c:
        w = c.worker(0)
        t = w.table("t", 100, 2, **kind)
        far = np.arange(50, 60)  # node 1's half under the range mapping, and its home under relocation
        pushed = t.push_async(far, np.ones((10, 2), np.float32))
        assert not pushed.done()
        pushed.wait()
        assert pushed.done()
        pulled = t.pull_async(far)
        assert not pulled.done()
        np.testing.assert_array_equal(pulled.wait(), np.ones((10, 2), np.float32))
        assert pulled.done()


def test_creating_a_table_waits_for_its_build_past_a_short_request_timeout():
    # Servers allocate, fill and compile for a new table while the worker waits: setting up, which on
    # a busy machine outlasts a request timeout chosen to notice a stalled peer (a 3 s one failed the
    # faults run's table creation while other jobs ran). Filling 4 M rows takes far longer than 10 ms.
    with ThreadCluster(nodes=1, timeouts=Timeouts(connect_s=30.0, request_s=0.01, barrier_s=30.0)) as c:
        t = c.worker(0).table("big", 4_000_000, 8, init=shoal.Normal(std=0.1))
        assert t.pull(np.array([3_999_999])).shape == (1, 8)  # a local read: no request to time out


@pytest.mark.parametrize("model", [shoal.ASP(), shoal.SSP(1)], ids=["ASP", "SSP"])
def test_clock_ticks_of_a_fast_loop_are_spaced_when_no_read_waits_on_them(model):
    """100 clocks as fast as the loop goes: under ASP a few ticks carry them (servers learn clocks
    from every request too, and the last goes before the barrier); under a bound every one goes,
    since reads wait on them."""
    with ThreadCluster(nodes=2) as c:
        w = c.worker(0)
        w.table("t", 8, 1, consistency=model)
        sent = w.tracker.sent["CLOCK"]
        for _ in range(100):
            w.advance_clock()
        ticks = w.tracker.sent["CLOCK"] - sent
        w.wait_all()
        deadline = time.monotonic() + 10
        while (told := [int(s.clocks.clocks[0]) for s in c.servers]) != [100, 100] and time.monotonic() < deadline:
            w.tracker.pump(0.01)
    if model.bound is None:
        assert ticks < 100, ticks  # 2 servers x 100 clocks would be 200
    else:
        assert ticks == 200
    assert told == [100, 100]


def test_ticks_an_asp_worker_sends_for_its_intents_go_to_its_nodes_server_alone():
    """Intents starting every clock (KGE's batches): its node's server, which acts on them, hears
    the clock every few ms; the other server only every ``TICK_QUIET_S``, and the last clock before
    a wait. A worker without shared memory: a co-located one's server reads the clock in its slot,
    and a look of it serves as a tick (``test_ticks.py``)."""
    with ThreadCluster(nodes=2) as c:
        w = c.worker(0, local_access=False)
        t = w.table("t", 64, 1, techniques="auto")
        told = [s.stats["op_clock"] for s in c.servers]
        started = time.monotonic()
        for clock in range(100):
            t.intent(np.array([clock % 64]), clock + 3, clock + 4)
            time.sleep(0.001)
            w.advance_clock()
        elapsed = time.monotonic() - started
        w.wait_all()
        deadline = time.monotonic() + 10
        while (last := [int(s.clocks.clocks[0]) for s in c.servers]) != [100, 100] and time.monotonic() < deadline:
            w.tracker.pump(0.01)
        local, remote = (s.stats["op_clock"] - n for s, n in zip(c.servers, told, strict=True))
    assert last == [100, 100]  # both know the last clock
    assert remote <= elapsed / TICK_QUIET_S + 2, (local, remote)
    assert local > 2 * remote, (local, remote)


def test_an_asp_worker_ticks_rarely_but_near_the_clocks_its_intents_start_and_end():
    """A loop of about 1 ms a clock, every table ASP: a tick at most every ``TICK_QUIET_S`` (every
    5 ms before: 20 or more in 100 clocks), and one in the few clocks before an intent starts, by
    which the node's server acts on it (a worker without shared memory, whose server cannot read the
    clock itself)."""
    with ThreadCluster(nodes=2) as c:
        w = c.worker(0, local_access=False)
        t = w.table("t", 64, 1, techniques="auto")
        ticked: list[int] = []
        tick = w._tick

        def recorded(now: float, everywhere: bool = True) -> None:
            ticked.append(w.clock)
            tick(now, everywhere)

        w._tick = recorded  # type: ignore[method-assign]
        t.intent(np.arange(8), 60, 1000)
        for _ in range(100):
            time.sleep(0.001)
            w.advance_clock()
        w.wait_all()
    assert len(ticked) < 15, ticked
    assert any(52 <= clock <= 60 for clock in ticked), ticked
