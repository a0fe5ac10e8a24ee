"""ZeroMQ over tcp and ipc: ROUTER listeners, one DEALER per connection.

Large frames go out with ``copy=False`` (pyzmq holds a reference to the array
until libzmq has sent it) and come in as ``zmq.Frame`` views, so an array
crosses the process boundary without a Python-level copy.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import zmq

from shoal.api.errors import ClusterError, ConfigError
from shoal.transport.base import Connection, Frames, Listener, Poller, Transport

log = logging.getLogger(__name__)

_REPLY_TIMEOUT_MS = 100  # a listener drops a reply to a peer that has stopped draining its socket
_SEND_TIMEOUT_MS = 5_000  # a connection waits this long for room before calling the peer stuck
_LINGER_MS = 1_000  # let one-way messages (clock ticks) leave before a socket closes
# Frames below this are copied on send. Zero-copy hands the buffer to pyzmq's
# garbage-collector thread, which costs more than copying a few hundred KB.
_COPY_THRESHOLD = 512 * 1024
# pyzmq's flags are enum members: combining or testing them per message builds enum objects. Plain
# ints cost nothing (a 1-key request pays for the enum arithmetic in every send and every look).
_SNDMORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)
_POLLIN = int(zmq.POLLIN)
_EVENTS = int(zmq.EVENTS)


def _ms(timeout: float | None) -> int | None:
    """ZeroMQ's whole milliseconds, rounded up: a wait under one (a server's loop waits for its next
    deadline) truncated to 0 returned at once, and the loop spun until the deadline passed."""
    return None if timeout is None else max(0, math.ceil(timeout * 1000))


def normalise_address(address: str) -> str:
    """Accept ``tcp://host:0`` for a free port; check the scheme."""
    if address.startswith("tcp://"):
        host, _, port = address[6:].rpartition(":")
        if not host or not port:
            raise ConfigError(f"tcp address needs host:port, got {address!r}")
        return f"tcp://{host}:*" if port == "0" else address
    if address.startswith("ipc://"):
        return address
    raise ConfigError(f"ZeroMQ transport speaks tcp:// and ipc://, got {address!r}")


def _send_parts(socket: zmq.Socket[Any], parts: Sequence[Any], flags: int) -> None:
    """``send_multipart`` without its per-part type checks and enum arithmetic: our frames are
    bytes, arrays and frames already. libzmq queues a multipart message whole once its first part is
    taken, so only that part can fail for want of room."""
    last = len(parts) - 1
    send = socket.send
    for i in range(last):
        send(parts[i], flags | _SNDMORE, copy=False)
    send(parts[last], flags, copy=False)


def _recv_parts(socket: zmq.Socket[Any]) -> list[zmq.Frame]:
    """The parts of one message, each as a frame: ``recv_multipart`` asks the socket (an option read
    and enum conversions) after every part, where the frame itself knows whether more follow."""
    frame = socket.recv(copy=False)
    parts = [frame]
    while frame.more:
        frame = socket.recv(copy=False)
        parts.append(frame)
    return parts


class ZmqListener(Listener):
    def __init__(self, ctx: zmq.Context, address: str, max_frame_bytes: int | None) -> None:
        self.socket = ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.setsockopt(zmq.SNDTIMEO, _REPLY_TIMEOUT_MS)
        self.socket.setsockopt(zmq.LINGER, _LINGER_MS)
        self.socket.copy_threshold = _COPY_THRESHOLD
        if max_frame_bytes:
            self.socket.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        try:
            self.socket.bind(normalise_address(address))
        except zmq.ZMQError as exc:
            self.socket.close(0)
            raise ConfigError(f"cannot bind {address!r}: {exc}") from exc
        self.address = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._poller = zmq.Poller()  # one for the socket's life: Socket.poll makes one per call
        self._poller.register(self.socket, zmq.POLLIN)
        self._others_ready = True  # what the last wait saw of the sockets ``wake_on`` named (``woke_others``)

    def recv(self, timeout: float | None) -> tuple[bytes, Frames] | None:
        if timeout == 0:  # the server's loop drains a burst so: no poll call, no exception when empty
            self._others_ready = True
            if not self.socket.get(_EVENTS) & _POLLIN:
                return None
        else:
            # The poll says which sockets are readable: each one asked again is a system call more
            # (ZeroMQ takes in its pending commands), two per pass of the server's loop.
            ready = self._poller.poll(_ms(timeout))
            own = any(socket is self.socket for socket, _ in ready)
            self._others_ready = len(ready) > own
            if not own:
                return None  # nothing here (what came may be for a connection that wakes us)
        parts = _recv_parts(self.socket)
        return parts[0].bytes, parts[1:]

    def woke_others(self) -> bool:
        return self._others_ready

    def wake_on(self, conn: Connection) -> None:
        if isinstance(conn, ZmqConnection):
            self._wake_on_socket(conn.socket)

    def wake_on_native(self, native: Any) -> None:
        self._wake_on_socket(native.socket)

    def _wake_on_socket(self, socket: zmq.Socket[Any]) -> None:
        self._poller.register(socket, zmq.POLLIN)

    def send(self, peer: bytes, frames: Sequence[Any]) -> bool:
        try:
            _send_parts(self.socket, [peer, *frames], 0)
            return True
        except zmq.ZMQError as exc:
            # EHOSTUNREACH: the peer disconnected, as every peer does when a job ends; a peer that
            # comes back sends its request again. EAGAIN: the peer stopped reading, worth a warning.
            (log.debug if exc.errno == zmq.EHOSTUNREACH else log.warning)("dropping reply to peer %r: %s", peer, exc)
            return False

    def close(self) -> None:
        self.socket.close()


class ZmqConnection(Connection):
    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.address = address
        self.socket = ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, _LINGER_MS)
        self.socket.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
        self.socket.copy_threshold = _COPY_THRESHOLD
        self._poller = zmq.Poller()  # one for the socket's life: Socket.poll makes one per call
        self._poller.register(self.socket, zmq.POLLIN)
        try:
            self.socket.connect(normalise_address(address))
        except zmq.ZMQError as exc:
            self.socket.close(0)
            raise ConfigError(f"cannot connect to {address!r}: {exc}") from exc

    def send(self, frames: Sequence[Any], block: bool = True) -> bool:
        try:
            _send_parts(self.socket, frames, 0 if block else _NOBLOCK)
            return True
        except zmq.Again:
            if not block:
                return False
            raise ClusterError(f"the peer at {self.address} accepted nothing for {_SEND_TIMEOUT_MS / 1000:.0f}s "
                               "(its queue is full: stopped or overloaded)") from None

    def recv(self, timeout: float | None) -> Frames | None:
        if timeout == 0:
            if not self.socket.get(_EVENTS) & _POLLIN:
                return None
        elif not self._poller.poll(_ms(timeout)):
            return None
        return _recv_parts(self.socket)

    def close(self) -> None:
        self.socket.close()


class ZmqPoller(Poller):
    def __init__(self) -> None:
        self._poller = zmq.Poller()
        self._conns: dict[zmq.Socket, ZmqConnection] = {}

    def register(self, conn: Connection) -> None:
        assert isinstance(conn, ZmqConnection)
        self._conns[conn.socket] = conn
        self._poller.register(conn.socket, zmq.POLLIN)

    def unregister(self, conn: Connection) -> None:
        assert isinstance(conn, ZmqConnection)
        if self._conns.pop(conn.socket, None) is not None:
            self._poller.unregister(conn.socket)

    def poll(self, timeout: float | None) -> list[Connection]:
        return [self._conns[s] for s, _ in self._poller.poll(_ms(timeout))]


class ZmqTransport(Transport):
    def __init__(self) -> None:
        self.ctx = zmq.Context()

    def listen(self, address: str, max_frame_bytes: int | None = None) -> Listener:
        return ZmqListener(self.ctx, address, max_frame_bytes)

    def connect(self, address: str) -> Connection:
        return ZmqConnection(self.ctx, address)

    def poller(self) -> Poller:
        return ZmqPoller()

    def native_context(self) -> zmq.Context:
        return self.ctx

    def close(self) -> None:
        # destroy() closes sockets still open (term() alone would wait for them forever).
        self.ctx.destroy(linger=_LINGER_MS)
