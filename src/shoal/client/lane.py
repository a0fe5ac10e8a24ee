"""A worker's lane to one server: small pulls of static tables sent and answered whole in
compiled code (``server.lane``, ``wire.lane``), their rows in any of the slices it holds.

``pull`` numbers the request as the worker's tracker numbers its others, sends it on a socket
of its own, and waits for its answer, all in one compiled call that lets go of the
interpreter while it waits. It returns ``OK``, or for whatever the lane did not serve
``GENERAL`` (the server said so), ``TIMEOUT`` (no answer within the wait) or ``FAILED`` (it
could not be sent); the caller then takes the general path, which waits, retries and
explains. A late answer to an earlier request is read and dropped by the next call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from shoal.storage.jit import kernel
from shoal.transport import native as io
from shoal.transport.native import SNDMORE, NativeSocket
from shoal.wire import lane
from shoal.wire.codec import tag_key
from shoal.wire.keyed_hash import key_words

OK, GENERAL, TIMEOUT, FAILED = 0, 1, 2, 3


@kernel
def _pull(handle: int, key: np.ndarray, frame: np.ndarray, rows: np.ndarray, shards: np.ndarray, out: np.ndarray,
          tag: np.ndarray, scratch: np.ndarray) -> int:
    """Send the request in ``frame`` (its fields set) with ``rows`` and their ``shards``; wait for its
    answer, the values into ``out`` (bytes). Returns OK, GENERAL, TIMEOUT or FAILED (could not send)."""
    head = frame[:lane.HEADER_BYTES].view(np.int64)
    req, count, table = head[lane.REQ], head[lane.COUNT], head[lane.TABLE_ID]
    lane.seal(key, frame)
    if io.send(handle, frame, lane.FRAME0_BYTES, SNDMORE) < 0:
        return FAILED
    io.send(handle, rows.view(np.uint8), 8 * count, SNDMORE)
    io.send(handle, shards.view(np.uint8), 8 * count, 0)
    while True:
        n = io.recv(handle, frame, 0)
        if n < 0:
            return TIMEOUT
        if not lane.opened(key, frame, n, tag) or head[lane.REQ] != req:
            io.drain(handle, scratch, tag)
            continue  # not this request's answer: a late one to an earlier request
        if (head[lane.TABLE_ID] != table or head[lane.COUNT] != count or head[lane.KIND] != lane.ROWS
                or not io.more(handle, scratch)):
            io.drain(handle, scratch, tag)
            return GENERAL  # (an answer that does not fit its request is not trusted)
        n_values = io.recv(handle, out, 0)
        io.drain(handle, scratch, tag)
        return OK if n_values == out.size else GENERAL


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

    def pull(self, numbered: Callable[[], tuple[int, int]], sender: int, table_id: int, rows: np.ndarray,
             shards: np.ndarray, clock: int, stream: tuple[int, int], out: np.ndarray) -> int:
        """Rows ``rows`` of a table, in slices ``shards`` (int64, C order both), into ``out`` (their
        values, C order), read after the requests of the worker's stream to this server up to
        ``stream`` (its incarnation and seq): OK, or GENERAL / TIMEOUT / FAILED (then send it the
        general way). ``numbered`` gives the request its number and the sender's incarnation, taken
        once the lane is this caller's: the server drops a number lower than one it served (a
        replay), so they go out in order."""
        with self._lock:
            req, incarnation = numbered()
            head = self._head
            head[lane.MAGIC_AT], head[lane.KIND], head[lane.REQ], head[lane.SENDER] = lane.MAGIC, lane.REQUEST, req, \
                sender
            head[lane.INCARNATION], head[lane.TABLE_ID] = incarnation, table_id
            head[lane.COUNT], head[lane.CLOCK] = rows.shape[0], clock
            head[lane.STREAM], head[lane.AFTER] = stream
            return int(_pull(self.socket.handle, self._key, self._frame, rows, shards,
                             out.reshape(-1).view(np.uint8), self._tag, self._scratch))

    @property
    def answered_clock(self) -> int:
        """The last answer's clock: every worker's updates from before it are in its rows."""
        return int(self._head[lane.CLOCK])

    def close(self) -> None:
        with self._lock:
            self.socket.close()
