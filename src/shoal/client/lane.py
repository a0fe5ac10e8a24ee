"""A worker's lane to one server: small pulls and pushes of static tables sent and answered
whole in compiled code (``server.lane``, ``wire.lane``), their rows in any of the slices it holds.

``send`` numbers a read as the worker's tracker numbers its other requests and sends it on a
socket of its own, in one compiled call; ``send_push`` sends a push the tracker numbered and
keeps (``RequestTracker.register``), as a request of the worker's stream to the server.
``collect`` takes the answers, in the order the requests went, a read's rows into its own
array, waiting (the interpreter let go) or taking only those already here. Several requests
are in flight together, as the general path's are. Each gets ``OK``, or for whatever the lane
did not serve ``GENERAL`` (the server said so: nothing of it was done) or ``TIMEOUT`` (no
answer within the wait: every request still in flight on the lane gets it, and the caller gives
the lane up; a push then may or may not have been applied, and its general copy is
acknowledged without being applied again if it was); a request that could not be sent is
not pending at all. The caller sends what was not served the general way, which waits,
retries and explains. An answer to a request no longer pending is read and dropped.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from shoal.storage.jit import kernel
from shoal.transport import native as io
from shoal.transport.native import DONTWAIT, SNDMORE, NativeSocket
from shoal.wire import lane
from shoal.wire.codec import tag_key
from shoal.wire.keyed_hash import key_words

OK, GENERAL, TIMEOUT = 0, 1, 2
_NOT_YET = -1  # (not waiting: no answer here yet)


@kernel
def _send(handle: int, key: np.ndarray, frame: np.ndarray, rows: np.ndarray, shards: np.ndarray,
          pushed: np.ndarray) -> bool:
    """Send the request in ``frame`` (its fields set) with ``rows``, their ``shards`` and, for a push,
    the ``pushed`` values (bytes; empty for a read); whether it went."""
    count = frame[:lane.HEADER_BYTES].view(np.int64)[lane.COUNT]
    lane.seal(key, frame)
    if io.send(handle, frame, lane.FRAME0_BYTES, SNDMORE) < 0:
        return False
    io.send(handle, rows.view(np.uint8), 8 * count, SNDMORE)
    if pushed.size:
        io.send(handle, shards.view(np.uint8), 8 * count, SNDMORE)
        io.send(handle, pushed, pushed.size, 0)
    else:
        io.send(handle, shards.view(np.uint8), 8 * count, 0)
    return True


@kernel
def _receive(handle: int, key: np.ndarray, frame: np.ndarray, req: int, count: int, table: int, done: int,
             out: np.ndarray, tag: np.ndarray, scratch: np.ndarray, flags: int) -> int:
    """The answer to request ``req`` (``count`` rows of ``table``), its values into ``out`` (bytes), as
    ``done`` (ROWS for a read, DONE for a push): OK, GENERAL, TIMEOUT, or with ``flags`` DONTWAIT
    ``_NOT_YET``. ``frame`` holds its header after."""
    head = frame[:lane.HEADER_BYTES].view(np.int64)
    while True:
        n = io.recv(handle, frame, flags)
        if n < 0:
            return _NOT_YET if flags else TIMEOUT
        if not lane.opened(key, frame, n, tag) or head[lane.REQ] < req:
            io.drain(handle, scratch, tag)
            continue  # not an answer, or one to a request no longer pending
        if head[lane.REQ] != req or head[lane.TABLE_ID] != table or head[lane.COUNT] != count:
            io.drain(handle, scratch, tag)
            return GENERAL  # (an answer that does not fit its request is not trusted)
        if done == lane.DONE and head[lane.KIND] == lane.DONE:
            io.drain(handle, scratch, tag)
            return OK
        if done != lane.ROWS or head[lane.KIND] != lane.ROWS or not io.more(handle, scratch):
            io.drain(handle, scratch, tag)
            return GENERAL
        n_values = io.recv(handle, out, 0)
        io.drain(handle, scratch, tag)
        return OK if n_values == out.size else GENERAL


class Pending:
    """A request sent on a lane: its number and what it asked (``done``: the answer that serves it,
    ROWS or DONE), its answer's ``status`` (None until collected) and clock (every worker's updates
    from before it are in a read's rows)."""

    __slots__ = ("req", "count", "table", "done", "out", "status", "clock", "answered")

    def __init__(self, req: int, count: int, table: int, done: int, out: np.ndarray) -> None:
        self.req, self.count, self.table, self.done, self.out = req, count, table, done, out
        self.status: int | None = None
        self.clock = 0
        #: told once its status is set, whoever collected it (a push's: its tracker request ends)
        self.answered: Callable[[Pending], None] | None = None


_NOTHING = np.empty(0, np.uint8)


class WorkerLane:
    """The lane to one server; one caller at a time (a lock: ZeroMQ sockets are not thread-safe)."""

    def __init__(self, ctx: Any, address: str, secret: bytes, timeout_s: float) -> None:
        self.address = address
        self.socket = NativeSocket.connect(ctx, address, timeout_s)
        self._key = key_words(tag_key(secret))
        self._frame = np.empty(lane.FRAME0_BYTES, np.uint8)
        self._head = self._frame[:lane.HEADER_BYTES].view(np.int64)
        self._tag = np.empty(32, np.uint8)
        self._scratch = np.empty(2, np.int64)
        self._lock = threading.Lock()
        self._pending: deque[Pending] = deque()  # in the order they went: answers come so
        self._closed = False

    def send(self, numbered: Callable[[], tuple[int, int]], sender: int, table_id: int, rows: np.ndarray,
             shards: np.ndarray, clock: int, stream: tuple[int, int], out: np.ndarray) -> Pending | None:
        """Ask for rows ``rows`` of a table, in slices ``shards`` (int64, C order both), into ``out``
        (their values, C order), read after the requests of the worker's stream to this server up
        to ``stream`` (its incarnation and seq); None if it could not be sent. ``numbered`` gives
        the request its number and the sender's incarnation, taken once the lane is this caller's:
        the server drops a number lower than one it served (a replay), so they go out in order."""
        with self._lock:
            if self._closed:
                return None
            req, incarnation = numbered()
            return self._send(lane.READ, req, incarnation, sender, table_id, rows, shards, _NOTHING, clock, stream,
                              out.reshape(-1).view(np.uint8))

    def send_push(self, req: int, incarnation: int, sender: int, table_id: int, rows: np.ndarray, shards: np.ndarray,
                  values: np.ndarray, clock: int, stream: tuple[int, int],
                  answered: Callable[[Pending], None]) -> Pending | None:
        """Push ``values`` (float32, a row each, C order) to rows ``rows`` of a table, in slices
        ``shards``, as request ``req`` of the worker's tracker and the next of its stream to this
        server after ``stream`` (its incarnation and the seq before the push's); ``answered`` is told
        its status. None if it could not be sent."""
        with self._lock:
            if self._closed:
                return None
            pending = self._send(lane.PUSH, req, incarnation, sender, table_id, rows, shards,
                                 values.reshape(-1).view(np.uint8), clock, stream, _NOTHING)
            if pending is not None:
                pending.answered = answered
            return pending

    def _send(self, kind: int, req: int, incarnation: int, sender: int, table_id: int, rows: np.ndarray,
              shards: np.ndarray, pushed: np.ndarray, clock: int, stream: tuple[int, int],
              out: np.ndarray) -> Pending | None:
        head = self._head
        head[lane.MAGIC_AT], head[lane.KIND], head[lane.REQ], head[lane.SENDER] = lane.MAGIC, kind, req, sender
        head[lane.INCARNATION], head[lane.TABLE_ID] = incarnation, table_id
        head[lane.COUNT], head[lane.CLOCK] = rows.shape[0], clock
        head[lane.STREAM], head[lane.AFTER] = stream
        if not _send(self.socket.handle, self._key, self._frame, rows, shards, pushed):
            return None
        pending = Pending(req, rows.shape[0], table_id, lane.ROWS if kind == lane.READ else lane.DONE, out)
        self._pending.append(pending)
        return pending

    def collect(self, until: Pending | None, wait: bool) -> None:
        """Take the answers up to ``until``'s (None: every request's; if ``wait``, else those already
        here), a read's rows into its array; sets their ``status``, then tells those that asked."""
        answered: list[Pending] = []
        with self._lock:
            until = until or (self._pending[-1] if self._pending else None)
            while until is not None and until.status is None and self._pending:
                first = self._pending[0]
                status = int(_receive(self.socket.handle, self._key, self._frame, first.req, first.count, first.table,
                                      first.done, first.out, self._tag, self._scratch, 0 if wait else DONTWAIT))
                if status == _NOT_YET:
                    break
                if status == TIMEOUT:
                    answered += self._give_up()
                    break
                first.status, first.clock = status, int(self._head[lane.CLOCK])
                answered.append(self._pending.popleft())
        _tell(answered)  # outside the lock: what they do may send on this lane

    @property
    def pending(self) -> bool:
        """Whether any request on it awaits its answer."""
        return bool(self._pending)

    def _give_up(self) -> list[Pending]:
        failed = list(self._pending)
        for pending in failed:
            pending.status = TIMEOUT
        self._pending.clear()
        return failed

    def close(self) -> None:
        """Close the socket; requests still pending get ``TIMEOUT``."""
        with self._lock:
            self._closed = True
            failed = self._give_up()
            self.socket.close()
        _tell(failed)


def _tell(answered: list[Pending]) -> None:
    for pending in answered:
        if pending.answered is not None:
            pending.answered(pending)
