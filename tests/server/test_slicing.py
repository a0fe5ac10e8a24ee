"""Moving slices of static tables between servers while workers push: nothing lost, nothing doubled."""

from __future__ import annotations

import os
import secrets
import threading
import time
import uuid

import numpy as np
import pytest

import shoal
from shoal.api.config import RebalancePolicy
from shoal.api.errors import ClusterError
from shoal.api.ids import OPERATOR, RENDEZVOUS
from shoal.client.worker import Worker
from shoal.cluster import membership
from shoal.cluster.requests import RequestTracker
from shoal.consistency.clocks import ClockTable
from shoal.placement.layout import TableLayout
from shoal.server.server import ParameterServer
from shoal.server.sync import Synchroniser
from shoal.server.tables import ServedTable
from shoal.storage.shard import ShardStore
from shoal.transport.faulty import Faults, FaultyTransport
from shoal.transport.zmq_transport import ZmqTransport
from shoal.wire import bodies
from shoal.wire.codec import Codec
from shoal.wire.message import Message
from shoal.wire.ops import Op
from tests.support.cluster import ThreadCluster
from tests.support.losing import LosingTransport, workers_with_losses
from tests.support.vouching import VouchWatch, watch_vouching
from tests.support.waiting import wait_until

KEYS = 400
BOUND_CLOCKS = 14  # clocks of the bounds-while-slices-move check, each a push of +1 to every key


def _table(w, **options):
    return w.table("moving", KEYS, 4, optimizer=shoal.optim.Sum(), slices=8, **options)


@pytest.mark.parametrize("local_access", [True, False])
def test_a_moved_slice_keeps_its_values_and_everyone_follows(local_access):
    with ThreadCluster(nodes=2) as c:
        w0, w1 = c.worker(0, local_access), c.worker(1, local_access)
        t0, t1 = _table(w0), _table(w1)
        keys = np.arange(KEYS)
        t0.push(keys, np.ones((KEYS, 4), np.float32) * keys[:, None])
        assert t0.layout.owners.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
        w0.move_slice("moving", 1, to=1)
        w0.move_slice("moving", 6, to=0)
        assert t0.layout.owners.tolist() == [0, 1, 0, 0, 1, 1, 0, 1] and t0.layout.epoch == 2
        # w1 has not heard: its first request to the old owner is refused, it refreshes and retries.
        np.testing.assert_array_equal(t1.pull(keys)[:, 0], keys)
        assert t1.layout.epoch == 2 and t1.counters["moved_retries"] >= 1
        t1.push(keys, np.ones((KEYS, 4), np.float32))
        np.testing.assert_array_equal(t0.pull(keys)[:, 0], keys + 1)
        stats = {s["node"]: s["tables"]["moving"]["shards"] for s in w0.server_stats()}
        assert stats == {0: [0, 2, 3, 6], 1: [1, 4, 5, 7]}
        if local_access:
            assert sorted(t0.local) == [0, 2, 3, 6] and sorted(t1.local) == [1, 4, 5, 7]


def test_slices_moving_back_and_forth_under_concurrent_pushes_lose_nothing():
    with ThreadCluster(nodes=2, workers_per_node=2) as c:
        workers = c.all_workers()
        tables = [_table(w) for w in workers]
        stop = threading.Event()
        moves = []

        def mover() -> None:
            rng = np.random.default_rng(0)
            admin = workers[0]
            while len(moves) < 10:
                shard = int(rng.integers(8))
                to = 1 - int(tables[0].layout.owners[shard]) if rng.random() < 0.9 else 0
                admin.move_slice("moving", shard, to=to)
                moves.append((shard, to))

        def pusher(rank: int) -> None:
            rng = np.random.default_rng(rank)
            deadline = time.monotonic() + 60
            while not stop.is_set() and time.monotonic() < deadline:  # push for as long as slices move
                keys = rng.choice(KEYS, size=64, replace=False)
                tables[rank].push(keys, np.ones((64, 4), np.float32))
                counts[rank][keys] += 1

        counts = [np.zeros(KEYS) for _ in workers]
        threads = [threading.Thread(target=pusher, args=(r,)) for r in range(1, 4)]
        moving = threading.Thread(target=mover)
        moving.start()
        for t in threads:
            t.start()
        moving.join(timeout=120)
        stop.set()
        for t in threads:
            t.join(timeout=120)
        assert len(moves) == 10
        got = tables[1].pull(np.arange(KEYS))
        np.testing.assert_array_equal(got[:, 0], sum(counts))


def test_a_worker_watching_the_servers_takes_in_one_that_joined():
    """The status a waiting call reads lists a server the worker has not met yet (it joined after the
    worker registered): the worker connects to it instead of failing on the unknown node."""
    with ThreadCluster(nodes=2) as c:
        w = c.worker(0)
        joiner = ParameterServer(2, c.spec, c.transport, bind="inproc://*")
        thread = threading.Thread(target=joiner.run, daemon=True, name="server-2")
        thread.start()
        try:
            wait_until(lambda: len(membership.status(w.tracker, 5.0).get("servers", [])) == 3,
                       what="the joined server listed in the status")
            w.replica_view.refresh(force=True)
            assert w.server_alive(2) and w.live_servers() == [0, 1, 2]
            table = _table(w)
            w.move_slice("moving", 3, to=2)
            table.push(np.arange(KEYS), np.ones((KEYS, 4), np.float32))
            np.testing.assert_array_equal(table.pull(np.arange(KEYS))[:, 0], np.ones(KEYS))
        finally:
            w.shutdown()  # while the joined server still answers its last clock
            joiner.stop()
            thread.join(timeout=10)


def test_rows_changed_before_a_subscriber_is_heard_from_reach_it_once_it_is():
    """A slice that moved here brings its subscribers, one of which this server may not have heard
    from yet (its messages are still on their way): the rows that changed meanwhile are owed to it
    and sent with its next eager message, never dropped while "the rest did not change" vouches for
    its stale copies."""
    spec = shoal.TableSpec("eager", 8, 1, optimizer=shoal.optim.Sum(), consistency=shoal.ESSP(0), slices=1)
    clocks = ClockTable.fresh(2)
    table = ServedTable(spec, TableLayout.initial(spec, 1), 0, "t" + uuid.uuid4().hex[:10], clocks)
    sent: list[tuple[bytes, Message]] = []
    sync = Synchroniser(clocks, {"eager": table}, lambda peer, msg: sent.append((peer, msg)))
    try:
        keys = np.arange(4)
        table.subscribe(1, keys)  # worker 1 caches rows 0..3 (it pulled them from the slice's last owner)
        table.push(keys, np.full((4, 1), 5.0, np.float32))
        sync.adopted("eager")  # worker 1 not heard from here: nowhere to send its rows yet
        assert not sent
        for worker in (0, 1):
            sync.observe(f"w{worker}".encode(), Message(Op.CLOCK, clock=1, sender=worker, body={"rank": worker}))
        rows = [msg for peer, msg in sent if peer == b"w1" and msg.op == Op.ROWS]
        assert rows and rows[-1].clock == 1
        got = {int(k): float(v) for msg in rows for k, v in zip(msg.arrays[0], msg.arrays[1][:, 0], strict=True)}
        assert got == {0: 5.0, 1: 5.0, 2: 5.0, 3: 5.0}, got
    finally:
        table.close()


def test_a_new_owner_sends_each_subscriber_every_row_it_caches_of_a_slice_that_moved_here():
    """The previous owner's last eager message may have been lost on its way (a subscriber takes them
    in order, and waits for a missing one, but that stream ends with the move): the new owner's first
    message carries every row each subscriber caches of the slice, not only the rows changed since it
    left, before "the rest did not change" vouches for the subscriber's copies."""
    spec = shoal.TableSpec("eager", 8, 1, optimizer=shoal.optim.Sum(), consistency=shoal.ESSP(0), slices=1)
    cluster_id = "t" + uuid.uuid4().hex[:10]
    clocks = ClockTable.fresh(2)
    table = ServedTable(spec, TableLayout.initial(spec, 1), 0, cluster_id, clocks)
    sent: list[tuple[bytes, Message]] = []
    sync = Synchroniser(clocks, {"eager": table}, lambda peer, msg: sent.append((peer, msg)))
    try:
        # The slice arrives with rows its previous owner had sent to worker 1 already: no change marks.
        arriving = ShardStore.receive(spec, 0, 8, cluster_id)
        state = {name: np.zeros_like(array) for name, array in arriving.state_arrays().items()}
        state["values"][:] = np.arange(8, dtype=np.float32)[:, None]
        arriving.load_rows(0, state)
        table.stores.pop(0).close()
        cached = np.zeros(8, dtype=np.bool_)
        cached[2:6] = True  # worker 1 caches rows 2..5
        table.adopt_slice(arriving, 1, {1: cached})
        for worker in (0, 1):
            sync.observe(f"w{worker}".encode(), Message(Op.CLOCK, clock=1, sender=worker, body={"rank": worker}))
        rows = [msg for peer, msg in sent if peer == b"w1" and msg.op == Op.ROWS]
        assert rows and rows[0].clock == 1
        got = {int(k): float(v) for k, v in zip(rows[0].arrays[0], rows[0].arrays[1][:, 0], strict=True)}
        assert got == {2: 2.0, 3: 3.0, 4: 4.0, 5: 5.0}, got
    finally:
        table.close()


def test_moving_to_an_unknown_server_or_slice_is_refused_by_name():
    with ThreadCluster(nodes=2) as c:
        w = c.worker(0)
        _table(w)
        with pytest.raises(ClusterError, match="live servers are"):
            w.move_slice("moving", 0, to=5)
        with pytest.raises(ClusterError, match="slices 0..7"):
            w.move_slice("moving", 9, to=1)
        with pytest.raises(ClusterError, match="not a static table"):
            w.move_slice("nope", 0, to=1)
        start = time.monotonic()
        w.move_slice("moving", 0, to=0)  # already there: nothing to do
        assert time.monotonic() - start < 1.0


@pytest.mark.parametrize("lane", [False, True], ids=["general path", "lane"])
def test_the_rebalancer_spreads_a_table_that_started_whole_on_one_server(lane):
    """The rebalancer moves slices by the bytes each served. On the lane (small reads and pushes served
    in compiled code, ``server.lane``) too: what it serves counts as the general path's does."""
    policy = RebalancePolicy(threshold=1.3, windows=2, window_s=0.3, min_bytes_per_s=1.0)
    options = dict(transport=ZmqTransport(), secret=secrets.token_bytes(32), lane=True) if lane else {}
    with ThreadCluster(nodes=2, rebalance=policy, **options) as c:
        w0, w1 = c.worker(0, local_access=False), c.worker(1, local_access=False)
        t0, t1 = (_table(w, placement="whole") for w in (w0, w1))
        keys = np.arange(KEYS)
        t0.push(keys, np.ones((KEYS, 4), np.float32) * keys[:, None])
        start_owner = int(t0.layout.owners[0])
        assert (t0.layout.owners == start_owner).all()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            t0.pull(keys)
            t1.pull(keys)
            if c.rendezvous.slices.moves_done >= 3 and not c.rendezvous.slices.busy():
                break
        owners = c.rendezvous.slices.layouts["moving"].owners
        assert 3 <= np.count_nonzero(owners != start_owner) <= 5, owners
        np.testing.assert_array_equal(t1.pull(keys)[:, 0], keys)
        history = c.rendezvous.slices.history
        assert any(h["moves"] for h in history) and max(h["imbalance"] for h in history) > 1.8
        if lane:  # the reads took the lane (not the general path beside it)
            assert t0.counters["lane_pulls"] > 10 * t0.counters["requests"], dict(t0.counters)


@pytest.mark.parametrize("model", [shoal.BSP(), shoal.SSP(1), shoal.ESSP(1)],
                         ids=lambda m: f"{type(m).__name__}{m.bound}")
@pytest.mark.parametrize("local_access", [False, True])
def test_bounds_hold_with_asynchronous_pushes_while_slices_move(model, local_access):
    """Each worker pulls every key, pushes +1 to every key asynchronously and waits for that push only
    one clock later, while slices of the table move back and forth: a read at clock c sees every
    push of clocks before c - bound of every worker, its own included (and under BSP none of a
    later clock)."""
    with ThreadCluster(nodes=2) as c:
        _check_bounds_while_slices_move(c, model, local_access)


@pytest.mark.parametrize("local_access", [False, True])
def test_bounds_hold_while_slices_move_over_a_network_that_loses_messages(local_access):
    """The same with 2 workers per node under ESSP, every message lost with probability 1% (requests
    and replies are sent again; a lost eager message of a slice's previous owner once left rows that
    its new owner vouched for stale). A request whose answer is lost waits for its resend, a read
    whose eager push is lost for the eager wait (reads took up to 5-9 s in 60 such runs): a
    generous request timeout."""
    lossy = FaultyTransport(ZmqTransport(), Faults(loss=0.01, seed=secrets.randbelow(1 << 30)))
    timeouts = shoal.Timeouts(connect_s=10.0, request_s=30.0, barrier_s=40.0)
    with ThreadCluster(nodes=2, workers_per_node=2, transport=lossy, timeouts=timeouts) as c:
        _check_bounds_while_slices_move(c, shoal.ESSP(1), local_access)


@pytest.mark.heavy
@pytest.mark.parametrize("run", range(int(os.environ.get("SHOAL_STRESS_RUNS", "20"))))
def test_no_server_vouches_for_rows_missing_an_update_while_slices_move_over_a_lossy_network(run):
    """The loss test above, many times, its servers watched as well: every rows message and every
    reply must hold every update before its clock (``tests.support.vouching``), so a server that
    vouches wrongly fails the run even when no read happens to look. The faults behind this file's
    fence and lost-answer tests broke 2 of 150 runs on the code before (both through reads): twenty
    runs (about 40 s) catch such a fault about a quarter of the time; ``SHOAL_STRESS_RUNS=200`` to
    hunt one."""
    lossy = FaultyTransport(ZmqTransport(), Faults(loss=0.01, seed=secrets.randbelow(1 << 30)))
    timeouts = shoal.Timeouts(connect_s=10.0, request_s=30.0, barrier_s=40.0)
    with ThreadCluster(nodes=2, workers_per_node=2, transport=lossy, timeouts=timeouts) as c:
        watch = watch_vouching(c.servers, VouchWatch("bound", per_clock=4, clocks=BOUND_CLOCKS))
        _check_bounds_while_slices_move(c, shoal.ESSP(1), local_access=False)
    assert watch.checked > 0
    assert not watch.violations, watch.violations[:3]


def _check_bounds_while_slices_move(c: ThreadCluster, model: shoal.Consistency, local_access: bool) -> None:
    clocks = BOUND_CLOCKS
    workers = c.all_workers(local_access=local_access)
    tables = [w.table("bound", KEYS, 1, optimizer=shoal.optim.Sum(), slices=6, consistency=model) for w in workers]
    seen: list[tuple[int, int, float, float]] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def run(rank: int) -> None:
        previous = None
        for clock in range(clocks):
            # Clocks interleave with moves (a job that starts quickly could end before the first):
            # a move at least every three clocks, four in all.
            moves = min(4, clock // 3)
            wait_until(lambda: c.rendezvous.slices.moves_done >= moves, timeout=60,  # noqa: B023 - read at once
                       what="the operator's slice moves")
            rows = tables[rank].pull(np.arange(KEYS))[:, 0]
            seen.append((rank, clock, float(rows.min()), float(rows.max())))
            push = tables[rank].push_async(np.arange(KEYS), np.ones((KEYS, 1), np.float32))
            workers[rank].advance_clock()
            if previous is not None:
                previous.wait()
            previous = push
        previous.wait()
        # As a job ends: a worker that has stopped calling Shoal cannot confirm the fences of slices
        # moving meanwhile, and the others' bounded reads at their new owners would wait for it.
        workers[rank].barrier()

    def train(rank: int) -> None:
        try:
            run(rank)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)

    threads = [threading.Thread(target=train, args=(r,)) for r in range(len(workers))]
    moving = threading.Thread(target=_move_back_and_forth, args=(c, "bound", 6, done))
    for t in threads:
        t.start()
    moving.start()
    for t in threads:
        t.join(timeout=120)
    done.set()
    moving.join(timeout=60)
    assert not errors, errors
    assert c.rendezvous.slices.moves_done >= 4 and len(seen) == len(workers) * clocks
    bound, others = model.bound, len(workers) - 1
    # own pushes of clocks < c, and every other worker's of clocks < c - bound
    late = [(rank, clock, low) for rank, clock, low, _ in seen if low < clock + others * max(clock - bound, 0)]
    assert not late, f"{len(late)} of {len(seen)} reads missed updates the bound promises: {late[:5]}"
    if bound == 0:  # at most the other workers' pushes of this clock beyond
        assert all(high <= (others + 1) * clock + others for _, clock, _, high in seen), seen


def test_pushes_answered_moved_together_count_as_unsettled_until_each_is_sent_again():
    """Worker 0 pushes at clock 0 and at clock 1 to slices that have both moved to server 2 without
    its knowing: both are answered "moved", the clock-1 push's answer first (it came from server 0,
    which the worker reads before server 1). Sending them again in that order, the clock-1 push's
    message must not tell server 2 (which counts worker 0 only up to its settled clock until it
    confirms the moves) that every push of clock 0 has landed: the clock-0 push is behind it. A BSP
    read at clock 1 held there meanwhile must see the clock-0 push."""
    slow = FaultyTransport(ZmqTransport(), Faults(delay_s=0.2))  # servers read every message 0.2 s late
    with ThreadCluster(nodes=3, transport=slow) as c:
        workers = [Worker(c.spec, rank, rank, ZmqTransport(), local_access=False) for rank in range(3)]
        c.workers += workers
        tables = [w.table("bsp", 30, 1, optimizer=shoal.optim.Sum(), slices=3, consistency=shoal.BSP())
                  for w in workers]
        pusher, reader, mover = tables
        assert pusher.layout.owners.tolist() == [0, 1, 2]
        keys = [pusher.layout.mapping.keys_of(s) for s in range(3)]
        for shard in (1, 0):
            workers[2].move_slice("bsp", shard, to=2)
        assert pusher.layout.owners.tolist() == [0, 1, 2], "worker 0 must not know the moves yet"
        first = pusher.push_async(keys[1], np.ones((keys[1].shape[0], 1), np.float32))  # to server 1: moved
        workers[0].advance_clock()
        second = pusher.push_async(keys[0], np.ones((keys[0].shape[0], 1), np.float32))  # to server 0: moved
        workers[0].advance_clock()
        for _ in range(2):
            workers[2].advance_clock()
        workers[1].advance_clock()
        read: list[np.ndarray] = []
        reading = threading.Thread(target=lambda: read.append(reader.pull(keys[1])))
        reading.start()
        wait_until(lambda: c.servers[2].sync.held_count() == 1, what="the read held at server 2 for worker 0")
        time.sleep(0.5)  # both answers "moved" are in: worker 0 takes them in one receive
        second.wait()
        first.wait()
        reading.join(timeout=30)
        assert read, "the read at clock 1 did not return"
        assert pusher.counters["moved_retries"] >= 2
        np.testing.assert_array_equal(read[0][:, 0], np.ones(keys[1].shape[0]))
        workers[1].advance_clock()  # every worker at clock 2: each push is in exactly once
        np.testing.assert_array_equal(mover.pull(np.concatenate(keys[:2]))[:, 0], np.ones(20))


def _move_back_and_forth(cluster: ThreadCluster, table: str, slices: int, done: threading.Event) -> None:
    """An operator outside the job moving slices between the two servers until ``done``."""
    tracker = RequestTracker(cluster.transport, Codec(cluster.spec.limits, cluster.spec.secret), sender=OPERATOR)
    tracker.connect(RENDEZVOUS, cluster.spec.rendezvous)
    try:
        shard = 0
        while not done.is_set():
            owners = membership.call(tracker, RENDEZVOUS, Message(Op.LAYOUT, table=table), 10,
                                     "layout").body["owners"]
            try:
                membership.call(tracker, RENDEZVOUS, Message(Op.MOVE_SLICE, table=table, body={
                    "shard": shard % slices, "to": 1 - int(owners[shard % slices])}), 30, "move")
            except ClusterError:  # refused: at start-up a server may not know the other's address yet
                time.sleep(0.1)
            shard += 1
    finally:
        tracker.close()


@pytest.mark.parametrize("pushes", ["waited", "in the background"])
def test_a_push_sent_to_a_server_after_it_left_lands_once_where_its_slice_went(pushes):
    """A worker that has not heard that server 1 was drained pushes to it after it stopped reading:
    the server's goodbye names the last request of each worker it handled, so this one is known
    unserved and goes where its slice is now, once (not waited for until the request timeout)."""
    timeouts = shoal.Timeouts(connect_s=10.0, request_s=6.0, barrier_s=20.0)
    with ThreadCluster(nodes=2, transport=ZmqTransport(), timeouts=timeouts) as c:
        stale, drainer = c.worker(0, local_access=False), c.worker(1)
        t_stale, _ = _table(stale), _table(drainer)
        keys = np.arange(KEYS)
        t_stale.push(keys, np.ones((KEYS, 4), np.float32))  # it has talked to server 1 before
        drainer.remove_server(1)
        c.threads[1].join(timeout=20)
        assert not c.threads[1].is_alive(), "the drained server did not leave"
        assert t_stale.layout.owners.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]  # it has not heard
        started = time.monotonic()
        if pushes == "waited":
            t_stale.push(keys, np.ones((KEYS, 4), np.float32))
        else:
            for _ in range(3):
                t_stale.push_async(keys, np.ones((KEYS, 4), np.float32))
            stale.wait_all()
        assert time.monotonic() - started < timeouts.request_s
        expected = 2 if pushes == "waited" else 4
        np.testing.assert_array_equal(t_stale.pull(keys), np.full((KEYS, 4), expected, np.float32))
        assert t_stale.layout.owners.tolist() == [0] * 8


def test_answers_still_on_their_way_from_a_server_that_left_are_taken_in():
    """Server 1 answered a push, then was drained and left, before the worker read the answer; the
    worker learns that it left while the answer waits in its socket: it keeps the connection until
    the answer is in, instead of closing it under the answer and waiting for the request timeout."""
    timeouts = shoal.Timeouts(connect_s=10.0, request_s=6.0, barrier_s=20.0)
    with ThreadCluster(nodes=2, transport=ZmqTransport(), timeouts=timeouts) as c:
        w0, drainer = c.worker(0, local_access=False), c.worker(1)
        t0, _ = _table(w0), _table(drainer)
        keys = np.arange(KEYS)
        remote = keys[KEYS // 2 :]  # slices 4..7, on server 1
        t0.push_async(remote, np.ones((remote.size, 4), np.float32))  # answered while w0 looks away
        drainer.remove_server(1)
        c.threads[1].join(timeout=20)
        assert not c.threads[1].is_alive(), "the drained server did not leave"
        w0.cluster_status()  # learns that server 1 left; its answer is still unread
        started = time.monotonic()
        w0.wait_all()
        assert time.monotonic() - started < timeouts.request_s
        expected = np.zeros((KEYS, 4), np.float32)
        expected[KEYS // 2 :] = 1
        np.testing.assert_array_equal(t0.pull(keys), expected)


def test_a_worker_confirms_a_fence_only_once_it_routes_by_the_move_behind_it():
    """Server 0 takes slice 1 at epoch 2 while the rendezvous does not know it yet (the old owner's
    report is lost), and the fence naming slice 1 is lost on its way to worker 0. Worker 0, routing
    by epoch 0, pushes to slice 0, which server 0 gave away at epoch 1: refused, and fenced again. That
    fence used to name no slice, so the worker confirmed epoch 2 by a layout of epoch 1 and sent its
    next push for slice 1 to server 1, while server 0, fence lifted, counted its clock in full: a BSP
    read there at clock 2 missed that clock-1 push (the bound violation of the slice-moving stress
    test under message loss)."""
    reports_held = threading.Event()
    fences_lost: list[dict] = []

    def lose_reports(header: dict) -> bool:
        return reports_held.is_set() and header["op"] == int(Op.MOVE_DONE)

    def lose_the_first_fence_naming_slice_1(header: dict) -> bool:
        if header["op"] == int(Op.FENCE) and header["body"].get("shard") == 1 and not fences_lost:
            fences_lost.append(header)
            return True
        return False

    with ThreadCluster(nodes=2, transport=LosingTransport(ZmqTransport(), lose_reports)) as c:
        pusher = Worker(c.spec, 0, 0, LosingTransport(ZmqTransport(), lose_the_first_fence_naming_slice_1),
                        local_access=False)
        reader = Worker(c.spec, 1, 1, ZmqTransport(), local_access=False)
        c.workers += [pusher, reader]
        t_push, t_read = (w.table("fenced", 20, 1, optimizer=shoal.optim.Sum(), slices=2, consistency=shoal.BSP())
                          for w in (pusher, reader))
        assert t_push.layout.owners.tolist() == [0, 1]
        keys = np.arange(20)
        slice0, slice1 = (t_push.layout.mapping.keys_of(s) for s in range(2))
        for t in (t_push, t_read):
            t.push(keys, np.ones((20, 1), np.float32))  # clock 0: both servers hear both workers
        for w in (pusher, reader):
            w.advance_clock()
        _move(c, "fenced", 0, to=1)  # epoch 1: the rendezvous knows it
        reports_held.set()
        mover = threading.Thread(target=_move, args=(c, "fenced", 1, 0))  # epoch 2: reported only later
        mover.start()
        try:
            wait_until(lambda: 1 in c.servers[0].tables["fenced"].stores, what="server 0 taking slice 1")
            t_push.push(slice0, np.ones((slice0.shape[0], 1), np.float32))  # refused by server 0, sent to server 1
            wait_until(lambda: _pumped(pusher) and 0 not in c.servers[0].sync.fences,
                       what="worker 0 confirming its fences at server 0")
            late = t_push.push_async(slice1, np.ones((slice1.shape[0], 1), np.float32))
            pusher.advance_clock()
            wait_until(lambda: _pumped(reader) and t_read.layout.epoch >= 2,
                       what="the reader learning the move from its fence")
            reader.advance_clock()
            read: list[np.ndarray] = []
            reading = threading.Thread(target=lambda: read.append(t_read.pull(slice1)))
            reading.start()
            wait_until(lambda: read or c.servers[0].sync.held_count() == 1, what="the read served or held")
            _pumped(pusher)
        finally:
            reports_held.clear()
            mover.join(timeout=30)
        while reading.is_alive():
            _pumped(pusher)
            reading.join(timeout=0.05)
        late.wait()
        assert fences_lost, "the fence naming slice 1 never reached worker 0"
        # clock 2 under BSP: both workers' clock-0 pushes and the pusher's clock-1 push to slice 1
        np.testing.assert_array_equal(read[0][:, 0], np.full(slice1.shape[0], 3.0))


def test_rows_a_server_read_after_refusing_a_push_whose_answer_was_lost_are_not_taken_to_hold_it():
    """Worker 0 pushes at clock 1 to slices 2 and 3 on server 1, which gave slice 2 away: refused
    whole, and the answer "moved" is lost. Server 1's next eager message says it had handled that
    request when it read its rows (``seen``), and the worker, not knowing the push was refused, took
    the rows to hold it and did not add it back: a read at clock 2 from the cache missed the
    worker's own clock-1 push (the stress test's last bound violation under message loss). A push
    handled but not answered may have been applied or refused: its rows are not cached."""
    armed = threading.Event()
    lost: list[dict] = []

    def lose_the_first_moved_answer(header: dict) -> bool:
        if armed.is_set() and header["op"] == int(Op.OK) and "moved" in (header["body"] or {}) and not lost:
            lost.append(header)
            return True
        return False

    with ThreadCluster(nodes=2, transport=ZmqTransport()) as c:
        pusher = Worker(c.spec, 0, 0, LosingTransport(ZmqTransport(), lose_the_first_moved_answer),
                        local_access=False)
        other = Worker(c.spec, 1, 1, ZmqTransport(), local_access=False)
        c.workers += [pusher, other]
        t_push, t_other = (w.table("eager", 40, 1, optimizer=shoal.optim.Sum(), slices=4, consistency=shoal.ESSP(1))
                           for w in (pusher, other))
        assert t_push.layout.owners.tolist() == [0, 0, 1, 1]
        keys = np.arange(40)
        slice3 = t_push.layout.mapping.keys_of(3)
        ones = np.ones((40, 1), np.float32)
        for t in (t_push, t_other):
            t.pull(keys)  # both cache every row, pushed eagerly from now on
        t_push.push(keys, ones)  # clock 0
        pusher.advance_clock()
        other.move_slice("eager", 2, to=0)  # the pusher does not know
        armed.set()
        late = t_push.push_async(keys, ones)  # clock 1: server 1 refuses its part, the answer is lost
        wait_until(lambda: (0, "eager") in c.servers[1].sync.refusing, what="server 1 refusing the push")
        t_other.push(keys, ones)  # clock 0: slice 3's rows change on server 1
        other.advance_clock()  # server 1's slowest clock advances: its eager message carries them
        pusher.advance_clock()
        read = t_push.pull(slice3)  # clock 2: from the cache
        late.wait()
        assert lost, "no answer \"moved\" was lost"
        # the pusher's clock-0 and clock-1 pushes (its own, at once) and the other worker's clock-0 push
        np.testing.assert_array_equal(read[:, 0], np.full(slice3.shape[0], 3.0))


def test_rows_a_new_owner_pushes_holding_a_push_whose_answer_was_lost_are_not_cached_with_it_added_again():
    """ESSP. Worker 0 caches slice 3 (on server 1) and pushes one to it; server 1 applies it and its
    answer is lost. Slice 3 moves to server 0, which pushes the worker the rows it caches: they hold
    the push. The cache added every push not answered by the server that sent the rows back to them
    (``server != node``), so it served 2 where the servers held 1, until the rows changed. A push
    not answered by its server may or may not be in rows from another: those rows are not cached."""
    blocking = threading.Event()
    lost: list[dict] = []

    def lose_the_pushs_answers(header: dict) -> bool:
        if not blocking.is_set() or header["op"] != int(Op.OK) or (header["body"] or {}).get("moved"):
            return False
        if not lost or header["req"] == lost[0]["req"]:  # the first answer, and its answers to resends
            lost.append(header)
            return True
        return False

    with ThreadCluster(nodes=2, transport=ZmqTransport()) as c:
        pusher, other = workers_with_losses(c, lose_the_pushs_answers)
        t_push, t_other = (w.table("cached", 40, 1, optimizer=shoal.optim.Sum(), slices=4,
                                   consistency=shoal.ESSP(1)) for w in (pusher, other))
        assert t_push.layout.owners.tolist() == [0, 0, 1, 1]
        slice3 = t_push.layout.mapping.keys_of(3)
        t_push.pull(slice3)  # cached, and pushed eagerly from now on
        t_push.pull(t_push.layout.mapping.keys_of(0))  # server 0 knows where the worker is
        blocking.set()
        late = t_push.push_async(slice3, np.ones((slice3.shape[0], 1), np.float32))
        wait_until(lambda: float(c.servers[1].tables["cached"].pull(slice3[:1])[0, 0]) == 1.0,
                   what="server 1 applying the push")
        other.move_slice("cached", 3, to=0)
        rows_pushed = t_push.counters["eager_rows"]
        wait_until(lambda: _pumped(pusher) and t_push.counters["eager_rows"] > rows_pushed,
                   what="server 0 pushing the worker the rows of slice 3")
        blocking.clear()
        late.wait()  # sent again to server 1, which had applied it: answered now
        assert lost, "no answer to the push was lost"
        cached_before = t_push.counters["rows_from_cache"]
        read = t_push.pull(slice3)
        np.testing.assert_array_equal(c.servers[0].tables["cached"].pull(slice3)[:, 0], 1.0)  # applied once
        np.testing.assert_array_equal(read[:, 0], 1.0)
        assert t_push.counters["rows_from_cache"] - cached_before in (0, slice3.shape[0])


def _pumped(worker: Worker) -> bool:
    """Let ``worker`` take what came for it (fences to answer, answers to send again); True."""
    worker.tracker.pump(0.01)
    return True


def _move(cluster: ThreadCluster, table: str, shard: int, to: int) -> None:
    """An operator outside the job moving slice ``shard`` of ``table`` to server ``to``; returns once moved."""
    tracker = RequestTracker(cluster.transport, Codec(cluster.spec.limits, cluster.spec.secret), sender=OPERATOR)
    tracker.connect(RENDEZVOUS, cluster.spec.rendezvous)
    try:
        membership.call(tracker, RENDEZVOUS, bodies.MoveSlice(shard, to).to_message(table=table), 30, "move")
    finally:
        tracker.close()


def test_a_move_whose_new_owner_answers_late_is_not_undone_and_no_push_is_lost() -> None:
    # The new owner takes the slice with the last chunk; its answer is lost until after the request
    # timeout (3 s here) and comes when the chunk is sent again. Undone at the timeout, the move left
    # the slice served on both servers (the new owner had fenced the workers to itself), each with a
    # share of the pushes.
    lost_until = time.monotonic() + 4.0
    last_chunks: set[tuple[int, int]] = set()
    lock = threading.Lock()

    def lose(header: dict) -> bool:
        with lock:
            if header["op"] == int(Op.SLICE_STATE) and header["body"].get("last"):
                last_chunks.add((header["inc"], header["req"]))
                return False
            return (header["op"] == int(Op.OK) and (header["inc"], header["req"]) in last_chunks
                    and time.monotonic() < lost_until)

    timeouts = shoal.Timeouts(connect_s=10.0, request_s=3.0, barrier_s=20.0)
    keys, ones = np.arange(400), np.ones((400, 1), np.float32)
    with ThreadCluster(nodes=2, transport=LosingTransport(ZmqTransport(), lose), timeouts=timeouts) as c:
        w0, w1 = c.worker(0, local_access=False), c.worker(1, local_access=False)
        t0 = w0.table("moving", 400, 1, optimizer=shoal.optim.Sum(), slices=8)
        t1 = w1.table("moving", 400, 1, optimizer=shoal.optim.Sum(), slices=8)
        t0.push(keys, ones)
        t1.push(keys, ones)
        assert int(t0.layout.owners[1]) == 0
        w0.move_slice("moving", 1, to=1, timeout=20)
        assert c.rendezvous.slices.describe("moving")["owners"][1] == 1
        for _ in range(5):
            t0.push(keys, ones)
            t1.push(keys, ones)
            w0.advance_clock()
            w1.advance_clock()
        w0.wait_all()
        w1.wait_all()
        holders = [n for n, server in enumerate(c.servers) if 1 in server.static.tables["moving"].stores]
        assert holders == [1]
        np.testing.assert_array_equal(t0.pull(keys)[:, 0], 12)
        np.testing.assert_array_equal(t1.pull(keys)[:, 0], 12)


@pytest.mark.heavy  # the rendezvous calls a server dead after 2 s without heartbeats
def test_a_move_to_a_server_that_dies_before_answering_is_undone() -> None:
    # Nothing of the slice reaches server 1 (its chunks are lost), which then dies: once the rendezvous
    # calls it dead, the move is undone and the slice served where it was.
    def lose(header: dict) -> bool:
        return header["op"] == int(Op.SLICE_STATE)

    timeouts = shoal.Timeouts(connect_s=10.0, request_s=3.0, barrier_s=20.0)
    keys = np.arange(400)
    with ThreadCluster(nodes=2, transport=LosingTransport(ZmqTransport(), lose), timeouts=timeouts) as c:
        w0 = c.worker(0, local_access=False)
        t0 = w0.table("moving", 400, 1, optimizer=shoal.optim.Sum(), slices=8)
        assert int(t0.layout.owners[1]) == 0
        part = keys[t0.layout.mapping.locate(keys)[0] == 1]
        moved: list[BaseException] = []

        def move() -> None:
            try:
                w0.move_slice("moving", 1, to=1, timeout=30)
            except ClusterError as exc:
                moved.append(exc)

        mover = threading.Thread(target=move)
        mover.start()
        time.sleep(0.5)
        c.servers[1].stop()
        mover.join(timeout=40)
        assert moved and "failed" in str(moved[0])
        assert c.rendezvous.slices.describe("moving")["owners"][1] == 0
        t0.push(part, np.ones((part.shape[0], 1), np.float32))
        np.testing.assert_array_equal(t0.pull(part)[:, 0], 1)


def test_a_push_pull_sent_again_after_its_slice_moved_is_applied_once():
    """Worker 0 push_pulls 300 rows of 64 floats (slice 1, on server 1): applied, and the answer (77 KB,
    more than a server keeps to answer a repeat with) is lost. Slice 1 moves to server 0. The worker
    sends the request again; server 1 sees a repeat of an answered PUSH_PULL whose reply it did not
    keep, and serves it again as a PULL alone (``ParameterServer._repeated``). The slice is not there
    any more: the PULL is answered "moved", which the worker takes as "nothing of the push_pull was
    done" and sends the push again to server 0: applied twice."""
    state = {"blocking": False, "lost": 0}

    def lose(header: dict) -> bool:
        if state["blocking"] and header.get("table") == "big" and header["op"] == int(Op.VALUES):
            state["lost"] += 1
            return True
        return False

    with ThreadCluster(nodes=2, transport=ZmqTransport()) as c:
        w0, w1 = workers_with_losses(c, lose)
        t0, _ = (w.table("big", 600, 64, optimizer=shoal.optim.Sum(), slices=2) for w in (w0, w1))
        assert t0.layout.owners.tolist() == [0, 1]
        keys = t0.layout.mapping.keys_of(1)
        assert keys.shape[0] * 64 * 4 > 64 << 10  # the reply is too large to be kept for a repeat
        state["blocking"] = True
        late = t0.push_pull_async(keys, np.ones((keys.shape[0], 64), np.float32))
        wait_until(lambda: _pumped(w0) and state["lost"] >= 1, what="the push_pull's answer lost")
        np.testing.assert_array_equal(c.servers[1].tables["big"].pull(keys[:1])[:, 0], [1.0])  # applied there
        w1.move_slice("big", 1, to=0)
        state["blocking"] = False
        late.result()
        assert state["lost"] >= 1, "the push_pull's answer was never lost"
        values = c.servers[0].tables["big"].pull(keys)[:, 0]
        np.testing.assert_array_equal(values, np.ones(keys.shape[0]), err_msg="the push_pull was applied "
                                      f"{values.max():.0f} times ({t0.counters['moved_retries']} sent again as moved)")


def test_a_push_pull_handled_after_a_refused_push_is_applied_once():
    """Worker 0 pushes (async) to slices 2 and 3 on server 1, which gave slice 2 away: refused whole,
    and server 1 refuses the worker's reads of the table until it confirms (``Synchroniser.refuse_reads``).
    The worker's next call, a push_pull of slice 3 alone, comes after it in the stream: server 1
    applies its push (``StaticService.handle``), then its read is refused (``Synchroniser.pull``) and
    the whole request is answered "moved", which says nothing was applied. The worker sends the push
    again: applied twice."""
    with ThreadCluster(nodes=2, transport=ZmqTransport()) as c:
        w0 = Worker(c.spec, 0, 0, ZmqTransport(), local_access=False)
        w1 = Worker(c.spec, 1, 1, ZmqTransport(), local_access=False)
        c.workers += [w0, w1]
        t0, t1 = (w.table("eager", 40, 1, optimizer=shoal.optim.Sum(), slices=4, consistency=shoal.ESSP(1))
                  for w in (w0, w1))
        assert t0.layout.owners.tolist() == [0, 0, 1, 1]
        both = np.concatenate([t0.layout.mapping.keys_of(2), t0.layout.mapping.keys_of(3)])
        slice3 = t0.layout.mapping.keys_of(3)
        w1.move_slice("eager", 2, to=0)  # worker 0 does not know
        first = t0.push_async(both, np.ones((both.shape[0], 1), np.float32))  # refused whole by server 1
        t0.push_pull(slice3, np.ones((slice3.shape[0], 1), np.float32))  # after it in the stream
        first.result()
        w0.wait_all()
        values = c.servers[1].tables["eager"].pull(slice3)[:, 0]
        # slice 3: +1 from the first push (sent again), +1 from the push_pull
        np.testing.assert_array_equal(values, np.full(slice3.shape[0], 2.0),
                                      err_msg=f"{t0.counters['moved_retries']} part(s) sent again as moved")


def test_a_push_pull_whose_read_is_released_while_its_slice_moves_is_applied_once():
    """BSP. Worker 0 (at clock 1) push_pulls slice 1 on server 1: the push is applied and the read
    held for worker 1. Slice 1 starts moving to server 0 (its new owner's answer is held back a
    while). Worker 1 ticks: the read is released, finds its slice moving and is held for the move
    (``Synchroniser._release`` -> ``hold_for_move``) -- as the whole PUSH_PULL message. When the move
    ends it is served again from the start (``SliceService._finish`` -> ``_serve_held``): its push is
    tried again, the slice is gone, the answer is "moved", and the worker sends the push again to
    server 0, which already holds it with the slice: applied twice."""
    state = {"armed": False}
    last_chunks: set[tuple[int, int]] = set()

    def lose(header: dict) -> bool:
        if header["op"] == int(Op.SLICE_STATE) and header["body"].get("last"):
            last_chunks.add((header["inc"], header["req"]))
            return False
        return state["armed"] and header["op"] == int(Op.OK) and (header["inc"], header["req"]) in last_chunks

    with ThreadCluster(nodes=2, transport=LosingTransport(ZmqTransport(), lose)) as c:
        w0 = Worker(c.spec, 0, 0, ZmqTransport(), local_access=False)
        w1 = Worker(c.spec, 1, 1, ZmqTransport(), local_access=False)
        c.workers += [w0, w1]
        t0, _ = (w.table("t", 8, 1, optimizer=shoal.optim.Sum(), slices=2, consistency=shoal.BSP()) for w in (w0, w1))
        assert t0.layout.owners.tolist() == [0, 1]
        keys = t0.layout.mapping.keys_of(1)
        server1 = c.servers[1]
        w0.advance_clock()
        late = t0.push_pull_async(keys, np.ones((keys.shape[0], 1), np.float32))  # clock 1: held for worker 1
        wait_until(lambda: _pumped(w0) and bool(server1.tables["t"].controller.held), what="the read held")
        state["armed"] = True
        mover = threading.Thread(target=_move, args=(c, "t", 1, 0))  # an operator outside the job
        mover.start()
        wait_until(lambda: 1 in server1.tables["t"].moving and bool(last_chunks), what="slice 1 moving")
        w1.advance_clock()  # slowest 1 at server 1: the read is released, its slice is moving: held whole
        wait_until(lambda: server1.slicing.stats["requests_held_for_moves"] >= 1, what="the push_pull held")
        state["armed"] = False  # the new owner's answer comes: the move ends
        mover.join(timeout=30)
        assert not mover.is_alive()
        late.result()
        w0.wait_all()
        values = c.servers[0].tables["t"].pull(keys)[:, 0]
        np.testing.assert_array_equal(values, np.ones(keys.shape[0]), err_msg=f"the push_pull was applied "
                                      f"{values.max():.0f} times ({t0.counters['moved_retries']} sent again as moved)")


def test_a_slice_whose_first_chunk_is_lost_and_sent_again_keeps_its_rows():
    """A slice larger than one message moves in several SLICE_STATE chunks, each its own request. The
    first chunk was lost once and sent again after the last had arrived: the new owner took the slice
    on the chunk marked last, with the first chunk's rows never loaded (zeros), and the first chunk,
    sent again, opened a new incoming slice that nothing completed. The rows of the first chunk read 0
    after the move. A slice is taken now once every row has come."""
    from shoal.api.config import Limits
    from shoal.wire.ops import Op
    from tests.support.losing import LosingTransport

    lost: list[int] = []

    def lose(header: dict) -> bool:
        if header["op"] == int(Op.SLICE_STATE) and header["body"].get("first_row") == 0 \
                and not header["body"].get("last") and not lost:
            lost.append(1)
            return True
        return False

    limits = Limits(max_message_bytes=1 << 16)  # a chunk carries ~220 rows of 64 float32
    with ThreadCluster(nodes=2, transport=LosingTransport(ZmqTransport(), lose), limits=limits) as c:
        w0 = c.worker(0, local_access=False)
        t0 = w0.table("big", 4000, 64, optimizer=shoal.optim.Sum(), slices=4)
        keys = np.arange(4000)
        t0.push(keys, np.ones((4000, 64), np.float32))
        assert int(t0.layout.owners[0]) == 0
        w0.move_slice("big", 0, to=1, timeout=30)
        assert lost, "no chunk was lost: the slice went in one chunk"
        time.sleep(2.0)  # the lost chunk is sent again meanwhile
        got = t0.pull(keys)[:, 0]
        bad = np.flatnonzero(got != 1.0)
        assert bad.size == 0, f"{bad.size} rows lost their push after the move (first: {bad[:5]}, read {got[bad[:5]]})"
