"""Worker clocks at a server: counted only in the worker's stream, told before a bounded read can wait
for them, and started over when the worker is."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import shoal
from shoal.transport.zmq_transport import ZmqTransport
from shoal.wire.ops import Op
from tests.support.cluster import ThreadCluster, table_on_every_worker
from tests.support.losing import LosingTransport
from tests.support.waiting import wait_until


def test_a_clock_carried_by_a_request_outside_the_stream_does_not_overtake_a_lost_push():
    """Worker 0's clock-0 push to slice 1 of a BSP table (server 1) is lost on its way, to be sent
    again. Its CLOCK 1 to server 1 is numbered in its stream, behind that push, and waits for it. The
    synchroniser learnt clocks from every worker message, and a push to an adaptive table (no stream:
    handled at once) told server 1 that worker 0 reached clock 1: worker 1's BSP read at clock 1 was
    answered without worker 0's clock-0 push."""
    armed = threading.Event()
    lost: list[dict] = []

    def lose_the_bsp_push(header: dict) -> bool:
        if armed.is_set() and not lost and header["op"] == int(Op.PUSH) and header["table"] == "bsp" \
                and header["sender"] == 0:
            lost.append(header)
            return True
        return False

    timeouts = shoal.Timeouts(connect_s=10.0, request_s=10.0, barrier_s=20.0, resend_s=3.0)
    with ThreadCluster(nodes=2, transport=LosingTransport(ZmqTransport(), lose_the_bsp_push),
                       timeouts=timeouts) as c:
        w0, w1 = c.worker(0, local_access=False), c.worker(1, local_access=False)
        bsp = [w.table("bsp", 20, 1, optimizer=shoal.optim.Sum(), slices=2, consistency=shoal.BSP())
               for w in (w0, w1)]
        adapt = w0.table("adapt", 20, 1, techniques="relocation")
        w1.table("adapt", 20, 1, techniques="relocation")
        slice1 = bsp[0].layout.mapping.keys_of(1)
        assert bsp[0].layout.owners.tolist() == [0, 1]
        armed.set()
        push = bsp[0].push_async(slice1, np.ones((slice1.shape[0], 1), np.float32))  # clock 0: lost
        w0.advance_clock()  # CLOCK 1, behind the lost push in worker 0's stream to server 1
        remote = np.arange(10, 20)  # an adaptive table's keys homed on server 1
        adapt.push(remote, np.ones((10, 1), np.float32))  # at clock 1, outside the stream
        w1.advance_clock()
        assert lost, "the push was not lost"
        reads: list[np.ndarray] = []
        reading = threading.Thread(target=lambda: reads.append(bsp[1].pull(slice1)))
        reading.start()  # worker 1 at clock 1 under BSP: every push of clock 0
        wait_until(lambda: bool(reads) or c.servers[1].sync.held_count() == 1, what="the read answered or held")
        push.wait()  # worker 0 sends its lost push again (after resend_s)
        reading.join(timeout=20)
        assert reads, "the read did not return"
        read = reads[0]
        np.testing.assert_array_equal(read[:, 0], np.ones(slice1.shape[0]),
                                      err_msg=f"server 1 clocks {c.servers[1].clocks.clocks.tolist()}")



def test_a_clock_an_asp_only_worker_has_not_told_yet_does_not_deadlock_bounded_reads():
    """Worker 0 has only an ASP table while it runs three quick clocks: ``client.ticks`` tells every
    server its clock at most every quiet period, so server 1 has heard clock 1 only (a tick left due). It
    then makes a BSP table (made by worker 1 earlier) and reads slice 0 at clock 3: held at server 0
    until worker 1 reaches clock 3. Worker 1, at clock 2, reads slice 1: held at server 1 until
    worker 0 reaches clock 2. The due tick went only with ``advance_clock`` or ``wait_all``, and worker
    0 waits in its read: both reads waited for each other until the request timeout. Making a bounded
    table sends it."""
    timeouts = shoal.Timeouts(connect_s=10.0, request_s=5.0, barrier_s=20.0)
    with ThreadCluster(nodes=2, timeouts=timeouts) as c:
        w0, w1 = c.worker(0, local_access=False), c.worker(1, local_access=False)
        for w in (w0, w1):
            w.table("asp", 8, 1)
        bsp1 = w1.table("bsp", 20, 1, optimizer=shoal.optim.Sum(), slices=2, consistency=shoal.BSP())
        for _ in range(2):
            w1.advance_clock()  # worker 1 at clock 2, told everywhere
        for _ in range(3):
            w0.advance_clock()  # quick clocks: only the first tick goes out at once
        bsp0 = w0.table("bsp", 20, 1, optimizer=shoal.optim.Sum(), slices=2, consistency=shoal.BSP())
        results: dict[int, object] = {}

        def read(rank: int, table, keys) -> None:
            try:
                results[rank] = table.pull(keys)
            except BaseException as exc:  # noqa: BLE001
                results[rank] = exc

        threads = [threading.Thread(target=read, args=(0, bsp0, bsp0.layout.mapping.keys_of(0))),
                   threading.Thread(target=read, args=(1, bsp1, bsp1.layout.mapping.keys_of(1)))]
        threads[0].start()
        wait_until(lambda: c.servers[0].sync.held_count() == 1, what="worker 0's read held at server 0")
        threads[1].start()
        wait_until(lambda: c.servers[1].sync.held_count() == 1 or 1 in results, what="worker 1's read held or served")
        threads[1].join(timeout=8)
        assert isinstance(results.get(1), np.ndarray), \
            f"worker 1's read at clock 2 never got worker 0's clock 2 to server 1: {results.get(1)!r} " \
            f"(server 1 clocks {c.servers[1].clocks.clocks.tolist()})"
        w1.advance_clock()
        threads[0].join(timeout=8)
        assert isinstance(results.get(0), np.ndarray), results.get(0)


@pytest.mark.parametrize("heard_first", [True, False], ids=["heard", "silent"])
def test_a_restarted_worker_is_held_to_the_bound_again(heard_first):
    # The job's workers are started again (new incarnations, at clock 0) on servers that counted their
    # earlier processes to clock 5 and ignored every lower clock: no BSP read waited for them. Heard
    # in its new stream, a restarted worker counts from its new clock. Silent, it was still counted at
    # clock 5, and worker 0's read at clock 2 passed without the pushes worker 1 was about to make: a
    # restarted worker tells every server its clock before it starts.
    with ThreadCluster(nodes=2) as c:
        keys = np.arange(16)
        ones = np.ones((16, 1), np.float32)
        first = [c.worker(r, local_access=False) for r in range(2)]
        tables = [w.table("bsp", 16, 1, optimizer=shoal.optim.Sum(), slices=2, consistency=shoal.BSP())
                  for w in first]
        for _ in range(5):
            for w, t in zip(first, tables, strict=True):
                t.push(keys, ones)
                w.advance_clock()
        for w in first:
            w.tracker.close()
            c.workers.remove(w)
        w0, w1 = c.worker(0, local_access=False), c.worker(1, local_access=False)
        t0, t1 = (w.table("bsp", 16, 1, optimizer=shoal.optim.Sum(), slices=2, consistency=shoal.BSP())
                  for w in (w0, w1))
        if heard_first:
            t1.push(keys, ones)
            w1.advance_clock()  # worker 1's new process heard by every server: at clock 1
        for _ in range(2):
            t0.push(keys, ones)
            w0.advance_clock()
        read: list[np.ndarray] = []
        reading = threading.Thread(target=lambda: read.append(t0.pull(keys)))
        reading.start()  # at clock 2: waits for worker 1's clock 2
        reading.join(timeout=0.5)
        assert not read, "the read passed before the restarted worker 1 reached clock 2"
        for _ in range(1 if heard_first else 2):
            t1.push(keys, ones)
            w1.advance_clock()
        reading.join(timeout=20)
        np.testing.assert_array_equal(read[0][:, 0], np.full(16, 14.0))


def test_a_worker_whose_unawaited_push_failed_still_leaves_and_holds_nobody_back():
    """Worker 1 starts a push that server 1 answers with an error, never waits for it, and shuts down.
    Leaving must still tell every server its final clock and the rendezvous that it left. ``shutdown``
    called ``wait_all`` first, which raised the push's unobserved error, logged as an unclean shutdown,
    and skipped both the final clock and the leave: the servers counted worker 1 at clock 0 for ever,
    and worker 0's BSP read at clock 1 was held until it expired."""
    from tests.support.cluster import fail_first_static_push

    timeouts = shoal.Timeouts(connect_s=10.0, request_s=6.0, barrier_s=20.0)
    with ThreadCluster(nodes=2, timeouts=timeouts) as c:
        w0, w1 = c.worker(0, local_access=False), c.worker(1, local_access=False)
        t0, t1 = table_on_every_worker([w0, w1], "t", 40, 1, optimizer=shoal.optim.Sum(), slices=2,
                                          consistency=shoal.BSP())
        slice0, slice1 = t0.layout.mapping.keys_of(0), t0.layout.mapping.keys_of(1)
        fail_first_static_push(c, 1)
        t1.push_async(slice1, np.ones((slice1.shape[0], 1), np.float32))  # fails at server 1; not awaited
        t1.push(slice0, np.ones((slice0.shape[0], 1), np.float32))  # acknowledged
        w1.shutdown()
        w0.advance_clock()
        started = time.monotonic()
        got = t0.pull(slice0)
        waited = time.monotonic() - started
        assert waited < timeouts.request_s / 2, waited
        np.testing.assert_array_equal(got[:, 0], np.ones(slice0.shape[0]))

