"""Frames that were never a message, or a message broken on the wire; and the decoder's contract.

* ``random_frames``: bytes that were never a message;
* ``broken_frames``: a valid message of any op, then truncated, bit-flipped,
  frames dropped, added or swapped, header fields replaced by values of the
  wrong type, absurd shapes and sizes, dtypes the wire refuses, other
  versions and ops, and (with a secret) bad or missing tags;
* ``check_decode``: what decoding any frames must give.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import blake3
import msgspec
from hypothesis import strategies as st

from shoal.api.config import Limits
from shoal.api.errors import ShoalError
from shoal.wire import PROTOCOL_VERSION, Codec, Op
from shoal.wire.codec import MAX_RANK, TAG_BYTES, WIRE_DTYPES, tag_key
from shoal.wire.schema import SCHEMAS, check_schema, is_int64
from tests.support.fuzzing import HOSTILE, INDEX, encoded, on_the_wire, op_messages, raw_bytes


def sign(frames: list[bytes], secret: bytes) -> list[bytes]:
    """``frames`` with a tag over all of them after the first, as a codec off loopback makes it."""
    mac = blake3.blake3(key=tag_key(secret))
    for f in frames:
        mac.update(f)
    return with_tag(frames, mac.digest())


def with_tag(frames: list[bytes], tag: bytes) -> list[bytes]:
    """``frames`` with ``tag`` after the first (an empty first frame if there is none)."""
    return [(frames[0] if frames else b"") + tag, *frames[1:]]


# ------------------------------------------------------------------ breaking frames

random_frames = st.lists(st.binary(max_size=64), max_size=5)

HEADER_FIELDS = st.sampled_from(["v", "op", "req", "table", "epoch", "clock", "sender", "flags", "dtype", "shapes",
                                 "body"]) | st.text(max_size=6)
BAD_DTYPES = st.sampled_from(sorted(WIRE_DTYPES) + [">f4", ">i8", "|O", "<U3", "<f2", "<c8", "V8", "<M8[s]", "f4",
                                                     "float32", "<f4\x00", ""]) | HOSTILE
HOSTILE_DIMS = st.sampled_from([0, 1, 3, -1, -(2**63), 2**31, 2**40, 2**40 - 1, 2**62, 2**63 - 1, 2**64 - 1])
HOSTILE_SHAPES = st.lists(HOSTILE_DIMS | st.integers(0, 64), max_size=6) | HOSTILE
VERSIONS = st.sampled_from([PROTOCOL_VERSION + 1, 0, -1, True, 1.0, "1", None]) | HOSTILE
OPS = st.sampled_from([int(op) for op in Op]) | HOSTILE
MUTATIONS = st.sampled_from(["truncate", "flip", "drop", "extra", "swap", "field", "shapes", "dtype", "version",
                             "op", "body"])


def _header(frames: list[bytes]) -> dict[str, Any] | None:
    try:
        header = msgspec.msgpack.decode(frames[0])
    except Exception:  # already broken beyond reading: leave it
        return None
    return header if isinstance(header, dict) else None


def _replace_one(draw: st.DrawFn, header: dict[str, Any], name: str, value: st.SearchStrategy[Any]) -> None:
    """Replace one entry of the header's list ``name``, or the whole field."""
    current = header.get(name)
    if isinstance(current, list) and current and draw(st.booleans()):
        current[draw(INDEX) % len(current)] = draw(value)
    else:
        header[name] = draw(st.lists(value, max_size=4))


@st.composite
def _mutated(draw: st.DrawFn, frames: list[bytes]) -> list[bytes]:
    """``frames`` broken in one way."""
    frames = list(frames)
    kind = draw(MUTATIONS)
    at = draw(INDEX) % len(frames) if frames else 0
    if kind in ("truncate", "flip") and frames and frames[at]:
        frame = frames[at]
        cut = draw(INDEX) % len(frame)
        frames[at] = frame[:cut] if kind == "truncate" else (
            frame[:cut] + bytes([frame[cut] ^ (1 + draw(INDEX) % 255)]) + frame[cut + 1:])
    elif kind == "drop" and frames:
        del frames[at]
    elif kind == "extra":
        frames.insert(draw(INDEX) % (len(frames) + 1), draw(st.binary(max_size=40)))
    elif kind == "swap" and len(frames) > 1:
        other = draw(INDEX) % len(frames)
        frames[at], frames[other] = frames[other], frames[at]
    elif frames and (header := _header(frames)) is not None:
        if kind == "field":
            name = draw(HEADER_FIELDS)
            if draw(st.booleans()):
                header.pop(name, None)
            else:
                header[name] = draw(HOSTILE)
        elif kind == "shapes":
            _replace_one(draw, header, "shapes", HOSTILE_SHAPES)
        elif kind == "dtype":
            _replace_one(draw, header, "dtype", BAD_DTYPES)
        elif kind == "version":
            header["v"] = draw(VERSIONS)
        elif kind == "op":
            header["op"] = draw(OPS)
        else:
            header["body"] = draw(HOSTILE)
        frames = [msgspec.msgpack.encode(header), *frames[1:]]
    return frames


TAGGING = st.sampled_from(["sign", "sign", "stale tag", "other secret", "bad tag", "no tag"])
ANY_OP_MESSAGES = op_messages(ops=list(SCHEMAS))


@st.composite
def _broken_frames(draw: st.DrawFn, secret: bytes | None) -> list[bytes]:
    frames = encoded(draw(ANY_OP_MESSAGES))
    for _ in range(draw(st.integers(1, 3))):
        frames = draw(_mutated(frames))
    if secret is None:
        return frames
    how = draw(TAGGING)
    if how == "sign":
        return sign(frames, secret)
    if how == "stale tag":
        return with_tag(frames, draw(raw_bytes(TAG_BYTES)))
    if how == "other secret":
        return sign(frames, secret[::-1])
    if how == "bad tag":
        return with_tag(frames, draw(st.binary(max_size=TAG_BYTES + 8)))
    return frames


@functools.cache
def broken_frames(secret: bytes | None = None) -> st.SearchStrategy[list[bytes]]:
    """A message of any op, then broken one to three times.

    With a secret, the broken frames are mostly signed again (to reach the checks
    behind the tag), else left with a tag that no longer fits, or a tag that is
    itself broken or missing.
    """
    return _broken_frames(secret)


# ------------------------------------------------------------------ the decoder's contract

_ROOMY = Limits(max_message_bytes=1 << 30)


def check_decode(codec: Codec, frames: Sequence[Any]) -> str:
    """Decode: a message that fits its schema and encodes again, or a ``ShoalError``; nothing else.

    Returns the outcome ("accepted" or the error code), for tallies.
    """
    try:
        msg = codec.decode(frames)
    except ShoalError as exc:
        req = getattr(exc, "req", None)
        assert req is None or is_int64(req), f"bad .req {req!r} on {exc!r}"  # an error reply echoes it
        assert isinstance(getattr(exc, "flags", None), int), f"no .flags on {exc!r}"
        return exc.code
    assert isinstance(msg.op, Op)
    check_schema(msg)
    for arr in msg.arrays:
        assert arr.dtype.str in WIRE_DTYPES and 1 <= arr.ndim <= MAX_RANK, (arr.dtype, arr.shape)
    again = Codec(_ROOMY, codec.secret).decode(on_the_wire(Codec(_ROOMY, codec.secret).encode(msg)))
    assert (again.op, again.req, again.table, again.epoch, again.clock, again.sender) == (
        msg.op, msg.req, msg.table, msg.epoch, msg.clock, msg.sender)
    assert [(a.dtype, a.shape, a.tobytes()) for a in again.arrays] == [
        (a.dtype, a.shape, a.tobytes()) for a in msg.arrays]
    return "accepted"
