"""A remote 1-key pull with every step of each side in one compiled function: the request path
out of Python, for ``bench_lean_request.py``.

Numba calls libzmq itself (the library pyzmq ships: ``shoal.transport.native``) and the C
library's record locks, on the sockets pyzmq opened (``Socket.underlying``); the keyed BLAKE3
tag is Shoal's compiled one (``shoal.wire.keyed_hash``). The steps are the
lean request's (``bench_lean_request.py``'s docstring): the keys checked, the header with the
request's number, the sender, its incarnation and its place in the worker's stream, the tag,
the replay guard and the stream's order at the server, the rows gathered under a stripe's
thread lock and record lock, the reply's header and tag checked, the wait bounded by the
socket's receive timeout. One difference: the header is a fixed row of little-endian int64s
(``HEADER_FIELDS``), not msgpack, as a compiled wire format would be.
"""

from __future__ import annotations

import numpy as np

from shoal.storage.jit import kernel, native
from shoal.transport import native as io
from shoal.transport.native import c_function, ptr, zmq_recv, zmq_send
from shoal.wire import keyed_hash
from shoal.wire.codec import TAG_BYTES


@native(lambda: c_function("fcntl", lambda t: t.intc(t.intc, t.intc, t.voidptr)))  # variadic: an int and a
def fcntl_call(fd: int, command: int, argument: int) -> int:  # pointer pass as the fixed arguments would
    raise NotImplementedError("compiled code only")


@native(lambda: c_function("pthread_mutex_lock", lambda t: t.intc(t.voidptr)))
def mutex_lock(mutex: int) -> int:
    raise NotImplementedError("compiled code only")


@native(lambda: c_function("pthread_mutex_unlock", lambda t: t.intc(t.voidptr)))
def mutex_unlock(mutex: int) -> int:
    raise NotImplementedError("compiled code only")

_SNDMORE = 2
_F_SETLKW, _F_RDLCK, _F_UNLCK = 7, 0, 2


@kernel
def _record_lock(fd: int, lock_type: int, offset: int, flock: np.ndarray) -> int:
    """``fcntl(F_SETLKW)`` on byte ``offset`` of ``fd``: a ``struct flock`` (x86-64 Linux layout:
    two shorts, start, length, pid) in ``flock`` (4 int64s)."""
    flock[0] = lock_type  # l_type (short), l_whence = SEEK_SET (short, 0), padding
    flock[1] = offset
    flock[2] = 1
    flock[3] = 0
    return fcntl_call(fd, _F_SETLKW, ptr(flock.ctypes.data))


# ------------------------------------------------------------------ the request

#: the header: one little-endian int64 each
HEADER_FIELDS = ("version", "op", "req", "table", "sender", "incarnation", "seq", "count", "dim", "clock")
_H = len(HEADER_FIELDS)
HEADER_BYTES = 8 * _H
FRAME0 = HEADER_BYTES + TAG_BYTES
VERSION, OP_PULL, OP_VALUES, TABLE_ID, QUIT = 1, 5, 6, 7, -1
MAX_SENDERS = 64
MAX_KEYS = 1024


@kernel
def _tag_ok(key: np.ndarray, frame: np.ndarray, tag: np.ndarray) -> bool:
    keyed_hash.keyed_blake3(key, frame, HEADER_BYTES, tag, 0)
    diff = 0
    for i in range(TAG_BYTES):  # every byte compared: the time says nothing of where they differ
        diff |= tag[i] ^ frame[HEADER_BYTES + i]
    return diff == 0


@kernel
def serve(sock: int, key: np.ndarray, rows: np.ndarray, stripes_fd: int, mutex: np.ndarray, incarnation: int,
          stripes: int) -> int:
    """Serve compiled pulls on ``sock`` (a ROUTER) until a request for table ``QUIT``; returns the
    requests served."""
    dim = rows.shape[1]
    peer = np.empty(256, np.uint8)
    frame = np.empty(FRAME0, np.uint8)
    head = frame[:HEADER_BYTES].view(np.int64)
    keys_in = np.empty(8 * MAX_KEYS, np.uint8)
    tag = np.empty(TAG_BYTES, np.uint8)
    scratch = np.empty(2, np.int64)
    flock = np.zeros(4, np.int64)
    reply = np.empty((MAX_SENDERS, FRAME0), np.uint8)  # each sender's last reply, kept for a repeat
    reply_rows = np.empty((MAX_SENDERS, MAX_KEYS * dim), np.float32)
    reply_count = np.zeros(MAX_SENDERS, np.int64)
    reply_peer = np.empty((MAX_SENDERS, 256), np.uint8)
    reply_peer_len = np.zeros(MAX_SENDERS, np.int64)
    last_inc = np.full(MAX_SENDERS, -1, np.int64)
    last_req = np.zeros(MAX_SENDERS, np.int64)
    next_seq = np.ones(MAX_SENDERS, np.int64)
    served = 0
    while True:
        n_peer = zmq_recv(ptr(sock), ptr(peer.ctypes.data), peer.size, 0)
        if n_peer < 0:
            return -1
        n_frame = n_keys = -1
        if io.more(sock, scratch):
            n_frame = zmq_recv(ptr(sock), ptr(frame.ctypes.data), frame.size, 0)
            if io.more(sock, scratch):
                n_keys = zmq_recv(ptr(sock), ptr(keys_in.ctypes.data), keys_in.size, 0)
        io.drain(sock, scratch, keys_in)
        if n_frame != FRAME0 or not _tag_ok(key, frame, tag):
            continue  # unsigned, or a wrong tag: the slow path refuses it
        if head[3] == QUIT:
            return served
        sender, count = head[4], head[7]
        if (head[0] != VERSION or head[1] != OP_PULL or head[3] != TABLE_ID or not 0 <= sender < MAX_SENDERS
                or not 0 < count <= MAX_KEYS or n_keys != 8 * count):
            continue  # the slow path's
        req, inc = head[2], head[5]
        if last_inc[sender] == inc and req <= last_req[sender]:
            if req == last_req[sender]:  # sent again: answered again
                zmq_send(ptr(sock), ptr(reply_peer[sender].ctypes.data), reply_peer_len[sender], _SNDMORE)
                zmq_send(ptr(sock), ptr(reply[sender].ctypes.data), FRAME0, _SNDMORE)
                zmq_send(ptr(sock), ptr(reply_rows[sender].ctypes.data), 4 * dim * reply_count[sender], 0)
            continue
        if head[6] != next_seq[sender]:
            continue  # out of its stream's order: the slow path holds it
        keys = keys_in[:n_keys].view(np.int64)
        bad = False
        for i in range(count):
            if not 0 <= keys[i] < rows.shape[0]:
                bad = True
        if bad:
            continue  # the slow path answers with the error
        next_seq[sender] = head[6] + 1
        out = reply_rows[sender]
        stripe = keys[0] % stripes
        mutex_lock(ptr(mutex.ctypes.data))
        _record_lock(stripes_fd, _F_RDLCK, stripe, flock)
        for i in range(count):
            for j in range(dim):
                out[i * dim + j] = rows[keys[i], j]
        _record_lock(stripes_fd, _F_UNLCK, stripe, flock)
        mutex_unlock(ptr(mutex.ctypes.data))
        answer = reply[sender]
        fields = answer[:HEADER_BYTES].view(np.int64)
        fields[0], fields[1], fields[2], fields[3] = VERSION, OP_VALUES, req, TABLE_ID
        fields[4], fields[5], fields[6], fields[7], fields[8], fields[9] = -1, incarnation, head[6], count, dim, head[9]
        keyed_hash.keyed_blake3(key, answer, HEADER_BYTES, answer, HEADER_BYTES)
        reply_peer[sender, :n_peer] = peer[:n_peer]
        reply_peer_len[sender] = n_peer
        reply_count[sender] = count
        last_inc[sender], last_req[sender] = inc, req
        zmq_send(ptr(sock), ptr(peer.ctypes.data), n_peer, _SNDMORE)
        zmq_send(ptr(sock), ptr(answer.ctypes.data), FRAME0, _SNDMORE)
        zmq_send(ptr(sock), ptr(out.ctypes.data), 4 * dim * count, 0)
        served += 1


@kernel
def pull(sock: int, key: np.ndarray, keys: np.ndarray, num_keys: int, out: np.ndarray, state: np.ndarray,
         frame: np.ndarray, tag: np.ndarray, scratch: np.ndarray) -> int:
    """One compiled pull of ``keys`` into ``out`` (count x dim float32) through ``sock`` (a DEALER
    with a receive timeout). ``state``: sender, incarnation, last request, last stream place.
    Returns 0, or a negative code: -1 keys out of range, -2 not answered in time, -3 a wrong
    tag, -4 not the reply to this request, -5 rows that do not fit the header."""
    count, dim = keys.shape[0], out.shape[1]
    for i in range(count):
        if not 0 <= keys[i] < num_keys:
            return -1
    state[2] += 1
    state[3] += 1
    head = frame[:HEADER_BYTES].view(np.int64)
    head[0], head[1], head[2], head[3], head[4] = VERSION, OP_PULL, state[2], TABLE_ID, state[0]
    head[5], head[6], head[7], head[8], head[9] = state[1], state[3], count, 0, 0
    keyed_hash.keyed_blake3(key, frame, HEADER_BYTES, frame, HEADER_BYTES)
    zmq_send(ptr(sock), ptr(frame.ctypes.data), FRAME0, _SNDMORE)
    zmq_send(ptr(sock), ptr(keys.ctypes.data), 8 * count, 0)
    n = zmq_recv(ptr(sock), ptr(frame.ctypes.data), FRAME0, 0)
    if n < 0:
        return -2
    n_rows = zmq_recv(ptr(sock), ptr(out.ctypes.data), out.nbytes, 0) if io.more(sock, scratch) else -1
    io.drain(sock, scratch, frame)
    if n != FRAME0 or not _tag_ok(key, frame, tag):
        return -3
    if head[2] != state[2] or head[1] != OP_VALUES or head[7] != count or head[8] != dim:
        return -4
    if n_rows != 4 * dim * count:
        return -5
    return 0


def new_mutex() -> np.ndarray:
    """A process-private pthread mutex (glibc's initialiser is all zeros)."""
    return np.zeros(8, np.int64)
