"""The lane's messages: a pull or a push that compiled code sends, checks and answers whole.

A lane message is frame 0, a fixed row of little-endian int64 fields whose first byte is
0xC1 (a byte msgpack never uses, so no codec header is ever taken for one) and the keyed
BLAKE3 tag over them (``wire.keyed_hash``), then the frames of its arrays: a request's rows
and each row's slice (int64 both), a push's values after them, an answer's values. The tag
covers the header alone, as the codec's does on a wire only this machine reaches: the lane
runs on no other.

A request names its table by ``table_id`` (a hash of the name), its rows' count, the
worker's clock, and the last request the worker sent this server in its numbered stream
before it (``server.streams``: ``stream`` its incarnation, ``after`` its seq, 0 for none).
A ``READ`` is read once the server has handled the stream up to ``after``. A ``PUSH`` is a
request of that stream itself, numbered ``after + 1``, its ``req`` the one the worker's
tracker gave it: the server applies it only as the next of the stream, and the general path
carries the same request (same number, same seq) if the lane does not. An answer repeats
the request's number and says ``ROWS`` (the values follow, in the request's order), ``DONE``
(the push is applied) or ``GENERAL`` (this server does not serve all of it here, or did not
handle the stream up to ``after`` within the wait it allows: nothing of it was done; send it
the general way, where it is served in its turn).
"""

from __future__ import annotations

import blake3
import numpy as np

from shoal.storage.jit import kernel
from shoal.wire import keyed_hash
from shoal.wire.codec import TAG_BYTES

MAGIC = 0xC1 | (4 << 8)  # 0xC1, then the lane's version
#: the header's fields, in order
FIELDS = ("magic", "kind", "req", "sender", "incarnation", "table_id", "count", "clock", "stream", "after")
(MAGIC_AT, KIND, REQ, SENDER, INCARNATION, TABLE_ID, COUNT, CLOCK, STREAM, AFTER) = range(len(FIELDS))
HEADER_BYTES = 8 * len(FIELDS)
FRAME0_BYTES = HEADER_BYTES + TAG_BYTES
READ, ROWS, GENERAL, PUSH, DONE = 1, 2, 3, 4, 5
#: most rows, and bytes of values, a lane request carries: larger ones take the general path, whose
#: cost is mostly their rows' and whose requests can be in flight together
MAX_ROWS = 4096
MAX_BYTES = 1 << 18


def table_id(name: str) -> int:
    """A table's number on the lane: 63 bits of a hash of its name."""
    return int.from_bytes(blake3.blake3(name.encode()).digest()[:8], "little") & ((1 << 63) - 1)


@kernel
def seal(key: np.ndarray, frame: np.ndarray) -> None:
    """Write the tag over ``frame``'s header (its int64 fields set already)."""
    keyed_hash.keyed_blake3(key, frame, HEADER_BYTES, frame, HEADER_BYTES)


@kernel
def opened(key: np.ndarray, frame: np.ndarray, size: int, scratch: np.ndarray) -> bool:
    """Whether ``frame`` (``size`` bytes received) is a lane header of this version under a tag
    made with ``key`` (``scratch``: 32 bytes). Every byte of the tag is compared: the time taken
    says nothing of where a forged one differs."""
    if size != FRAME0_BYTES or frame[:HEADER_BYTES].view(np.int64)[0] != MAGIC:
        return False
    keyed_hash.keyed_blake3(key, frame, HEADER_BYTES, scratch, 0)
    diff = 0
    for i in range(TAG_BYTES):
        diff |= scratch[i] ^ frame[HEADER_BYTES + i]
    return diff == 0
