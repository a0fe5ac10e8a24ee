"""A live server meets bad input: every bad request gets a typed error reply, and the
server keeps serving with its tables untouched.

The server runs its real loop in a thread behind ZeroMQ on loopback tcp. Requests go
through a raw DEALER socket of the test's own, so frames can be malformed by hand.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest

from shoal import (
    AuthError,
    ClusterSpec,
    ConfigError,
    DTypeError,
    KeyRangeError,
    Limits,
    MessageTooLargeError,
    NonFiniteError,
    Normal,
    ProtocolError,
    ShapeError,
    ShoalError,
    TableError,
    TableSpec,
)
from shoal.api.ids import SERVERS
from shoal.cluster.replay import new_incarnation
from shoal.cluster.throttle import ThrottledWarnings
from shoal.server.server import ParameterServer
from shoal.transport.zmq_transport import ZmqTransport
from shoal.wire import PROTOCOL_VERSION, Codec, Message, Op
from shoal.wire.ops import Flag
from tests.support.live_server import INCARNATION, WORKER, LiveServer, RawClient

SECRET = b"k" * 32
REQ = 9
SPEC = TableSpec("t", num_keys=64, dim=4, init=Normal(std=1.0), seed=3)
ALL_KEYS = np.arange(SPEC.num_keys, dtype=np.int64)


@pytest.fixture
def client(start_server: Callable[..., LiveServer], connect: Callable[..., RawClient]) -> RawClient:
    """A client of a fresh server that holds table ``t`` (``SPEC``)."""
    client = connect(start_server())
    client.create_table(SPEC)
    return client


def assert_error_reply(reply: Message, error: type[ShoalError], req: int = REQ) -> None:
    assert reply.op == Op.ERROR
    assert reply.body["code"] == error.code, reply.body["message"]
    assert reply.req == req


def assert_serves_unchanged(client: RawClient, before: np.ndarray) -> None:
    np.testing.assert_array_equal(client.pull(ALL_KEYS), before)


# ----------------------------------------------------------- raw frames


def keys(*ks: int) -> np.ndarray:
    return np.array(ks, dtype=np.int64)


def values(n: int, dtype: Any = np.float32, dim: int = SPEC.dim, fill: float = 1.0) -> np.ndarray:
    return np.full((n, dim), fill, dtype=dtype)


def frames_of(msg: Message) -> list[bytes]:
    msg.sender = WORKER if msg.sender == -1 else msg.sender  # as worker 0, unless it says otherwise
    msg.req, msg.incarnation = REQ, INCARNATION if msg.sender == WORKER else new_incarnation()
    return [memoryview(f).tobytes() for f in Codec().encode(msg)]


def push_frames(ks: np.ndarray | None = None, vs: np.ndarray | None = None,
                table: str = "t", op: Op = Op.PUSH) -> list[bytes]:
    ks = keys(1, 2, 3) if ks is None else ks
    vs = values(len(ks)) if vs is None else vs
    return frames_of(Message(op, table=table, arrays=[ks, vs]))


def with_header(frames: list[bytes], **changes: Any) -> list[bytes]:
    header = msgspec.msgpack.decode(frames[0])
    header.update(changes)
    return [msgspec.msgpack.encode(header), *frames[1:]]


def with_nonfinite(value: float, row: int = 1) -> np.ndarray:
    vs = values(3)
    vs[row, 2] = value
    return vs


def create_frames(**changes: Any) -> list[bytes]:
    spec = {**SPEC.to_dict(), **changes}
    return frames_of(Message(Op.CREATE_TABLE, table="t", body={"spec": spec}))


def create_new_frames(layout: Any) -> list[bytes]:
    """A new table ("w", laid out by the rendezvous) whose layout is ``layout``."""
    spec = {**SPEC.to_dict(), "name": "w"}
    return frames_of(Message(Op.CREATE_TABLE, table="w", body={"spec": spec, "layout": layout}))


# --------------------------------------------------------------- bad input


BAD_REQUESTS = [
    # (frames, error, req of the reply: 0 when the header could not be read)
    pytest.param([b"\xc1garbage"], ProtocolError, 0, id="garbage header"),
    pytest.param([b""], ProtocolError, 0, id="empty header frame"),
    pytest.param([push_frames()[0][:-6], *push_frames()[1:]], ProtocolError, 0, id="truncated header"),
    pytest.param([*push_frames()[:2], push_frames()[2][:-3]], ProtocolError, REQ, id="truncated values frame"),
    pytest.param(push_frames()[:2], ProtocolError, REQ, id="values frame missing"),
    pytest.param([*push_frames(), b"\x00" * 8], ProtocolError, REQ, id="extra frame"),
    pytest.param(with_header(push_frames(), op=99), ProtocolError, REQ, id="unknown op"),
    pytest.param(with_header(push_frames(), v=PROTOCOL_VERSION + 1), ProtocolError, REQ, id="unknown protocol version"),
    pytest.param(with_header(push_frames(), dtype=["<i8", "|O"]), ProtocolError, REQ, id="object dtype"),
    pytest.param(frames_of(Message(Op.VALUES, arrays=[values(1)])), ProtocolError, REQ,
                 id="op the server does not serve"),
    pytest.param(push_frames(vs=values(3, np.float64)), DTypeError, REQ, id="float64 values for a float32 table"),
    pytest.param(push_frames(vs=values(3, dim=SPEC.dim - 1)), ShapeError, REQ, id="values one column short"),
    pytest.param(push_frames(vs=values(4)), ShapeError, REQ, id="more value rows than keys"),
    pytest.param(push_frames(ks=keys(0, 64)), KeyRangeError, REQ, id="key past the end"),
    pytest.param(push_frames(ks=keys(5, -1)), KeyRangeError, REQ, id="negative key"),
    pytest.param(frames_of(Message(Op.PULL, table="t", arrays=[keys(2, 1000)])), KeyRangeError, REQ,
                 id="pull of a key out of range"),
    pytest.param(push_frames(vs=with_nonfinite(np.nan)), NonFiniteError, REQ, id="NaN in a push"),
    pytest.param(push_frames(vs=with_nonfinite(np.inf)), NonFiniteError, REQ, id="Inf in a push"),
    pytest.param(push_frames(vs=with_nonfinite(-np.inf), op=Op.PUSH_PULL), NonFiniteError, REQ,
                 id="-Inf in a push_pull"),
    pytest.param(push_frames(table="nope"), TableError, REQ, id="unknown table"),
    pytest.param(frames_of(Message(Op.PULL, table="nope", arrays=[keys(1)])), TableError, REQ,
                 id="pull from an unknown table"),
    pytest.param(create_frames(dim=SPEC.dim + 1), TableError, REQ, id="create existing table with another spec"),
    pytest.param(create_frames(name="u"), ProtocolError, REQ, id="create with a spec of another name"),
    pytest.param(create_frames(dim=0), ConfigError, REQ, id="create with an invalid spec"),
    pytest.param(create_new_frames({"owners": [0, 0], "epoch": 0}), ProtocolError, REQ,
                 id="create with a layout of too many slices"),
    pytest.param(create_new_frames({"owners": [2**40], "epoch": 0}), ProtocolError, REQ,
                 id="create with a layout naming a server past any job"),
    pytest.param(create_new_frames({"owners": [0]}), ProtocolError, REQ, id="create with a layout without an epoch"),
]


@pytest.mark.parametrize(("frames", "error", "req"), BAD_REQUESTS)
def test_bad_request_gets_a_typed_error_and_changes_nothing(
    client: RawClient, frames: list[bytes], error: type[ShoalError], req: int
) -> None:
    before = client.pull(ALL_KEYS)

    client.send_frames(frames)

    assert_error_reply(client.reply(), error, req)
    assert_serves_unchanged(client, before)


def test_good_push_after_bad_ones_still_applies(client: RawClient) -> None:
    # guards the "unchanged" checks above: pushes do change what a pull returns
    before = client.pull(ALL_KEYS)
    for frames, _, _ in (p.values for p in BAD_REQUESTS):
        client.send_frames(frames)
        assert client.reply().op == Op.ERROR

    assert client.push(keys(1, 2), values(2, fill=0.5)).op == Op.OK

    expected = before.copy()
    expected[[1, 2]] += 0.5
    np.testing.assert_array_equal(client.pull(ALL_KEYS), expected)


def test_create_of_an_existing_table_with_the_same_spec_is_accepted(client: RawClient) -> None:
    before = client.pull(ALL_KEYS)

    client.create_table(SPEC)

    assert_serves_unchanged(client, before)


def test_skip_policy_applies_finite_rows_and_drops_the_others(client: RawClient) -> None:
    spec = TableSpec("s", num_keys=8, dim=3, init=Normal(std=1.0), nonfinite="skip")
    client.create_table(spec)
    all_keys = np.arange(spec.num_keys)
    before = client.pull(all_keys, table="s")
    grads = np.array([[1, 1, 1], [np.nan, 1, 1], [2, 2, 2], [1, np.inf, 1]], dtype=np.float32)

    reply = client.push(keys(1, 2, 3, 4), grads, table="s")

    assert reply.op == Op.OK
    assert reply.body == {"skipped": 2}
    expected = before.copy()
    expected[1] += 1
    expected[3] += 2
    np.testing.assert_array_equal(client.pull(all_keys, table="s"), expected)


ADAPTIVE = TableSpec("a", num_keys=8, dim=3, init=Normal(std=1.0), techniques="auto")


@pytest.mark.parametrize("policy", ["reject", "skip"])
def test_nonfinite_push_to_an_adaptive_table_follows_the_policy(client: RawClient, policy: str) -> None:
    spec = TableSpec(f"a_{policy}", num_keys=8, dim=3, init=Normal(std=1.0), techniques="auto", nonfinite=policy)
    client.create_table(spec)
    all_keys = np.arange(spec.num_keys)
    before = client.pull(all_keys, table=spec.name)
    grads = np.array([[1, 1, 1], [np.nan, 1, 1], [2, 2, 2]], dtype=np.float32)

    reply = client.push(keys(1, 2, 3), grads, table=spec.name)

    expected = before.copy()
    if policy == "reject":
        assert reply.op == Op.ERROR and reply.body["code"] == NonFiniteError.code
    else:  # the finite rows land, the bad one adds nothing
        assert reply.op == Op.OK
        expected[1] += 1
        expected[3] += 2
    np.testing.assert_array_equal(client.pull(all_keys, table=spec.name), expected)


@pytest.mark.parametrize("kind", ["state", "sync"])
def test_placement_rows_with_nan_from_a_peer_are_dropped_and_the_server_keeps_serving(
    client: RawClient, kind: str
) -> None:
    client.create_table(ADAPTIVE)
    all_keys = np.arange(ADAPTIVE.num_keys)
    before = client.pull(all_keys, table="a")
    rows = np.ones((2, ADAPTIVE.dim), np.float32)
    rows[1, 0] = np.nan
    # state: interest, the last announcements taken (a column per node), replicas, epochs, steps
    extra = ([np.zeros(2, np.int64), np.zeros((2, 1), np.int64), *[np.zeros(2, np.int64)] * 3] if kind == "state"
             else [np.zeros(2, np.uint8)])
    body = {"kind": kind} if kind == "state" else {"kind": kind, "origin": 0, "target": 0, "hops": 0, "part": 1,
                                                   "parent": 1}
    body.update(channel=1, seq=1, base=1, acks=0, acked=0)  # the first message of a server's channel
    client.send_frames(frames_of(Message(Op.PLACEMENT, table="a", sender=SERVERS, flags=Flag.NO_REPLY,
                                         body=body, arrays=[keys(1, 2), rows, *extra])))

    np.testing.assert_array_equal(client.pull(all_keys, table="a"), before)  # answered after the bad message
    assert client.live.server.stats["error_ProtocolError"] == 1


@pytest.mark.parametrize("header", [dict(seq=-1, base=1, acked=0), dict(seq=1, base=0, acked=0),
                                    dict(seq=1, base=1, acked=-3)], ids=["seq", "base", "acked"])
def test_a_placement_message_with_a_bad_channel_header_is_refused_and_the_server_keeps_serving(
    client: RawClient, header: dict[str, int]
) -> None:
    client.create_table(ADAPTIVE)
    all_keys = np.arange(ADAPTIVE.num_keys)
    before = client.pull(all_keys, table="a")
    body = {"kind": "replicate", "channel": 1, "acks": 0, **header}
    client.send_frames(frames_of(Message(Op.PLACEMENT, table="a", sender=SERVERS, flags=Flag.NO_REPLY, body=body,
                                         arrays=[keys(1, 2), np.ones((2, ADAPTIVE.dim), np.float32)])))

    np.testing.assert_array_equal(client.pull(all_keys, table="a"), before)  # answered after the bad message
    assert client.live.server.stats["error_ProtocolError"] == 1


def test_oversized_message_is_refused(start_server: Callable[..., LiveServer],
                                      connect: Callable[..., RawClient]) -> None:
    client = connect(start_server(limits=Limits(max_message_bytes=65536)))
    client.create_table(SPEC)
    before = client.pull(ALL_KEYS)
    n = 4000  # 32 KB of keys + 64 KB of values
    big = push_frames(ks=np.arange(n, dtype=np.int64) % SPEC.num_keys, vs=values(n))
    assert sum(len(f) for f in big) > 96_000

    client.send_frames(big)

    assert_error_reply(client.reply(), MessageTooLargeError)
    assert_serves_unchanged(client, before)


def test_pull_whose_reply_would_be_oversized_is_refused(start_server: Callable[..., LiveServer],
                                                        connect: Callable[..., RawClient]) -> None:
    client = connect(start_server(limits=Limits(max_message_bytes=65536)))
    client.create_table(SPEC)
    before = client.pull(ALL_KEYS)
    many = np.arange(5000, dtype=np.int64) % SPEC.num_keys  # 40 KB request, 80 KB reply

    client.send_frames(frames_of(Message(Op.PULL, table="t", arrays=[many])))

    assert_error_reply(client.reply(), MessageTooLargeError)
    assert_serves_unchanged(client, before)


@pytest.mark.parametrize("flags", ["1", None, 1.5], ids=["string", "null", "float"])
def test_header_with_non_integer_flags_is_refused(client: RawClient, flags: Any) -> None:
    before = client.pull(ALL_KEYS)

    client.send_frames(with_header(push_frames(), flags=flags))

    assert_error_reply(client.reply(), ProtocolError)
    assert_serves_unchanged(client, before)


# --------------------------------------------------------- authentication


@pytest.fixture
def signed_client(start_server: Callable[..., LiveServer], connect: Callable[..., RawClient]) -> RawClient:
    client = connect(start_server(secret=SECRET), secret=SECRET)
    client.create_table(SPEC)
    return client


def signed_push_frames(secret: bytes) -> list[bytes]:
    msg = Message(Op.PUSH, req=REQ, table="t", arrays=[keys(1, 2, 3), values(3)])
    return [memoryview(f).tobytes() for f in Codec(secret=secret).encode(msg)]


def tampered_push_frames() -> list[bytes]:
    frames = signed_push_frames(SECRET)
    frames[2] = values(3, fill=100.0).tobytes()
    return frames


@pytest.mark.parametrize("frames", [
    pytest.param(push_frames(), id="unsigned push"),
    pytest.param(frames_of(Message(Op.PULL, table="t", arrays=[keys(1)])), id="unsigned pull"),
    pytest.param(signed_push_frames(b"x" * 32), id="push signed with another secret"),
    pytest.param(tampered_push_frames(), id="push altered after signing"),
])
def test_message_without_a_valid_tag_is_refused_and_not_applied(signed_client: RawClient,
                                                                frames: list[bytes]) -> None:
    before = signed_client.pull(ALL_KEYS)

    signed_client.send_frames(frames)

    # The refusal itself is unsigned: the peer may not hold the secret.
    reply = signed_client.reply(codec=Codec())
    assert_error_reply(reply, AuthError)
    assert reply.arrays == []
    assert_serves_unchanged(signed_client, before)


def test_a_flood_of_wrongly_signed_messages_logs_one_warning_and_counts_them_all(
        signed_client: RawClient, caplog: pytest.LogCaptureFixture) -> None:
    """Each wrongly signed message logged a warning (2,136 lines in 5 s): now the first is logged,
    the rest are counted (in the server's stats, and in the next warning an interval later)."""
    before = signed_client.pull(ALL_KEYS)
    flood = 500
    with caplog.at_level(logging.WARNING, logger="shoal.server.server"):
        for _ in range(flood):
            signed_client.send_frames(signed_push_frames(b"x" * 32))
        for _ in range(flood):
            assert_error_reply(signed_client.reply(codec=Codec()), AuthError)
    warnings = [r.getMessage() for r in caplog.records if "unauthenticated" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert signed_client.live.server.stats["dropped_unauthenticated"] == flood
    assert_serves_unchanged(signed_client, before)


def test_throttled_warnings_report_how_many_came_meanwhile(caplog: pytest.LogCaptureFixture) -> None:
    clock = [0.0]
    warnings = ThrottledWarnings(logging.getLogger("shoal.test"), every_s=10.0, now=lambda: clock[0])
    with caplog.at_level(logging.WARNING, logger="shoal.test"):
        for second in range(25):
            clock[0] = float(second)
            warnings.warn("kind", "bad thing from %s", "peer")
            warnings.warn("other", "another thing")
    assert [r.getMessage() for r in caplog.records] == [
        "bad thing from peer", "another thing",
        "bad thing from peer (10 such in the last 10s)", "another thing (10 such in the last 10s)",
        "bad thing from peer (10 such in the last 10s)", "another thing (10 such in the last 10s)",
    ]


def test_signed_push_applies(signed_client: RawClient) -> None:
    before = signed_client.pull(ALL_KEYS)

    assert signed_client.push(keys(3), values(1, fill=2.0)).op == Op.OK

    expected = before.copy()
    expected[3] += 2.0
    np.testing.assert_array_equal(signed_client.pull(ALL_KEYS), expected)



def test_a_table_larger_than_the_limit_is_refused_before_any_memory_is_taken():
    transport = ZmqTransport()
    spec = ClusterSpec("cap", 1, 1, "tcp://127.0.0.1:1", limits=Limits(max_table_bytes=1 << 20))
    server = ParameterServer(0, spec, transport, share_memory=False)
    try:
        huge = TableSpec("huge", 10**9, 1000)
        with pytest.raises(TableError, match="needs 4000000000000 bytes"):
            server.dispatch(Message(Op.CREATE_TABLE, req=1, table="huge", body={"spec": huge.to_dict()}))
        assert "huge" not in server.tables
    finally:
        server.close()
        transport.close()


def test_a_table_of_more_slices_than_the_limit_is_refused_before_any_segment_is_made():
    transport = ZmqTransport()
    spec = ClusterSpec("cap", 1, 1, "tcp://127.0.0.1:1", limits=Limits(max_slices=64))
    server = ParameterServer(0, spec, transport, share_memory=False)
    try:
        many = TableSpec("many", 10_000, 4, slices=1000)
        with pytest.raises(TableError, match="1000 slices; the limit is 64"):
            server.dispatch(Message(Op.CREATE_TABLE, req=1, table="many", body={"spec": many.to_dict()}))
        assert "many" not in server.tables
        bounded = TableSpec("bounded", 100_000, 64, mapping="bounded", slice_bytes=4096)
        with pytest.raises(TableError, match="larger slice_bytes"):
            server.dispatch(Message(Op.CREATE_TABLE, req=2, table="bounded", body={"spec": bounded.to_dict()}))
    finally:
        server.close()
        transport.close()
