"""A worker's ordered stream of requests to a server (``client.streams``) as the server's
``StreamOrder`` sees it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from shoal.api.config import Limits
from shoal.api.errors import ClusterError
from shoal.client.streams import Streams
from shoal.client.worker import Worker
from shoal.cluster.requests import RequestTracker
from shoal.server.streams import StreamOrder
from shoal.transport.inproc import InProcTransport
from shoal.wire.codec import Codec
from shoal.wire.message import Message
from shoal.wire.ops import Op


def test_a_request_whose_send_failed_leaves_no_hole_that_later_requests_wait_for() -> None:
    # The first send finds the server's queue full (the ZeroMQ connection raises ClusterError after a
    # bounded wait): that request never left, so it must not stay the floor of the later ones, or the
    # server would hold each of them for a request that never comes.
    transport = InProcTransport()
    listener = transport.listen("inproc://*")
    tracker = RequestTracker(transport, Codec(Limits()), sender=0)
    tracker.connect(1, listener.address)
    # What ``send_ordered`` uses of a worker: its streams, its tracker and its settled clock.
    worker: Any = SimpleNamespace(streams=Streams(incarnation=7), tracker=tracker, settled_clock=lambda: 0)
    conn = tracker.connection(1)
    real_send, sends = conn.send, []

    def full_once(frames: Any, block: bool = True) -> bool:
        sends.append(frames)
        if len(sends) == 1:
            raise ClusterError("the peer accepted nothing for 5s (its queue is full)")
        return real_send(frames, block)

    conn.send = full_once  # type: ignore[method-assign]
    try:
        with pytest.raises(ClusterError):
            Worker.send_ordered(worker, 1, Message(Op.CLOCK, clock=1), "CLOCK 1")
        later = Message(Op.CLOCK, clock=2)
        Worker.send_ordered(worker, 1, later, "CLOCK 2")
        _, seq, floor, _ = later.body["stream"]
        assert (seq, floor) == (2, 2)
        assert StreamOrder(num_workers=1).admit(b"worker-0", later)
    finally:
        tracker.close()
        listener.close()
        transport.close()
