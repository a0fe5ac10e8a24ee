"""A worker's requests to a server are handled in their stream's order, whatever order they arrive in."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import shoal
from shoal import Normal, TableSpec
from shoal.transport.zmq_transport import ZmqTransport
from shoal.wire import Message, Op
from tests.support.cluster import ThreadCluster
from tests.support.live_server import INCARNATION, REPLY_WAIT_S, WORKER, LiveServer, RawClient
from tests.support.losing import LosingTransport

SPEC = TableSpec("t", num_keys=8, dim=1, init=Normal(std=0.0), seed=1)


def _push(client: RawClient, req: int, seq: int, floor: int) -> None:
    """Send a push of +1 to key 0 as request ``seq`` of worker 0's stream, without waiting."""
    msg = Message(Op.PUSH, req=req, table="t", sender=WORKER, incarnation=INCARNATION,
                  body={"stream": [1, seq, floor, 0]},
                  arrays=[np.zeros(1, np.int64), np.ones((1, 1), np.float32)])
    client.send_frames(client.codec.encode(msg))


def test_a_floor_that_skips_to_a_waiting_request_serves_it_and_those_after(
        start_server: Callable[..., LiveServer], connect: Callable[..., RawClient]) -> None:
    """Request 2 was given up by its worker (it timed out, say), and arrives late or never. Request
    3 arrives first and waits for it; request 4 says that nothing below 3 is awaited any more: 3 is
    next, and is served at once, then 4 (the server waited for a request timeout,
    which stalled every bounded read behind them: the ESSP run of bench_consistency under injected
    network delay)."""
    client = connect(start_server())
    client.create_table(SPEC)
    _push(client, req=1, seq=1, floor=1)
    assert client.reply().op == Op.OK
    _push(client, req=3, seq=3, floor=2)  # waits for 2
    _push(client, req=4, seq=4, floor=3)  # 2 is not awaited any more
    started = time.monotonic()
    answered = {client.reply().req, client.reply().req}
    assert answered == {3, 4} and time.monotonic() - started < REPLY_WAIT_S
    assert client.pull(np.zeros(1, np.int64))[0, 0] == 3.0


def test_a_clock_tick_lost_while_an_earlier_request_is_unanswered_holds_back_nothing() -> None:
    """A worker's clock ticks are requests in its stream; a newer tick used to supersede an unanswered
    older one, which it forgot (never sent again). A tick lost on the way while an earlier push was
    still unanswered left a hole the server could not skip: the requests after it carried the
    earlier push as their floor, and once that push was answered the worker sent nothing newer, so
    its next push waited at the server for the lost tick until the request timeout (1 run in 6-16
    of the bounds-while-slices-move test under 1% loss). Now a tick is sent again until answered."""
    armed = threading.Event()
    lost = {"CLOCK": 0, "OK": 0}

    def lose(header: dict[str, Any]) -> bool:
        """The first tick reaching the server, and the first three answers reaching the worker (the
        first push's, sent again: it stays unanswered while the next tick goes)."""
        op = Op(header["op"]).name
        if armed.is_set() and op in lost and lost[op] < (1 if op == "CLOCK" else 3):
            lost[op] += 1
            return True
        return False

    timeouts = shoal.Timeouts(connect_s=10.0, request_s=4.0, barrier_s=10.0)
    with ThreadCluster(nodes=1, transport=LosingTransport(ZmqTransport(), lose), timeouts=timeouts) as c:
        w = c.worker(0, local_access=False)
        t = w.table("ticks", 8, 1, consistency=shoal.SSP(1))  # bounded: every clock ticks
        keys = np.arange(8)
        armed.set()
        first = t.push_async(keys, np.ones((8, 1), np.float32))  # its answer lost, three times
        w.advance_clock()  # lost
        second = t.push_async(keys, np.ones((8, 1), np.float32))
        w.advance_clock()  # superseded the lost one, and carried the first push as its floor
        first.wait()
        second.wait()  # waited for the lost tick until the request timeout
        assert lost == {"CLOCK": 1, "OK": 3}
        np.testing.assert_array_equal(t.pull(keys)[:, 0], 2.0)


def _position(seq: int, floor: int) -> Message:
    return Message(Op.PUSH, req=100 + seq, table="t", sender=0, incarnation=5, body={"stream": [1, seq, floor, 0]})


def test_a_floor_heard_while_a_request_is_parked_skips_what_the_worker_gave_up_once_it_is_handled() -> None:
    # Request 1 is held for a slice move; the move outlasts the worker's timeout, which gives up 1 and 2
    # (2 never came) and says so in request 3 (floor 3). Once 1 is handled, 3 goes: it must not wait for 2.
    from shoal.server.streams import StreamOrder
    from tests.support.clock import ManualClock

    order = StreamOrder(num_workers=1, now=ManualClock())
    first, third = _position(1, 1), _position(3, 3)
    assert order.admit(b"w", first)
    order.park(first)
    assert not order.admit(b"w", third)  # behind the parked one
    assert order.unpark(first)
    order.finished(first)
    ready = order.next_ready(0)
    assert ready is not None and ready[1] is third
    assert order.waiting_count() == 0


def test_pushes_applied_on_the_lane_free_their_stream_and_their_general_copies_are_only_acknowledged() -> None:
    """A push the lane applied (``server.lane``) is counted handled in its worker's stream: the requests
    after it go on. Its general copy (sent when the lane's answer was late) must not be applied again:
    one that comes after is known as such (``handled_on_lane``), one that came before and waited for
    its turn is taken out of the stream for the server to acknowledge (``take_lane_copies``)."""
    from shoal.server.streams import StreamOrder

    def request(seq: int, floor: int = 1) -> Message:
        return Message(Op.PUSH, req=seq, table="t", sender=WORKER, incarnation=INCARNATION,
                       body={"stream": [7, seq, floor, 0]})

    order = StreamOrder(num_workers=1)
    first = request(1)
    assert order.admit(b"w", first)
    order.finished(first)
    early_copy, after = request(3), request(4)  # both wait for 2, which goes on the lane
    assert not order.admit(b"w", early_copy) and not order.admit(b"w", after)
    order.lane_handled(WORKER, 7, 2)
    order.lane_handled(WORKER, 7, 3)  # the lane applied 3 too: its copy waiting here is not for serving
    assert order.take_lane_copies() == [(b"w", early_copy)]
    assert order.next_ready(WORKER) == (b"w", after)
    order.finished(after)
    assert order.handled_on_lane(request(2)) and order.handled_on_lane(request(3))
    assert not order.handled_on_lane(request(4))  # handled the general way
    assert not order.handled_on_lane(request(5))  # not handled at all
    assert not order.handled_on_lane(request(0, floor=0))  # (a ring's unwritten places name no request)
    assert order.seen(WORKER) == 4
