"""A live server for tests that speak to it frame by frame: its real loop in a thread behind ZeroMQ
on loopback tcp, and a raw DEALER socket of the test's own (so frames can be made, malformed or
reordered by hand)."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import zmq

from shoal import TableSpec
from shoal.cluster.replay import new_incarnation
from shoal.server.server import ParameterServer
from shoal.transport.zmq_transport import ZmqTransport
from shoal.wire import Codec, Message, Op

REPLY_WAIT_S = 30.0  # generous: the first request may wait for numba to compile the kernels
WORKER = 0  # requests come as worker 0's, of one stream
INCARNATION = new_incarnation()


@dataclass
class LiveServer:
    """A ``ParameterServer`` running its loop in a thread; ``failure`` is what killed the loop, if anything."""

    server: ParameterServer
    transport: ZmqTransport
    thread: threading.Thread = field(init=False)
    failure: BaseException | None = None

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, name="shoal-test-server", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.server.run(register=False)
        except BaseException as exc:  # kept for the test to report, instead of an unhandled-thread warning
            self.failure = exc

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(REPLY_WAIT_S)
        assert not self.thread.is_alive(), "server loop did not stop"
        self.transport.close()


class RawClient:
    """A DEALER socket talking to one live server."""

    def __init__(self, sock: zmq.Socket, live: LiveServer, codec: Codec) -> None:
        self.sock = sock
        self.live = live
        self.codec = codec
        self._reqs = itertools.count(100)

    def send_frames(self, frames: list[Any]) -> None:
        self.sock.send_multipart(frames)

    def reply(self, codec: Codec | None = None) -> Message:
        """The next reply, decoded; fails fast if the server loop has died."""
        deadline = time.monotonic() + REPLY_WAIT_S
        while not self.sock.poll(50):
            if not self.live.thread.is_alive():
                pytest.fail(f"server loop died: {self.live.failure!r}")
            if time.monotonic() > deadline:
                pytest.fail(f"no reply within {REPLY_WAIT_S}s")
        return (codec or self.codec).decode(self.sock.recv_multipart())

    def call(self, msg: Message) -> Message:
        if not msg.req:
            msg.req = next(self._reqs)
        msg.sender, msg.incarnation = WORKER if msg.sender == -1 else msg.sender, INCARNATION
        self.send_frames(self.codec.encode(msg))
        reply = self.reply()
        assert reply.req == msg.req
        return reply

    def create_table(self, spec: TableSpec) -> None:
        reply = self.call(Message(Op.CREATE_TABLE, table=spec.name, body={"spec": spec.to_dict()}))
        assert reply.op == Op.OK, reply.body

    def pull(self, keys: np.ndarray, table: str = "t") -> np.ndarray:
        reply = self.call(Message(Op.PULL, table=table, arrays=[keys]))
        assert reply.op == Op.VALUES, reply.body
        return reply.arrays[0].copy()

    def push(self, keys: np.ndarray, values: np.ndarray, table: str = "t") -> Message:
        return self.call(Message(Op.PUSH, table=table, arrays=[keys, values]))
