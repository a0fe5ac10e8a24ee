"""A transport that loses the messages a test picks, and no others: the network fault that random loss
(``FaultyTransport``) makes only sometimes, made every time."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import msgspec

from shoal.client.worker import Worker
from shoal.transport.base import Connection, Listener, Transport
from shoal.transport.faulty import Faults, FaultyTransport, _Delayed
from shoal.transport.zmq_transport import ZmqTransport
from tests.support.cluster import ThreadCluster


class _Losing(_Delayed):
    def __init__(self, lose: Callable[[dict[str, Any]], bool]) -> None:
        super().__init__(Faults(), random.Random(0))
        self.lose = lose

    def admit(self, item: Any) -> None:
        frames = item[1] if isinstance(item, tuple) else item  # a listener's arrivals name their peer
        if self.lose(msgspec.msgpack.decode(bytes(frames[0]))):
            self.stats["lost"] += 1
            return
        super().admit(item)


class LosingTransport(FaultyTransport):
    """Wraps ``inner``; what arrives anywhere is lost when ``lose(its decoded header)`` says so."""

    def __init__(self, inner: Transport, lose: Callable[[dict[str, Any]], bool]) -> None:
        super().__init__(inner, Faults())
        self.lose = lose

    def listen(self, address: str, max_frame_bytes: int | None = None) -> Listener:
        listener = super().listen(address, max_frame_bytes)
        listener.delayed = _Losing(self.lose)  # type: ignore[attr-defined]
        return listener

    def connect(self, address: str) -> Connection:
        conn = super().connect(address)
        conn.delayed = _Losing(self.lose)  # type: ignore[attr-defined]
        return conn


def workers_with_losses(cluster: ThreadCluster, lose: Callable[[dict[str, Any]], bool]) -> tuple[Worker, Worker]:
    """Workers 0 and 1 of ``cluster`` on nodes 0 and 1, reaching every table through their servers;
    what arrives at worker 0 is lost where ``lose(its decoded header)`` says so."""
    lossy = Worker(cluster.spec, 0, 0, LosingTransport(ZmqTransport(), lose), local_access=False)
    plain = Worker(cluster.spec, 1, 1, ZmqTransport(), local_access=False)
    cluster.workers += [lossy, plain]
    return lossy, plain
