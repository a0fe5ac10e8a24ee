"""Every job is authenticated; a tagged message is served once whatever connection replays it;
only members act, each in its role; a table must fit the server's memory budget.

The attacker here is a process on the same machine that is not part of the job
(it can reach 127.0.0.1), or one that captured a tagged message on the wire.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from shoal import BudgetError, Limits, ReplayError, RoleError, TableSpec
from shoal.api.errors import AuthError
from shoal.cluster.replay import PER_STREAM, REPLY_BYTES, new_incarnation
from shoal.launch.user_dir import runs_dir
from shoal.transport.zmq_transport import ZmqTransport
from shoal.wire import Codec, Message, Op
from tests.support.cluster import ThreadCluster

SECRET = bytes(range(32))
PROBE = str(Path(__file__).resolve().parent / "scripts" / "probe_worker.py")
REPLY_WAIT_S = 10.0


class Outsider:
    """Raw DEALER sockets: each ``send`` may come from a new connection, as an attacker's would."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sockets: list[zmq.Socket] = []

    def connect(self, address: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.connect(address)
        self.sockets.append(sock)
        return sock

    def send(self, address: str, frames: list[bytes], codec: Codec | None = None,
             sock: zmq.Socket | None = None) -> Message:
        """Send ``frames`` on a new connection (or on ``sock``); the reply, decoded."""
        sock = sock or self.connect(address)
        sock.send_multipart(frames)
        assert sock.poll(int(REPLY_WAIT_S * 1000)), "no reply"
        return (codec or Codec()).decode(sock.recv_multipart())

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def outsider():
    attacker = Outsider()
    yield attacker
    attacker.close()


def wire_bytes(frames: list) -> list[bytes]:
    return [memoryview(f).tobytes() for f in frames]


@pytest.mark.parametrize("local", [True, False], ids=["loopback tag", "full tag"])
def test_a_captured_push_played_again_on_new_connections_is_refused(outsider: Outsider, local: bool):
    """The issue's attack: one signed PUSH sent once more from each of three new connections was
    applied three more times (4.0 instead of 1.0)."""
    with ThreadCluster(nodes=1, transport=ZmqTransport(), secret=SECRET) as cluster:
        worker = cluster.worker(0)
        table = worker.table("t", 8, 2)
        codec = Codec(secret=SECRET, local=local)  # off loopback, a tag covers every frame
        reader = Codec(secret=SECRET, local=True)  # the server's replies, over loopback here
        push = Message(Op.PUSH, req=1, table="t", sender=0, incarnation=new_incarnation(),
                       arrays=[np.array([3]), np.ones((1, 2), np.float32)])
        captured = wire_bytes(codec.encode(push))
        address = cluster.servers[0].address

        assert outsider.send(address, captured, reader).op == Op.OK  # the original
        for _ in range(3):
            reply = outsider.send(address, captured, reader)
            assert reply.op == Op.OK  # a repeat of an answered request gets its reply again...
        np.testing.assert_array_equal(table.pull(np.array([3])), [[1.0, 1.0]])  # ...and nothing more

        member = outsider.connect(address)
        for req in range(2, 2 + PER_STREAM + 1):  # the stream moves on; its first request is forgotten
            ping = Message(Op.PING, req=req, sender=0, incarnation=push.incarnation)
            outsider.send(address, wire_bytes(codec.encode(ping)), reader, member)
        reply = outsider.send(address, captured, reader)
        assert reply.op == Op.ERROR and reply.body["code"] == ReplayError.code, reply.body
        np.testing.assert_array_equal(table.pull(np.array([3])), [[1.0, 1.0]])
        worker.shutdown()


def test_a_tag_over_the_header_only_is_refused_off_loopback():
    local, remote = Codec(secret=SECRET, local=True), Codec(secret=SECRET)
    frames = wire_bytes(local.encode(Message(Op.PING, req=1, sender=0, incarnation=new_incarnation())))
    assert local.decode(frames).op == Op.PING
    with pytest.raises(AuthError, match="header only"):
        remote.decode(frames)
    push = wire_bytes(local.encode(Message(Op.PUSH, req=2, table="t", sender=0, incarnation=new_incarnation(),
                                           arrays=[np.array([3]), np.ones((1, 2), np.float32)])))
    push[2] = np.full((1, 2), 5.0, np.float32).tobytes()  # the frames of a header-only tag are not covered:
    np.testing.assert_array_equal(local.decode(push).arrays[1], [[5.0, 5.0]])  # only on loopback
    with pytest.raises(AuthError, match="header only"):
        remote.decode(push)


@pytest.mark.parametrize("message", [
    pytest.param(Message(Op.CLOCK, clock=5, sender=10**6, body={"rank": 10**6}), id="CLOCK of rank 10^6"),
    pytest.param(Message(Op.CLOCK, clock=5, sender=-1, body={"rank": -1}), id="CLOCK of rank -1"),
    pytest.param(Message(Op.CLOCK, clock=5, sender=0, body={"rank": 1}), id="CLOCK for another worker"),
    pytest.param(Message(Op.PUSH, table="t", sender=7, arrays=[np.array([1]), np.ones((1, 2), np.float32)]),
                 id="PUSH of a rank that is no member"),
    pytest.param(Message(Op.GOSSIP, table="t", sender=0, body={"shard": 0, "vv": [], "stage": 0, "deltas": [],
                                                               "states": []}), id="gossip from a worker"),
    pytest.param(Message(Op.SHUTDOWN, sender=-3), id="SHUTDOWN from an observer"),
])
def test_a_member_out_of_its_role_is_refused_by_name(outsider: Outsider, message: Message):
    with ThreadCluster(nodes=1, workers_per_node=2, transport=ZmqTransport(), secret=SECRET) as cluster:
        worker = cluster.worker(0)
        worker.table("t", 8, 2)
        codec = Codec(secret=SECRET, local=True)
        message.req, message.incarnation = 1, new_incarnation()
        reply = outsider.send(cluster.servers[0].address, wire_bytes(codec.encode(message)), codec)
        assert reply.op == Op.ERROR and reply.body["code"] == RoleError.code, reply.body
        assert str(message.sender) in reply.body["message"]
        assert not cluster.servers[0]._stop.is_set()
        worker.shutdown()


def test_a_table_over_the_servers_memory_budget_is_refused_before_anything_is_allocated():
    limits = Limits(server_memory_bytes=8 << 20)
    with ThreadCluster(nodes=2, limits=limits) as cluster:
        worker = cluster.worker(0)
        worker.table("fits", 1000, 64)  # 256 KB over two servers
        before = set(os.listdir("/dev/shm"))
        with pytest.raises(BudgetError, match=r"needs 15 MiB on server \d.*budget is 8 MiB"):
            worker.table("huge", 1_000_000, 8)  # 32 MB: 16 MB a server
        assert set(os.listdir("/dev/shm")) <= before | {n for n in os.listdir("/dev/shm") if "fits" in n}
        assert all("huge" not in s.services for s in cluster.servers)
        assert "huge" not in cluster.rendezvous.tables  # a refused table is no table: the name stays free
        smaller = worker.table("huge", 1000, 8)
        smaller.push(np.arange(1000), np.ones((1000, 8), np.float32))
        assert smaller.pull(np.arange(1000)).sum() == 8000
        worker.shutdown()


def test_a_hundred_thousand_junk_requests_from_one_member_keep_the_servers_memory_bounded(outsider: Outsider):
    with ThreadCluster(nodes=1, transport=ZmqTransport(), secret=SECRET) as cluster:
        server = cluster.servers[0]
        codec = Codec(secret=SECRET, local=True)
        sock = outsider.connect(server.address)
        incarnation, sent, answered = new_incarnation(), 0, 0
        deadline = time.monotonic() + 120
        while sent < 100_000 and time.monotonic() < deadline:
            for _ in range(500):
                sent += 1
                sock.send_multipart(codec.encode(Message(Op.PING, req=sent, sender=0, incarnation=incarnation)))
            while answered < sent - 1000 or sock.poll(0):
                assert sock.poll(int(REPLY_WAIT_S * 1000))
                sock.recv_multipart()
                answered += 1
        assert sent == 100_000
        assert server.replay.entries <= PER_STREAM + 1  # requests remembered: the latest of the stream only
        assert server.replay.streams == 1
        # 4096 remembered requests with their small replies, not 100k (the old per-connection memory
        # grew by 68 MB for 164k pings and never shrank); what that costs in bytes: test_replay.py
        assert server.replay.kept_reply_bytes <= REPLY_BYTES


def test_a_default_job_refuses_unsigned_shutdown_create_table_and_clock_from_outside(tmp_path, outsider):
    """``shoal run`` without a secret: the job makes one, and a local process outside it is refused."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", "1", "--workers-per-node", "1", "--",
         sys.executable, PROBE, str(tmp_path), "hang"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        info_file = tmp_path / "w0.json"
        deadline = time.monotonic() + 60
        while not info_file.exists() or not info_file.read_text().endswith("}"):
            assert time.monotonic() < deadline and launcher.poll() is None, launcher.communicate(timeout=10)[0]
            time.sleep(0.1)
        info = json.loads(info_file.read_text())
        server, rendezvous = info["server_addresses"][0], info["rendezvous"]
        attacks = [
            Message(Op.SHUTDOWN, req=1, sender=0, incarnation=new_incarnation()),
            Message(Op.CREATE_TABLE, req=1, table="evil", sender=0, incarnation=new_incarnation(),
                    body={"spec": TableSpec("evil", 1 << 28, 1).to_dict()}),
            Message(Op.CLOCK, req=1, clock=10**6, sender=0, incarnation=new_incarnation(), body={"rank": 0}),
        ]
        for address in (server, rendezvous):
            for attack in attacks:
                reply = outsider.send(address, wire_bytes(Codec().encode(attack)))
                assert reply.op == Op.ERROR and reply.body["code"] == AuthError.code, (address, attack.op, reply)
        job = json.loads((runs_dir() / f"{info['cluster_id']}.json").read_text())
        assert "secret" not in job and Path(job["secret_file"]).stat().st_mode & 0o077 == 0
        assert all(job["secret_file"] not in arg for arg in launcher.args)
        # Still serving, unchanged: a member (holding the job's secret) sees no table "evil" and clock 0.
        member = Codec(secret=bytes.fromhex(Path(job["secret_file"]).read_text()), local=True)
        stats = outsider.send(server, wire_bytes(member.encode(
            Message(Op.STATS, req=1, sender=-3, incarnation=new_incarnation()))), member)
        assert stats.op == Op.OK and "evil" not in stats.body["tables"] and stats.body["clocks"] == [0]
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.communicate(timeout=30)
    assert not Path(job["secret_file"]).exists()  # the job's secret goes with it


def test_a_large_table_is_built_while_the_server_goes_on_answering(outsider: Outsider):
    """Making a table of hundreds of MB takes seconds; the request loop serves meanwhile, and answers
    every CREATE_TABLE of it once the table is ready."""
    with ThreadCluster(nodes=1, transport=ZmqTransport(), secret=SECRET) as cluster:
        codec = Codec(secret=SECRET, local=True)
        sock = outsider.connect(cluster.servers[0].address)
        first, second = new_incarnation(), new_incarnation()  # two requesters' streams
        big = TableSpec("big", 2_000_000, 64)  # 512 MB of rows, each drawn from the initialiser
        for incarnation in (first, second, first):  # the last one a repeat: answered once, with the first
            sock.send_multipart(codec.encode(Message(Op.CREATE_TABLE, req=1, table="big", sender=0,
                                                     incarnation=incarnation, body={"spec": big.to_dict()})))
        sock.send_multipart(codec.encode(Message(Op.PING, req=2, sender=0, incarnation=first)))
        replies = []
        while len(replies) < 3:
            assert sock.poll(60_000), replies
            replies.append(codec.decode(sock.recv_multipart()))
        assert (replies[0].req, replies[0].op) == (2, Op.OK)  # the ping did not wait for the table
        assert sorted((r.incarnation, r.req, r.op) for r in replies[1:]) == sorted(
            [(first, 1, Op.OK), (second, 1, Op.OK)])
        assert not sock.poll(200)  # no answer to the repeat
        assert cluster.servers[0].services["big"].spec("big") == big
