"""Servers that join a running job: a bounded read of a slice moved to one is answered once it holds
what the bound promises. Each docstring says what went wrong before."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest

import shoal
from shoal.server.server import ParameterServer
from tests.support.cluster import ThreadCluster, table_on_every_worker
from tests.support.waiting import wait_until

TIMEOUTS = shoal.Timeouts(connect_s=10.0, request_s=6.0, barrier_s=20.0)
KEYS = 400



def _join_server(c: ThreadCluster, node: int) -> ParameterServer:
    """Start a server that joins the running cluster as ``node`` (scale out)."""
    server = ParameterServer(node, c.spec, c.transport, bind="inproc://*")
    thread = threading.Thread(target=server.run, daemon=True, name=f"server-{node}")
    thread.start()
    c.servers.append(server)
    c.threads.append(thread)
    wait_until(lambda: node in c.rendezvous.slices.live_servers(), what=f"server {node} registered")
    return server


def test_a_bsp_read_at_a_joined_server_does_not_wait_for_a_worker_that_has_left():
    """Worker 1 pushes at clock 0 and leaves (its final clock: it never holds anyone back again,
    every push of it applied). A server joins and slice 0 moves to it. Worker 0 at clock 1 reads
    slice 0 under BSP: every update of clocks < 1 is there, so the read must be answered.
    The joined server never heard worker 1's final clock (it was told only to the servers of that
    moment) and counted worker 1 at clock 0 for ever: the read was held until it expired. A slice
    now brings what its old owner knew of every worker's clock."""
    with ThreadCluster(nodes=2, timeouts=TIMEOUTS) as c:
        w0, w1 = c.worker(0, local_access=False), c.worker(1, local_access=False)
        t0, t1 = table_on_every_worker([w0, w1], "t", 40, 1, optimizer=shoal.optim.Sum(), slices=2,
                                          consistency=shoal.BSP())
        keys = np.arange(40)
        t1.push(keys, np.ones((40, 1), np.float32))  # clock 0
        w1.advance_clock()
        w1.shutdown()  # leaves: its final clock goes to servers 0 and 1
        _join_server(c, 2)
        w0.move_slice("t", 0, to=2)
        assert int(t0.layout.owners[0]) == 2
        w0.advance_clock()  # clock 1: needs every update of clock 0
        slice0 = t0.layout.mapping.keys_of(0)
        started = time.monotonic()
        got = t0.pull(slice0)
        assert time.monotonic() - started < TIMEOUTS.request_s / 2
        np.testing.assert_array_equal(got[:, 0], np.ones(slice0.shape[0]))


def test_a_bsp_read_at_a_joined_server_does_not_wait_for_ever_on_a_worker_busy_elsewhere():
    """A server joins and slice 0 moves to it (worker 0 asks). Worker 1 trains on, pushing to slice 1
    only (server 1) and advancing its clock: it ticks every server it knows, which are servers 0 and 1.
    Worker 0 at clock c reads slice 0 under BSP once worker 1 has reached c: the read must be answered.
    The joined server learnt worker 1's clock from nothing (worker 1 never heard of it: no request
    of it was refused, and the joined server's fence is told only to workers it has heard from), so
    it counted worker 1 at clock 0 and held the read until it expired. A worker under a bound now
    asks the rendezvous for the servers at most once a second, in the background. Worker 1 trains on
    while worker 0 reads (three clocks and then nothing left the answer to its question unread on a
    busy machine: it learnt of the joined server after its last tick, and the read waited for ever)."""
    with ThreadCluster(nodes=2, timeouts=TIMEOUTS) as c:
        w0, w1 = c.worker(0, local_access=False), c.worker(1, local_access=False)
        t0, t1 = table_on_every_worker([w0, w1], "t", 40, 1, optimizer=shoal.optim.Sum(), slices=2,
                                          consistency=shoal.BSP())
        slice0, slice1 = t0.layout.mapping.keys_of(0), t0.layout.mapping.keys_of(1)
        _join_server(c, 2)
        w0.move_slice("t", 0, to=2)
        assert int(t0.layout.owners[0]) == 2
        read = threading.Event()

        def train_elsewhere() -> None:  # worker 1 trains on slice 1 alone until worker 0's read is in
            for _ in range(2000):
                if read.is_set():
                    return
                t1.push(slice1, np.ones((slice1.shape[0], 1), np.float32))
                w1.advance_clock()
                time.sleep(0.002)

        for _ in range(3):
            t1.push(slice1, np.ones((slice1.shape[0], 1), np.float32))
            w1.advance_clock()
        elsewhere = threading.Thread(target=train_elsewhere, name="worker-1")
        elsewhere.start()
        try:
            t0.push(slice0, np.ones((slice0.shape[0], 1), np.float32))
            w0.advance_clock()  # clock 1; worker 1 is at clock 3 and on
            started = time.monotonic()
            got = t0.pull(slice0)
            waited = time.monotonic() - started
        finally:
            read.set()
            elsewhere.join(30)
        assert waited < TIMEOUTS.request_s / 2, waited
        np.testing.assert_array_equal(got[:, 0], np.ones(slice0.shape[0]))


def test_a_bsp_read_at_a_joined_server_is_answered_while_the_worker_ahead_waits_at_a_barrier():
    """A server joins and slice 0 moves to it while worker 1 last asked for the servers under a second
    ago (it asks at most once a second, as it advances its clock): worker 1 runs three clocks ahead
    knowing nothing of the joined server, and waits at a barrier. Worker 0 at clock 1 reads slice 0
    under BSP: the joined server holds the read for worker 1's clock, which it had only from the move
    (clock 0), while worker 1 waits for worker 0 at the barrier. The read waited until it expired.
    A worker under a bound now asks for the servers while it waits too, and tells a server it learns
    of its clock at once."""
    with ThreadCluster(nodes=2, timeouts=TIMEOUTS) as c:
        w0, w1 = c.worker(0, local_access=False), c.worker(1, local_access=False)
        t0, t1 = table_on_every_worker([w0, w1], "t", 40, 1, optimizer=shoal.optim.Sum(), slices=2,
                                          consistency=shoal.BSP())
        slice0, slice1 = t0.layout.mapping.keys_of(0), t0.layout.mapping.keys_of(1)
        # Worker 1 asked for the servers just before the join, and its next question falls after its
        # three clocks (held here: on a busy machine the join may take longer than the period).
        w1.replica_view.refresh(force=True)
        w1.replica_view.checked_at = math.inf
        _join_server(c, 2)
        w0.move_slice("t", 0, to=2)
        for _ in range(3):
            t1.push(slice1, np.ones((slice1.shape[0], 1), np.float32))
            w1.advance_clock()
        assert len(w1.servers) == 2, "worker 1 learnt of the joined server: the test sets up nothing"
        w1.replica_view.checked_at = w1.now()  # from here on it asks at most once a period, as always
        at_barrier = threading.Thread(target=w1.barrier, name="worker-1")
        at_barrier.start()
        try:
            t0.push(slice0, np.ones((slice0.shape[0], 1), np.float32))
            w0.advance_clock()  # clock 1; worker 1 is at clock 3, waiting at the barrier
            started = time.monotonic()
            got = t0.pull(slice0)
            waited = time.monotonic() - started
            w0.barrier()
        finally:
            at_barrier.join(30)
        assert waited < TIMEOUTS.request_s / 2, waited
        np.testing.assert_array_equal(got[:, 0], np.ones(slice0.shape[0]))


def test_a_worker_answers_the_fence_of_a_server_that_joined_later():
    """A server joins and slice 0 moves to it: it fences every worker (counts it only up to its
    settled clock) until the worker confirms the move. Worker 0 pushes to slice 1 (server 1 is slow
    to apply it: 1 s), advances to clock 1 and reads slice 0 under BSP; worker 1 is at clock 1 too.
    Worker 0's read carries settled clock 0 (its push is still open), so the joined server holds it;
    the push is acknowledged a second later, and the worker, waiting inside its call, answers the
    fence: the read must be answered then. The worker dropped every message of the joined server
    ("ignoring unexpected FENCE from server 2": it took only those of nodes below the cluster's
    initial node count), never confirmed, and the read was held until it expired."""
    with ThreadCluster(nodes=2, timeouts=TIMEOUTS) as c:
        w0, w1 = c.worker(0, local_access=False), c.worker(1, local_access=False)
        t0, t1 = table_on_every_worker([w0, w1], "t", 40, 1, optimizer=shoal.optim.Sum(), slices=2,
                                          consistency=shoal.BSP())
        slice0, slice1 = t0.layout.mapping.keys_of(0), t0.layout.mapping.keys_of(1)
        _join_server(c, 2)
        w0.move_slice("t", 0, to=2)
        w1.cluster_status()  # worker 1 knows the joined server: its ticks go there too
        w1.advance_clock()
        service = c.servers[1].static
        original = service._push

        def slow(table, msg):  # type: ignore[no-untyped-def]
            time.sleep(1.0)
            return original(table, msg)

        service._push = slow
        pushed = t0.push_async(slice1, np.ones((slice1.shape[0], 1), np.float32))  # clock 0, open for 1 s
        w0.advance_clock()
        started = time.monotonic()
        got = t0.pull(slice0)  # clock 1
        waited = time.monotonic() - started
        pushed.wait()
        assert waited < TIMEOUTS.request_s / 2, waited
        np.testing.assert_array_equal(got[:, 0], np.zeros(slice0.shape[0]))


@pytest.mark.parametrize("model", [shoal.BSP(), shoal.ESSP(0)], ids=["BSP", "ESSP0"])
def test_bounded_reads_of_a_slice_moved_to_a_joined_server_see_every_push(model):
    """A server joins a running 2-node job (grow) and slice 3 of a BSP table moves to it. Two workers
    then loop: read every key at clock c, push +1 to every key asynchronously, advance, and wait for
    the push one clock later. BSP promises every worker's pushes of clocks < c in a read at clock c:
    the minimum read at clock c is 2*c. The new owner's fence (a one-way FENCE message) was dropped by
    the worker, which accepted unsolicited messages only from nodes below the job's initial count,
    and ESSP rows from it alike: the reads timed out."""
    timeouts = shoal.Timeouts(connect_s=10.0, request_s=10.0, barrier_s=30.0)
    with ThreadCluster(nodes=2, timeouts=timeouts) as c:
        _join_server(c, 2)
        workers = [c.worker(0, local_access=False), c.worker(1, local_access=False)]
        wait_until(lambda: c.rendezvous.status()["servers"][2:3] not in ([], [None]),
                   what="server 2 registered")
        for w in workers:
            w.replica_view.refresh(force=True)
            w.cluster_status()
        tables = [w.table("grown", KEYS, 1, optimizer=shoal.optim.Sum(), slices=4, consistency=model)
                  for w in workers]
        workers[0].move_slice("grown", 3, to=2)
        seen: list[tuple[int, int, float]] = []
        errors: list[BaseException] = []

        def run(rank: int) -> None:
            try:
                previous = None
                for clock in range(8):
                    rows = tables[rank].pull(np.arange(KEYS))[:, 0]
                    seen.append((rank, clock, float(rows.min())))
                    push = tables[rank].push_async(np.arange(KEYS), np.ones((KEYS, 1), np.float32))
                    workers[rank].advance_clock()
                    if previous is not None:
                        previous.wait()
                    previous = push
                previous.wait()
                workers[rank].barrier()
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        elapsed = time.monotonic() - started
        assert not errors, errors
        late = [(r, clk, low) for r, clk, low in seen if low < 2 * clk]
        assert not late, f"reads missed pushes BSP promises: {late[:5]}"
        np.testing.assert_array_equal(tables[0].pull(np.arange(KEYS))[:, 0], np.full(KEYS, 16.0))
        assert elapsed < 20, f"8 clocks took {elapsed:.1f}s"
