"""Messages <-> frames: a msgpack header, raw array frames, and a tag proving the secret.

Arrays are never serialised: each travels as its own frame straight from the
array's memory and is read back with ``np.frombuffer`` (no copy). The header
names each frame's dtype and shape, and the decoder checks them against the
frame sizes before building a view. Nothing here can execute code from the
wire: msgpack decodes plain data only, and there is no pickle anywhere.

The header is a typed msgspec ``Struct``: msgspec decodes it and checks every
field's type and range in one compiled pass, where msgpack and a Python check
per field ran before (a 1-key request decodes in 4.1 against 5.9 us and encodes
in 2.3 against 3.1, on every message on both sides). A header it refuses is
decoded again as plain msgpack, to say what is wrong with it.

The tag is keyed BLAKE3 (about 4 GB/s a core, against under 2 for
HMAC-SHA256), under a key derived from the job's secret, and ends frame 0, after
the header: a frame of its own cost every message a frame more to send and to
receive on both sides (6-8 us of CPU against 1-2 for the 32 bytes' copy). Off
this machine it covers every frame. On a wire only this machine reaches (loopback tcp, ipc) it
covers the header alone: a local process that does not hold the secret can
neither forge a header nor see or alter traffic on loopback without the
privileges that would let it read the secret anyway, and the arrays are then
not hashed at all. The header carries the sender, its incarnation and the
request number, so the receiver's ``ReplayGuard`` refuses a tagged message
played again, on any connection.
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Sequence
from typing import Annotated, Any

import blake3
import msgspec
import numpy as np

from shoal.api.config import Limits
from shoal.api.errors import AuthError, MessageTooLargeError, ProtocolError, ShoalError
from shoal.wire.message import Message
from shoal.wire.ops import PROTOCOL_VERSION, Flag, Op
from shoal.wire.schema import check_schema, is_int64

TAG_BYTES = 32
WIRE_DTYPES = frozenset({"<f4", "<f8", "<i4", "<i8", "<u8", "|u1", "|b1"})
MAX_RANK = 4
_MAX_DIM = 1 << 40  # no real array has a dimension this long; larger ones only overflow reshape
_HEADER_LIMIT = 1 << 20  # headers are small; a larger one is hostile or broken
_KEY_CONTEXT = "shoal 2026-12 message tag"  # the tag key is derived from the secret, never the secret itself
_TAGS = Flag.SIGNED | Flag.SIGNED_HEADER
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_INT_FIELDS = ("req", "epoch", "clock", "sender", "inc", "flags")
_OTHER_FIELDS = (("table", str), ("body", dict), ("dtype", list), ("shapes", list))
_OPS = {int(op): op for op in Op}
_WIRE_NUMPY = {name: np.dtype(name) for name in WIRE_DTYPES}

#: exact ints (no bools, no floats) that fit in 64 signed bits: they land in int64 arrays
_Int64 = Annotated[int, msgspec.Meta(ge=_INT64_MIN, le=_INT64_MAX)]
_Dim = Annotated[int, msgspec.Meta(ge=0, lt=_MAX_DIM)]


class Header(msgspec.Struct):
    """Frame 0: a msgpack map of these fields (a peer may add others; they are ignored), then the tag
    when the message is signed."""

    v: int
    op: int
    req: _Int64
    table: str
    epoch: _Int64
    clock: _Int64
    sender: _Int64
    inc: _Int64
    flags: _Int64
    dtype: list[str]
    shapes: list[Annotated[list[_Dim], msgspec.Meta(min_length=1, max_length=MAX_RANK)]]
    body: dict[str, Any]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Header)

Frame = Any  # bytes, memoryview, numpy array, or zmq.Frame: anything with the buffer protocol


def frames_nbytes(frames: Sequence[Frame]) -> int:
    """The bytes ``frames`` hold: arrays and views count their bytes; bytes and zmq frames have a
    length in bytes."""
    size = 0
    for f in frames:
        size += f.nbytes if isinstance(f, (np.ndarray, memoryview)) else len(f)
    return size


def _failure(exc: ShoalError, header: Header | dict[str, Any] | None) -> ShoalError:
    """Attach what we know of the request, so the error reply can name it."""
    req: Any
    flags: Any
    if isinstance(header, Header):
        req, flags = header.req, header.flags
    else:
        req = header.get("req") if isinstance(header, dict) else None
        flags = header.get("flags") if isinstance(header, dict) else None
    exc.req = req if is_int64(req) else None  # type: ignore[attr-defined]
    exc.flags = flags if isinstance(flags, int) and not isinstance(flags, bool) else 0  # type: ignore[attr-defined]
    return exc


def _plain_header(view: memoryview) -> dict[str, Any]:
    """A header msgspec refused, decoded as plain msgpack: a map, or ``ProtocolError``."""
    try:
        header = msgspec.msgpack.decode(view)
    except Exception as exc:  # garbage: msgspec.DecodeError, or what deep nesting provokes
        raise _failure(ProtocolError(f"header is not valid msgpack: {type(exc).__name__}"), None) from None
    if not isinstance(header, dict) or not all(type(k) is str for k in header):
        raise _failure(ProtocolError("header must be a map with string keys"), None)
    return header


def _typed(header: dict[str, Any]) -> Header:
    """The fields of a header msgspec refused, checked one by one to name the one that is wrong."""
    get = header.get
    for name in _INT_FIELDS:  # exact ints (no bools) that fit in 64 bits: they land in int64 arrays
        value = get(name)
        if type(value) is not int or not _INT64_MIN <= value <= _INT64_MAX:
            raise ProtocolError(f"header field {name!r} must be an int that fits in 64 signed bits, got {value!r}")
    for name, kind in _OTHER_FIELDS:
        if type(get(name)) is not kind:
            raise ProtocolError(f"header field {name!r} must be {kind.__name__}, got {get(name)!r}")
    if not all(type(k) is str for k in header["body"]):
        raise ProtocolError("header field 'body' must be a map with string keys")
    for i, (dtype, shape) in enumerate(zip(header["dtype"], header["shapes"], strict=False)):
        if type(dtype) is not str:
            raise ProtocolError(f"frame {i}: dtype {dtype!r} is not allowed on the wire")
        if type(shape) is not list or not 1 <= len(shape) <= MAX_RANK or \
                not all(type(n) is int and 0 <= n < _MAX_DIM for n in shape):
            raise ProtocolError(f"frame {i}: bad shape {shape!r}")
    raw_op = get("op")
    if type(raw_op) is not int or raw_op not in _OPS:
        raise ProtocolError(f"unknown op {raw_op!r}")
    # What else is wrong (how many frames, their sizes) ``Codec._message`` and ``Codec._array`` say.
    return Header(header["v"], raw_op, header["req"], header["table"], header["epoch"], header["clock"],
                  header["sender"], header["inc"], header["flags"], header["dtype"], header["shapes"],
                  header["body"])


def _decoded(view: memoryview) -> Header | dict[str, Any]:
    """The header, typed; or, where it is not a well-formed one, the plain map it is (for ``_typed``
    to say what is wrong, once the tag is checked)."""
    if view.nbytes > _HEADER_LIMIT:
        raise _failure(ProtocolError(f"header of {view.nbytes} bytes is too large"), None)
    try:
        return _DECODER.decode(view)
    except Exception:  # msgspec.DecodeError, or whatever else garbage provokes
        return _plain_header(view)


def _versioned(header: Header | dict[str, Any]) -> Header | dict[str, Any]:
    """``header``, if it is of this protocol's version."""
    version = header.v if isinstance(header, Header) else header.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise _failure(
            ProtocolError(f"unsupported protocol version {version!r}; this peer speaks {PROTOCOL_VERSION}"),
            header,
        )
    return header


def _view(frame: Frame) -> memoryview:
    """The frame's bytes, flat (arrays of any dtype and shape are cast to bytes for the tag)."""
    if type(frame) is bytes:  # headers and tags: no attribute lookup that fails
        return memoryview(frame)
    buf = getattr(frame, "buffer", None)  # zmq.Frame exposes its bytes as .buffer
    view = buf if isinstance(buf, memoryview) else memoryview(frame)
    if view.format == "B" and view.ndim == 1:
        return view
    return view.cast("B") if view.nbytes else memoryview(b"")


def tag_key(secret: bytes) -> bytes:
    """The 32-byte BLAKE3 key a job's secret stands for."""
    return blake3.blake3(secret, derive_key_context=_KEY_CONTEXT).digest()


class Codec:
    """Encodes and checks messages under one limit and one secret, for one kind of wire.

    ``local``: the wire only this machine reaches, where a tag over the header is enough
    (see the module's docstring); a codec that is not local refuses such tags.
    """

    def __init__(self, limits: Limits | None = None, secret: bytes | None = None, local: bool = False) -> None:
        self.limits = limits or Limits()
        self.secret = secret
        self.local = local
        self._key = None if secret is None else tag_key(secret)

    def for_wire(self, local: bool) -> Codec:
        """This codec for a wire that is (or is not) only this machine's."""
        return self if local == self.local else Codec(self.limits, self.secret, local)

    # ------------------------------------------------------------------ encode

    def encode(self, msg: Message) -> list[Frame]:
        arrays = [a if a.flags.c_contiguous else np.ascontiguousarray(a) for a in msg.arrays]
        dtypes = []
        for a in arrays:
            name = a.dtype.str
            if name not in WIRE_DTYPES:
                raise ProtocolError(f"dtype {a.dtype} cannot travel on the wire")
            if not 1 <= a.ndim <= MAX_RANK:
                raise ProtocolError(f"arrays on the wire have 1 to {MAX_RANK} dimensions, got shape {a.shape}")
            dtypes.append(name)
        flags = msg.flags & ~_TAGS
        if self._key is not None:
            flags |= Flag.SIGNED_HEADER if self.local else Flag.SIGNED
        header = Header(PROTOCOL_VERSION, int(msg.op), msg.req, msg.table, msg.epoch, msg.clock, msg.sender,
                        msg.incarnation, flags, dtypes, [list(a.shape) for a in arrays], msg.body)
        try:
            frames: list[Frame] = [_ENCODER.encode(header)]
        except (TypeError, OverflowError) as exc:  # a body holding what msgpack has no form for
            raise ProtocolError(f"{msg.op.name} message cannot be encoded: {exc}") from None
        frames.extend(arrays)
        size = len(frames[0])
        for a in arrays:
            size += a.nbytes
        if size > self.limits.max_message_bytes:
            raise MessageTooLargeError(
                f"{msg.op.name} message of {size} bytes exceeds the limit of {self.limits.max_message_bytes}"
            )
        if self._key is not None:
            head = frames[0]
            frames[0] = head + self._tag([_view(f) for f in ([head] if self.local else frames)])
        return frames

    def _tag(self, views: Sequence[memoryview]) -> bytes:
        assert self._key is not None
        if len(views) == 1:  # a header alone (loopback): one call
            return blake3.blake3(views[0], key=self._key).digest()
        mac = blake3.blake3(key=self._key)
        for v in views:
            mac.update(v)
        return mac.digest()

    # ------------------------------------------------------------------ decode

    def decode(self, frames: Sequence[Frame]) -> Message:
        """Check and decode; raises ``ProtocolError``/``AuthError`` with ``.req`` set when known."""
        views = [_view(f) for f in frames]
        if not views:
            raise _failure(ProtocolError("empty message"), None)
        size = 0
        for v in views:
            size += v.nbytes
        if self._key is None:
            header = self._header(views[0])
            tag = None
        else:
            header, tag = self._signed_header(views[0])
            views[0] = views[0][:-TAG_BYTES]
            size -= TAG_BYTES
        if size > self.limits.max_message_bytes:
            raise _failure(
                MessageTooLargeError(f"message of {size} bytes exceeds the limit of {self.limits.max_message_bytes}"),
                header,
            )
        if tag is not None:
            self._verify(views, header, tag)
        try:
            msg = self._message(header, views[1:])
            check_schema(msg)
        except ShoalError as exc:
            raise _failure(exc, header) from None
        except Exception as exc:  # anything else a hostile header provokes is malformed input too
            raise _failure(ProtocolError(f"malformed message: {type(exc).__name__}: {exc}"), header) from None
        return msg

    def _signed_header(self, first: memoryview) -> tuple[Header | dict[str, Any], memoryview]:
        """Frame 0 of a signed message: its header and the tag after it. A frame 0 that is a header
        with no tag after it is refused as unsigned (``AuthError``; an older peer's, by its version),
        one that is neither as malformed."""
        if first.nbytes > TAG_BYTES:
            try:
                header = _decoded(first[:-TAG_BYTES])
            except ProtocolError:
                pass
            else:
                return _versioned(header), first[-TAG_BYTES:]
        header = _versioned(_decoded(first))
        raise _failure(AuthError("message is not signed; this peer requires a tag made with the job's secret"),
                       header)

    def _verify(self, views: list[memoryview], header: Header | dict[str, Any], tag: memoryview) -> None:
        """Check ``tag`` against the frames (frame 0 without it) it says it covers."""
        flags = header.flags if isinstance(header, Header) else header.get("flags")
        header_only = isinstance(flags, int) and not isinstance(flags, bool) and bool(flags & Flag.SIGNED_HEADER)
        if header_only and not self.local:
            raise _failure(AuthError("message is signed over its header only, which is enough only on a "
                                     "wire this machine alone reaches; this one is not"), header)
        if not hmac.compare_digest(self._tag(views[:1] if header_only else views), tag):
            raise _failure(AuthError("message has a wrong tag (different shared secret?)"), header)

    def _header(self, view: memoryview) -> Header | dict[str, Any]:
        """The header of an unsigned message (``_decoded``), of this protocol version."""
        return _versioned(_decoded(view))

    def _message(self, header: Header | dict[str, Any], frames: Sequence[memoryview]) -> Message:
        h = header if isinstance(header, Header) else _typed(header)
        raw_op = h.op
        op = _OPS.get(raw_op) if type(raw_op) is int else None
        if op is None:
            raise ProtocolError(f"unknown op {raw_op!r}")
        dtypes, shapes = h.dtype, h.shapes
        count = len(frames)
        if len(dtypes) != count or len(shapes) != count:
            raise ProtocolError(
                f"header describes {len(dtypes)} dtype(s) and {len(shapes)} shape(s) for {count} frame(s)"
            )
        arrays = [self._array(i, dtypes[i], shapes[i], frames[i]) for i in range(count)]
        return Message(op, h.req, h.table, h.epoch, h.clock, h.sender, h.inc, h.flags, h.body, arrays)

    @staticmethod
    def _array(i: int, dtype: str, shape: list[int], frame: memoryview) -> np.ndarray:
        """Frame ``i`` as an array (a view of its bytes), once its size fits the header's ``shape``
        (checked in range, as ``Header`` declares it)."""
        dt = _WIRE_NUMPY.get(dtype)
        if dt is None:
            raise ProtocolError(f"frame {i}: dtype {dtype!r} is not allowed on the wire")
        count = math.prod(shape)
        if count * dt.itemsize != frame.nbytes:
            raise ProtocolError(
                f"frame {i}: shape {shape} of {dtype} needs {count * dt.itemsize} bytes, frame has {frame.nbytes}"
            )
        array = np.frombuffer(frame, dtype=dt)
        return array if len(shape) == 1 else array.reshape(shape)
