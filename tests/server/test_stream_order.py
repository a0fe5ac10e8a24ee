"""A worker's requests to a server are handled in their stream's order, whatever order they arrive in."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from shoal import Normal, TableSpec
from shoal.wire import Message, Op
from tests.support.live_server import INCARNATION, REPLY_WAIT_S, WORKER, LiveServer, RawClient

SPEC = TableSpec("t", num_keys=8, dim=1, init=Normal(std=0.0), seed=1)


def _push(client: RawClient, req: int, seq: int, floor: int) -> None:
    """Send a push of +1 to key 0 as request ``seq`` of worker 0's stream, without waiting."""
    msg = Message(Op.PUSH, req=req, table="t", sender=WORKER, incarnation=INCARNATION,
                  body={"stream": [1, seq, floor, 0]},
                  arrays=[np.zeros(1, np.int64), np.ones((1, 1), np.float32)])
    client.send_frames(client.codec.encode(msg))


def test_a_floor_that_skips_to_a_waiting_request_serves_it_and_those_after(
        start_server: Callable[..., LiveServer], connect: Callable[..., RawClient]) -> None:
    """Request 2 (a clock tick, say) was superseded and forgotten by its worker, and arrives late or
    never. Request 3 arrives first and waits for it; request 4 says that nothing below 3 is awaited
    any more: 3 is next, and is served at once, then 4 (the server waited for a request timeout,
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
