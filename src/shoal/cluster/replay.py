"""Exactly-once serving of requests that may arrive more than once.

A requester sends a request again when its reply is overdue (the message or
its reply was lost, or the link duplicated it). The receiver keeps, per peer,
the requests it saw lately and the replies it sent: a repeat of one still
being served is dropped, a repeat of one already answered gets the same reply
again, and only a new request is served. A push applied twice would be a lost
update of another kind, so this sits in front of every handler.
"""

from __future__ import annotations

from collections import OrderedDict
from enum import Enum
from typing import Any

#: requests remembered per peer: far more than any peer keeps in flight
PER_PEER = 4096
#: peers remembered (connections come and go; the oldest is forgotten first)
PEERS = 4096
#: bytes of replies kept to answer repeats with; older replies are dropped first
REPLY_BYTES = 8 << 20
#: larger replies are not kept: a repeat of a read is served again instead (reads are idempotent)
KEEP_REPLY_BYTES = 64 << 10


class Verdict(Enum):
    NEW = "new"  # serve it
    IN_PROGRESS = "in progress"  # a repeat of one being served: drop it
    ANSWERED = "answered"  # a repeat of one answered: send the kept reply again (if kept; else the
    # receiver serves a read again, and drops anything else)


_SERVING = None  # a request seen whose reply is not sent yet


class ReplayGuard:
    def __init__(self, per_peer: int = PER_PEER, peers: int = PEERS, reply_bytes: int = REPLY_BYTES,
                 keep_reply_bytes: int = KEEP_REPLY_BYTES) -> None:
        self.per_peer, self.max_peers, self.reply_bytes = per_peer, peers, reply_bytes
        self.keep_reply_bytes = min(keep_reply_bytes, reply_bytes)
        self._peers: OrderedDict[bytes, OrderedDict[int, list[Any] | bool | None]] = OrderedDict()
        self._kept: OrderedDict[tuple[bytes, int], int] = OrderedDict()  # replies kept, oldest first: size
        self._kept_bytes = 0

    def admit(self, peer: bytes, req: int) -> tuple[Verdict, list[Any] | None]:
        """Whether request ``req`` from ``peer`` is new; for a repeat of an answered one, its reply if kept."""
        seen = self._peers.get(peer)
        if seen is None:
            seen = self._peers[peer] = OrderedDict()
            if len(self._peers) > self.max_peers:
                old_peer, old = self._peers.popitem(last=False)
                for r in old:
                    self._forget_reply((old_peer, r))
        else:
            self._peers.move_to_end(peer)
        if req in seen:
            entry = seen[req]
            if entry is _SERVING:
                return Verdict.IN_PROGRESS, None
            return Verdict.ANSWERED, entry if isinstance(entry, list) else None
        seen[req] = _SERVING
        if len(seen) > self.per_peer:
            old_req, _ = seen.popitem(last=False)
            self._forget_reply((peer, old_req))
        return Verdict.NEW, None

    def answered(self, peer: bytes, req: int, frames: list[Any], size: int) -> None:
        """Keep the reply to ``req`` (within the byte budget) to send again if the request is repeated."""
        seen = self._peers.get(peer)
        if seen is None or req not in seen:
            return
        seen[req] = frames if size <= self.keep_reply_bytes else True
        if size > self.keep_reply_bytes:
            return
        self._kept[(peer, req)] = size
        self._kept_bytes += size
        while self._kept_bytes > self.reply_bytes:
            (old_peer, old_req), _ = next(iter(self._kept.items()))
            self._forget_reply((old_peer, old_req))
            entries = self._peers.get(old_peer)
            if entries is not None and old_req in entries:
                entries[old_req] = True  # answered, reply no longer kept

    def _forget_reply(self, key: tuple[bytes, int]) -> None:
        size = self._kept.pop(key, None)
        if size is not None:
            self._kept_bytes -= size
