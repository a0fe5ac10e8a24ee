"""Exactly-once serving of requests that may arrive more than once, by mistake or by malice.

A requester sends a request again when its reply is overdue (the message or
its reply was lost, or the link duplicated it); an attacker who captured a
tagged message may play it again on a connection of its own. The receiver
therefore keeps, per *stream* -- a requester's incarnation, with the sender
it belongs to, both covered by the tag -- the requests it saw lately and the replies it sent: a
repeat of one still being served is dropped, a repeat of one already answered
gets the same reply again, and only a new request is served. A push applied
twice would be a lost update of another kind, so this sits in front of every
handler, for one-way messages too.

Memory is bounded whatever peers send. Per stream, only the latest
``PER_STREAM`` request numbers are kept, and every number at or below the
highest one forgotten is refused from then on (its ``floor``); across streams,
at most ``ENTRIES`` numbers are kept (the least recently heard stream loses its
oldest first), and at most ``STREAMS`` streams. A stream dropped altogether
raises its sender's *horizon* to the stream's birth time, which an incarnation
carries in its high bits: a stream of that sender born no later is refused as
one that may have been dropped. A live requester is never hit by this, because
a tracker's incarnation is born when it sends its first request.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

#: request numbers remembered per stream: far more than any requester keeps in flight
PER_STREAM = 4096
#: request numbers remembered in all (about 100 bytes each)
ENTRIES = 1 << 17
#: streams remembered; the least recently heard is forgotten first
STREAMS = 4096
#: bytes of replies kept to answer repeats with; older replies are dropped first
REPLY_BYTES = 8 << 20
#: larger replies are not kept: a repeat of a read is served again instead (reads are idempotent)
KEEP_REPLY_BYTES = 64 << 10
#: senders whose horizon is remembered; past this, one horizon for all
HORIZONS = 1 << 16

_KEPT_AFTER_LEAVING = 16
_RANDOM_BITS = 22  # an incarnation: its birth in milliseconds since the epoch, then random bits


class Verdict(Enum):
    NEW = "new"  # serve it
    IN_PROGRESS = "in progress"  # a repeat of one being served: drop it
    ANSWERED = "answered"  # a repeat of one answered: send the kept reply again (if kept; else the
    # receiver serves a read again, and drops anything else)
    STALE = "stale"  # older than what is remembered of its stream: it may have been served; refuse it


_SERVING = None  # a request seen whose reply is not sent yet


def new_incarnation() -> int:
    """A stream's name, unique per requester and born now."""
    return (time.time_ns() // 1_000_000) << _RANDOM_BITS | secrets.randbits(_RANDOM_BITS)


def born_ms(incarnation: int) -> int:
    return incarnation >> _RANDOM_BITS


@dataclass
class _Stream:
    sender: int
    floor: int = 0  # every request number at or below this is refused unless still remembered
    #: request number -> the reply frames kept, True (answered, reply not kept) or None (serving)
    seen: OrderedDict[int, list[Any] | bool | None] = field(default_factory=OrderedDict)


class ReplayGuard:
    def __init__(self, per_stream: int = PER_STREAM, entries: int = ENTRIES, streams: int = STREAMS,
                 reply_bytes: int = REPLY_BYTES, keep_reply_bytes: int = KEEP_REPLY_BYTES) -> None:
        self.per_stream, self.max_entries, self.max_streams = per_stream, entries, streams
        self.reply_bytes = reply_bytes
        self.keep_reply_bytes = min(keep_reply_bytes, reply_bytes)
        #: by incarnation, least recently heard first
        self._streams: OrderedDict[int, _Stream] = OrderedDict()
        self._entries = 0
        self._horizon: dict[int, int] = {}  # sender -> birth (ms) of its latest dropped stream
        self._common_horizon = 0
        self._kept: OrderedDict[tuple[int, int], int] = OrderedDict()  # replies kept, oldest first: size
        self._kept_bytes = 0

    @property
    def entries(self) -> int:
        """Request numbers remembered now (for metrics and the memory bound's tests)."""
        return self._entries

    @property
    def streams(self) -> int:
        return len(self._streams)

    @property
    def kept_reply_bytes(self) -> int:
        return self._kept_bytes

    def admit(self, sender: int, incarnation: int, req: int) -> tuple[Verdict, list[Any] | None]:
        """Whether request ``req`` of ``sender``'s stream ``incarnation`` is new; for a repeat of an
        answered one, its reply if kept."""
        key = incarnation
        stream = self._streams.get(key)
        if stream is None:
            if born_ms(incarnation) <= max(self._horizon.get(sender, 0), self._common_horizon):
                return Verdict.STALE, None
            stream = self._streams[key] = _Stream(sender)
            if len(self._streams) > self.max_streams:
                self._drop_stream(next(iter(self._streams)))
        elif stream.sender != sender:  # another sender's stream: only a forger would ask this
            return Verdict.STALE, None
        else:
            self._streams.move_to_end(key)
        entry = stream.seen.get(req, False)
        if entry is not False:
            if entry is _SERVING:
                return Verdict.IN_PROGRESS, None
            return Verdict.ANSWERED, entry if isinstance(entry, list) else None
        if req <= stream.floor:
            return Verdict.STALE, None
        stream.seen[req] = _SERVING
        self._entries += 1
        if len(stream.seen) > self.per_stream:
            self._forget_oldest(key, stream)
        while self._entries > self.max_entries:
            oldest_key, oldest = next(iter(self._streams.items()))
            self._forget_oldest(oldest_key, oldest)
        return Verdict.NEW, None

    def answered(self, incarnation: int, req: int, frames: list[Any], size: int) -> None:
        """Keep the reply to request ``req`` of stream ``incarnation`` (within the byte budget) to send
        again if the request is repeated."""
        key = incarnation
        stream = self._streams.get(key)
        if stream is None or req not in stream.seen:
            return
        keep = size <= self.keep_reply_bytes
        stream.seen[req] = frames if keep else True
        if not keep:
            return
        self._kept[(key, req)] = size
        self._kept_bytes += size
        while self._kept_bytes > self.reply_bytes:
            old_key, old_req = next(iter(self._kept))
            self._forget_reply((old_key, old_req))
            old = self._streams.get(old_key)
            if old is not None and old_req in old.seen:
                old.seen[old_req] = True  # answered, reply no longer kept

    def retire(self, sender: int) -> None:
        """``sender`` has left: forget all but its last few requests (a repeat of its goodbye still gets
        its answer), refusing the forgotten ones from now on."""
        for key in [k for k, stream in self._streams.items() if stream.sender == sender]:
            stream = self._streams[key]
            while len(stream.seen) > _KEPT_AFTER_LEAVING:
                self._forget_oldest(key, stream)

    def _forget_oldest(self, key: int, stream: _Stream) -> None:
        req, _ = stream.seen.popitem(last=False)
        self._entries -= 1
        stream.floor = max(stream.floor, req)
        self._forget_reply((key, req))

    def _drop_stream(self, key: int) -> None:
        stream = self._streams.pop(key)
        for req in stream.seen:
            self._forget_reply((key, req))
        self._entries -= len(stream.seen)
        self._horizon[stream.sender] = max(self._horizon.get(stream.sender, 0), born_ms(key))
        if len(self._horizon) > HORIZONS:  # senders by the ten thousand: one horizon for all
            self._common_horizon = max(self._common_horizon, *self._horizon.values())
            self._horizon.clear()

    def _forget_reply(self, key: tuple[int, int]) -> None:
        size = self._kept.pop(key, None)
        if size is not None:
            self._kept_bytes -= size
