"""The other servers of a job, as one server process reaches them.

One request tracker and one address book, shared by replication (gossip),
adaptive placement (relocation, replicas, intents) and slice moves: a peer's
address is followed from the rendezvous's status in one place, and each of those
services hears of a new or changed address through ``on_address``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from shoal.api.ids import server_sender
from shoal.cluster.requests import RequestTracker
from shoal.transport.base import Transport
from shoal.wire.codec import Codec


class PeerDirectory:
    def __init__(self, node: int, transport: Transport, codec: Codec, resend_s: float | None,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.node = node
        self.tracker = RequestTracker(transport, codec, sender=server_sender(node), resend_s=resend_s, now=now)
        #: each peer server's address, once it has registered
        self.addresses: dict[int, str] = {}
        self._listeners: list[Callable[[int], None]] = []

    def on_address(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(node)`` whenever a peer's address is new or changed (it registered, or was
        started again elsewhere)."""
        self._listeners.append(listener)

    def on_status(self, status: dict[str, Any]) -> None:
        """Follow the rendezvous's list of servers (None for one that has not registered or has left)."""
        for n, address in enumerate(status.get("servers") or []):
            if n != self.node and address and self.addresses.get(n) != address:
                self.addresses[n] = address
                self.tracker.connect(n, address)
                for listener in self._listeners:
                    listener(n)

    def close(self) -> None:
        self.tracker.close()
