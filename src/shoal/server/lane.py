"""The server's lane: small pulls of static tables answered whole in compiled code.

A pull through the general path costs the server's interpreter several times what
libzmq and the kernel cost (``benchmarks/results/lean_request.md``). The lane is a
socket of its own (``transport.native``) whose requests one compiled call serves,
as many as are queued, each time the loop wakes: the tag and header checked
(``wire.lane``), the replay guard, the rows grouped by slice and gathered by
address, one slice at a time under its stripe locks, straight into the message
ZeroMQ sends, the answer signed and sent. Nothing of it runs in Python per message.

It serves what the general path would serve at once and nothing else: a static ASP
table's rows in slices held here, none moving, of a table whose rows were not
lost, to a worker whose reads are not refused (one of its pushes was answered
"moved"). Any other request is answered ``GENERAL`` (all of it, if one row is not
servable): the worker sends it the general way, which holds, refuses or explains
it. What the compiled code reads of that state is a table of entries the loop
makes again whenever the state changes (``_signature``), before it serves
anything: a slice that left, and whose memory is gone, is never read through an
old entry.

The lane's requests are not in the worker's stream, so each names the last request
the worker sent this server in it. One this server has not handled yet (a push still
on its way) holds the read: it keeps its buffers and is answered at the first pump
after the stream got that far, as the loop pumps after each message it handled; if
that takes longer than ``HOLD_S`` (a push parked by a slice move), or too many are
held, it is answered ``GENERAL`` and the general path reads after it. What has been
handled of each worker's stream the loop writes down before each pump.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from shoal.server.streams import StreamOrder
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
# What the lane counts (``counts``): requests answered with rows, rows sent, answered GENERAL (of
# those, how many because the worker's stream was not handled far enough in time), held until it
# was, dropped (a wrong tag or malformed), refused as replays.
(C_SERVED, C_ROWS, C_GENERAL, C_EARLY, C_HELD, C_DROPPED, C_REPLAYED) = range(7)
COUNTER_NAMES = ("lane_pulls", "lane_rows", "lane_general", "lane_early", "lane_held", "lane_dropped",
                 "lane_replayed")
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
            node: int, table: int, count: int, clock: int, values: np.ndarray) -> None:
    """Send the answer; for ``ROWS`` the message ``values`` (a ``zmq_msg_t``) holding the rows goes
    to ZeroMQ, or is closed if it cannot go."""
    fields = reply[:lane.HEADER_BYTES].view(np.int64)
    fields[lane.MAGIC_AT], fields[lane.KIND], fields[lane.REQ], fields[lane.SENDER] = lane.MAGIC, kind, req, node
    fields[lane.INCARNATION], fields[lane.TABLE_ID], fields[lane.COUNT], fields[lane.CLOCK] = 0, table, count, clock
    fields[lane.STREAM], fields[lane.AFTER] = 0, 0  # (a request's; the buffer's bytes are not sent unset)
    lane.seal(key, reply)
    io.send(handle, peer, n_peer, SNDMORE)
    if kind == lane.ROWS:
        io.send(handle, reply, lane.FRAME0_BYTES, SNDMORE)
        if io.zmq_msg_send(ptr(values.ctypes.data), ptr(handle), 0) < 0:
            io.zmq_msg_close(ptr(values.ctypes.data))
    else:
        io.send(handle, reply, lane.FRAME0_BYTES, 0)


@kernel
def _group(entries: np.ndarray, refusing: np.ndarray, table: int, sender: int, rows: np.ndarray,
           shards: np.ndarray, count: int, entry_of: np.ndarray, starts: np.ndarray, at: np.ndarray,
           grouped: np.ndarray) -> int:
    """The row size of the request's rows if every one is servable here, else 0; then ``grouped``
    holds their positions by slice, slice ``e``'s from ``starts[e]`` to ``starts[e + 1]``."""
    n_entries = entries.shape[0]
    starts[:] = 0
    row_bytes = 0
    last, e = -1, -1
    for i in range(count):
        if shards[i] != last or e < 0:
            last, e = shards[i], -1
            for j in range(n_entries):
                if entries[j, E_TABLE] == table and entries[j, E_SHARD] == last:
                    e = j
                    break
            if e < 0 or entries[e, E_SERVABLE] == 0 or refusing[e, sender] != 0:
                return 0
            if row_bytes and entries[e, E_ROW_BYTES] != row_bytes:
                return 0
            row_bytes = entries[e, E_ROW_BYTES]
        if not 0 <= rows[i] < entries[e, E_ROWS]:
            return 0  # the general path names the bad key
        entry_of[i] = e
        starts[e + 1] += 1
    for j in range(n_entries):
        starts[j + 1] += starts[j]
        at[j] = starts[j]
    for i in range(count):
        e = entry_of[i]
        grouped[at[e]] = i
        at[e] += 1
    return row_bytes


@kernel
def _gather(entry: np.ndarray, rows: np.ndarray, grouped: np.ndarray, lo: int, hi: int, row_bytes: int, data: int,
            slice_rows: np.ndarray, stripes_at: np.ndarray, scratch: np.ndarray) -> bool:
    """Copy the rows at ``grouped[lo:hi]`` of one slice to their places in ``data``, under the
    slice's locks; False (nothing copied) if the slice was moved off meanwhile."""
    n = hi - lo
    for k in range(n):
        slice_rows[k] = rows[grouped[lo + k]]
    fd, stripes = entry[E_LOCK_FD], entry[E_STRIPES]
    locked = 0
    whole = fd >= 0 and n * 4 >= stripes  # as ``StripedLocks.hold``: every stripe at once
    if whole:
        _record_lock(fd, _F_RDLCK, 0, stripes, stripes_at)
    elif fd >= 0:
        locked = _stripes_of(slice_rows, n, stripes, stripes_at[4:])
        for i in range(locked):
            _record_lock(fd, _F_RDLCK, stripes_at[4 + i], 1, stripes_at)
    _memcpy(ptr(scratch.ctypes.data + 16), ptr(entry[E_HEADER]), 8)  # the slice's "moved off" mark
    retired = scratch[2] != 0
    if not retired:
        base = entry[E_VALUES]
        for k in range(n):
            _memcpy(ptr(data + grouped[lo + k] * row_bytes), ptr(base + slice_rows[k] * row_bytes), row_bytes)
    if whole:
        _record_lock(fd, _F_UNLCK, 0, stripes, stripes_at)
    for i in range(locked - 1, -1, -1):
        _record_lock(fd, _F_UNLCK, stripes_at[4 + i], 1, stripes_at)
    return not retired


# A request's buffers, one row of ``inbox`` each (a request waiting for its stream keeps its row):
# the sender's routing id, frame 0, the rows, their slices.
_PEER_AT, _FRAME_AT = 0, 256
_ROWS_AT = _FRAME_AT + lane.FRAME0_BYTES
_SHARDS_AT = _ROWS_AT + 8 * lane.MAX_ROWS
_INBOX_BYTES = _SHARDS_AT + 8 * lane.MAX_ROWS
# Per inbox row (``held``): the routing id's size, whether it waits, since when (ns).
(H_PEER_BYTES, H_WAITING, H_SINCE_NS) = range(3)
#: requests that may wait at once for their worker's stream (one row more takes the next request in)
HELD_MOST = 8
#: how long one may wait before it is answered "general" (a push parked by a slice move, say), at
#: most: a quarter of the resend timeout if less, far within what a worker waits for a lane's answer
#: before it gives the lane up
HOLD_S = 0.05


@kernel
def _early(head: np.ndarray, handled: np.ndarray) -> bool:
    """Whether a request of the worker's stream before this one is not handled here yet."""
    sender, after = head[lane.SENDER], head[lane.AFTER]
    return after > 0 and (handled[sender, 0] != head[lane.STREAM] or handled[sender, 1] < after)


@kernel
def _respond(handle: int, key: np.ndarray, node: int, entries: np.ndarray, refusing: np.ndarray, slowest: int,
             counts: np.ndarray, box: np.ndarray, n_peer: int, reply: np.ndarray, values: np.ndarray,
             scratch: np.ndarray, stripes_at: np.ndarray, by_row: np.ndarray, starts: np.ndarray,
             at: np.ndarray) -> None:
    """Answer the checked request in ``box`` (an inbox row) with its rows, or GENERAL if they are not
    all servable here."""
    peer, head = box[_PEER_AT:], box[_FRAME_AT:_FRAME_AT + lane.HEADER_BYTES].view(np.int64)
    rows, shards = box[_ROWS_AT:_SHARDS_AT].view(np.int64), box[_SHARDS_AT:].view(np.int64)
    sender, req, table, count = head[lane.SENDER], head[lane.REQ], head[lane.TABLE_ID], head[lane.COUNT]
    clock = min(slowest, head[lane.CLOCK])
    entry_of, grouped, slice_rows = by_row[0], by_row[1], by_row[2]
    row_bytes = _group(entries, refusing, table, sender, rows, shards, count, entry_of, starts, at, grouped)
    # The rows are gathered straight into the message ZeroMQ sends: no copy of them after.
    served = (0 < count * row_bytes <= lane.MAX_BYTES
              and io.zmq_msg_init_size(ptr(values.ctypes.data), count * row_bytes) == 0)
    if served:
        data = io.zmq_msg_data(ptr(values.ctypes.data))
        for e in range(entries.shape[0]):  # one slice at a time, each under its own locks
            if starts[e] < starts[e + 1] and not _gather(entries[e], rows, grouped, starts[e], starts[e + 1],
                                                         row_bytes, data, slice_rows, stripes_at, scratch):
                served = False  # moved off between the entries' making and now
                io.zmq_msg_close(ptr(values.ctypes.data))
                break
    if not served:
        counts[C_GENERAL] += 1
        _answer(handle, key, peer, n_peer, reply, lane.GENERAL, req, node, table, count, clock, values)
        return
    counts[C_SERVED] += 1
    counts[C_ROWS] += count
    _answer(handle, key, peer, n_peer, reply, lane.ROWS, req, node, table, count, clock, values)


@kernel
def _serve(handle: int, key: np.ndarray, node: int, entries: np.ndarray, refusing: np.ndarray, clocks: np.ndarray,
           handled: np.ndarray, replay: np.ndarray, counts: np.ndarray, inbox: np.ndarray, held: np.ndarray,
           now_ns: int, hold_ns: int, reply: np.ndarray, values: np.ndarray, tag: np.ndarray, scratch: np.ndarray,
           stripes_at: np.ndarray, by_row: np.ndarray, starts: np.ndarray, at: np.ndarray) -> int:
    """Answer the held requests whose turn has come (or whose wait ran out), then serve the requests
    queued on ``handle``; how many are held now."""
    num_workers = clocks.shape[0]
    slowest = clocks.min() if num_workers else 0
    waiting = 0
    for r in range(inbox.shape[0]):
        if held[r, H_WAITING] == 0:
            continue
        box = inbox[r]
        head = box[_FRAME_AT:_FRAME_AT + lane.HEADER_BYTES].view(np.int64)
        if not _early(head, handled):
            held[r, H_WAITING] = 0
            _respond(handle, key, node, entries, refusing, slowest, counts, box, held[r, H_PEER_BYTES], reply,
                     values, scratch, stripes_at, by_row, starts, at)
        elif now_ns - held[r, H_SINCE_NS] > hold_ns:
            held[r, H_WAITING] = 0
            counts[C_GENERAL] += 1
            counts[C_EARLY] += 1
            _answer(handle, key, box[_PEER_AT:], held[r, H_PEER_BYTES], reply, lane.GENERAL, head[lane.REQ], node,
                    head[lane.TABLE_ID], head[lane.COUNT], min(slowest, head[lane.CLOCK]), values)
        else:
            waiting += 1
    taken = 0
    while taken < _MOST_PER_WAKE:
        r = 0
        while held[r, H_WAITING]:  # a free row: at most HELD_MOST of HELD_MOST + 1 wait
            r += 1
        box = inbox[r]
        peer, frame = box[_PEER_AT:_FRAME_AT], box[_FRAME_AT:_ROWS_AT]
        n_peer = io.recv(handle, peer, DONTWAIT)
        if n_peer < 0:
            break  # nothing queued
        taken += 1
        n_frame = n_rows = n_shards = -1
        if n_peer <= peer.size and io.more(handle, scratch):
            n_frame = io.recv(handle, frame, 0)
            if io.more(handle, scratch):
                n_rows = io.recv(handle, box[_ROWS_AT:_SHARDS_AT], 0)
                if io.more(handle, scratch):
                    n_shards = io.recv(handle, box[_SHARDS_AT:], 0)
        io.drain(handle, scratch, tag)
        if n_frame < 0 or not lane.opened(key, frame, n_frame, tag):
            counts[C_DROPPED] += 1
            continue
        head = frame[:lane.HEADER_BYTES].view(np.int64)
        sender, req, inc, count = head[lane.SENDER], head[lane.REQ], head[lane.INCARNATION], head[lane.COUNT]
        if (head[lane.KIND] != lane.REQUEST or not 0 <= sender < num_workers or not 0 < count <= lane.MAX_ROWS
                or n_rows != 8 * count or n_shards != 8 * count):
            counts[C_DROPPED] += 1
            continue
        if replay[sender, 0] == inc and req < replay[sender, 1]:
            counts[C_REPLAYED] += 1  # older than one served: played again (a repeat of the last is read again)
            continue
        replay[sender, 0], replay[sender, 1] = inc, req
        if _early(head, handled):  # a request of the worker's before it is not handled here yet: it waits
            if waiting < HELD_MOST:
                held[r, H_WAITING], held[r, H_PEER_BYTES], held[r, H_SINCE_NS] = 1, n_peer, now_ns
                waiting += 1
                counts[C_HELD] += 1
                continue
            counts[C_GENERAL] += 1
            counts[C_EARLY] += 1
            _answer(handle, key, peer, n_peer, reply, lane.GENERAL, req, node, head[lane.TABLE_ID], count,
                    min(slowest, head[lane.CLOCK]), values)
            continue
        _respond(handle, key, node, entries, refusing, slowest, counts, box, n_peer, reply, values, scratch,
                 stripes_at, by_row, starts, at)
    return waiting


class ServerLane:
    """One server's lane: its socket, what it may serve, and what it counted."""

    def __init__(self, node: int, ctx: Any, host: str, secret: bytes, clocks: np.ndarray, order: StreamOrder,
                 resend_s: float) -> None:
        self.node = node
        self._hold_ns = int(min(HOLD_S, resend_s / 4) * 1e9)
        self.socket = NativeSocket.listen(ctx, host)
        self.address = self.socket.address
        self._secret = secret
        self._key = np.empty(0, np.uint64)  # made at ``warm``: checking it loads numba
        self._clocks = clocks
        num_workers = clocks.shape[0]
        self._order = order
        #: per worker: the incarnation of its stream here and the last seq of it handled
        self._handled = np.zeros((max(num_workers, 1), 2), np.int64)
        self._replay = np.zeros((max(num_workers, 1), 2), np.int64)
        self._replay[:, 0] = -1
        self.counts = np.zeros(len(COUNTER_NAMES), np.int64)
        self._inbox = np.empty((HELD_MOST + 1, _INBOX_BYTES), np.uint8)
        self._held = np.zeros((HELD_MOST + 1, 3), np.int64)
        #: requests held until their worker's stream is handled far enough (``waiting_until``)
        self.holding = 0
        self._by_row = np.empty((3, lane.MAX_ROWS), np.int64)  # each row's slice, rows by slice, a slice's rows
        self._reply = np.empty(lane.FRAME0_BYTES, np.uint8)
        self._tag = np.empty(32, np.uint8)
        self._scratch = np.empty(4, np.int64)
        self._stripes_at = np.empty(4 + 64, np.int64)
        self._signature: object = None
        self._entries = np.zeros((0, _ENTRY_FIELDS), np.int64)
        self._refusing = np.zeros((0, max(num_workers, 1)), np.int8)
        self._values = np.empty(8, np.int64)  # a zmq_msg_t (64 bytes): each answer's rows
        self._starts = np.zeros(1, np.int64)  # where each entry's rows start in a request, grouped by slice
        self._at = np.zeros(0, np.int64)
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
        """Serve what is queued on the lane, and the held requests whose turn has come; how many are
        held now."""
        self.warm()
        signature = _signature(tables, lost, refusing)
        if signature != self._signature:
            self._make_entries(tables, lost, refusing)
            self._signature = signature
        self._order.write_handled(self._handled)
        # The stripes' record locks do not exclude this process's other threads (a test's workers
        # in threads beside the server): their thread locks do, held while the compiled call runs.
        for lock in self._thread_locks:
            lock.acquire()
        try:
            self.holding = int(_serve(self.socket.handle, self._key, self.node, self._entries, self._refusing,
                                      self._clocks, self._handled, self._replay, self.counts, self._inbox,
                                      self._held, time.monotonic_ns(), self._hold_ns, self._reply, self._values,
                                      self._tag, self._scratch, self._stripes_at, self._by_row, self._starts,
                                      self._at))
        finally:
            for lock in reversed(self._thread_locks):
                lock.release()
        return self.holding

    def waiting_until(self) -> float | None:
        """When the first held request's wait runs out (``time.monotonic``), if one is held."""
        if not self.holding:
            return None
        since = self._held[self._held[:, H_WAITING] == 1, H_SINCE_NS]
        return (int(since.min()) + self._hold_ns) / 1e9 if since.size else None

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
        self._starts = np.zeros(len(entries) + 1, np.int64)
        self._at = np.zeros(len(entries), np.int64)
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
