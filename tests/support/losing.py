"""A transport that loses the messages a test picks, and no others: the network fault that random loss
(``FaultyTransport``) makes only sometimes, made every time."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import msgspec

from shoal.transport.base import Connection, Listener, Transport
from shoal.transport.faulty import Faults, FaultyTransport, _Delayed


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
