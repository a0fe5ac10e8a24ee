"""The server's loop waits on its lane's socket once a worker has been told where the lane is."""

from __future__ import annotations

import secrets
import time

import numpy as np

import shoal
from shoal.transport.zmq_transport import ZmqTransport
from tests.support.cluster import ThreadCluster


def test_the_loop_waits_on_the_lane_only_once_a_worker_was_told_its_address() -> None:
    """Each socket a ZeroMQ wait covers costs the server's loop system calls at every pass. No
    request can come on the lane before a worker knows its address (a PING's answer), and the
    workers of a job whose tables are all adaptive do not ask for it while they train."""
    with ThreadCluster(nodes=1, transport=ZmqTransport(), secret=secrets.token_bytes(32), lane=True) as c:
        server = c.servers[0]
        assert server.lane is not None
        lane_socket = server.lane.socket.socket

        def waited_on() -> list[object]:
            return [socket for socket, _ in server.listener._poller.sockets]  # type: ignore[attr-defined]

        assert all(socket is not lane_socket for socket in waited_on())
        worker = c.worker(0, local_access=False)
        adaptive = worker.table("a", 64, 4, techniques="auto", optimizer=shoal.optim.Sum())
        keys = np.arange(8)
        for _ in range(20):
            adaptive.push(keys, np.ones((8, 4), np.float32))
            adaptive.pull(keys)
            worker.advance_clock()
        assert all(socket is not lane_socket for socket in waited_on())  # no static table: no lane asked for
        table = worker.table("t", 64, 4, optimizer=shoal.optim.Sum())
        table.push(keys, np.ones((8, 4), np.float32))
        deadline, reads = time.monotonic() + 20, 0
        while table.counters["lane_pulls"] == 0 and reads < 5000 and time.monotonic() < deadline:
            np.testing.assert_array_equal(table.pull(keys), np.ones((8, 4), np.float32))
            reads += 1
        assert table.counters["lane_pulls"] > 0, dict(table.counters)
        assert any(socket is lane_socket for socket in waited_on())
        for _ in range(20):  # served on the lane from now on
            np.testing.assert_array_equal(table.pull(keys), np.ones((8, 4), np.float32))
        assert table.counters["lane_pulls"] > 20
