"""Codec: messages <-> frames, the checks on everything that arrives, and the tag (keyed BLAKE3).

Frames are decoded here as a socket would hand them over (one bytes object or
``zmq.Frame`` per frame), never as the arrays ``encode`` returned.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from shoal import (
    AuthError,
    Limits,
    MessageTooLargeError,
    ProtocolError,
    ShapeError,
    ShoalError,
)
from shoal.placement.messages import Owner, Relocate, Replicate, from_parts, tables_of, to_parts
from shoal.wire import PROTOCOL_VERSION, Codec, Flag, Message, Op
from shoal.wire.schema import PLACEMENT_KINDS, ROWS, SCHEMAS, ArrayRule, Moved

SECRET = b"s" * 32
OTHER_SECRET = b"o" * 32
REQ = 7


def on_the_wire(frames: list[Any]) -> list[bytes]:
    """What a socket delivers: each frame copied into its own bytes object."""
    return [memoryview(f).tobytes() for f in frames]


def keys(*ks: int) -> np.ndarray:
    return np.array(ks, dtype=np.int64)


def rows(n: int, dim: int = 3, dtype: type = np.float32) -> np.ndarray:
    return np.arange(n * dim, dtype=dtype).reshape(n, dim)


def push(**fields: Any) -> Message:
    return Message(Op.PUSH, req=REQ, table="t", arrays=[keys(0, 1, 2), rows(3)], **fields)


def push_frames() -> list[bytes]:
    return on_the_wire(Codec().encode(push()))


def with_header(frames: list[bytes], **changes: Any) -> list[bytes]:
    """``frames`` with some header fields replaced (a value of ``...`` removes the field)."""
    header = msgspec.msgpack.decode(frames[0])
    for name, value in changes.items():
        if value is ...:
            header.pop(name)
        else:
            header[name] = value
    return [msgspec.msgpack.encode(header), *frames[1:]]


def assert_same_message(got: Message, sent: Message, flags: int | None = None) -> None:
    assert (got.op, got.req, got.table, got.epoch, got.clock, got.sender, got.body) == (
        sent.op, sent.req, sent.table, sent.epoch, sent.clock, sent.sender, sent.body
    )
    assert got.flags == (sent.flags if flags is None else flags)
    assert len(got.arrays) == len(sent.arrays)
    for a, b in zip(got.arrays, sent.arrays, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()  # bit-exact, NaN payloads included


def rejects(codec: Codec, frames: list[Any], error: type[ShoalError]) -> ShoalError:
    """Decode ``frames``, expecting exactly ``error``; return it for further checks."""
    with pytest.raises(ShoalError) as info:
        codec.decode(frames)
    assert type(info.value) is error, f"expected {error.__name__}, got {type(info.value).__name__}: {info.value}"
    return info.value


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "signed"])
def test_round_trip_keeps_every_field(secret: bytes | None) -> None:
    codec = Codec(secret=secret)
    sent = Message(Op.PUSH_PULL, req=41, table="emb", epoch=3, clock=12, sender=5, flags=Flag.NO_REPLY,
                   body={"note": "x", "nested": {"a": [1, 2.5, None, b"raw"]}},
                   arrays=[keys(9, 0, 4), rows(3, dim=5, dtype=np.float64)])

    got = codec.decode(on_the_wire(codec.encode(sent)))

    assert_same_message(got, sent, flags=sent.flags | (Flag.SIGNED if secret else 0))


@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "signed"])
def test_message_without_arrays_round_trips(secret: bytes | None) -> None:
    codec = Codec(secret=secret)
    sent = Message(Op.PING, req=1, sender=2)

    assert_same_message(codec.decode(on_the_wire(codec.encode(sent))), sent,
                        flags=Flag.SIGNED if secret else 0)


def test_signed_message_ends_its_header_frame_with_a_tag_and_carries_the_signed_flag() -> None:
    frames = Codec(secret=SECRET).encode(push())

    assert len(frames) == 1 + 2  # no frame of its own: one more to send and receive on every message
    assert msgspec.msgpack.decode(frames[0][:-32])["flags"] & Flag.SIGNED



def test_encode_sends_contiguous_arrays_without_copying() -> None:
    msg = push()

    frames = Codec().encode(msg)

    assert all(np.shares_memory(frame, arr) for frame, arr in zip(frames[1:], msg.arrays, strict=True))


def test_encode_makes_strided_arrays_contiguous() -> None:
    wide = rows(3, dim=6)
    strided = wide[:, ::2]
    codec = Codec()

    got = codec.decode(on_the_wire(codec.encode(Message(Op.PUSH, table="t", arrays=[keys(0, 1, 2), strided]))))

    np.testing.assert_array_equal(got.arrays[1], strided)


@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "signed"])
def test_decoded_arrays_are_views_of_the_received_bytes(secret: bytes | None) -> None:
    codec = Codec(secret=secret)
    frames = on_the_wire(codec.encode(push()))

    msg = codec.decode(frames)

    for arr, frame in zip(msg.arrays, frames[1:len(msg.arrays) + 1], strict=True):
        assert np.shares_memory(arr, np.frombuffer(frame, dtype=np.uint8))


def test_decoded_arrays_are_views_of_received_zmq_frames() -> None:
    codec = Codec()
    frames = [zmq.Frame(f) for f in on_the_wire(codec.encode(push()))]

    msg = codec.decode(frames)

    for arr, frame in zip(msg.arrays, frames[1:len(msg.arrays) + 1], strict=True):
        assert np.shares_memory(arr, np.frombuffer(frame.buffer, dtype=np.uint8))


# ------------------------------------------------------- round-trip properties

INT64 = st.integers(-(2**63), 2**63 - 1)
PLAIN = st.recursive(
    st.none() | st.booleans() | INT64 | st.floats(allow_nan=False) | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
BODY_FIELD = {int: INT64, str: st.text(max_size=16), dict: st.dictionaries(st.text(max_size=6), PLAIN, max_size=3),
              list: st.lists(INT64, max_size=4), bool: st.booleans()}


def array_for(rule: ArrayRule, n: int) -> st.SearchStrategy[np.ndarray]:
    if rule.kind == "i":
        return hnp.arrays(st.sampled_from([np.int64, np.int32]), (n,) + (2,) * (rule.ndim - 1))
    if rule.kind == "u":
        return hnp.arrays(np.uint8, (n,) + (2,) * (rule.ndim - 1))
    dims = st.lists(st.integers(1, 4), min_size=rule.ndim - 1, max_size=rule.ndim - 1)
    return dims.flatmap(lambda d: hnp.arrays(st.sampled_from([np.float32, np.float64]), (n, *d)))


@st.composite
def messages(draw: st.DrawFn) -> Message:
    """Any message that fits its op's schema (and its kind's, for a placement message)."""
    op = draw(st.sampled_from(list(Op)))
    schema = SCHEMAS[op]
    body = draw(st.dictionaries(st.text(max_size=6), PLAIN, max_size=3))
    for name, kind in schema.optional.items():
        body.pop(name, None)
        if draw(st.booleans()):
            body[name] = draw(BODY_FIELD[kind])
    for name, kind in schema.body.items():
        body[name] = draw(BODY_FIELD[kind])
    if op == Op.PLACEMENT:
        body["kind"] = draw(st.sampled_from(sorted(PLACEMENT_KINDS)))
        schema = PLACEMENT_KINDS[body["kind"]]
        for name, kind in schema.body.items():
            body[name] = draw(BODY_FIELD[kind])
    shared_rows = draw(st.integers(0, 6))
    arrays = [draw(array_for(rule, shared_rows if schema.same_rows else draw(st.integers(0, 6))))
              for rule in schema.arrays]
    return Message(
        op, req=draw(INT64), table=draw(st.text(min_size=1 if SCHEMAS[op].needs_table else 0, max_size=20)),
        epoch=draw(INT64), clock=draw(INT64), sender=draw(INT64),
        flags=draw(st.sampled_from([0, Flag.NO_REPLY])), body=body, arrays=arrays,
    )


@settings(max_examples=200, deadline=None)
@given(msg=messages(), secret=st.sampled_from([None, SECRET]))
def test_any_valid_message_round_trips(msg: Message, secret: bytes | None) -> None:
    codec = Codec(secret=secret)

    got = codec.decode(on_the_wire(codec.encode(msg)))

    assert_same_message(got, msg, flags=msg.flags | (Flag.SIGNED if secret else 0))


@settings(max_examples=200, deadline=None)
@given(arrays=st.lists(
    hnp.arrays(st.sampled_from([np.float32, np.float64, np.int64]),
               hnp.array_shapes(min_dims=1, max_dims=4, min_side=0, max_side=5)),
    max_size=4,
))
def test_frames_carry_any_wire_array_exactly(arrays: list[np.ndarray]) -> None:
    # The framing layer carries any rank the decoder allows, whatever today's ops
    # need; the per-op schema is switched off to reach it with arbitrary arrays.
    codec = Codec()
    sent = Message(Op.OK, req=1, arrays=arrays)

    with mock.patch("shoal.wire.codec.check_schema"):
        got = codec.decode(on_the_wire(codec.encode(sent)))

    assert_same_message(got, sent)


# ------------------------------------------------------------------ rejections


def header_only(header: Any) -> list[bytes]:
    return [msgspec.msgpack.encode(header)]


@pytest.mark.parametrize("frames", [
    pytest.param([], id="no frames"),
    pytest.param([b""], id="empty header frame"),
    pytest.param([b"\xc1\x00\x01"], id="garbage header"),
    pytest.param([push_frames()[0][:-5], *push_frames()[1:]], id="truncated header"),
    pytest.param(header_only([1, 22, 7]), id="header is a list"),
    pytest.param(header_only({1: "v", 2: "op"}), id="header keyed by ints"),
    pytest.param(header_only({"v": 1, "pad": "x" * (1 << 20)}), id="header over 1 MiB"),
])
def test_unreadable_header_is_rejected_without_a_request_id(frames: list[bytes]) -> None:
    err = rejects(Codec(), frames, ProtocolError)

    assert err.req is None  # type: ignore[attr-defined]


@pytest.mark.parametrize("version", [PROTOCOL_VERSION + 1, 0, "1", None, ...],
                         ids=["next", "zero", "string", "null", "missing"])
def test_other_protocol_version_is_rejected(version: Any) -> None:
    err = rejects(Codec(), with_header(push_frames(), v=version), ProtocolError)

    assert "version" in str(err)
    assert err.req == REQ  # type: ignore[attr-defined]


@pytest.mark.parametrize("op", [99, 0, -1, "PUSH", None, ...], ids=["99", "0", "negative", "name", "null", "missing"])
def test_unknown_op_is_rejected(op: Any) -> None:
    err = rejects(Codec(), with_header(push_frames(), op=op), ProtocolError)

    assert "op" in str(err)
    assert err.req == REQ  # type: ignore[attr-defined]


@pytest.mark.parametrize("frames", [
    pytest.param(with_header(push_frames(), op=22.0), id="float"),
    pytest.param(with_header(on_the_wire(Codec().encode(Message(Op.PING, req=REQ))), op=True), id="bool"),
])
def test_op_of_wrong_type_is_rejected(frames: list[bytes]) -> None:
    rejects(Codec(), frames, ProtocolError)


@pytest.mark.parametrize(("field", "value"), [
    ("epoch", 1.5), ("clock", None), ("sender", True), ("flags", "2"), ("table", 5),
    ("body", [1, 2]), ("dtype", "<i8"), ("shapes", {"0": [3]}), ("clock", ...),
])
def test_header_field_of_wrong_type_is_rejected(field: str, value: Any) -> None:
    err = rejects(Codec(), with_header(push_frames(), **{field: value}), ProtocolError)

    assert repr(field) in str(err)
    assert err.req == REQ  # type: ignore[attr-defined]


@pytest.mark.parametrize("req", ["7", 7.0, False, None], ids=["string", "float", "bool", "null"])
def test_request_id_of_wrong_type_is_rejected_and_not_echoed(req: Any) -> None:
    err = rejects(Codec(), with_header(push_frames(), req=req), ProtocolError)

    assert err.req is None  # type: ignore[attr-defined]


@pytest.mark.parametrize("dtype", [">f4", "|O", "<U3", "<f2", "<c8", "f4", "float32", 4, None])
def test_dtype_not_allowed_on_the_wire_is_rejected(dtype: Any) -> None:
    err = rejects(Codec(), with_header(push_frames(), dtype=["<i8", dtype]), ProtocolError)

    assert "dtype" in str(err)
    assert err.req == REQ  # type: ignore[attr-defined]


@pytest.mark.parametrize("dtype", [">f4", "|O", "<U3"])
def test_encode_refuses_arrays_the_wire_does_not_carry(dtype: str) -> None:
    values = np.zeros((3, 3), dtype=dtype)

    with pytest.raises(ProtocolError):
        Codec().encode(Message(Op.PUSH, table="t", arrays=[keys(0, 1, 2), values]))


@pytest.mark.parametrize("shape", [
    [3, 4], [4, 3], [36], [-3, -3], [], [1, 1, 1, 3, 3], [3.0, 3], [True, 3], [3, "3"], None,
], ids=["more columns", "more rows", "wrong count", "negative", "rank 0", "rank 5", "float", "bool", "string", "null"])
def test_shape_not_matching_the_frame_is_rejected(shape: Any) -> None:
    # the values frame holds 3 x 3 float32 = 36 bytes
    err = rejects(Codec(), with_header(push_frames(), shapes=[[3], shape]), ProtocolError)

    assert err.req == REQ  # type: ignore[attr-defined]


@pytest.mark.parametrize("frames", [
    pytest.param(push_frames()[:2], id="frame missing"),
    pytest.param([*push_frames(), bytes(8)], id="extra frame"),
    pytest.param(with_header(push_frames(), dtype=["<i8"]), id="fewer dtypes than frames"),
    pytest.param(with_header(push_frames(), shapes=[[3], [3, 3], [1]]), id="more shapes than frames"),
])
def test_frame_count_not_matching_the_header_is_rejected(frames: list[bytes]) -> None:
    err = rejects(Codec(), frames, ProtocolError)

    assert err.req == REQ  # type: ignore[attr-defined]


def test_encode_refuses_a_message_over_the_limit() -> None:
    codec = Codec(Limits(max_message_bytes=4096))
    big = Message(Op.VALUES, req=REQ, arrays=[np.zeros((2, 512), dtype=np.float32)])  # 4096 bytes + header

    with pytest.raises(MessageTooLargeError):
        codec.encode(big)
    codec.encode(Message(Op.VALUES, req=REQ, arrays=[np.zeros((2, 256), dtype=np.float32)]))  # fits


@pytest.mark.parametrize("value", [object(), 2**70, np.int64(3)], ids=["object", "int over 64 bits", "numpy scalar"])
def test_encode_refuses_a_body_msgpack_has_no_form_for_with_a_typed_error(value: Any) -> None:
    with pytest.raises(ProtocolError, match="PING message cannot be encoded"):
        Codec(secret=SECRET).encode(Message(Op.PING, req=REQ, body={"x": value}))


def test_a_header_field_this_peer_does_not_know_is_ignored() -> None:
    frames = Codec().encode(Message(Op.PING, req=REQ, body={"note": "hi"}))
    header = msgspec.msgpack.decode(frames[0])
    header["from_a_later_peer"] = [1, {"x": 2}]
    msg = Codec().decode([msgspec.msgpack.encode(header), *frames[1:]])
    assert (msg.op, msg.req, msg.body) == (Op.PING, REQ, {"note": "hi"})


@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "signed"])
def test_decode_refuses_a_message_over_the_limit(secret: bytes | None) -> None:
    big = Message(Op.VALUES, req=REQ, arrays=[np.zeros((4, 512), dtype=np.float32)])
    frames = on_the_wire(Codec(secret=secret).encode(big))

    err = rejects(Codec(Limits(max_message_bytes=4096), secret=secret), frames, MessageTooLargeError)

    assert isinstance(err, ProtocolError)
    assert err.req == REQ  # type: ignore[attr-defined]


# ------------------------------------------------------------------ tag


def flip_byte(frame: bytes, at: int = 0) -> bytes:
    return frame[:at] + bytes([frame[at] ^ 0xFF]) + frame[at + 1:]


def signed_push() -> list[bytes]:
    return on_the_wire(Codec(secret=SECRET).encode(push()))


def untagged(frames: list[bytes]) -> list[bytes]:
    """A signed message's frames with the tag cut off the end of frame 0."""
    return [frames[0][:-32], *frames[1:]]


def tagged(frames: list[bytes], tag: bytes) -> list[bytes]:
    return [frames[0] + tag, *frames[1:]]


def tag_of(frames: list[bytes]) -> bytes:
    return frames[0][-32:]


@pytest.mark.parametrize("frames", [
    pytest.param(push_frames(), id="unsigned"),
    pytest.param(on_the_wire(Codec().encode(Message(Op.PING, req=REQ))), id="unsigned, header only"),
    pytest.param(on_the_wire(Codec(secret=OTHER_SECRET).encode(push())), id="other secret"),
    pytest.param(untagged(signed_push()), id="tag dropped"),
    pytest.param(tagged(untagged(signed_push()), flip_byte(tag_of(signed_push()))), id="tag altered"),
    pytest.param([*signed_push()[:2], flip_byte(signed_push()[2], 4)], id="values altered"),
    pytest.param(tagged(with_header(untagged(signed_push()), table="u"), tag_of(signed_push())),
                 id="header altered"),
])
def test_message_without_a_valid_tag_is_refused(frames: list[bytes]) -> None:
    err = rejects(Codec(secret=SECRET), frames, AuthError)

    assert err.req == REQ  # type: ignore[attr-defined]


def test_a_truncated_tag_leaves_a_malformed_header() -> None:
    # The tag's 32 bytes end frame 0: cut short, the bytes before them are no longer the header.
    rejects(Codec(secret=SECRET), tagged(untagged(signed_push()), tag_of(signed_push())[:16]), ProtocolError)


def test_a_message_of_the_protocol_before_is_refused_by_its_version() -> None:
    # Protocol 7 sent the tag as a frame of its own: frame 0 is a header with no tag after it.
    older = with_header(untagged(signed_push()), v=PROTOCOL_VERSION - 1)
    err = rejects(Codec(secret=SECRET), [*older, tag_of(signed_push())], ProtocolError)

    assert "unsupported protocol version" in str(err)


def test_signed_message_to_a_peer_without_a_secret_is_malformed_to_it() -> None:
    # The tag follows the header in frame 0, which a peer without a secret cannot read past.
    rejects(Codec(), signed_push(), ProtocolError)


# -------------------------------------------------------------- per-op schema


@pytest.mark.parametrize(("msg", "error"), [
    pytest.param(Message(Op.PULL, table="t"), ProtocolError, id="PULL without keys"),
    pytest.param(Message(Op.PULL, table="t", arrays=[keys(1), keys(2)]), ProtocolError, id="PULL with two arrays"),
    pytest.param(Message(Op.PULL, table="t", arrays=[np.zeros(2)]), ProtocolError, id="float keys"),
    pytest.param(Message(Op.PULL, table="t", arrays=[np.zeros(2, dtype="<u8")]), ProtocolError,
                 id="unsigned keys"),
    pytest.param(Message(Op.PULL, table="t", arrays=[np.zeros((2, 1), dtype=np.int64)]), ShapeError,
                 id="2-D keys"),
    pytest.param(Message(Op.PULL, arrays=[keys(1)]), ProtocolError, id="PULL without a table"),
    pytest.param(Message(Op.PUSH, table="t", arrays=[keys(0, 1, 2)]), ProtocolError, id="PUSH without values"),
    pytest.param(Message(Op.PUSH, table="t", arrays=[keys(0, 1, 2), keys(0, 1, 2)]), ProtocolError,
                 id="integer values"),
    pytest.param(Message(Op.PUSH, table="t", arrays=[keys(0, 1, 2), np.zeros(3, dtype=np.float32)]), ShapeError,
                 id="1-D values"),
    pytest.param(Message(Op.PUSH, table="t", arrays=[keys(0, 1, 2), np.zeros((3, 1, 1), dtype=np.float32)]),
                 ShapeError, id="3-D values"),
    pytest.param(Message(Op.PUSH, table="t", arrays=[keys(0, 1, 2), rows(2)]), ShapeError,
                 id="PUSH rows mismatch"),
    pytest.param(Message(Op.PUSH_PULL, table="t", arrays=[keys(0), rows(4)]), ShapeError,
                 id="PUSH_PULL rows mismatch"),
    pytest.param(Message(Op.VALUES, arrays=[keys(1, 2)]), ProtocolError, id="VALUES of integers"),
    pytest.param(Message(Op.CLOCK), ProtocolError, id="CLOCK without rank"),
    pytest.param(Message(Op.CLOCK, body={"rank": True}), ProtocolError, id="CLOCK rank bool"),
    pytest.param(Message(Op.CLOCK, body={"rank": "0"}), ProtocolError, id="CLOCK rank string"),
    pytest.param(Message(Op.CREATE_TABLE, table="t", body={"spec": ["t", 4, 2]}), ProtocolError,
                 id="CREATE_TABLE spec not a map"),
    pytest.param(Message(Op.ERROR, body={"message": "no code"}), ProtocolError, id="ERROR without code"),
    pytest.param(Message(Op.PING, arrays=[keys(1)]), ProtocolError, id="PING with an array"),
])
def test_message_not_fitting_its_op_is_rejected(msg: Message, error: type[ShoalError]) -> None:
    msg.req = REQ

    err = rejects(Codec(), on_the_wire(Codec().encode(msg)), error)

    assert err.req == REQ  # type: ignore[attr-defined]


#: where a placement message stands in its sender's channel (``cluster.links``)
CHANNEL = {"channel": 7, "seq": 1, "base": 1, "acks": 0, "acked": 0}


def placement(kind: str, arrays: list[np.ndarray], **body: Any) -> Message:
    return Message(Op.PLACEMENT, table="t", body={"kind": kind, **CHANNEL, **body}, arrays=arrays)


@pytest.mark.parametrize(("msg", "error", "says"), [
    pytest.param(placement("teleport", [keys(1)]), ProtocolError, "unknown placement message 'teleport'",
                 id="unknown kind"),
    pytest.param(placement("handover", [keys(1)], to=1), ProtocolError, "placement 'handover' needs body field 'hops'",
                 id="handover without hops"),
    pytest.param(placement("announce", [keys(1)], active=1, node=0, hops=0), ProtocolError, "'active' of type bool",
                 id="announce active not a bool"),
    pytest.param(placement("relocate", [keys(1), rows(1)], to=1), ProtocolError, "carries 1 array(s), got 2",
                 id="relocate with rows"),
    pytest.param(placement("state", [keys(1, 2), rows(2), keys(0), np.zeros((2, 2), np.int64), *[keys(0, 0)] * 3]),
                 ShapeError, "disagree",
                 id="state interest of another length"),
    pytest.param(placement("sync", [keys(1), rows(1), keys(1)], origin=0, target=1, hops=0, part=1, parent=1),
                 ProtocolError,
                 "array 2 must be of kind 'u'", id="sync marks not bytes"),
    pytest.param(placement("batch", [keys(1), keys(2)], messages=[{"kind": "relocate", "to": 1},
                                                                  {"kind": "handover", "to": 1, "hops": 0}]),
                 ProtocolError, "'handover' in a batch carries 2 array(s), got 1", id="batch short of arrays"),
    pytest.param(placement("batch", [keys(1), keys(1), keys(1)], messages=[{"kind": "relocate", "to": 1}] * 2),
                 ProtocolError, "carries 3 array(s), its messages 2", id="batch with an array left over"),
    pytest.param(placement("batch", [keys(1)], messages=[{"kind": "batch", "messages": []}]), ProtocolError,
                 "unknown placement message 'batch'", id="batch in a batch"),
    pytest.param(placement("batch", [], messages=[]), ProtocolError, "a list of 1 to 64", id="empty batch"),
    pytest.param(Message(Op.PLACEMENT, table="t", body={"kind": "relocate", "to": 1}, arrays=[keys(1)]),
                 ProtocolError, "needs body field 'channel'", id="outside any channel"),
    pytest.param(placement("ack", [keys(1)]), ProtocolError, "acknowledgement carries no arrays",
                 id="acknowledgement with keys"),
    pytest.param(placement("batch", [keys(1)], messages=[{"kind": "relocate", "to": "1"}]), ProtocolError,
                 "'relocate' in a batch needs body field 'to'", id="batch with a malformed message"),
])
def test_placement_message_not_fitting_its_kind_is_rejected_on_arrival(msg: Message, error: type[ShoalError],
                                                                        says: str) -> None:
    msg.req = REQ

    err = rejects(Codec(), on_the_wire(Codec().encode(msg)), error)

    assert says in str(err) and err.req == REQ  # type: ignore[attr-defined]


def test_each_placement_kind_round_trips() -> None:
    bodies = {"relocate": {"to": 1}, "handover": {"to": 1, "hops": 0}, "owner": {"owner": 0},
              "announce": {"active": True, "node": 1, "generation": 1, "hops": 0}, "state": {}, "replicate": {},
              "sync": {"origin": 0, "target": 1, "hops": 0, "part": 1, "parent": 1},
              "synced": {"target": 1, "parts": 0, "part": 1, "parent": 1}}
    carried = {"relocate": 1, "handover": 2, "owner": 3, "announce": 1, "state": 7, "replicate": 2, "sync": 3,
               "synced": 3}
    assert sorted(bodies) == sorted(PLACEMENT_KINDS)
    for kind, body in bodies.items():
        second = rows(2) if PLACEMENT_KINDS[kind].arrays[1:2] == (ROWS,) else keys(3, 4)
        arrays = [keys(0, 1), second, *[keys(1, 1)] * 5][: carried[kind]]
        if kind in ("sync", "synced"):
            arrays[2] = np.zeros(2, dtype=np.uint8)
        if kind == "state":  # the last announcement of each node taken, per key
            arrays[3] = np.zeros((2, 3), dtype=np.int64)
        msg = Codec().decode(on_the_wire(Codec().encode(placement(kind, arrays, **body))))
        assert msg.body["kind"] == kind and len(msg.arrays) == carried[kind]


def test_a_batch_of_placement_messages_round_trips_in_order() -> None:
    sent = [Relocate(keys(0, 2), to=1), Owner(keys(1, 1), keys(1, 1), keys(1, 1), owner=0),
            Replicate(keys(0, 1), rows(2))]
    body, arrays = to_parts(sent)

    msg = Codec().decode(on_the_wire(Codec().encode(placement(body["kind"], arrays, **{"messages": body["messages"]}))))
    got = from_parts(msg.body, msg.arrays)

    assert [type(m) for m in got] == [Relocate, Owner, Replicate] and got[1].owner == 0
    np.testing.assert_array_equal(got[2].rows, sent[2].rows)
    assert to_parts(sent[:1])[0] == {"kind": "relocate", "to": 1}  # one message alone goes as itself
    assert tables_of(msg.body, "t") == ["t", "t", "t"]  # all of the table the message names


def test_a_batch_of_several_tables_names_each_messages_table_and_a_bad_list_is_refused() -> None:
    sent = [Relocate(keys(0, 2), to=1), Relocate(keys(1, 1), to=1)]
    body, arrays = to_parts(sent, ["a", "b"])
    body.update(CHANNEL)
    msg = Codec().decode(on_the_wire(Codec().encode(Message(Op.PLACEMENT, table="a", body=body, arrays=arrays))))
    assert tables_of(msg.body, "a") == ["a", "b"]
    assert "tables" not in to_parts(sent, ["a", "a"])[0]  # one table: nothing more to say
    for bad in (["a"], ["a", 3], ["a", ""], "ab"):
        frames = Codec().encode(Message(Op.PLACEMENT, table="a", body={**body, "tables": bad}, arrays=arrays))
        with pytest.raises(ProtocolError, match="tables must name one table per message"):
            Codec().decode(on_the_wire(frames))


def test_absurd_dimensions_are_a_protocol_error_not_a_crash() -> None:
    header = {"v": 1, "op": int(Op.PING), "req": 3, "table": "", "epoch": 0, "clock": 0, "sender": 0, "flags": 0,
              "dtype": ["<f4"], "shapes": [[0, 2**64 - 1]], "body": {}}
    frames = [msgspec.msgpack.encode(header), b""]
    with pytest.raises(ProtocolError) as info:
        Codec().decode(frames)
    assert info.value.req == 3


def test_a_moved_answer_round_trips_and_a_malformed_one_is_refused() -> None:
    moved = Moved(np.array([0, 3]), np.array([1, -1]))
    reply = Codec().decode(Codec().encode(Message(Op.OK, req=1, body=moved.to_body())))
    got = Moved.in_reply(reply, 4)
    assert got is not None and got.positions.tolist() == [0, 3] and got.owners.tolist() == [1, -1]
    assert Moved.in_reply(Message(Op.OK), 4) is None
    for body in ({"moved": [4], "owners": [0]}, {"moved": [0, 1], "owners": [0]}, {"moved": [0]},
                 {"moved": [True], "owners": [0]}, {"moved": "0", "owners": [0]}, {"moved": [-1], "owners": [0]},
                 {"moved": [1, 1], "owners": [0, 0]}):
        with pytest.raises(ProtocolError):
            Moved.in_reply(Message(Op.OK, body=body), 4)
