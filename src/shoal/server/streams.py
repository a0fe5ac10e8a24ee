"""Each worker's requests handled in the order the worker sent them, whatever order they arrive in.

A worker numbers its requests to this server about static tables and its clock:
``stream = [incarnation, seq, floor, settled]``. ``floor`` is the lowest ``seq``
the worker still waits on; everything below it is over (answered, or given up:
timed out, or sent to a server that left). ``settled`` is the worker's settled clock:
every push it made in iterations before it has been acknowledged. A request that arrives early waits here until those
before it have been handled, so a read is served after the worker's earlier
pushes, and a clock is counted after the pushes of the iterations it closes --
also when a lost request is sent again after later ones. A request held while
its slice moves to another server holds back the worker's later ones until it
has been handled.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shoal.api.errors import ProtocolError
from shoal.wire.message import Message

_INT64_END = 1 << 63  # stream numbers land in int64 arrays

#: requests kept per worker while an earlier one is missing: far more than a worker has in flight
MAX_WAITING = 4096
#: pushes applied on the lane remembered per worker, for their general copies (a ring of int64s:
#: 32 KB per worker): as many as may wait
LANED_KEPT = MAX_WAITING


class StaleRequestError(ProtocolError):
    """A request from a worker's earlier incarnation, or one its sender has given up on."""


@dataclass
class _Stream:
    incarnation: int
    next_seq: int
    #: requests that arrived before an earlier one, by seq, with when they arrived
    waiting: dict[int, tuple[bytes, Message, float]] = field(default_factory=dict)
    #: seq of a request held for a slice move: later ones wait until it is handled
    parked: int | None = None
    #: seq of the request being handled now
    serving: int | None = None
    #: the highest floor heard: the worker is over every request below it (one heard while a request
    #: was parked is applied once that request has been handled)
    floor: int = 0
    #: seqs of the latest pushes applied on the lane (``server.lane``), a ring made at the first, and
    #: how many were written to it
    laned: np.ndarray | None = None
    laned_count: int = 0


@dataclass(frozen=True)
class Position:
    """Where a request stands in its worker's stream."""

    worker: int
    incarnation: int
    seq: int
    floor: int
    settled: int


def position_of(msg: Message) -> Position | None:
    """The request's place in its sender's stream; None for requests outside any stream."""
    value = msg.body.get("stream")
    if value is None:
        return None
    global _last_position
    last = _last_position  # one tuple, read once: server threads of one process share it
    if last[0] is msg and last[1] is value:  # asked again while the same request is handled
        return last[2]
    if type(value) is not list or len(value) != 4:
        raise ProtocolError(f"stream must be [incarnation, seq, floor, settled] of non-negative ints, "
                            f"got {value!r}")
    incarnation, seq, floor, settled = value
    if not (type(incarnation) is int and type(seq) is int and type(floor) is int and type(settled) is int
            and 0 <= incarnation < _INT64_END and 0 <= seq < _INT64_END and 0 <= floor < _INT64_END
            and 0 <= settled < _INT64_END):
        raise ProtocolError(f"stream must be [incarnation, seq, floor, settled] of non-negative ints, "
                            f"got {value!r}")
    if floor > seq:
        raise ProtocolError(f"stream floor {floor} lies past the request's own seq {seq}")
    if settled > msg.clock:
        raise ProtocolError(f"settled clock {settled} lies past the request's clock {msg.clock}")
    position = Position(msg.sender, incarnation, seq, floor, settled)
    _last_position = (msg, value, position)
    return position


#: the request whose position was read last, its stream field and its position: one request is
#: asked about several times while it is handled (admitted, served, finished)
_last_position: tuple[Any, Any, Position | None] = (None, None, None)


def settled_of(msg: Message) -> int | None:
    """The sender's settled clock, for a request in a stream (checked by ``StreamOrder.admit``)."""
    value = msg.body.get("stream")
    return int(value[3]) if isinstance(value, list) and len(value) == 4 else None


class StreamOrder:
    """Per worker: which request may be handled next, and the ones waiting for it."""

    def __init__(self, num_workers: int, now: Callable[[], float] = time.monotonic) -> None:
        self.num_workers = num_workers
        self.now = now
        self._streams: dict[int, _Stream] = {}
        #: requests dropped unhandled because their worker no longer waits on them (a floor past them,
        #: a new incarnation, the worker gone): the server answers them (``take_given_up``), which
        #: also ends what its replay guard keeps of them as being served
        self._given_up: list[tuple[bytes, Message]] = []
        #: general copies of pushes applied on the lane that were waiting for their turn: the server
        #: acknowledges them (``take_lane_copies``)
        self._lane_copies: list[tuple[bytes, Message]] = []

    def admit(self, peer: bytes, msg: Message) -> bool:
        """True: handle ``msg`` now. False: it waits (``next_ready`` hands it back in its turn).

        Raises ``StaleRequestError`` for a request its worker no longer waits on.
        """
        pos = position_of(msg)
        if pos is None:
            return True
        if not 0 <= pos.worker < self.num_workers:
            raise ProtocolError(f"stream of worker {pos.worker}, which is not a worker of this cluster")
        stream = self._streams.get(pos.worker)
        if stream is None or pos.incarnation > stream.incarnation:  # first contact, or a restarted worker
            if stream is not None:
                self._give_up(stream, None)
            stream = self._streams[pos.worker] = _Stream(pos.incarnation, pos.floor, floor=pos.floor)
        elif pos.incarnation < stream.incarnation:
            raise StaleRequestError(f"request {pos.seq} of worker {pos.worker} comes from its incarnation "
                                    f"{pos.incarnation}, which was replaced by incarnation {stream.incarnation}")
        stream.floor = max(stream.floor, pos.floor)
        if stream.floor > stream.next_seq and stream.parked is None:
            self._skip_to(stream, stream.floor)  # the worker gave up on the ones before
        if pos.seq < stream.next_seq:
            raise StaleRequestError(f"request {pos.seq} of worker {pos.worker} arrived after the worker "
                                    "stopped waiting for it")
        if pos.seq == stream.next_seq and stream.parked is None and stream.serving is None:
            stream.next_seq += 1
            stream.serving = pos.seq
            return True
        if len(stream.waiting) >= MAX_WAITING:
            raise ProtocolError(f"worker {pos.worker} has {MAX_WAITING} requests waiting for request "
                                f"{stream.next_seq}, which has not arrived")
        stream.waiting[pos.seq] = (peer, msg, self.now())
        return False

    def next_ready(self, worker: int) -> tuple[bytes, Message] | None:
        """The waiting request of ``worker`` whose turn has come, if any (admitted by this call)."""
        stream = self._streams.get(worker)
        if stream is None or stream.parked is not None:
            return None
        if stream.floor > stream.next_seq:  # heard while a request was parked
            self._skip_to(stream, stream.floor)
        if stream.serving is not None:
            return None
        item = stream.waiting.pop(stream.next_seq, None)
        if item is None:
            return None
        stream.serving = stream.next_seq
        stream.next_seq += 1
        return item[0], item[1]

    def lane_handled(self, worker: int, incarnation: int, seq: int) -> None:
        """Request ``seq`` of ``worker``'s stream was a push applied on the lane, as the stream's next
        (the lane checked that against ``write_handled``): the requests after it may go."""
        stream = self._streams.get(worker)
        if (stream is None or stream.incarnation != incarnation or stream.next_seq != seq or stream.parked is not None
                or stream.serving is not None):  # the lane went by what this said before its pump
            raise AssertionError(f"push {seq} of worker {worker} applied on the lane out of its stream's turn")
        stream.next_seq = seq + 1
        copy = stream.waiting.pop(seq, None)
        if copy is not None:  # its general copy came first and waited for its turn: acknowledged, not applied
            self._lane_copies.append((copy[0], copy[1]))
        if stream.laned is None:
            stream.laned = np.full(LANED_KEPT, -1, np.int64)  # (no seq is negative)
        stream.laned[stream.laned_count % LANED_KEPT] = seq
        stream.laned_count += 1

    def handled_on_lane(self, msg: Message) -> bool:
        """Whether ``msg`` is the general copy of a push applied on the lane (sent when the lane's
        answer was late): acknowledged, not applied again."""
        pos = position_of(msg)
        stream = self._streams.get(pos.worker) if pos is not None else None
        return (pos is not None and stream is not None and stream.incarnation == pos.incarnation
                and pos.seq < stream.next_seq and stream.laned is not None and bool((stream.laned == pos.seq).any()))

    def finished(self, msg: Message) -> None:
        """``msg`` has been handled (answered, or held by its bound): the next one may go."""
        stream = self._mine(msg)
        if stream is not None:
            stream.serving = None

    def park(self, msg: Message) -> None:
        """``msg`` waits for a slice move: the worker's later requests wait for it."""
        stream = self._mine(msg)
        if stream is not None:
            stream.parked, stream.serving = stream.serving, None

    def _mine(self, msg: Message) -> _Stream | None:
        """The stream of ``msg`` if it is the request being handled in it."""
        pos = position_of(msg)
        stream = self._streams.get(pos.worker) if pos is not None else None
        if pos is None or stream is None or stream.incarnation != pos.incarnation or stream.serving != pos.seq:
            return None
        return stream

    def unpark(self, msg: Message) -> bool:
        """True if ``msg`` was the request holding back its worker's stream (it is handled again now)."""
        pos = position_of(msg)
        stream = self._streams.get(pos.worker) if pos is not None else None
        if pos is None or stream is None or stream.parked != pos.seq or stream.incarnation != pos.incarnation:
            return False
        stream.parked, stream.serving = None, pos.seq
        return True

    def seen(self, worker: int) -> int:
        """The highest seq of ``worker`` handled here: replies carry it, so the worker knows which of
        its pushes the rows include."""
        stream = self._streams.get(worker)
        if stream is None:
            return 0
        for unfinished in (stream.parked, stream.serving):
            if unfinished is not None:
                return unfinished - 1
        return stream.next_seq - 1

    def write_handled(self, out: np.ndarray) -> None:
        """``out[worker] = (incarnation, seq, blocked)``: every request of that stream up to ``seq`` was
        handled here (``seen``), and ``blocked`` (1) if the next is parked for a slice move or being
        served, so no request may go before it; (0, 0, 0) for a worker not heard from."""
        out[:] = 0
        for worker, stream in self._streams.items():
            out[worker, 0], out[worker, 1] = stream.incarnation, self.seen(worker)
            out[worker, 2] = stream.parked is not None or stream.serving is not None

    def handled(self) -> list[list[int]]:
        """``[worker, incarnation, seq]`` per stream: every request up to ``seq`` was handled here,
        none after it (those waiting for an earlier one, or held for a slice move, were not)."""
        return [[worker, stream.incarnation, self.seen(worker)] for worker, stream in sorted(self._streams.items())]

    def expire(self, max_age: float) -> list[tuple[bytes, Message]]:
        """Requests that waited longer than ``max_age`` for an earlier one that never came: removed."""
        cutoff = self.now() - max_age
        old = []
        for stream in self._streams.values():
            for seq, (peer, msg, since) in list(stream.waiting.items()):
                if since < cutoff:
                    old.append((peer, msg))
                    del stream.waiting[seq]
        return old

    def forget(self, worker: int) -> None:
        """The worker has left: nothing of it waits any more."""
        stream = self._streams.pop(worker, None)
        if stream is not None:
            self._give_up(stream, None)

    def take_given_up(self) -> list[tuple[bytes, Message]]:
        """The requests dropped since the last call because their worker no longer waits on them."""
        given_up, self._given_up = self._given_up, []
        return given_up

    def take_lane_copies(self) -> list[tuple[bytes, Message]]:
        """The general copies of lane pushes taken out of their streams since the last call."""
        copies, self._lane_copies = self._lane_copies, []
        return copies

    def has_given_up(self) -> bool:
        """Whether requests wait for ``take_given_up``."""
        return bool(self._given_up)

    def waiting_count(self) -> int:
        return sum(len(s.waiting) for s in self._streams.values())

    def _skip_to(self, stream: _Stream, floor: int) -> None:
        self._give_up(stream, floor)
        stream.next_seq = floor

    def _give_up(self, stream: _Stream, floor: int | None) -> None:
        """Drop the requests of ``stream`` waiting below ``floor`` (None: all of them)."""
        for seq in [s for s in stream.waiting if floor is None or s < floor]:
            peer, msg, _ = stream.waiting.pop(seq)
            self._given_up.append((peer, msg))
