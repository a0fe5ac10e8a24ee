"""A missing or misconfigured peer fails within its timeout, naming what is missing."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import shoal
from shoal.api.config import ClusterSpec, Timeouts
from shoal.api.errors import ProtocolError
from shoal.api.ids import RENDEZVOUS
from shoal.client.worker import Worker
from shoal.cluster import membership
from shoal.cluster.rendezvous import Rendezvous
from shoal.consistency.clocks import FINISHED
from shoal.launch.env import role_from_env
from shoal.server.server import ParameterServer
from shoal.transport.zmq_transport import ZmqTransport
from shoal.wire.codec import Codec
from shoal.wire.message import Message
from shoal.wire.ops import Op
from shoal.wire.schema import BarrierNote
from tests.support.cluster import ThreadCluster
from tests.support.losing import LosingTransport
from tests.support.waiting import wait_until

QUICK = Timeouts(connect_s=1.5, request_s=1.5, barrier_s=1.5)


@pytest.fixture
def transport():
    t = ZmqTransport()
    yield t
    t.close()


def test_a_missing_server_is_named_within_the_connect_timeout(transport):
    rendezvous = Rendezvous(transport, Codec(), "tcp://127.0.0.1:0", "missing", 2, 1).start()
    spec = ClusterSpec("missing", 2, 1, rendezvous.address, timeouts=QUICK)
    server = ParameterServer(0, spec, transport)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        start = time.monotonic()
        with pytest.raises(shoal.ClusterError, match=r"registered node\(s\) \[0\], missing node\(s\) \[1\]"):
            Worker(spec, 0, 0, transport)
        assert time.monotonic() - start < 5
    finally:
        server.stop()
        thread.join(timeout=5)
        rendezvous.stop()


def test_an_unreachable_rendezvous_is_named(transport):
    spec = ClusterSpec("nobody", 1, 1, "tcp://127.0.0.1:9", timeouts=QUICK)
    start = time.monotonic()
    with pytest.raises(shoal.ClusterError, match=r"rendezvous at tcp://127.0.0.1:9 did not answer"):
        Worker(spec, 0, 0, transport)
    assert time.monotonic() - start < 5


def test_a_barrier_that_cannot_complete_names_the_missing_ranks():
    with ThreadCluster(nodes=1, workers_per_node=2, timeouts=QUICK) as c:
        w = c.worker(0)
        with pytest.raises(shoal.RequestTimeoutError, match=r"arrived rank\(s\) \[0\], missing rank\(s\) \[1\]"):
            w.barrier()


def test_a_dead_server_makes_requests_time_out_naming_it():
    with ThreadCluster(nodes=2, timeouts=QUICK) as c:
        w = c.worker(0, local_access=False)
        t = w.table("t", 10, 2)
        c.servers[1].stop()
        c.threads[1].join(timeout=5)
        with pytest.raises(shoal.RequestTimeoutError, match=r"PULL of 5 key\(s\) of 't'.*peer 1"):
            t.pull(np.arange(10))


def test_a_worker_leaving_does_not_wait_for_a_dead_servers_acknowledgement_of_its_last_clock():
    # It waited the whole 5 s for a server the rendezvous already called dead.
    with ThreadCluster(nodes=2, timeouts=Timeouts(connect_s=30.0, request_s=30.0, barrier_s=30.0)) as c:
        w = c.worker(0, local_access=False)
        w.table("t", 10, 2)
        c.servers[1].stop()
        c.threads[1].join(timeout=5)
        deadline = time.monotonic() + 20
        while membership.status(w.tracker, 5.0)["alive"][1] and time.monotonic() < deadline:
            time.sleep(0.1)
        started = time.monotonic()
        w.shutdown()
        assert time.monotonic() - started < 4.0


def test_a_worker_leaving_waits_for_a_live_server_whose_acknowledgement_needs_a_request_sent_again():
    # The worker's last tick before it leaves is lost on its way: the server holds the final clock
    # behind it until it is sent again (about a second). The worker looked for 0.5 s, which forgot
    # the final clock's request, then found nothing left to wait for and closed: the tick never went
    # again, and the server counted the worker at its earlier clock until the request timeout.
    lost: list[dict] = []

    def lose_the_first_tick(header: dict) -> bool:
        if header["op"] == int(Op.CLOCK) and not (header["body"] or {}).get("final") and not lost:
            lost.append(header)
            return True
        return False

    timeouts = Timeouts(connect_s=30.0, request_s=30.0, barrier_s=30.0)
    with ThreadCluster(nodes=1, transport=LosingTransport(ZmqTransport(), lose_the_first_tick), timeouts=timeouts) as c:
        w = c.worker(0, local_access=False)
        w.table("t", 10, 2, consistency=shoal.BSP())
        w.advance_clock()  # lost
        w.shutdown()
        assert lost
        wait_until(lambda: c.servers[0].sync.clocks.learned[0] == FINISHED, timeout=3.0,
                   what="the server counting the worker as finished")


def test_init_outside_a_launcher_names_the_missing_variable(monkeypatch):
    for name in ("SHOAL_CLUSTER_ID", "SHOAL_RENDEZVOUS", "SHOAL_NUM_NODES"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(shoal.ConfigError, match="SHOAL_CLUSTER_ID is not set"):
        shoal.init()


def test_bad_environment_values_are_named():
    env = {"SHOAL_CLUSTER_ID": "c", "SHOAL_NUM_NODES": "two", "SHOAL_WORKERS_PER_NODE": "1",
           "SHOAL_RENDEZVOUS": "tcp://127.0.0.1:1", "SHOAL_NODE": "0", "SHOAL_RANK": "0"}
    with pytest.raises(shoal.ConfigError, match="SHOAL_NUM_NODES must be an integer, got 'two'"):
        role_from_env(server=False, env=env)
    env["SHOAL_NUM_NODES"] = "1"
    env["SHOAL_RANK"] = "5"
    with pytest.raises(shoal.ConfigError, match=r"SHOAL_RANK=5 is outside \[0, 1\)"):
        role_from_env(server=False, env=env)


def test_a_server_refuses_a_non_loopback_bind_without_a_secret(transport):
    spec = ClusterSpec("open", 1, 1, "tcp://127.0.0.1:1")
    with pytest.raises(shoal.ConfigError, match="not loopback: that needs a shared secret"):
        ParameterServer(0, spec, transport, bind="tcp://0.0.0.0:0", share_memory=False)


@pytest.mark.parametrize("order", ["finished first", "waiting first"])
def test_a_barrier_waiting_for_a_finished_worker_fails_at_once_naming_it(order):
    slow = Timeouts(connect_s=10.0, request_s=10.0, barrier_s=60.0)
    with ThreadCluster(nodes=1, workers_per_node=3, timeouts=slow) as c:
        w0, w1, w2 = c.all_workers()
        if order == "finished first":
            w2.shutdown()
        else:
            threading.Timer(0.3, w2.shutdown).start()
        errors: list[BaseException] = []
        waiter = threading.Thread(target=lambda: _barrier_error(w1, errors))
        waiter.start()
        start = time.monotonic()
        with pytest.raises(shoal.ClusterError, match=r"barrier 1 cannot complete: rank\(s\) \[2\] finished"):
            w0.barrier()
        waiter.join(timeout=10)
        assert time.monotonic() - start < 5
        assert len(errors) == 1 and isinstance(errors[0], shoal.ClusterError)


def _barrier_error(worker, errors):
    try:
        worker.barrier()
    except shoal.ShoalError as exc:
        errors.append(exc)


def test_barrier_notes_are_typed_and_a_malformed_one_is_not_passed_on():
    with ThreadCluster(nodes=1, workers_per_node=2) as c:
        w0, w1 = c.worker(0), c.worker(1)
        heard: list[dict[int, BarrierNote]] = []
        t = threading.Thread(target=lambda: heard.append(w1.barrier()))
        t.start()
        assert shoal.BarrierNote is BarrierNote  # what a user builds a note with
        assert w0.barrier(BarrierNote(False, "disk full")) == {0: BarrierNote(False, "disk full")}
        t.join(timeout=30)
        assert heard == [{0: BarrierNote(False, "disk full")}]
        # A note of the wrong type (the string an older worker sent, say) fails the declaration of
        # BARRIER: refused, typed, before the rendezvous counts the rank as arrived.
        generation = 2
        t = threading.Thread(target=lambda: heard.append(w1.barrier()))
        t.start()
        with pytest.raises(ProtocolError, match="note"):
            membership.call(w0.tracker, RENDEZVOUS, Message(Op.BARRIER, body={
                "rank": 0, "generation": generation, "note": "ok:/tmp/x"}), 30, "barrier")
        # A mapping that is no note reaches nobody.
        reply = membership.call(w0.tracker, RENDEZVOUS, Message(Op.BARRIER, body={
            "rank": 0, "generation": generation, "note": {"ok": "yes"}}), 30, "barrier")
        t.join(timeout=30)
        assert reply.body["notes"] == {} and heard[-1] == {}


def test_a_server_hears_of_a_server_that_registers_while_its_heartbeat_is_held(transport, monkeypatch):
    # A server's heartbeat is a long poll the rendezvous holds until it has a move for it; a server
    # registering meanwhile went unseen until the poll ran out (0.4 s, then the next heartbeat), and
    # so did every placement message for it (a Kinships job's set-up waited 0.4 s on that).
    from shoal.cluster import rendezvous as rendezvous_module
    from shoal.server import server as server_module

    monkeypatch.setattr(rendezvous_module, "_POLL_S", 60.0)  # held far longer than the waits below
    monkeypatch.setattr(server_module, "_HEARTBEAT_S", 60.0)
    rendezvous = Rendezvous(transport, Codec(), "tcp://127.0.0.1:0", "late", 2, 1).start()
    spec = ClusterSpec("late", 2, 1, rendezvous.address)
    servers = [ParameterServer(n, spec, transport) for n in range(2)]
    threads = [threading.Thread(target=s.run, daemon=True) for s in servers]
    try:
        threads[0].start()
        deadline = time.monotonic() + 20
        while 0 not in rendezvous._polls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert 0 in rendezvous._polls, "server 0's heartbeat was never held"
        threads[1].start()
        while 1 not in servers[0].peers.addresses and time.monotonic() < deadline:
            time.sleep(0.01)
        assert 1 in servers[0].peers.addresses
        # and it polls again at once, not a heartbeat period later: the job's end (or a move for it)
        # comes as the answer of a held poll
        while 0 not in rendezvous._polls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert 0 in rendezvous._polls
    finally:
        for s in servers:
            s.stop()
        for t in threads:
            if t.is_alive() or t.ident is not None:
                t.join(timeout=5)
        rendezvous.stop()


def test_a_held_heartbeat_from_a_server_that_missed_a_registration_is_answered_at_once(transport, monkeypatch):
    # A server's first long poll reached the rendezvous after another server had registered, but
    # after the answer it had read: held, it left the server without that server's address (and
    # its placement messages for it queued) until the poll ran out. One Kinships job in three on
    # 2 nodes spent 0.45 s setting up instead of 0.08.
    from shoal.api.ids import server_sender
    from shoal.cluster import rendezvous as rendezvous_module
    from shoal.cluster.requests import RequestTracker
    from shoal.wire import bodies

    monkeypatch.setattr(rendezvous_module, "_POLL_S", 60.0)
    rendezvous = Rendezvous(transport, Codec(), "tcp://127.0.0.1:0", "behind", 2, 1).start()
    trackers = [RequestTracker(transport, Codec(), sender=server_sender(n)) for n in range(2)]
    try:
        for tracker in trackers:
            tracker.connect(RENDEZVOUS, rendezvous.address)
        seen = membership.register(trackers[0], "server", 0, 0, "tcp://127.0.0.1:1", 10)["incarnations"]
        membership.register(trackers[1], "server", 1, 1, "tcp://127.0.0.1:2", 10)  # after server 0 read its status

        poll = bodies.ClusterStatus("server", 0, poll=True, registered=sum(seen)).to_message()
        start = time.monotonic()
        status = membership.call(trackers[0], RENDEZVOUS, poll, 10).body
        assert time.monotonic() - start < 5  # not held for _POLL_S
        assert status["servers"] == ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]
        assert status["poll_again"]  # and it polls again at once: a job ending meanwhile answers that poll

        # Knowing every registration, its poll is held as before.
        poll = bodies.ClusterStatus("server", 0, poll=True, registered=sum(status["incarnations"])).to_message()
        req = trackers[0].request(RENDEZVOUS, poll, lambda reply: None, "a held poll")
        deadline = time.monotonic() + 10
        while 0 not in rendezvous._polls and time.monotonic() < deadline:
            trackers[0].pump(0.01)
        assert 0 in rendezvous._polls and not trackers[0].done({req})
    finally:
        for tracker in trackers:
            tracker.close()
        rendezvous.stop()
