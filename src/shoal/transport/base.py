"""The transport contract: frames between a listener and the connections to it.

A *listener* is bound at an address and talks to many peers, each known by an
opaque peer id. A *connection* talks to exactly one listener. Frames are
buffers; what they mean is the wire layer's business. Every backend passes the
same contract tests (``tests/transport/test_contract.py``).
"""

from __future__ import annotations

import ipaddress
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

Frames = list[Any]  # each item supports the buffer protocol


def is_loopback_host(host: str) -> bool:
    """True for a host name or address only this machine can reach (a name like ``127.x.example``
    is not: it may resolve anywhere)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def loopback_host(address: str) -> str | None:
    """The IPv4 loopback host (or ``localhost``) of a tcp address, else None."""
    if not address.startswith("tcp://"):
        return None
    host = address[6:].rpartition(":")[0]
    return host if ":" not in host and is_loopback_host(host) else None


def is_loopback(address: str) -> bool:
    """True for addresses only this machine can reach (loopback tcp, ipc, in-process)."""
    if not address.startswith("tcp://"):
        return True
    return is_loopback_host(address[6:].rpartition(":")[0].strip("[]"))


class Listener(ABC):
    """A bound endpoint that receives from and replies to many peers."""

    address: str

    @abstractmethod
    def recv(self, timeout: float | None) -> tuple[bytes, Frames] | None:
        """Next ``(peer, frames)``, or None if nothing arrived within ``timeout`` seconds."""

    @abstractmethod
    def send(self, peer: bytes, frames: Sequence[Any]) -> bool:
        """Send to ``peer``; False if the peer is gone (the frames are dropped)."""

    def wake_on(self, conn: Connection) -> None:  # noqa: B027 - a hint; a listener may wait its timeout out
        """Let ``recv`` return None before its timeout when ``conn`` has something to read (the
        owner of both reads it then): one wait for both, where waiting on each in turn would leave
        an answer on ``conn`` unread for the listener's whole timeout."""

    def wake_on_native(self, native: Any) -> None:  # noqa: B027 - a hint, as ``wake_on``
        """``wake_on`` for a native socket (``transport.native.NativeSocket``)."""

    def woke_others(self) -> bool:
        """Whether what ``wake_on`` named may have something to read, as the last ``recv`` left it:
        False only where that call's wait saw none of it readable (the owner need not ask each)."""
        return True

    @abstractmethod
    def close(self) -> None: ...


class Connection(ABC):
    """One peer's link to a listener."""

    address: str

    @abstractmethod
    def send(self, frames: Sequence[Any], block: bool = True) -> bool:
        """Queue frames for the listener.

        A blocking send waits a bounded time for room and then raises
        ``ClusterError``; a non-blocking one returns False when there is no room
        (the frames are dropped). True when queued.
        """

    @abstractmethod
    def recv(self, timeout: float | None) -> Frames | None:
        """Next frames from the listener, or None after ``timeout`` seconds."""

    @abstractmethod
    def close(self) -> None: ...


class Poller(ABC):
    """Waits on several connections at once."""

    @abstractmethod
    def register(self, conn: Connection) -> None: ...

    @abstractmethod
    def unregister(self, conn: Connection) -> None: ...

    @abstractmethod
    def poll(self, timeout: float | None) -> list[Connection]:
        """Connections with frames ready, waiting at most ``timeout`` seconds."""


class Transport(ABC):
    """Makes listeners, connections and pollers of one kind."""

    @abstractmethod
    def listen(self, address: str, max_frame_bytes: int | None = None) -> Listener:
        """Bind at ``address``; a port of 0 picks a free port (see ``Listener.address``)."""

    @abstractmethod
    def connect(self, address: str) -> Connection: ...

    @abstractmethod
    def poller(self) -> Poller: ...

    def native_context(self) -> Any:
        """The ZeroMQ context native sockets (``transport.native``) open in, or None where this
        transport has none: messages between compiled code then take this transport's own path
        (a transport that injects faults keeps every message on it)."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook; most transports hold nothing
        """Release what the transport holds (sockets, contexts)."""
