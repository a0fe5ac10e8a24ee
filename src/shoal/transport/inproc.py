"""An in-process transport: queues instead of sockets, for unit tests of server
and client logic run in threads. Frames are copied on send, as a socket would.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from shoal.api.errors import ConfigError
from shoal.transport.base import Connection, Frames, Listener, Poller, Transport


def _copy(frames: Sequence[Any]) -> Frames:
    return [f if isinstance(f, bytes) else bytes(memoryview(f)) for f in frames]


class _Inbox:
    def __init__(self, cond: threading.Condition) -> None:
        self.items: deque[Any] = deque()
        self.cond = cond

    def put(self, item: Any) -> None:
        with self.cond:
            self.items.append(item)
            self.cond.notify_all()

    def get(self, timeout: float | None) -> Any | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while not self.items:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self.cond.wait(remaining)
            return self.items.popleft()


class InProcListener(Listener):
    def __init__(self, transport: InProcTransport, address: str) -> None:
        self.transport = transport
        self.address = address
        self.inbox = _Inbox(transport.cond)
        self.peers: dict[bytes, InProcConnection] = {}
        self.wakers: list[InProcConnection] = []  # ``wake_on``

    def recv(self, timeout: float | None) -> tuple[bytes, Frames] | None:
        if not self.wakers:
            return self.inbox.get(timeout)  # type: ignore[no-any-return]
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.inbox.cond:
            while not self.inbox.items:
                remaining = None if deadline is None else deadline - time.monotonic()
                if any(c.inbox.items for c in self.wakers) or (remaining is not None and remaining <= 0):
                    return None
                self.inbox.cond.wait(remaining)
            return self.inbox.items.popleft()  # type: ignore[no-any-return]

    def wake_on(self, conn: Connection) -> None:
        if isinstance(conn, InProcConnection):
            self.wakers.append(conn)

    def send(self, peer: bytes, frames: Sequence[Any]) -> bool:
        conn = self.peers.get(peer)
        if conn is None or conn.closed:
            return False
        conn.inbox.put(_copy(frames))
        return True

    def close(self) -> None:
        self.transport.listeners.pop(self.address, None)


class InProcConnection(Connection):
    def __init__(self, transport: InProcTransport, address: str, peer: bytes) -> None:
        self.transport = transport
        self.address = address
        self.peer = peer
        self.inbox = _Inbox(transport.cond)
        self.closed = False

    def send(self, frames: Sequence[Any], block: bool = True) -> bool:
        listener = self.transport.listeners.get(self.address)
        if listener is None:
            return True  # like ZeroMQ: nobody is bound yet, or any more; the caller times out
        listener.peers[self.peer] = self
        listener.inbox.put((self.peer, _copy(frames)))
        return True

    def recv(self, timeout: float | None) -> Frames | None:
        return self.inbox.get(timeout)  # type: ignore[no-any-return]

    def close(self) -> None:
        self.closed = True


class InProcPoller(Poller):
    def __init__(self, transport: InProcTransport) -> None:
        self.transport = transport
        self.conns: list[InProcConnection] = []

    def register(self, conn: Connection) -> None:
        assert isinstance(conn, InProcConnection)
        self.conns.append(conn)

    def unregister(self, conn: Connection) -> None:
        if conn in self.conns:
            self.conns.remove(conn)  # type: ignore[arg-type]

    def poll(self, timeout: float | None) -> list[Connection]:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.transport.cond:
            while True:
                ready: list[Connection] = [c for c in self.conns if c.inbox.items]
                remaining = None if deadline is None else deadline - time.monotonic()
                if ready or (remaining is not None and remaining <= 0):
                    return ready
                self.transport.cond.wait(remaining)


class InProcTransport(Transport):
    """Addresses are ``inproc://name``; ``inproc://*`` picks a fresh name."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.listeners: dict[str, InProcListener] = {}
        self._ids = itertools.count()

    def listen(self, address: str, max_frame_bytes: int | None = None) -> Listener:
        if not address.startswith("inproc://"):
            raise ConfigError(f"in-process transport speaks inproc://, got {address!r}")
        if address == "inproc://*":
            address = f"inproc://listener-{next(self._ids)}"
        if address in self.listeners:
            raise ConfigError(f"{address!r} is already bound")
        listener = InProcListener(self, address)
        self.listeners[address] = listener
        return listener

    def connect(self, address: str) -> Connection:
        if not address.startswith("inproc://"):
            raise ConfigError(f"in-process transport speaks inproc://, got {address!r}")
        return InProcConnection(self, address, f"peer-{next(self._ids)}".encode())

    def poller(self) -> Poller:
        return InProcPoller(self)
