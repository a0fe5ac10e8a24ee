"""Keyed BLAKE3 in compiled code, for tags computed inside compiled request paths.

The ``blake3`` package is a Python object to numba; a compiled lane (``server.lane``,
``client.lane``) signs and checks its headers here instead. One chunk (up to 1,024 bytes:
a header) is all it hashes; the result is BLAKE3's keyed hash of those bytes, byte for byte
(``key_words`` checks that against the package before any key is used).
"""

from __future__ import annotations

import functools

import blake3
import numpy as np

from shoal.storage.jit import kernel
from shoal.wire.codec import TAG_BYTES

_IV = np.array([0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A, 0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19],
               dtype=np.uint64)
_PERMUTATION = np.array([2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8], dtype=np.int64)
_CHUNK_START, _CHUNK_END, _ROOT, _KEYED_HASH = 1, 2, 8, 16
_MASK = 0xFFFFFFFF
BLOCK = 64
CHUNK = 1024


@kernel
def _rotr(x: int, n: int) -> int:
    return ((x >> n) | (x << (32 - n))) & _MASK


@kernel
def _g(s: np.ndarray, a: int, b: int, c: int, d: int, x: int, y: int) -> None:
    s[a] = (s[a] + s[b] + x) & _MASK
    s[d] = _rotr(s[d] ^ s[a], 16)
    s[c] = (s[c] + s[d]) & _MASK
    s[b] = _rotr(s[b] ^ s[c], 12)
    s[a] = (s[a] + s[b] + y) & _MASK
    s[d] = _rotr(s[d] ^ s[a], 8)
    s[c] = (s[c] + s[d]) & _MASK
    s[b] = _rotr(s[b] ^ s[c], 7)


@kernel
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


@kernel
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
            word = np.uint64(0)
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
    """A 32-byte key as ``keyed_blake3`` takes it; the compiled hash is checked first against the
    ``blake3`` package (once per process): a tag both sides compute wrongly alike would still
    match between them."""
    _check_against_package()
    return np.frombuffer(key, dtype="<u4").astype(np.uint64)


@functools.cache
def _check_against_package() -> None:
    key = bytes(range(32))
    words = np.frombuffer(key, dtype="<u4").astype(np.uint64)
    data = np.random.default_rng(0).integers(0, 256, CHUNK, dtype=np.uint8)
    tag = np.empty(TAG_BYTES, np.uint8)
    for n in (0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 80, 2 * BLOCK + 3, CHUNK):
        keyed_blake3(words, data, n, tag, 0)
        if tag.tobytes() != blake3.blake3(data[:n].tobytes(), key=key).digest():
            raise AssertionError(f"the compiled keyed BLAKE3 of {n} bytes differs from the blake3 package's")
