"""Exactly-once serving of requests that may arrive more than once, by mistake or by malice.

A requester sends a request again when its reply is overdue (the message or
its reply was lost, or the link duplicated it); an attacker who captured a
tagged message may play it again on a connection of its own. The receiver
therefore keeps, per *stream* -- a requester's (sender, incarnation), both
covered by the tag -- the requests it saw lately and the replies it sent: a
repeat of one still being served is dropped, a repeat of one already answered
gets the same reply again, and only a new request is served. A push applied
twice would be a lost update of another kind, so this sits in front of every
handler, for one-way messages too.

Replies are kept within a byte budget; those to requests that can be served
again (reads, which the receiver serves again when a repeat finds no reply)
are the first to go, so that a read-heavy peer does not push out a push's
acknowledgement: a repeat of a push whose reply is gone can only be dropped.

Memory is bounded whatever peers send. A request still being served is never
forgotten (a requester keeps few in flight). Of the answered ones, each stream
keeps its latest ``PER_STREAM``, and all streams together ``ENTRIES`` (the least
recently heard stream gives up its oldest first); every number at or below the
highest one forgotten is refused from then on (the stream's ``floor``). At most
``STREAMS`` streams are held: the least recently heard one with nothing in
service is dropped, leaving a tombstone (its floor) so that it is neither
replayed nor refused when heard again. Past ``TOMBSTONES`` tombstones the oldest
goes too and raises its sender's *horizon* to the stream's birth time, which an
incarnation carries in its high bits: a stream of that sender born no later and
not held is refused as one that may have been dropped.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

#: answered request numbers remembered per stream: far more than any requester keeps in flight
PER_STREAM = 4096
#: answered request numbers remembered in all (about 100 bytes each)
ENTRIES = 1 << 17
#: streams held; the least recently heard idle one is dropped first
STREAMS = 4096
#: streams dropped whose floor is still known
TOMBSTONES = 1 << 15
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
_ABSENT = False  # not a value ``seen`` holds
Key = tuple[int, int]  # (sender, incarnation)


def new_incarnation() -> int:
    """A stream's name, unique per requester and born now."""
    return (time.time_ns() // 1_000_000) << _RANDOM_BITS | secrets.randbits(_RANDOM_BITS)


def born_ms(incarnation: int) -> int:
    return incarnation >> _RANDOM_BITS


@dataclass
class _Stream:
    floor: int = 0  # every request number at or below this is refused unless still remembered
    #: request number -> the reply frames kept, True (answered, reply not kept) or None (serving)
    seen: OrderedDict[int, list[Any] | bool | None] = field(default_factory=OrderedDict)
    serving: int = 0  # entries of ``seen`` still being served
    #: requests being served that can be served again (reads): their replies are the first to go
    redoable: set[int] = field(default_factory=set)


class ReplayGuard:
    def __init__(self, per_stream: int = PER_STREAM, entries: int = ENTRIES, streams: int = STREAMS,
                 tombstones: int = TOMBSTONES, reply_bytes: int = REPLY_BYTES,
                 keep_reply_bytes: int = KEEP_REPLY_BYTES) -> None:
        self.per_stream, self.max_entries, self.max_streams = per_stream, entries, streams
        self.max_tombstones = tombstones
        self.reply_bytes = reply_bytes
        self.keep_reply_bytes = min(keep_reply_bytes, reply_bytes)
        self._streams: OrderedDict[Key, _Stream] = OrderedDict()  # least recently heard first
        self._keys: dict[int, list[Key]] = {}  # incarnation -> its streams (a reply names only that)
        self._entries = 0
        self._tombstones: OrderedDict[Key, int] = OrderedDict()  # dropped streams' floors, oldest first
        self._horizon: dict[int, int] = {}  # sender -> birth (ms) of its latest forgotten stream
        self._common_horizon = 0
        self._kept: OrderedDict[tuple[Key, int], int] = OrderedDict()  # replies kept, oldest first: size
        #: replies to requests that can be served again (reads), oldest first: dropped before any other
        self._kept_redoable: OrderedDict[tuple[Key, int], int] = OrderedDict()
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

    def admit(self, sender: int, incarnation: int, req: int, one_way: bool = False,
              redoable: bool = False) -> tuple[Verdict, list[Any] | None]:
        """Whether request ``req`` of ``sender``'s stream ``incarnation`` is new; for a repeat of an
        answered one, its reply if kept. A ``one_way`` message needs no reply: it counts as answered.
        A ``redoable`` one (a read) can be served again: its reply is dropped first when replies
        fill their budget, so that one that cannot (a push's acknowledgement) is kept."""
        key = (sender, incarnation)
        stream = self._streams.get(key)
        if stream is None:
            stream = self._open(key)
            if stream is None:
                return Verdict.STALE, None
        else:
            self._streams.move_to_end(key)
        entry = stream.seen.get(req, _ABSENT)
        if entry is not _ABSENT:
            if entry is _SERVING:
                return Verdict.IN_PROGRESS, None
            return Verdict.ANSWERED, entry if isinstance(entry, list) else None
        if req <= stream.floor:
            return Verdict.STALE, None
        stream.seen[req] = True if one_way else _SERVING
        stream.serving += 0 if one_way else 1
        if redoable and not one_way:
            stream.redoable.add(req)
        self._entries += 1
        if len(stream.seen) - stream.serving > self.per_stream:
            self._forget_answered(key, stream)
        if self._entries > self.max_entries:
            self._trim()
        return Verdict.NEW, None

    def answered(self, incarnation: int, req: int, frames: list[Any], size: int) -> None:
        """Keep the reply to request ``req`` of stream ``incarnation`` (within the byte budget) to send
        again if the request is repeated."""
        for key in self._keys.get(incarnation, ()):
            stream = self._streams[key]
            if stream.seen.get(req, _ABSENT) is _SERVING:
                break
        else:
            return
        stream.serving -= 1
        if len(stream.seen) - stream.serving > self.per_stream:  # many answered at once (given up, say)
            self._forget_answered(key, stream)
        redoable = req in stream.redoable
        stream.redoable.discard(req)
        keep = size <= self.keep_reply_bytes
        stream.seen[req] = frames if keep else True
        if not keep:
            return
        (self._kept_redoable if redoable else self._kept)[(key, req)] = size
        self._kept_bytes += size
        while self._kept_bytes > self.reply_bytes:
            old_key, old_req = next(iter(self._kept_redoable or self._kept))
            self._forget_reply((old_key, old_req))
            old = self._streams.get(old_key)
            if old is not None and isinstance(old.seen.get(old_req, _ABSENT), list):
                old.seen[old_req] = True  # answered, reply no longer kept

    def retire(self, sender: int) -> None:
        """``sender`` has left: forget all but its last few answered requests (a repeat of its goodbye
        still gets its answer), refusing the forgotten ones from now on."""
        for key in [k for k in self._streams if k[0] == sender]:
            stream = self._streams[key]
            while len(stream.seen) - stream.serving > _KEPT_AFTER_LEAVING and self._forget_answered(key, stream):
                pass

    # ------------------------------------------------------------------ bounds

    def _open(self, key: Key) -> _Stream | None:
        """A stream heard for the first time, or again after it was dropped; None if it may have been
        forgotten altogether (born no later than its sender's horizon)."""
        sender, incarnation = key
        floor = self._tombstones.pop(key, None)
        if floor is None and born_ms(incarnation) <= max(self._horizon.get(sender, 0), self._common_horizon):
            return None
        stream = self._streams[key] = _Stream(floor or 0)
        self._keys.setdefault(incarnation, []).append(key)
        if len(self._streams) > self.max_streams:
            self._drop_idle(keep=key)
        return stream

    def _forget_answered(self, key: Key, stream: _Stream) -> bool:
        """Forget the stream's oldest answered request (those being served stay); False if none."""
        req = next((r for r, entry in stream.seen.items() if entry is not _SERVING), None)
        if req is None:
            return False
        del stream.seen[req]
        self._entries -= 1
        stream.floor = max(stream.floor, req)
        self._forget_reply((key, req))
        return True

    def _trim(self) -> None:
        """Over ``ENTRIES``: the least recently heard streams give up answered requests first."""
        for key, stream in list(self._streams.items()):
            while self._entries > self.max_entries and self._forget_answered(key, stream):
                pass
            if self._entries <= self.max_entries:
                return

    def _drop_idle(self, keep: Key) -> None:
        """Over ``STREAMS``: drop the least recently heard stream with nothing in service (but ``keep``),
        keeping its floor as a tombstone."""
        key = next((k for k, s in self._streams.items() if k != keep and not s.serving), None)
        if key is None:  # every other stream has a request in service: the least recently heard goes
            key = next(k for k in self._streams if k != keep)
        stream = self._streams.pop(key)
        keys = self._keys[key[1]]
        keys.remove(key)
        if not keys:
            del self._keys[key[1]]
        for req in stream.seen:
            self._forget_reply((key, req))
        self._entries -= len(stream.seen)
        self._tombstones[key] = max(stream.floor, max(stream.seen, default=0))
        if len(self._tombstones) > self.max_tombstones:
            (sender, incarnation), _ = self._tombstones.popitem(last=False)
            self._horizon[sender] = max(self._horizon.get(sender, 0), born_ms(incarnation))
            if len(self._horizon) > HORIZONS:  # senders by the ten thousand: one horizon for all
                self._common_horizon = max(self._common_horizon, *self._horizon.values())
                self._horizon.clear()

    def _forget_reply(self, key: tuple[Key, int]) -> None:
        size = self._kept.pop(key, None)
        if size is None:
            size = self._kept_redoable.pop(key, None)
        if size is not None:
            self._kept_bytes -= size
