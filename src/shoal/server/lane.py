"""The server's lane: small pulls of static tables answered whole in compiled code.

A pull through the general path costs the server's interpreter several times what
libzmq and the kernel cost (``benchmarks/results/lean_request.md``). The lane is a
socket of its own (``transport.native``) whose requests one compiled call serves,
as many as are queued, each time the loop wakes: the tag and header checked
(``wire.lane``), the replay guard, the rows gathered by address under the slice's
stripe locks, the answer signed and sent. Nothing of it runs in Python per message.

It serves what the general path would serve at once and nothing else: a static ASP
table's rows in one slice held here, not moving, of a table whose rows were not
lost, to a worker whose reads are not refused (one of its pushes was answered
"moved"). Any other request is answered ``GENERAL``: the worker sends it the
general way, which holds, refuses or explains it. What the compiled code reads of
that state is a table of entries the loop makes again whenever the state changes
(``_signature``), before it serves anything: a slice that left, and whose memory
is gone, is never read through an old entry.

The lane's requests are not in the worker's stream: a worker sends one only when
none of its pushes to that server awaits an answer, so its own writes are in
(``client.lane``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shoal.server.tables import ServedTable
from shoal.storage.jit import kernel, native
from shoal.transport import native as io
from shoal.transport.native import DONTWAIT, SNDMORE, NativeSocket, c_function, ptr
from shoal.wire import lane
from shoal.wire.codec import tag_key
from shoal.wire.keyed_hash import key_words

_F_SETLKW, _F_RDLCK, _F_UNLCK = 7, 0, 2


@native(lambda: c_function("memcpy", lambda t: t.voidptr(t.voidptr, t.voidptr, t.size_t)))
def _memcpy(to: int, source: int, size: int) -> int:
    raise NotImplementedError("compiled code only")


@native(lambda: c_function("fcntl", lambda t: t.intc(t.intc, t.intc, t.voidptr)))  # variadic: an int and a
def _fcntl(fd: int, command: int, argument: int) -> int:  # pointer pass as the fixed arguments would
    raise NotImplementedError("compiled code only")


# An entry per slice the lane may serve: these int64 fields.
(E_TABLE, E_SHARD, E_VALUES, E_ROWS, E_ROW_BYTES, E_LOCK_FD, E_STRIPES, E_HEADER, E_SERVABLE) = range(9)
_ENTRY_FIELDS = 9
# What the lane counts (``counts``): requests answered with rows, rows sent, answered GENERAL,
# dropped (a wrong tag or malformed), refused as replays.
(C_SERVED, C_ROWS, C_GENERAL, C_DROPPED, C_REPLAYED) = range(5)
COUNTER_NAMES = ("lane_pulls", "lane_rows", "lane_general", "lane_dropped", "lane_replayed")
_MOST_PER_WAKE = 256  # requests served per call: the loop's other work waits no longer than this


@kernel
def _record_lock(fd: int, lock_type: int, start: int, length: int, flock: np.ndarray) -> None:
    """``fcntl(F_SETLKW)`` on bytes [start, start + length) of ``fd``; ``flock`` (4 int64s) is a
    ``struct flock`` in the x86-64 Linux layout: type and whence (shorts), start, length, pid."""
    flock[0] = lock_type  # l_type; l_whence SEEK_SET (0)
    flock[1] = start
    flock[2] = length
    flock[3] = 0
    _fcntl(fd, _F_SETLKW, ptr(flock.ctypes.data))


@kernel
def _stripes_of(rows: np.ndarray, count: int, stripes: int, out: np.ndarray) -> int:
    """The distinct stripes ``rows[:count]`` touch, ascending, into ``out``; how many."""
    n = 0
    for i in range(count):
        s = rows[i] % stripes
        j = n
        while j > 0 and out[j - 1] > s:
            j -= 1
        if j > 0 and out[j - 1] == s:
            continue
        for k in range(n, j, -1):
            out[k] = out[k - 1]
        out[j] = s
        n += 1
    return n


@kernel
def _answer(handle: int, key: np.ndarray, peer: np.ndarray, n_peer: int, reply: np.ndarray, kind: int, req: int,
            node: int, table: int, shard: int, count: int, clock: int, values: np.ndarray, nbytes: int) -> None:
    fields = reply[:lane.HEADER_BYTES].view(np.int64)
    fields[lane.MAGIC_AT], fields[lane.KIND], fields[lane.REQ], fields[lane.SENDER] = lane.MAGIC, kind, req, node
    fields[lane.INCARNATION], fields[lane.TABLE_ID], fields[lane.SHARD] = 0, table, shard
    fields[lane.COUNT], fields[lane.CLOCK] = count, clock
    lane.seal(key, reply)
    io.send(handle, peer, n_peer, SNDMORE)
    if kind == lane.ROWS:
        io.send(handle, reply, lane.FRAME0_BYTES, SNDMORE)
        io.send(handle, values, nbytes, 0)
    else:
        io.send(handle, reply, lane.FRAME0_BYTES, 0)


@kernel
def _serve(handle: int, key: np.ndarray, node: int, entries: np.ndarray, refusing: np.ndarray, clocks: np.ndarray,
           replay: np.ndarray, counts: np.ndarray, peer: np.ndarray, frame: np.ndarray, rows_in: np.ndarray,
           reply: np.ndarray, values: np.ndarray, tag: np.ndarray, scratch: np.ndarray, stripes_at: np.ndarray) -> int:
    """Serve the lane requests queued on ``handle``; how many were taken off it."""
    num_workers = clocks.shape[0]
    slowest = clocks.min() if num_workers else 0
    head = frame[:lane.HEADER_BYTES].view(np.int64)
    rows = rows_in.view(np.int64)
    taken = 0
    while taken < _MOST_PER_WAKE:
        n_peer = io.recv(handle, peer, DONTWAIT)
        if n_peer < 0:
            break  # nothing queued
        taken += 1
        n_frame = n_rows = -1
        if n_peer <= peer.size and io.more(handle, scratch):
            n_frame = io.recv(handle, frame, 0)
            if io.more(handle, scratch):
                n_rows = io.recv(handle, rows_in, 0)
        io.drain(handle, scratch, rows_in)
        if n_frame < 0 or not lane.opened(key, frame, n_frame, tag):
            counts[C_DROPPED] += 1
            continue
        sender, req, inc, count = head[lane.SENDER], head[lane.REQ], head[lane.INCARNATION], head[lane.COUNT]
        if (head[lane.KIND] != lane.REQUEST or not 0 <= sender < num_workers or not 0 < count <= lane.MAX_ROWS
                or n_rows != 8 * count):
            counts[C_DROPPED] += 1
            continue
        if replay[sender, 0] == inc and req < replay[sender, 1]:
            counts[C_REPLAYED] += 1  # older than one served: played again (a repeat of the last is read again)
            continue
        replay[sender, 0], replay[sender, 1] = inc, req
        table, shard = head[lane.TABLE_ID], head[lane.SHARD]
        clock = min(slowest, head[lane.CLOCK])
        e = -1
        for i in range(entries.shape[0]):
            if entries[i, E_TABLE] == table and entries[i, E_SHARD] == shard:
                e = i
                break
        servable = e >= 0 and entries[e, E_SERVABLE] != 0 and refusing[e, sender] == 0
        if servable and count * entries[e, E_ROW_BYTES] > values.size:
            servable = False
        if servable:
            num_rows = entries[e, E_ROWS]
            for i in range(count):
                if not 0 <= rows[i] < num_rows:
                    servable = False  # the general path names the bad key
                    break
        if not servable:
            counts[C_GENERAL] += 1
            _answer(handle, key, peer, n_peer, reply, lane.GENERAL, req, node, table, shard, count, clock, values, 0)
            continue
        row_bytes, fd, stripes = entries[e, E_ROW_BYTES], entries[e, E_LOCK_FD], entries[e, E_STRIPES]
        locked = 0
        whole = fd >= 0 and count * 4 >= stripes  # as ``StripedLocks.hold``: every stripe at once
        if whole:
            _record_lock(fd, _F_RDLCK, 0, stripes, stripes_at)
        elif fd >= 0:
            locked = _stripes_of(rows, count, stripes, stripes_at[4:])
            for i in range(locked):
                _record_lock(fd, _F_RDLCK, stripes_at[4 + i], 1, stripes_at)
        _memcpy(ptr(scratch.ctypes.data + 16), ptr(entries[e, E_HEADER]), 8)  # the slice's "moved off" mark
        retired = scratch[2] != 0
        if not retired:
            base = entries[e, E_VALUES]
            for i in range(count):
                _memcpy(ptr(values.ctypes.data + i * row_bytes), ptr(base + rows[i] * row_bytes), row_bytes)
        if whole:
            _record_lock(fd, _F_UNLCK, 0, stripes, stripes_at)
        for i in range(locked - 1, -1, -1):
            _record_lock(fd, _F_UNLCK, stripes_at[4 + i], 1, stripes_at)
        if retired:  # moved off between the entries' making and now
            counts[C_GENERAL] += 1
            _answer(handle, key, peer, n_peer, reply, lane.GENERAL, req, node, table, shard, count, clock, values, 0)
            continue
        counts[C_SERVED] += 1
        counts[C_ROWS] += count
        _answer(handle, key, peer, n_peer, reply, lane.ROWS, req, node, table, shard, count, clock, values,
                count * row_bytes)
    return taken


class ServerLane:
    """One server's lane: its socket, what it may serve, and what it counted."""

    def __init__(self, node: int, ctx: Any, host: str, secret: bytes, clocks: np.ndarray) -> None:
        self.node = node
        self.socket = NativeSocket.listen(ctx, host)
        self.address = self.socket.address
        self._secret = secret
        self._key = np.empty(0, np.uint64)  # made at ``warm``: checking it loads numba
        self._clocks = clocks
        num_workers = clocks.shape[0]
        self._replay = np.zeros((max(num_workers, 1), 2), np.int64)
        self._replay[:, 0] = -1
        self.counts = np.zeros(len(COUNTER_NAMES), np.int64)
        self._peer = np.empty(256, np.uint8)
        self._frame = np.empty(lane.FRAME0_BYTES, np.uint8)
        self._rows_in = np.empty(8 * lane.MAX_ROWS, np.uint8)
        self._reply = np.empty(lane.FRAME0_BYTES, np.uint8)
        self._tag = np.empty(32, np.uint8)
        self._scratch = np.empty(4, np.int64)
        self._stripes_at = np.empty(4 + 64, np.int64)
        self._signature: object = None
        self._entries = np.zeros((0, _ENTRY_FIELDS), np.int64)
        self._refusing = np.zeros((0, max(num_workers, 1)), np.int8)
        self._values = np.empty(lane.MAX_BYTES, np.uint8)
        self._thread_locks: list[Any] = []
        self._warm = False

    def warm(self) -> None:
        """Compile the lane's kernels (or load them from numba's cache) now: before a worker knows the
        lane's address, not inside its first request's wait. (Not at start: a job that never
        pulls loads no numba.)"""
        if not self._warm:
            self._warm = True
            self._key = key_words(tag_key(self._secret))
            self.pump({}, {}, set())

    def pump(self, tables: dict[str, ServedTable], lost: dict[str, str], refusing: set[tuple[int, str]]) -> int:
        """Serve what is queued on the lane; how many requests were taken."""
        self.warm()
        signature = _signature(tables, lost, refusing)
        if signature != self._signature:
            self._make_entries(tables, lost, refusing)
            self._signature = signature
        # The stripes' record locks do not exclude this process's other threads (a test's workers
        # in threads beside the server): their thread locks do, held while the compiled call runs.
        for lock in self._thread_locks:
            lock.acquire()
        try:
            return int(_serve(self.socket.handle, self._key, self.node, self._entries, self._refusing, self._clocks,
                              self._replay, self.counts, self._peer, self._frame, self._rows_in, self._reply,
                              self._values, self._tag, self._scratch, self._stripes_at))
        finally:
            for lock in reversed(self._thread_locks):
                lock.release()

    def _make_entries(self, tables: dict[str, ServedTable], lost: dict[str, str],
                      refusing: set[tuple[int, str]]) -> None:
        entries, refused, locks = [], [], []
        workers = self._refusing.shape[1]
        for name, table in tables.items():
            if table.spec.consistency.bound is not None:
                continue  # bounded reads wait on clocks: the general path's
            tid = lane.table_id(name)
            for shard, store in table.stores.items():
                row_bytes = store.values.strides[0]
                held = store.locks
                if held is not None and held.thread_lock not in locks:
                    locks.append(held.thread_lock)
                servable = name not in lost and shard not in table.moving
                entries.append([tid, shard, store.values.ctypes.data, store.num_rows, row_bytes,
                                -1 if held is None else held.fd, 0 if held is None else held.num_stripes,
                                store.header.ctypes.data, int(servable)])
                refused.append([int((w, name) in refusing) for w in range(workers)])
        self._entries = np.array(entries, np.int64).reshape(-1, _ENTRY_FIELDS)
        self._refusing = np.array(refused, np.int8).reshape(-1, workers)
        self._thread_locks = locks

    def stats(self) -> dict[str, int]:
        return {name: int(n) for name, n in zip(COUNTER_NAMES, self.counts, strict=True) if n}

    def close(self) -> None:
        self.socket.close()
        self._clocks = np.zeros(0, np.int64)  # the server's clocks' memory is unmapped next


def _signature(tables: dict[str, ServedTable], lost: dict[str, str], refusing: set[tuple[int, str]]) -> object:
    """What the entries are made of: the tables, each one's layout epoch (every move changes it),
    slices and slices moving, the tables lost, the reads refused."""
    return (tuple((name, id(t), t.layout.epoch, tuple(t.stores), tuple(t.moving)) for name, t in tables.items()),
            tuple(lost), frozenset(refusing))
