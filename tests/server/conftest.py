"""Fixtures of the server tests: live servers, and raw clients of them."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import zmq

from shoal import ClusterSpec, Limits
from shoal.server.server import ParameterServer
from shoal.transport.zmq_transport import ZmqTransport
from shoal.wire import Codec
from tests.support.live_server import LiveServer, RawClient


@pytest.fixture
def start_server() -> Iterator[Callable[..., LiveServer]]:
    started: list[LiveServer] = []

    def start(secret: bytes | None = None, limits: Limits | None = None, workers: int = 1) -> LiveServer:
        cluster = ClusterSpec("test", num_nodes=1, workers_per_node=workers, rendezvous="tcp://127.0.0.1:1",
                              secret=secret, limits=limits or Limits())
        transport = ZmqTransport()
        started.append(LiveServer(ParameterServer(0, cluster, transport, share_memory=False), transport))
        return started[-1]

    yield start
    for live in started:
        live.stop()


@pytest.fixture
def connect() -> Iterator[Callable[..., RawClient]]:
    ctx = zmq.Context()
    sockets: list[zmq.Socket] = []

    def connect(live: LiveServer, secret: bytes | None = None) -> RawClient:
        sockets.append(ctx.socket(zmq.DEALER))
        sockets[-1].connect(live.server.address)
        return RawClient(sockets[-1], live, Codec(secret=secret, local=True))  # over loopback

    yield connect
    for sock in sockets:
        sock.close(linger=0)
    ctx.term()
