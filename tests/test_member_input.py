"""What a member of the job (one holding the secret) may send: every bad message gets a typed error
and the peer keeps serving; a table is checked against the limits and the budget before anything is
allocated, whichever peer it is sent to; memory stays bounded (README "Security")."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from shoal import Limits, TableSpec
from shoal.api.errors import ERRORS_BY_CODE, ServerError
from shoal.cluster.replay import new_incarnation
from shoal.transport.zmq_transport import ZmqTransport
from shoal.wire import Codec, Message, Op
from tests.support.cluster import ThreadCluster
from tests.support.waiting import wait_until

SECRET = bytes(range(32))
REPLY_WAIT_S = 5.0
CODEC = Codec(secret=SECRET, local=True)  # every address here is loopback


class Member:
    """A member of the job that speaks raw: a DEALER socket per address, signed with the job's secret."""

    def __init__(self, sender: int = 0) -> None:
        self.ctx = zmq.Context()
        self.sockets: dict[str, zmq.Socket] = {}
        self.sender, self.incarnation, self.req = sender, new_incarnation(), 0

    def send(self, address: str, msg: Message, wait_s: float = REPLY_WAIT_S) -> Message | None:
        """``msg`` as the next request of this member's stream; its reply, or None if none came."""
        sock = self.sockets.get(address)
        if sock is None:
            sock = self.sockets[address] = self.ctx.socket(zmq.DEALER)
            sock.connect(address)
        self.req += 1
        msg.req, msg.sender, msg.incarnation = self.req, self.sender, self.incarnation
        sock.send_multipart([memoryview(f).tobytes() for f in CODEC.encode(msg)])
        if wait_s == 0:
            return None  # fire and forget
        if not sock.poll(int(wait_s * 1000)):
            return None
        return CODEC.decode(sock.recv_multipart())

    def recv(self, wait_s: float) -> Message | None:
        (sock,) = self.sockets.values()
        return CODEC.decode(sock.recv_multipart()) if sock.poll(int(wait_s * 1000)) else None

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def member():
    m = Member()
    yield m
    m.close()


def create(spec: TableSpec) -> Message:
    return Message(Op.CREATE_TABLE, table=spec.name, body={"spec": spec.to_dict()})


def assert_typed_error(reply: Message | None, *codes: str) -> None:
    assert reply is not None, "no reply at all (the peer swallowed the request)"
    assert reply.op == Op.ERROR, (reply.op, reply.body)
    assert reply.body["code"] in ERRORS_BY_CODE and reply.body["code"] != ServerError.code, reply.body
    if codes:
        assert reply.body["code"] in codes, reply.body


# ------------------------------------------------------------------ rendezvous: CREATE_TABLE


@pytest.mark.parametrize("spec", [
    pytest.param(TableSpec("huge_hash", num_keys=2**62, dim=1, mapping="hash"), id="hash mapping of 2**62 keys"),
    pytest.param(TableSpec("huge_slices", num_keys=2**62, dim=1, slices=2**50), id="2**50 slices"),
])
def test_rendezvous_answers_an_impossible_create_table_with_a_typed_error(member: Member, spec: TableSpec):
    """The rendezvous built the layout of any table a worker named (``slices.add_table``), with none
    of the checks a server makes first (max_table_bytes, max_slices). Building it raised numpy's
    ValueError / MemoryError, which ``Rendezvous._handle`` did not catch (only ShoalError): the serve
    loop logged it and the requester got no answer at all; its resends were then dropped as 'in
    progress' for good (the replay guard held the request as being served)."""
    with ThreadCluster(nodes=1, transport=ZmqTransport(), secret=SECRET) as cluster:
        address = cluster.rendezvous.address
        assert member.send(address, Message(Op.PING)).op == Op.OK
        assert_typed_error(member.send(address, create(spec)), "TableError", "BudgetError", "ConfigError")
        assert member.send(address, Message(Op.PING)).op == Op.OK  # and it goes on serving


def test_rendezvous_refuses_a_table_cut_into_more_slices_than_the_limit(member: Member):
    """A server refuses a table cut into more than ``Limits.max_slices`` slices; the rendezvous took
    it, kept a layout of one owner per slice, and put every owner into every status it answers. One
    CREATE_TABLE of ~100 bytes made every later CLUSTER_STATUS (the servers' heartbeats, workers'
    looks, REGISTER answers) larger than the message limit: they all failed, and servers whose
    heartbeats went unanswered shut themselves down."""
    limits = Limits(max_message_bytes=1 << 16)
    spec = TableSpec("many_slices", num_keys=200_000, dim=1, slices=200_000)  # max_slices: 4096
    with ThreadCluster(nodes=1, transport=ZmqTransport(), secret=SECRET, limits=limits) as cluster:
        address = cluster.rendezvous.address
        assert member.send(address, Message(Op.CLUSTER_STATUS)).op == Op.OK
        # The server it would live on refuses it by its limit...
        assert_typed_error(member.send(cluster.servers[0].address, create(spec)), "TableError")
        # ...the rendezvous must too, and in any case keep answering status.
        reply = member.send(address, create(spec))
        status = member.send(address, Message(Op.CLUSTER_STATUS))
        assert status is not None and status.op == Op.OK, (status.body if status else None)
        assert_typed_error(reply, "TableError")


def test_a_table_over_the_servers_budget_is_not_allocated_when_sent_to_the_rendezvous(member: Member):
    """README: 'A table is checked against the memory its servers may give tables ... before anything
    is allocated (BudgetError)'. A CREATE_TABLE sent to the rendezvous alone was stored unchecked and
    announced in every status; each server then built it in ``_adopt_tables`` (server.py), which
    called ``_add_table`` without ``_check_budget``, ``max_table_bytes`` or ``max_slices``."""
    limits = Limits(server_memory_bytes=1 << 20)
    spec = TableSpec("over_budget", num_keys=1 << 16, dim=16)  # 4 MiB on one server, over its 1 MiB
    with ThreadCluster(nodes=1, transport=ZmqTransport(), secret=SECRET, limits=limits) as cluster:
        server = cluster.servers[0]
        assert_typed_error(member.send(server.address, create(spec)), "BudgetError")  # the front door
        member.send(cluster.rendezvous.address, create(spec))  # the side door
        deadline = time.monotonic() + 3.0  # heartbeats come every 0.5 s
        while time.monotonic() < deadline and spec.name not in server.services:
            time.sleep(0.05)
        assert spec.name not in server.services, "the server allocated a table over its memory budget"
        assert spec.name not in server.tables


# ------------------------------------------------------------------ server: the replay guard's memory


def test_requests_a_worker_gives_up_on_are_not_held_as_in_service_forever(member: Member):
    """README: memory is bounded whatever peers send; 'a request still being served is never
    forgotten'. A request that arrives before an earlier one of its worker waits in ``StreamOrder``;
    when a later request raised the stream's floor past it, ``StreamOrder._skip_to`` (streams.py)
    deleted it without an answer, but the replay guard still held it as being served (``_SERVING``):
    no ``answered`` ever came for it, and in-service entries are never trimmed (replay.py
    ``_forget_answered``/``_trim`` skip them). Each round below left 1500 such entries behind; the
    stream's memory grew without bound, far past PER_STREAM (4096). They are answered now."""
    from shoal.cluster.replay import PER_STREAM

    waiting, rounds = 1500, 4
    with ThreadCluster(nodes=1, transport=ZmqTransport(), secret=SECRET) as cluster:
        server = cluster.servers[0]
        address = server.address
        assert member.send(address, create(TableSpec("t", num_keys=8, dim=2))).op == Op.OK
        stream_inc, next_seq = 1, 0
        keys = np.array([1], dtype=np.int64)

        def pull(seq: int, floor: int) -> Message:
            return Message(Op.PULL, table="t", body={"stream": [stream_inc, seq, floor, 0]}, arrays=[keys])

        for _ in range(rounds):
            for seq in range(next_seq + 1, next_seq + 1 + waiting):  # request next_seq is "lost"
                member.send(address, pull(seq, next_seq), wait_s=0)
            last = next_seq + 1 + waiting
            reply = member.send(address, pull(last, last), wait_s=REPLY_WAIT_S)  # the worker gave up on the rest
            while reply is not None and reply.op != Op.VALUES:  # skip anything else queued on the socket
                reply = member.recv(REPLY_WAIT_S)
            assert reply is not None and reply.op == Op.VALUES
            next_seq = last + 1
        assert server.order.waiting_count() == 0  # the server holds none of them any more...
        # ...and answers them (they stayed in service for good), so the guard keeps PER_STREAM answered
        wait_until(lambda: server.replay.entries <= PER_STREAM + 16,
                   what=f"the replay guard back to {PER_STREAM} entries (it holds {server.replay.entries})")


# ------------------------------------------------------------------ rendezvous: a server's heartbeat


@pytest.mark.parametrize("load", [
    pytest.param({"t": [[0]]}, id="a row without its bytes"),
    pytest.param({"t": 5}, id="rows that are no list"),
    pytest.param({"t": [["zero", 1.0]]}, id="a shard that is no number"),
])
def test_rendezvous_answers_a_malformed_server_heartbeat_with_a_typed_error(load: object):
    """A server's CLUSTER_STATUS carries its slices' load, an untyped ``dict`` the schema cannot check
    (bodies.ClusterStatus.load). ``SliceAuthority.on_load`` (slices.py) unpacked it blindly; the
    ValueError/TypeError escaped ``Rendezvous._handle`` (which caught ShoalError only), so the
    heartbeat was never answered (and its resends were dropped as in progress): the server, hearing
    nothing for connect_s, shut itself down."""
    from shoal.api.ids import server_sender

    server_member = Member(sender=server_sender(0))
    try:
        with ThreadCluster(nodes=1, transport=ZmqTransport(), secret=SECRET) as cluster:
            heartbeat = Message(Op.CLUSTER_STATUS, body={"role": "server", "node": 0, "load": load})
            assert_typed_error(server_member.send(cluster.rendezvous.address, heartbeat), "ProtocolError")
    finally:
        server_member.close()


@pytest.mark.parametrize("layout", [{"owners": [7], "epoch": 0}, {"owners": [0, 0], "epoch": 0}, {"owners": "0"}],
                         ids=["a server of no job", "too many slices", "no list"])
def test_a_table_laid_out_where_no_server_is_is_refused_by_the_rendezvous(member: Member, layout: dict) -> None:
    """A CREATE_TABLE names the layout its servers built, which the rendezvous keeps for every status
    and move: one naming servers the job does not have, or another number of slices, is refused and
    the table left unknown."""
    spec = TableSpec("laid_out", num_keys=64, dim=1)
    with ThreadCluster(nodes=1, transport=ZmqTransport(), secret=SECRET) as cluster:
        message = Message(Op.CREATE_TABLE, table=spec.name, body={"spec": spec.to_dict(), "layout": layout})
        assert_typed_error(member.send(cluster.rendezvous.address, message), "ProtocolError")
        assert spec.name not in cluster.rendezvous.tables
        status = member.send(cluster.rendezvous.address, Message(Op.CLUSTER_STATUS))
        assert status is not None and status.op == Op.OK
