"""A remote 1-key pull with every step of each side in one compiled function: the request path
out of Python, for ``bench_lean_request.py``.

Numba calls libzmq itself (the library pyzmq ships, through ``ctypes``) and the C library's
record locks, on the sockets pyzmq opened (``Socket.underlying``); the keyed BLAKE3 tag is
computed here (``keyed_blake3``, checked against the ``blake3`` package). The steps are the
lean request's (``bench_lean_request.py``'s docstring): the keys checked, the header with the
request's number, the sender, its incarnation and its place in the worker's stream, the tag,
the replay guard and the stream's order at the server, the rows gathered under a stripe's
thread lock and record lock, the reply's header and tag checked, the wait bounded by the
socket's receive timeout. One difference: the header is a fixed row of little-endian int64s
(``HEADER_FIELDS``), not msgpack, as a compiled wire format would be.
"""

from __future__ import annotations

import ctypes.util
import glob
import os

import blake3
import llvmlite.binding as llvm
import numpy as np
import zmq
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

# ------------------------------------------------------------------ keyed BLAKE3

_IV = np.array([0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A, 0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19],
               dtype=np.uint64)
_PERMUTATION = np.array([2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8], dtype=np.int64)
_CHUNK_START, _CHUNK_END, _ROOT, _KEYED_HASH = 1, 2, 8, 16
_MASK = 0xFFFFFFFF
BLOCK = 64
CHUNK = 1024
TAG_BYTES = 32


@njit(cache=True, inline="always")
def _rotr(x: int, n: int) -> int:
    return ((x >> n) | (x << (32 - n))) & _MASK


@njit(cache=True, inline="always")
def _g(s: np.ndarray, a: int, b: int, c: int, d: int, x: int, y: int) -> None:
    s[a] = (s[a] + s[b] + x) & _MASK
    s[d] = _rotr(s[d] ^ s[a], 16)
    s[c] = (s[c] + s[d]) & _MASK
    s[b] = _rotr(s[b] ^ s[c], 12)
    s[a] = (s[a] + s[b] + y) & _MASK
    s[d] = _rotr(s[d] ^ s[a], 8)
    s[c] = (s[c] + s[d]) & _MASK
    s[b] = _rotr(s[b] ^ s[c], 7)


@njit(cache=True)
def _compress(cv: np.ndarray, m: np.ndarray, block_len: int, flags: int, s: np.ndarray, t: np.ndarray) -> None:
    """BLAKE3's compression of block ``m`` (16 words) under chaining value ``cv`` (chunk 0), into
    ``s`` (16 words, not yet folded); ``t`` is scratch for the permuted words."""
    for i in range(8):
        s[i] = cv[i]
    for i in range(4):
        s[8 + i] = _IV[i]
    s[12] = 0
    s[13] = 0
    s[14] = block_len
    s[15] = flags
    for r in range(7):
        _g(s, 0, 4, 8, 12, m[0], m[1])
        _g(s, 1, 5, 9, 13, m[2], m[3])
        _g(s, 2, 6, 10, 14, m[4], m[5])
        _g(s, 3, 7, 11, 15, m[6], m[7])
        _g(s, 0, 5, 10, 15, m[8], m[9])
        _g(s, 1, 6, 11, 12, m[10], m[11])
        _g(s, 2, 7, 8, 13, m[12], m[13])
        _g(s, 3, 4, 9, 14, m[14], m[15])
        if r < 6:
            for i in range(16):
                t[i] = m[_PERMUTATION[i]]
            for i in range(16):
                m[i] = t[i]


@njit(cache=True)
def keyed_blake3(key_words: np.ndarray, data: np.ndarray, n: int, out: np.ndarray, at: int) -> None:
    """BLAKE3's keyed hash of ``data[:n]`` (bytes, at most one chunk: 1,024) into ``out[at:at + 32]``.
    ``key_words``: the 32-byte key as 8 little-endian words."""
    cv = np.empty(8, np.uint64)
    for i in range(8):
        cv[i] = key_words[i]
    m = np.empty(16, np.uint64)
    s = np.empty(16, np.uint64)
    t = np.empty(16, np.uint64)
    blocks = max(1, (n + BLOCK - 1) // BLOCK)
    for b in range(blocks):
        start = b * BLOCK
        length = min(BLOCK, n - start)
        for w in range(16):
            word = 0
            for k in range(4):
                pos = start + 4 * w + k
                if 4 * w + k < length:
                    word |= np.uint64(data[pos]) << (8 * k)
            m[w] = word
        flags = _KEYED_HASH
        if b == 0:
            flags |= _CHUNK_START
        if b == blocks - 1:
            flags |= _CHUNK_END | _ROOT
        _compress(cv, m, length, flags, s, t)
        for i in range(8):
            cv[i] = s[i] ^ s[i + 8]
    for i in range(8):
        for k in range(4):
            out[at + 4 * i + k] = (cv[i] >> (8 * k)) & 0xFF


def key_words(key: bytes) -> np.ndarray:
    """A 32-byte key as ``keyed_blake3`` takes it; checked first against the ``blake3`` package."""
    words = np.frombuffer(key, dtype="<u4").astype(np.uint64)
    data = np.random.default_rng(0).integers(0, 256, CHUNK, dtype=np.uint8)
    tag = np.empty(TAG_BYTES, np.uint8)
    for n in (0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 80, 2 * BLOCK + 3, CHUNK):
        keyed_blake3(words, data, n, tag, 0)
        if tag.tobytes() != blake3.blake3(data[:n].tobytes(), key=key).digest():
            raise AssertionError(f"the compiled keyed BLAKE3 of {n} bytes differs from the blake3 package's")
    return words


# ------------------------------------------------------------------ libzmq and libc
# Declared by symbol name (``ExternalFunction``) and loaded into the process's symbol table, not
# bound through ``ctypes``: numba caches no code that holds a ctypes function's address, and every
# process would compile these functions again (seconds) before its first request.


def _libzmq_path() -> str:
    """The libzmq pyzmq was built with and loaded (its wheel's copy, or the system's)."""
    here = os.path.dirname(zmq.__file__)
    found = sorted(glob.glob(os.path.join(here, "..", "pyzmq.libs", "libzmq*.so*")))
    return found[0] if found else ctypes.util.find_library("zmq") or "libzmq.so.5"


llvm.load_library_permanently(_libzmq_path())
_INT, _PTR = types.intc, types.voidptr
zmq_send = types.ExternalFunction("zmq_send", _INT(_PTR, _PTR, types.size_t, _INT))
zmq_recv = types.ExternalFunction("zmq_recv", _INT(_PTR, _PTR, types.size_t, _INT))
zmq_getsockopt = types.ExternalFunction("zmq_getsockopt", _INT(_PTR, _INT, _PTR, _PTR))
fcntl_call = types.ExternalFunction("fcntl", _INT(_INT, _INT, _PTR))  # (variadic: an int and a pointer pass alike)
mutex_lock = types.ExternalFunction("pthread_mutex_lock", _INT(_PTR))
mutex_unlock = types.ExternalFunction("pthread_mutex_unlock", _INT(_PTR))


@intrinsic
def _ptr(typingctx: object, address: types.Integer) -> tuple[object, object]:
    """An address (a socket's ``underlying``, an array's ``ctypes.data``) as a C pointer."""
    def codegen(context: object, builder: ir.IRBuilder, signature: object, args: list[ir.Value]) -> ir.Value:
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())
    return _PTR(types.intp), codegen


_SNDMORE, _RCVMORE = 2, 13
_F_SETLKW, _F_RDLCK, _F_UNLCK, _SEEK_SET = 7, 0, 2, 0


@njit(cache=True)
def _more(sock: int, scratch: np.ndarray) -> bool:
    """Whether the message being received has another frame (``scratch``: 2 int64s)."""
    scratch[0] = 0
    scratch[1] = 8
    zmq_getsockopt(_ptr(sock), _RCVMORE, _ptr(scratch.ctypes.data), _ptr(scratch.ctypes.data + 8))
    return scratch[0] != 0


@njit(cache=True)
def _drain(sock: int, scratch: np.ndarray, sink: np.ndarray) -> None:
    """Receive what is left of a message that is refused."""
    while _more(sock, scratch):
        zmq_recv(_ptr(sock), _ptr(sink.ctypes.data), sink.size, 0)


@njit(cache=True)
def _record_lock(fd: int, lock_type: int, offset: int, flock: np.ndarray) -> int:
    """``fcntl(F_SETLKW)`` on byte ``offset`` of ``fd``: a ``struct flock`` (x86-64 Linux layout:
    two shorts, start, length, pid) in ``flock`` (4 int64s)."""
    flock[0] = lock_type  # l_type (short), l_whence = SEEK_SET (short, 0), padding
    flock[1] = offset
    flock[2] = 1
    flock[3] = 0
    return fcntl_call(fd, _F_SETLKW, _ptr(flock.ctypes.data))


# ------------------------------------------------------------------ the request

#: the header: one little-endian int64 each
HEADER_FIELDS = ("version", "op", "req", "table", "sender", "incarnation", "seq", "count", "dim", "clock")
_H = len(HEADER_FIELDS)
HEADER_BYTES = 8 * _H
FRAME0 = HEADER_BYTES + TAG_BYTES
VERSION, OP_PULL, OP_VALUES, TABLE_ID, QUIT = 1, 5, 6, 7, -1
MAX_SENDERS = 64
MAX_KEYS = 1024


@njit(cache=True)
def _tag_ok(key: np.ndarray, frame: np.ndarray, tag: np.ndarray) -> bool:
    keyed_blake3(key, frame, HEADER_BYTES, tag, 0)
    diff = 0
    for i in range(TAG_BYTES):  # every byte compared: the time says nothing of where they differ
        diff |= tag[i] ^ frame[HEADER_BYTES + i]
    return diff == 0


@njit(cache=True)
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
        n_peer = zmq_recv(_ptr(sock), _ptr(peer.ctypes.data), peer.size, 0)
        if n_peer < 0:
            return -1
        n_frame = n_keys = -1
        if _more(sock, scratch):
            n_frame = zmq_recv(_ptr(sock), _ptr(frame.ctypes.data), frame.size, 0)
            if _more(sock, scratch):
                n_keys = zmq_recv(_ptr(sock), _ptr(keys_in.ctypes.data), keys_in.size, 0)
        _drain(sock, scratch, keys_in)
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
                zmq_send(_ptr(sock), _ptr(reply_peer[sender].ctypes.data), reply_peer_len[sender], _SNDMORE)
                zmq_send(_ptr(sock), _ptr(reply[sender].ctypes.data), FRAME0, _SNDMORE)
                zmq_send(_ptr(sock), _ptr(reply_rows[sender].ctypes.data), 4 * dim * reply_count[sender], 0)
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
        mutex_lock(_ptr(mutex.ctypes.data))
        _record_lock(stripes_fd, _F_RDLCK, stripe, flock)
        for i in range(count):
            for j in range(dim):
                out[i * dim + j] = rows[keys[i], j]
        _record_lock(stripes_fd, _F_UNLCK, stripe, flock)
        mutex_unlock(_ptr(mutex.ctypes.data))
        answer = reply[sender]
        fields = answer[:HEADER_BYTES].view(np.int64)
        fields[0], fields[1], fields[2], fields[3] = VERSION, OP_VALUES, req, TABLE_ID
        fields[4], fields[5], fields[6], fields[7], fields[8], fields[9] = -1, incarnation, head[6], count, dim, head[9]
        keyed_blake3(key, answer, HEADER_BYTES, answer, HEADER_BYTES)
        reply_peer[sender, :n_peer] = peer[:n_peer]
        reply_peer_len[sender] = n_peer
        reply_count[sender] = count
        last_inc[sender], last_req[sender] = inc, req
        zmq_send(_ptr(sock), _ptr(peer.ctypes.data), n_peer, _SNDMORE)
        zmq_send(_ptr(sock), _ptr(answer.ctypes.data), FRAME0, _SNDMORE)
        zmq_send(_ptr(sock), _ptr(out.ctypes.data), 4 * dim * count, 0)
        served += 1


@njit(cache=True, nogil=True)
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
    keyed_blake3(key, frame, HEADER_BYTES, frame, HEADER_BYTES)
    zmq_send(_ptr(sock), _ptr(frame.ctypes.data), FRAME0, _SNDMORE)
    zmq_send(_ptr(sock), _ptr(keys.ctypes.data), 8 * count, 0)
    n = zmq_recv(_ptr(sock), _ptr(frame.ctypes.data), FRAME0, 0)
    if n < 0:
        return -2
    n_rows = zmq_recv(_ptr(sock), _ptr(out.ctypes.data), out.nbytes, 0) if _more(sock, scratch) else -1
    _drain(sock, scratch, frame)
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
