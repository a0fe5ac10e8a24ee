"""A pull is held to the model its reader names for the slices it reads, not only to the table's."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from shoal import SSP, TableSpec
from shoal.wire import Message, Op
from tests.support.live_server import INCARNATION, LiveServer, RawClient

SPEC = TableSpec("t", num_keys=8, dim=1, consistency=SSP(5))
KEY = np.zeros(1, np.int64)


def _pull(client: RawClient, req: int, clock: int, named: object = None) -> None:
    """Worker 0's pull of key 0 at ``clock``, naming ``named`` as its model; not waited for."""
    msg = Message(Op.PULL, req=req, table="t", clock=clock, sender=0, incarnation=INCARNATION,
                  body={} if named is None else {"consistency": named}, arrays=[KEY])
    client.send_frames(client.codec.encode(msg))


def test_a_pull_naming_a_tighter_model_is_held_until_it_is_met(
        start_server: Callable[..., LiveServer], connect: Callable[..., RawClient]) -> None:
    """Two workers; worker 1 is at clock 0. Worker 0's pull at clock 3 is within the table's SSP(5)
    and answered at once; the same pull naming BSP waits for worker 1 to reach clock 3."""
    client = connect(start_server(workers=2))
    client.create_table(SPEC)
    _pull(client, req=1, clock=3)
    assert client.reply().req == 1
    _pull(client, req=2, clock=3, named={"kind": "bsp"})
    assert not client.sock.poll(300)  # held
    for clock in (1, 2):
        assert client.call(Message(Op.CLOCK, clock=clock, sender=1, body={"rank": 1})).op == Op.OK
    assert not client.sock.poll(100)  # worker 1 at clock 2: still held
    tick = Message(Op.CLOCK, req=9, clock=3, sender=1, incarnation=INCARNATION, body={"rank": 1})
    client.send_frames(client.codec.encode(tick))
    replies = {reply.req: reply for reply in (client.reply(), client.reply())}
    assert replies[9].op == Op.OK
    assert replies[2].op == Op.VALUES and replies[2].clock == 3


def test_a_pull_naming_no_model_is_refused_and_the_server_keeps_serving(
        start_server: Callable[..., LiveServer], connect: Callable[..., RawClient]) -> None:
    client = connect(start_server(workers=2))
    client.create_table(SPEC)
    for req, named in enumerate([{"kind": "strict"}, {"kind": ["ssp"]}, {"kind": "ssp", "staleness": -1},
                                 {"kind": "ssp", "lazy": {"max_pushes": "x"}}], start=1):
        _pull(client, req=req, clock=0, named=named)
        reply = client.reply()
        assert reply.req == req and reply.op == Op.ERROR and reply.body["code"] == "ProtocolError", reply.body
    assert client.pull(KEY)[0, 0] == 0.0
