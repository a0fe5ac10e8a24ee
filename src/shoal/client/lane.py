"""A worker's lane to one server: small pulls of static tables sent and answered whole in
compiled code (``server.lane``, ``wire.lane``), their rows in any of the slices it holds.

``send`` numbers a request as the worker's tracker numbers its others and sends it on a
socket of its own, in one compiled call; ``collect`` takes the answers, in the order the
requests went, each into its own request's array, waiting (the interpreter let go) or
taking only those already here. Several requests are in flight together, as the general
path's are. Each gets ``OK``, or for whatever the lane did not serve ``GENERAL`` (the server
said so) or ``TIMEOUT`` (no answer within the wait: every request still in flight on the lane
gets it, and the caller gives the lane up); a request that could not be sent is not
pending at all. The caller sends what was not served the general way, which waits,
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
def _send(handle: int, key: np.ndarray, frame: np.ndarray, rows: np.ndarray, shards: np.ndarray) -> bool:
    """Send the request in ``frame`` (its fields set) with ``rows`` and their ``shards``; whether it went."""
    count = frame[:lane.HEADER_BYTES].view(np.int64)[lane.COUNT]
    lane.seal(key, frame)
    if io.send(handle, frame, lane.FRAME0_BYTES, SNDMORE) < 0:
        return False
    io.send(handle, rows.view(np.uint8), 8 * count, SNDMORE)
    io.send(handle, shards.view(np.uint8), 8 * count, 0)
    return True


@kernel
def _receive(handle: int, key: np.ndarray, frame: np.ndarray, req: int, count: int, table: int, out: np.ndarray,
             tag: np.ndarray, scratch: np.ndarray, flags: int) -> int:
    """The answer to request ``req`` (``count`` rows of ``table``), its values into ``out`` (bytes):
    OK, GENERAL, TIMEOUT, or with ``flags`` DONTWAIT ``_NOT_YET``. ``frame`` holds its header after."""
    head = frame[:lane.HEADER_BYTES].view(np.int64)
    while True:
        n = io.recv(handle, frame, flags)
        if n < 0:
            return _NOT_YET if flags else TIMEOUT
        if not lane.opened(key, frame, n, tag) or head[lane.REQ] < req:
            io.drain(handle, scratch, tag)
            continue  # not an answer, or one to a request no longer pending
        if (head[lane.REQ] != req or head[lane.TABLE_ID] != table or head[lane.COUNT] != count
                or head[lane.KIND] != lane.ROWS or not io.more(handle, scratch)):
            io.drain(handle, scratch, tag)
            return GENERAL  # (an answer that does not fit its request is not trusted)
        n_values = io.recv(handle, out, 0)
        io.drain(handle, scratch, tag)
        return OK if n_values == out.size else GENERAL


class Pending:
    """A request sent on a lane: its number and what it asked, its answer's ``status`` (None until
    collected) and clock (every worker's updates from before it are in its rows)."""

    __slots__ = ("req", "count", "table", "out", "status", "clock")

    def __init__(self, req: int, count: int, table: int, out: np.ndarray) -> None:
        self.req, self.count, self.table, self.out = req, count, table, out
        self.status: int | None = None
        self.clock = 0


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
            head = self._head
            head[lane.MAGIC_AT], head[lane.KIND], head[lane.REQ], head[lane.SENDER] = lane.MAGIC, lane.REQUEST, req, \
                sender
            head[lane.INCARNATION], head[lane.TABLE_ID] = incarnation, table_id
            head[lane.COUNT], head[lane.CLOCK] = rows.shape[0], clock
            head[lane.STREAM], head[lane.AFTER] = stream
            if not _send(self.socket.handle, self._key, self._frame, rows, shards):
                return None
            pending = Pending(req, rows.shape[0], table_id, out.reshape(-1).view(np.uint8))
            self._pending.append(pending)
            return pending

    def collect(self, until: Pending, wait: bool) -> None:
        """Take the answers up to ``until``'s (if ``wait``; else those already here), each into its
        request's array; sets their ``status``."""
        with self._lock:
            while until.status is None and self._pending:
                first = self._pending[0]
                status = int(_receive(self.socket.handle, self._key, self._frame, first.req, first.count, first.table,
                                      first.out, self._tag, self._scratch, 0 if wait else DONTWAIT))
                if status == _NOT_YET:
                    return
                if status == TIMEOUT:
                    self._give_up()
                    return
                first.status, first.clock = status, int(self._head[lane.CLOCK])
                self._pending.popleft()

    def _give_up(self) -> None:
        for pending in self._pending:
            pending.status = TIMEOUT
        self._pending.clear()

    def close(self) -> None:
        """Close the socket; requests still pending get ``TIMEOUT``."""
        with self._lock:
            self._closed = True
            self._give_up()
            self.socket.close()
