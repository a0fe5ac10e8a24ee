"""The server's lane: small pulls and pushes of static tables served whole in compiled code.

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
"moved"); a push of finite values to such rows, of a table whose update rule
adds them (``Sum``, ``SGD``: no state beside the values). Any other request is
answered ``GENERAL`` (all of it, if one row is not servable), with nothing of it
done: the worker sends it the general way, which holds, refuses or explains it.
What the compiled code reads of that state is a table of entries the loop makes
again whenever the state changes (``_signature``), before it serves anything: a
slice that left, and whose memory is gone, is never read or written through an
old entry.

A read on the lane is not in the worker's stream, so it names the last request the
worker sent this server in it. One this server has not handled yet (a push still on
its way) holds the read: it keeps its buffers and is answered at the first pump after
the stream got that far, as the loop pumps after each message it handled; if that
takes longer than ``HOLD_S`` (a push parked by a slice move), or too many are held, it
is answered ``GENERAL`` and the general path reads after it. What has been handled of
each worker's stream the loop writes down before each pump.

A push on the lane is a request of the worker's stream: it is applied only as the
stream's next (held as a read is until then), and the loop then counts it handled
there (``pump`` returns it; ``StreamOrder.lane_handled``), so the requests after it
go on. Its general copy, sent if the lane's answer is late, finds it handled and is
acknowledged without being applied again; a lane copy that comes after the general
one was handled is answered ``GENERAL`` and applies nothing.
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

_F_SETLKW, _F_RDLCK, _F_WRLCK, _F_UNLCK = 7, 0, 1, 2


@native(lambda: c_function("memcpy", lambda t: t.voidptr(t.voidptr, t.voidptr, t.size_t)))
def _memcpy(to: int, source: int, size: int) -> int:
    raise NotImplementedError("compiled code only")


@native(lambda: c_function("fcntl", lambda t: t.intc(t.intc, t.intc, t.voidptr)))  # variadic: an int and a
def _fcntl(fd: int, command: int, argument: int) -> int:  # pointer pass as the fixed arguments would
    raise NotImplementedError("compiled code only")


# An entry per slice the lane may serve: these int64 fields (a push also needs ``E_PUSHABLE``: its
# table's rule adds ``scale`` times the pushed values, ``scales[entry]``, to float32 rows).
(E_TABLE, E_SHARD, E_VALUES, E_ROWS, E_ROW_BYTES, E_LOCK_FD, E_STRIPES, E_HEADER, E_SERVABLE,
 E_PUSHABLE) = range(10)
_ENTRY_FIELDS = 10
# What the lane counts (``counts``): reads answered with rows, rows sent, pushes applied, rows
# written, answered GENERAL (of those, how many because the worker's stream was not handled far
# enough in time), held until it was, dropped (a wrong tag or malformed), refused as replays.
(C_SERVED, C_ROWS, C_PUSHED, C_PUSHED_ROWS, C_GENERAL, C_EARLY, C_HELD, C_DROPPED, C_REPLAYED) = range(9)
COUNTER_NAMES = ("lane_pulls", "lane_rows", "lane_pushes", "lane_pushed_rows", "lane_general", "lane_early",
                 "lane_held", "lane_dropped", "lane_replayed")
# A push applied, for the loop to count in its worker's stream (``take_applied``): these fields.
(A_SENDER, A_STREAM, A_SEQ, A_TABLE) = range(4)
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
           shards: np.ndarray, count: int, pushing: bool, entry_of: np.ndarray, starts: np.ndarray, at: np.ndarray,
           grouped: np.ndarray) -> int:
    """The row size of the request's rows if every one is servable here (for a push: writable by
    the lane), else 0; then ``grouped`` holds their positions by slice, slice ``e``'s from
    ``starts[e]`` to ``starts[e + 1]``."""
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
            if (e < 0 or entries[e, E_SERVABLE] == 0 or refusing[e, sender] != 0
                    or (pushing and entries[e, E_PUSHABLE] == 0)):
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
def _lock_slice(entry: np.ndarray, rows: np.ndarray, grouped: np.ndarray, lo: int, hi: int, lock_type: int,
                slice_rows: np.ndarray, stripes_at: np.ndarray) -> int:
    """Lock (``lock_type``: for reading or writing) the stripes of one slice that the rows at
    ``grouped[lo:hi]`` touch, their rows in the slice into ``slice_rows``; how many stripes were
    locked one by one (-1: all at once, as ``StripedLocks.hold`` does for many rows)."""
    n = hi - lo
    for k in range(n):
        slice_rows[k] = rows[grouped[lo + k]]
    fd, stripes = entry[E_LOCK_FD], entry[E_STRIPES]
    if fd < 0:
        return 0
    if n * 4 >= stripes:
        _record_lock(fd, lock_type, 0, stripes, stripes_at)
        return -1
    locked = _stripes_of(slice_rows, n, stripes, stripes_at[4:])
    for i in range(locked):
        _record_lock(fd, lock_type, stripes_at[4 + i], 1, stripes_at)
    return locked


@kernel
def _unlock_slice(entry: np.ndarray, locked: int, stripes_at: np.ndarray) -> None:
    """Undo ``_lock_slice``."""
    fd, stripes = entry[E_LOCK_FD], entry[E_STRIPES]
    if locked < 0:
        _record_lock(fd, _F_UNLCK, 0, stripes, stripes_at)
    for i in range(locked - 1, -1, -1):
        _record_lock(fd, _F_UNLCK, stripes_at[4 + i], 1, stripes_at)


@kernel
def _retired(entry: np.ndarray, scratch: np.ndarray) -> bool:
    """Whether the slice was moved off (its header's mark)."""
    _memcpy(ptr(scratch.ctypes.data + 16), ptr(entry[E_HEADER]), 8)
    return scratch[2] != 0


@kernel
def _gather(entry: np.ndarray, rows: np.ndarray, grouped: np.ndarray, lo: int, hi: int, row_bytes: int, data: int,
            slice_rows: np.ndarray, stripes_at: np.ndarray, scratch: np.ndarray) -> bool:
    """Copy the rows at ``grouped[lo:hi]`` of one slice to their places in ``data``, under the
    slice's locks; False (nothing copied) if the slice was moved off meanwhile."""
    locked = _lock_slice(entry, rows, grouped, lo, hi, _F_RDLCK, slice_rows, stripes_at)
    retired = _retired(entry, scratch)
    if not retired:
        base = entry[E_VALUES]
        for k in range(hi - lo):
            _memcpy(ptr(data + grouped[lo + k] * row_bytes), ptr(base + slice_rows[k] * row_bytes), row_bytes)
    _unlock_slice(entry, locked, stripes_at)
    return not retired


@kernel
def _add(entry: np.ndarray, scale: float, rows: np.ndarray, grouped: np.ndarray, lo: int, hi: int, row_bytes: int,
         pushed: np.ndarray, slice_rows: np.ndarray, stripes_at: np.ndarray, row: np.ndarray) -> None:
    """Add ``scale`` times the pushed values at ``grouped[lo:hi]`` (float32, a row each) to their rows of
    one slice, under the slice's locks held for writing (``row``: room for one row)."""
    locked = _lock_slice(entry, rows, grouped, lo, hi, _F_WRLCK, slice_rows, stripes_at)
    base, dim = entry[E_VALUES], row_bytes // 4
    for k in range(hi - lo):
        at = base + slice_rows[k] * row_bytes
        _memcpy(ptr(row.ctypes.data), ptr(at), row_bytes)
        first = grouped[lo + k] * dim
        for j in range(dim):
            row[j] += np.float32(scale * pushed[first + j])
        _memcpy(ptr(at), ptr(row.ctypes.data), row_bytes)
    _unlock_slice(entry, locked, stripes_at)


# A request's buffers, one row of ``inbox`` each (a request waiting for its stream keeps its row):
# the sender's routing id, frame 0, the rows, their slices, a push's values.
_PEER_AT, _FRAME_AT = 0, 256
_ROWS_AT = _FRAME_AT + lane.FRAME0_BYTES
_SHARDS_AT = _ROWS_AT + 8 * lane.MAX_ROWS
_VALUES_AT = _SHARDS_AT + 8 * lane.MAX_ROWS
_INBOX_BYTES = _VALUES_AT + lane.MAX_BYTES
# Per inbox row (``held``): the routing id's size, whether it waits, since when (ns), the bytes of a
# push's values.
(H_PEER_BYTES, H_WAITING, H_SINCE_NS, H_VALUES_BYTES) = range(4)
#: requests that may wait at once for their worker's stream (one row more takes the next request in)
HELD_MOST = 8
#: how long one may wait before it is answered "general" (a push parked by a slice move, say), at
#: most: a quarter of the resend timeout if less, far within what a worker waits for a lane's answer
#: before it gives the lane up
HOLD_S = 0.05


_NOW, _LATER, _NEVER = 1, 0, -1


@kernel
def _turn(head: np.ndarray, handled: np.ndarray) -> int:
    """Whether the request may be served now: a read once the worker's stream is handled here up to
    the request it names, a push as that stream's next (``_LATER``: not handled that far yet); a push
    whose stream is not the one here, or whose turn has passed, ``_NEVER``."""
    sender, after, stream = head[lane.SENDER], head[lane.AFTER], head[lane.STREAM]
    if head[lane.KIND] == lane.READ:
        return _LATER if after > 0 and (handled[sender, 0] != stream or handled[sender, 1] < after) else _NOW
    if handled[sender, 0] != stream or handled[sender, 1] > after:
        return _NEVER
    return _LATER if handled[sender, 1] < after or handled[sender, 2] != 0 else _NOW


@kernel
def _apply(entries: np.ndarray, scales: np.ndarray, box: np.ndarray, count: int, row_bytes: int, n_values: int,
           scratch: np.ndarray, stripes_at: np.ndarray, by_row: np.ndarray, starts: np.ndarray,
           row: np.ndarray) -> bool:
    """Apply the push in ``box``, its rows grouped by slice (``_group``): all of it, or nothing if its
    values are not a float32 row per key, one is not finite, or a slice was moved off."""
    if n_values != count * row_bytes or row_bytes % 4 != 0 or row_bytes > 4 * row.shape[0]:
        return False
    pushed = box[_VALUES_AT:_VALUES_AT + n_values].view(np.float32)
    for i in range(pushed.shape[0]):
        if not np.isfinite(pushed[i]):
            return False  # the general path drops such rows and says how many
    for e in range(entries.shape[0]):
        if starts[e] < starts[e + 1] and _retired(entries[e], scratch):
            return False
    rows = box[_ROWS_AT:_SHARDS_AT].view(np.int64)
    for e in range(entries.shape[0]):  # one slice at a time, each under its own locks
        if starts[e] < starts[e + 1]:
            _add(entries[e], scales[e], rows, by_row[1], starts[e], starts[e + 1], row_bytes, pushed, by_row[2],
                 stripes_at, row)
    return True


@kernel
def _count_load(load: np.ndarray, starts: np.ndarray) -> None:
    """Count a served request's rows to each slice it touched (``load``: rows and requests per entry)."""
    for e in range(load.shape[0]):
        if starts[e] < starts[e + 1]:
            load[e, 0] += starts[e + 1] - starts[e]
            load[e, 1] += 1


@kernel
def _respond(handle: int, key: np.ndarray, node: int, entries: np.ndarray, scales: np.ndarray, refusing: np.ndarray,
             slowest: int, handled: np.ndarray, counts: np.ndarray, load: np.ndarray, applied: np.ndarray,
             box: np.ndarray, n_peer: int, n_values: int, reply: np.ndarray, values: np.ndarray, scratch: np.ndarray,
             stripes_at: np.ndarray, by_row: np.ndarray, starts: np.ndarray, at: np.ndarray, row: np.ndarray) -> None:
    """Serve the checked request in ``box`` (an inbox row) whose turn it is: a read answered with its
    rows, a push applied (and noted in ``applied``), or GENERAL if not all of it is servable here;
    what it served counted in ``load``."""
    peer, head = box[_PEER_AT:], box[_FRAME_AT:_FRAME_AT + lane.HEADER_BYTES].view(np.int64)
    rows, shards = box[_ROWS_AT:_SHARDS_AT].view(np.int64), box[_SHARDS_AT:_VALUES_AT].view(np.int64)
    sender, req, table, count = head[lane.SENDER], head[lane.REQ], head[lane.TABLE_ID], head[lane.COUNT]
    clock = min(slowest, head[lane.CLOCK])
    entry_of, grouped, slice_rows = by_row[0], by_row[1], by_row[2]
    pushing = head[lane.KIND] == lane.PUSH
    row_bytes = _group(entries, refusing, table, sender, rows, shards, count, pushing, entry_of, starts, at, grouped)
    if pushing:
        if row_bytes == 0 or not _apply(entries, scales, box, count, row_bytes, n_values, scratch, stripes_at,
                                        by_row, starts, row):
            counts[C_GENERAL] += 1
            _answer(handle, key, peer, n_peer, reply, lane.GENERAL, req, node, table, count, clock, values)
            return
        handled[sender, 1] = head[lane.AFTER] + 1  # the stream's next: its later reads and pushes follow
        n = applied[0, 0] + 1
        applied[0, 0] = n
        applied[n, A_SENDER], applied[n, A_STREAM] = sender, head[lane.STREAM]
        applied[n, A_SEQ], applied[n, A_TABLE] = head[lane.AFTER] + 1, table
        counts[C_PUSHED] += 1
        counts[C_PUSHED_ROWS] += count
        _count_load(load, starts)
        _answer(handle, key, peer, n_peer, reply, lane.DONE, req, node, table, count, clock, values)
        return
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
    _count_load(load, starts)
    _answer(handle, key, peer, n_peer, reply, lane.ROWS, req, node, table, count, clock, values)


@kernel
def _serve(handle: int, key: np.ndarray, node: int, entries: np.ndarray, scales: np.ndarray, refusing: np.ndarray,
           clocks: np.ndarray, handled: np.ndarray, replay: np.ndarray, counts: np.ndarray, load: np.ndarray,
           applied: np.ndarray, inbox: np.ndarray, held: np.ndarray, now_ns: int, hold_ns: int, reply: np.ndarray,
           values: np.ndarray, tag: np.ndarray, scratch: np.ndarray, stripes_at: np.ndarray, by_row: np.ndarray,
           starts: np.ndarray, at: np.ndarray, row: np.ndarray) -> int:
    """Serve the held requests whose turn has come (answer GENERAL those whose wait ran out), then the
    requests queued on ``handle``; how many are held now."""
    num_workers = clocks.shape[0]
    slowest = clocks.min() if num_workers else 0
    waiting = 0
    served = True
    while served:  # a push served may be what another held request waited for
        served = False
        waiting = 0
        for r in range(inbox.shape[0]):
            if held[r, H_WAITING] == 0:
                continue
            box = inbox[r]
            head = box[_FRAME_AT:_FRAME_AT + lane.HEADER_BYTES].view(np.int64)
            turn = _turn(head, handled)
            if turn == _NOW:
                held[r, H_WAITING] = 0
                served = True
                _respond(handle, key, node, entries, scales, refusing, slowest, handled, counts, load, applied, box,
                         held[r, H_PEER_BYTES], held[r, H_VALUES_BYTES], reply, values, scratch, stripes_at, by_row,
                         starts, at, row)
            elif turn == _NEVER or now_ns - held[r, H_SINCE_NS] > hold_ns:
                held[r, H_WAITING] = 0
                counts[C_GENERAL] += 1
                counts[C_EARLY] += turn == _LATER
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
        n_frame = n_rows = n_shards = n_values = -1
        if n_peer <= peer.size and io.more(handle, scratch):
            n_frame = io.recv(handle, frame, 0)
            if io.more(handle, scratch):
                n_rows = io.recv(handle, box[_ROWS_AT:_SHARDS_AT], 0)
                if io.more(handle, scratch):
                    n_shards = io.recv(handle, box[_SHARDS_AT:_VALUES_AT], 0)
                    if io.more(handle, scratch):
                        n_values = io.recv(handle, box[_VALUES_AT:], 0)
        io.drain(handle, scratch, tag)
        if n_frame < 0 or not lane.opened(key, frame, n_frame, tag):
            counts[C_DROPPED] += 1
            continue
        head = frame[:lane.HEADER_BYTES].view(np.int64)
        sender, req, inc, count, kind = (head[lane.SENDER], head[lane.REQ], head[lane.INCARNATION], head[lane.COUNT],
                                         head[lane.KIND])
        # (a push's values longer than the buffer were cut: the size received says so, and ``_apply`` refuses it)
        if (not (kind == lane.READ and n_values < 0 or kind == lane.PUSH and 0 < n_values <= lane.MAX_BYTES)
                or not 0 <= sender < num_workers or not 0 < count <= lane.MAX_ROWS or n_rows != 8 * count
                or n_shards != 8 * count):
            counts[C_DROPPED] += 1
            continue
        if replay[sender, 0] == inc and req < replay[sender, 1]:
            counts[C_REPLAYED] += 1  # older than one served: played again (a repeat of the last is read again)
            continue
        replay[sender, 0], replay[sender, 1] = inc, req
        turn = _turn(head, handled)
        if turn == _LATER and waiting < HELD_MOST:  # a request of the worker's before it is not handled yet
            held[r, H_WAITING], held[r, H_PEER_BYTES], held[r, H_SINCE_NS] = 1, n_peer, now_ns
            held[r, H_VALUES_BYTES] = n_values
            waiting += 1
            counts[C_HELD] += 1
            continue
        if turn != _NOW:
            counts[C_GENERAL] += 1
            counts[C_EARLY] += turn == _LATER
            _answer(handle, key, peer, n_peer, reply, lane.GENERAL, req, node, head[lane.TABLE_ID], count,
                    min(slowest, head[lane.CLOCK]), values)
            continue
        _respond(handle, key, node, entries, scales, refusing, slowest, handled, counts, load, applied, box, n_peer,
                 n_values, reply, values, scratch, stripes_at, by_row, starts, at, row)
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
        #: per worker: the incarnation of its stream here, the last seq of it handled, whether the
        #: next is held back (``StreamOrder.write_handled``)
        self._handled = np.zeros((max(num_workers, 1), 3), np.int64)
        self._replay = np.zeros((max(num_workers, 1), 2), np.int64)
        self._replay[:, 0] = -1
        self.counts = np.zeros(len(COUNTER_NAMES), np.int64)
        self._inbox = np.empty((HELD_MOST + 1, _INBOX_BYTES), np.uint8)
        self._held = np.zeros((HELD_MOST + 1, 4), np.int64)
        #: the pushes applied in one pump (a row each after row 0, which counts them), for the loop
        self._applied = np.zeros((2 + _MOST_PER_WAKE + HELD_MOST, 4), np.int64)
        self._table_names: dict[int, str] = {}
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
        self._scales = np.zeros(0, np.float64)
        #: per entry: rows served and requests since the last ``take_load``, and the slice each counts for
        self._load = np.zeros((0, 2), np.int64)
        self._load_of: list[tuple[str, int]] = []
        self._row = np.empty(lane.MAX_BYTES // 4, np.float32)  # a row a push adds to
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

    def pump(self, tables: dict[str, ServedTable], lost: dict[str, str],
             refusing: set[tuple[int, str]]) -> list[tuple[int, str]]:
        """Serve what is queued on the lane, and the held requests whose turn has come (``holding``:
        how many are held now). Returns the pushes applied, each as (worker, table), counted handled
        in their workers' streams: the loop serves the requests that waited for them."""
        self.warm()
        signature = _signature(tables, lost, refusing)
        if signature != self._signature:
            self.take_load(tables)
            self._make_entries(tables, lost, refusing)
            self._signature = signature
        self._order.write_handled(self._handled)
        # The stripes' record locks do not exclude this process's other threads (a test's workers
        # in threads beside the server): their thread locks do, held while the compiled call runs.
        for lock in self._thread_locks:
            lock.acquire()
        try:
            self.holding = int(_serve(self.socket.handle, self._key, self.node, self._entries, self._scales,
                                      self._refusing, self._clocks, self._handled, self._replay, self.counts,
                                      self._load, self._applied, self._inbox, self._held, time.monotonic_ns(),
                                      self._hold_ns, self._reply, self._values, self._tag, self._scratch,
                                      self._stripes_at, self._by_row, self._starts, self._at, self._row))
        finally:
            for lock in reversed(self._thread_locks):
                lock.release()
        count = int(self._applied[0, 0])
        if not count:
            return []
        self._applied[0, 0] = 0
        applied = []
        for sender, stream, seq, table in self._applied[1:count + 1].tolist():
            self._order.lane_handled(sender, stream, seq)
            applied.append((sender, self._table_names[table]))
        return applied

    def take_load(self, tables: dict[str, ServedTable]) -> None:
        """Add what the lane served since the last call to its tables' load (``ServedTable.load``),
        which the server reports and the rebalancer reads: a slice read or written on the lane is as
        busy as one served the general way."""
        for e in np.flatnonzero(self._load[:, 1]).tolist():
            name, shard = self._load_of[e]
            table = tables.get(name)
            if table is not None:
                table.count_served(shard, int(self._load[e, 0]), int(self._load[e, 1]))
        self._load[:] = 0

    def waiting_until(self) -> float | None:
        """When the first held request's wait runs out (``time.monotonic``), if one is held."""
        if not self.holding:
            return None
        since = self._held[self._held[:, H_WAITING] == 1, H_SINCE_NS]
        return (int(since.min()) + self._hold_ns) / 1e9 if since.size else None

    def _make_entries(self, tables: dict[str, ServedTable], lost: dict[str, str],
                      refusing: set[tuple[int, str]]) -> None:
        entries, scales, refused, locks, load_of = [], [], [], [], []
        workers = self._refusing.shape[1]
        self._table_names = {}
        for name, table in tables.items():
            if table.spec.consistency.bound is not None:
                continue  # bounded reads wait on clocks: the general path's
            tid = lane.table_id(name)
            self._table_names[tid] = name
            for shard, store in table.stores.items():
                row_bytes = store.values.strides[0]
                held = store.locks
                if held is not None and held.thread_lock not in locks:
                    locks.append(held.thread_lock)
                servable = name not in lost and shard not in table.moving
                # A rule with state beside the values (Adagrad, Adam) updates it in Python: the general path's.
                pushable = store.rule.scale is not None and not store.rule.state and store.values.dtype == np.float32
                entries.append([tid, shard, store.values.ctypes.data, store.num_rows, row_bytes,
                                -1 if held is None else held.fd, 0 if held is None else held.num_stripes,
                                store.header.ctypes.data, int(servable), int(pushable)])
                scales.append(store.rule.scale if pushable else 0.0)
                load_of.append((name, shard))
                refused.append([int((w, name) in refusing) for w in range(workers)])
        self._entries = np.array(entries, np.int64).reshape(-1, _ENTRY_FIELDS)
        self._scales = np.array(scales, np.float64)
        self._load = np.zeros((len(entries), 2), np.int64)
        self._load_of = load_of
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
