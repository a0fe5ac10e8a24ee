"""Requests that are lost, duplicated or reordered: sent again until answered, served exactly once."""

from __future__ import annotations

import threading
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import shoal
from shoal.api.config import Limits, Timeouts
from shoal.cluster.replay import ENTRIES, PER_STREAM, REPLY_BYTES, STREAMS, ReplayGuard, Verdict, new_incarnation
from shoal.cluster.requests import RESEND_BYTES_PER_S, RESEND_MIN_S, RequestTracker, RoundTrip
from shoal.transport.faulty import Faults, FaultyTransport
from shoal.transport.zmq_transport import ZmqTransport
from shoal.wire.codec import Codec
from shoal.wire.message import Message
from shoal.wire.ops import Op
from tests.support.clock import ManualClock
from tests.support.cluster import ThreadCluster
from tests.support.losing import workers_with_losses

A = new_incarnation()
B = new_incarnation()


def test_a_repeat_is_dropped_while_served_and_answered_again_after():
    guard = ReplayGuard(per_stream=3, reply_bytes=10)
    assert guard.admit(0, A, 1) == (Verdict.NEW, None)
    assert guard.admit(0, A, 1) == (Verdict.IN_PROGRESS, None)
    assert guard.admit(0, B, 1) == (Verdict.NEW, None)  # requests are told apart per stream
    guard.answered(A, 1, [b"reply"], 5)
    assert guard.admit(0, A, 1) == (Verdict.ANSWERED, [b"reply"])
    guard.admit(0, A, 2)
    guard.answered(A, 2, [b"another!"], 8)  # over the byte budget together: the oldest reply goes
    assert guard.admit(0, A, 1) == (Verdict.ANSWERED, None)
    assert guard.admit(0, A, 2) == (Verdict.ANSWERED, [b"another!"])
    for req in (3, 4, 5):  # only the last three answered requests per stream are remembered...
        guard.admit(0, A, req)
        guard.answered(A, req, [b"r"], 1)
    assert guard.admit(0, A, 1) == (Verdict.STALE, None)  # ...and the forgotten ones are refused
    assert guard.admit(0, A, 6) == (Verdict.NEW, None)


def test_a_request_being_served_is_never_forgotten():
    """A pull held by its bound, a barrier waiting at the rendezvous: its stream goes quiet, and a
    resend of it must still be recognised, however much else is forgotten meanwhile."""
    guard = ReplayGuard(per_stream=4, entries=8)
    guard.admit(0, A, 1)  # held
    for req in range(2, 200):
        guard.admit(0, A, req)
        guard.answered(A, req, [b"r"], 1)
        guard.admit(1, B, req)
        guard.answered(B, req, [b"r"], 1)
    assert guard.admit(0, A, 1) == (Verdict.IN_PROGRESS, None)
    assert guard.entries <= 8 + 1


def test_a_full_window_trims_the_quiet_streams_without_failing():
    guard = ReplayGuard(per_stream=8, entries=4)  # stream a goes quiet and empty; b keeps asking
    for req in (1, 2):
        guard.admit(0, A, req)
        guard.answered(A, req, [b"r"], 1)
    for req in range(1, 50):
        assert guard.admit(1, B, req) == (Verdict.NEW, None)
        guard.answered(B, req, [b"r"], 1)
    assert guard.entries <= 4
    assert guard.admit(0, new_incarnation(), 1) == (Verdict.NEW, None)


def test_streams_of_one_incarnation_are_told_apart_by_sender():
    guard = ReplayGuard()
    assert guard.admit(0, A, 1) == (Verdict.NEW, None)
    assert guard.admit(1, A, 1) == (Verdict.NEW, None)  # another sender that drew the same incarnation
    guard.answered(A, 1, [b"one"], 3)
    guard.answered(A, 1, [b"two"], 3)
    assert guard.admit(0, A, 1) == (Verdict.ANSWERED, [b"one"])
    assert guard.admit(1, A, 1) == (Verdict.ANSWERED, [b"two"])
    assert guard.admit(0, 0, 1) == (Verdict.STALE, None)  # a stream not born at any time (no incarnation)


def test_junk_from_one_stream_or_from_many_keeps_memory_bounded():
    """100k requests of one stream, then 20k streams of one request each, every one answered with a
    100-byte reply: the guard keeps what its bounds allow, a few MB, not what it was sent."""
    guard = ReplayGuard()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for req in range(1, 100_001):
            guard.admit(0, A, req)
            guard.answered(A, req, [b"r" * 100], 100)
        assert guard.entries <= PER_STREAM + 1  # the newest is trimmed when the next comes
        for i in range(20_000):
            incarnation = new_incarnation()
            guard.admit(i % 64, incarnation, 1)
            guard.answered(incarnation, 1, [b"r" * 100], 100)
        held_mb = (tracemalloc.get_traced_memory()[0] - before) / 2**20
    finally:
        tracemalloc.stop()
    assert guard.streams == STREAMS and guard.entries <= ENTRIES and guard.kept_reply_bytes <= REPLY_BYTES
    assert held_mb < 16, f"{held_mb:.1f} MB held"


def test_a_dropped_stream_is_neither_replayed_nor_refused_when_heard_again():
    guard = ReplayGuard(streams=1, tombstones=1)

    def ask(incarnation: int, req: int) -> Verdict:
        verdict, _ = guard.admit(0, incarnation, req)
        guard.answered(incarnation, req, [b"r"], 1)
        return verdict

    old = new_incarnation()
    ask(old, 1)
    time.sleep(0.002)  # births a millisecond apart
    first = new_incarnation()
    ask(first, 1)  # one stream held: the old one is dropped, its floor kept as a tombstone
    assert ask(old, 1) == Verdict.STALE  # its old request: refused
    assert ask(old, 2) == Verdict.NEW  # its next one: served
    time.sleep(0.002)
    ask(new_incarnation(), 1)  # old is dropped again; one tombstone kept: first's goes, and the
    assert ask(first, 2) == Verdict.STALE  # sender's horizon moves past it
    assert ask(old, 3) == Verdict.NEW  # old's tombstone is the one kept
    assert ask(new_incarnation(), 1) == Verdict.NEW  # a stream born now is welcome
    assert guard.admit(1, first, 1) == (Verdict.NEW, None)  # other senders' horizons did not move


def test_a_sender_that_left_is_forgotten_but_its_goodbye_still_answered():
    guard = ReplayGuard()
    for req in range(1, 101):
        guard.admit(3, A, req)
        guard.answered(A, req, [b"ok"], 2)
    guard.retire(3)
    assert guard.entries == 16
    assert guard.admit(3, A, 100) == (Verdict.ANSWERED, [b"ok"])
    assert guard.admit(3, A, 50) == (Verdict.STALE, None)


def test_counts_stay_exact_when_a_tenth_of_all_messages_are_lost_or_duplicated():
    """Every message, request or reply, between every pair of processes: 10% lost, 10% twice,
    reordered by jitter. Workers push +1 to overlapping keys through the servers; every total is exact."""
    faults = Faults(delay_s=0.0005, jitter_s=0.002, loss=0.1, duplicate=0.1, seed=5)
    transport = FaultyTransport(ZmqTransport(), faults)
    timeouts = Timeouts(connect_s=20.0, request_s=30.0, barrier_s=60.0, resend_s=0.05)
    keys = np.arange(0, 300, 3)

    def body(w):
        table = w.table("counts", 300, 2, mapping="hash")
        w.barrier()
        for _ in range(10):
            pushes = [table.push_async(keys, np.ones((keys.size, 2), np.float32)) for _ in range(5)]
            for p in pushes:
                p.wait()
        w.barrier()
        return table.pull(np.arange(300)), w.tracker.resent

    with ThreadCluster(nodes=2, workers_per_node=2, transport=transport, timeouts=timeouts) as cluster:
        results = cluster.run_workers(body, local_access=False)
        repeats = sum(s.stats["repeats_in_progress"] + s.stats["repeats_answered"] for s in cluster.servers)
    expected = np.zeros((300, 2), np.float32)
    expected[keys] = 4 * 50
    for values, _ in results:
        assert (values == expected).all()
    assert sum(resent for _, resent in results) > 0  # requests or replies were lost, and sent again
    assert repeats > 0  # and servers saw repeats without serving them twice


def test_the_resend_timeout_follows_the_peers_round_trips_within_its_bounds():
    trip = RoundTrip()
    assert trip.timeout(1.0) == 1.0  # nothing timed yet: the configured timeout
    for _ in range(20):
        trip.observe(0.002)
    assert trip.timeout(1.0) == RESEND_MIN_S  # fast and steady: the floor, never sooner
    for rtt in (0.05, 0.4, 0.02, 0.6):
        trip.observe(rtt)
    assert RESEND_MIN_S < trip.timeout(1.0) < 1.0  # slow and jittery: later
    assert trip.timeout(0.1) == 0.1  # and never later than configured


def test_a_lost_request_is_sent_again_after_the_peers_round_trip_not_the_configured_timeout():
    """The peer answers the first requests at once, then ignores one request's first copy: its
    repeat comes after about the floor of the learned timeout, well before the configured 1 s."""
    transport = ZmqTransport()
    listener = transport.listen("tcp://127.0.0.1:0")
    codec = Codec(Limits())
    tracker = RequestTracker(transport, codec, sender=0, resend_s=1.0)
    tracker.connect(1, listener.address)
    seen: list[tuple[int, float]] = []

    def serve() -> None:
        answered: set[int] = set()
        while len(seen) < 22:
            item = listener.recv(5.0)
            if item is None:
                return
            peer, frames = item
            msg = codec.decode(frames)
            seen.append((msg.req, time.monotonic()))
            if msg.req <= 20 or msg.req in answered:
                listener.send(peer, codec.encode(msg.reply(Op.OK)))
            else:
                answered.add(msg.req)  # the first copy of request 21 is "lost"

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        for _ in range(20):
            req = tracker.request(1, Message(Op.PING), lambda _: None)
            tracker.wait({req}, 5.0)
        lost = tracker.request(1, Message(Op.PING), lambda _: None)
        tracker.wait({lost}, 5.0)
    finally:
        server.join(5.0)
        tracker.close()
        listener.close()
        transport.close()
    first, repeat = [at for req, at in seen if req == lost]
    assert tracker.resent == 1
    assert repeat - first < 0.5  # about RESEND_MIN_S (50 ms) on an idle machine; not the configured 1 s


def test_an_unanswered_request_is_sent_again_by_the_trackers_clock_then_twice_as_late():
    clock = ManualClock()
    transport = ZmqTransport()
    listener = transport.listen("tcp://127.0.0.1:0")  # reads, never answers
    codec = Codec(Limits())
    tracker = RequestTracker(transport, codec, sender=0, resend_s=0.5, now=clock)
    tracker.connect(1, listener.address)

    def copies_received() -> list[int]:
        got = []
        while (item := listener.recv(0.2)) is not None:
            got.append(codec.decode(item[1]).req)
        return got

    try:
        req = tracker.request(1, Message(Op.PING), lambda _: None)
        assert copies_received() == [req]
        resent = []
        for step_s in (0.4, 0.2, 0.7, 0.4):  # due at 0.5 s, then 1.0 s after that (at 1.5 s)
            clock.advance(step_s)
            tracker.pump(0)
            resent.append(tracker.resent)
        assert resent == [0, 1, 1, 2]
        assert copies_received() == [req, req]  # the same request, not a new one
    finally:
        tracker.close()
        listener.close()
        transport.close()


def test_a_lost_request_is_sent_again_when_its_timeout_ends_not_at_the_next_look_on_a_grid():
    """Resends were looked for every 50 ms: a request made just after a look and due just before the
    next waited up to 50 ms more than its timeout (under 5% loss, an adaptive job at a third of its
    speed)."""
    clock = ManualClock()
    transport = ZmqTransport()
    listener = transport.listen("tcp://127.0.0.1:0")  # reads, never answers
    tracker = RequestTracker(transport, Codec(Limits()), sender=0, resend_s=1.0, now=clock)
    tracker.connect(1, listener.address)
    try:
        tracker.round_trips[1] = RoundTrip()
        for _ in range(10):
            tracker.round_trips[1].observe(0.001)  # answered at once so far: due after RESEND_MIN_S
        tracker.pump(0)
        clock.advance(0.01)
        tracker.request(1, Message(Op.PING), lambda _: None)
        clock.advance(RESEND_MIN_S - 0.001)
        tracker.pump(0)
        assert tracker.resent == 0
        clock.advance(0.002)
        tracker.pump(0)
        assert tracker.resent == 1
    finally:
        tracker.close()
        listener.close()
        transport.close()


def test_a_large_read_is_not_sent_again_while_its_reply_could_still_be_arriving():
    transport = ZmqTransport()
    listener = transport.listen("tcp://127.0.0.1:0")
    tracker = RequestTracker(transport, Codec(Limits()), sender=0, resend_s=8.0)
    tracker.connect(1, listener.address)
    try:
        tracker.round_trips[1] = RoundTrip()
        for _ in range(10):
            tracker.round_trips[1].observe(0.001)  # small requests answered at once
        small = tracker.request(1, Message(Op.PING), lambda _: None)
        large = tracker.request(1, Message(Op.PING), lambda _: None, reply_bytes=200_000_000)
        after = {req: tracker._pending[req].resend_at - tracker._pending[req].started for req in (small, large)}
        assert after[small] == pytest.approx(RESEND_MIN_S)
        assert after[large] == pytest.approx(200_000_000 / RESEND_BYTES_PER_S, rel=0.01)  # 4 s at 50 MB/s
    finally:
        tracker.close()
        listener.close()
        transport.close()


def test_a_request_ended_without_a_reply_times_no_round_trip():
    """Requests failed at once (their peer was replaced) are no round trips: taken for ~0 s ones, they
    would bring the resend timeout of a peer that answers in 0.5 s down to the floor."""
    from shoal.api.errors import ClusterError
    from shoal.transport.inproc import InProcTransport

    clock = ManualClock()
    transport = InProcTransport()
    listener = transport.listen("inproc://*")
    tracker = RequestTracker(transport, Codec(Limits()), sender=0, resend_s=1.0, now=clock)
    tracker.connect(1, listener.address)
    try:
        req = tracker.request(1, Message(Op.PING), lambda _: None)
        clock.advance(0.5)
        item = listener.recv(1.0)
        assert item is not None
        listener.send(item[0], Codec(Limits()).encode(Message(Op.OK, req=req)))
        tracker.wait({req}, 5.0)
        for _ in range(20):
            tracker.request(1, Message(Op.PING), lambda _: None)
            tracker.fail_peer(1, ClusterError("server 1 was started again"))
        trip = tracker.round_trips[1]
        assert trip.samples == 1
        assert trip.timeout(1.0) > 0.5
        req = tracker.request(1, Message(Op.PING), lambda _: None)  # an error is an answer: timed
        item = listener.recv(1.0)
        assert item is not None
        listener.send(item[0], Codec(Limits()).encode(Message(Op.ERROR, req=req,
                                                              body={"code": "ClusterError", "message": "no"})))
        with pytest.raises(ClusterError):
            tracker.wait({req}, 5.0)
            raise tracker.take_error(req) or AssertionError("no error kept")
        assert trip.samples == 2
    finally:
        tracker.close()
        listener.close()
        transport.close()


def test_a_push_whose_answer_is_lost_once_is_answered_when_sent_again_on_a_busy_server():
    """A message lost on the way costs a delay, not the request; a repeat of an answered request gets
    the same reply again. Worker 0's push to server 1 is applied and answered; the answer is lost on
    the way back once, while another worker reads 250 x 50 KB from server 1. The server kept replies
    for repeats in one budget, oldest dropped first, the reads' replies with the rest: the push's small
    answer was dropped, and a repeat of an answered PUSH whose reply is gone can only be dropped. The
    push failed with RequestTimeoutError although it was applied (a caller that retried it applied it
    twice). Replies to reads, which are served again, now go first."""
    state: dict[str, Any] = {"armed": False, "lost": 0}
    lose = _lose_one_answer(state, lambda header: header.get("table") == "p")

    timeouts = shoal.Timeouts(connect_s=10.0, request_s=6.0, barrier_s=30.0, resend_s=1.0)
    with ThreadCluster(nodes=2, transport=ZmqTransport(), timeouts=timeouts) as c:
        w0, w1 = workers_with_losses(c, lose)
        t0 = w0.table("p", 400, 64, optimizer=shoal.optim.Sum())
        t1 = w1.table("p", 400, 64, optimizer=shoal.optim.Sum())
        key = np.array([300])  # range mapping over 2 nodes: server 1
        state["armed"] = True
        pending = t0.push_async(key, np.ones((1, 64), np.float32))
        deadline = time.monotonic() + 10
        while not state["lost"] and time.monotonic() < deadline:
            w0.tracker.pump(0.01)
        assert state["lost"] == 1, "the push's answer was never lost: the test did not run its fault"
        assert float(t1.pull(key)[0, 0]) == 1.0  # applied at server 1
        reads = np.arange(200, 400)  # 200 rows x 64 floats: 51 KB, a reply the server keeps
        for _ in range(250):
            t1.pull(reads)
        started = time.monotonic()
        try:
            pending.wait()
        except shoal.ShoalError as exc:
            raise AssertionError(f"the applied push failed after {time.monotonic() - started:.1f}s: {exc!r}") from None
        assert float(t1.pull(key)[0, 0]) == 1.0


def test_a_barrier_whose_answer_is_lost_once_completes_while_others_ask_the_rendezvous():
    """Two workers meet at a barrier; the rendezvous's answer to worker 0 is lost once on the network.
    Before worker 0 sends its barrier request again, worker 1 asks the rendezvous for the cluster
    status a few thousand times. The rendezvous kept replies for repeats in one budget, oldest dropped
    first: the barrier's answer was dropped, and a repeat of an answered request whose reply is gone
    was dropped without a word. Worker 0 waited out the whole barrier timeout although every worker
    reached the barrier. Replies to status and layout reads, served again on a repeat, now go first."""
    state: dict[str, Any] = {"armed": False, "lost": 0}
    lose = _lose_one_answer(state, lambda header: "notes" in (header.get("body") or {}))

    timeouts = shoal.Timeouts(connect_s=10.0, request_s=20.0, barrier_s=25.0, resend_s=1.0)
    with ThreadCluster(nodes=2, transport=ZmqTransport(), timeouts=timeouts) as c:
        w0, w1 = workers_with_losses(c, lose)
        for w in (w0, w1):  # a table of 4000 slices: its layout makes each status reply about 4.6 KB
            w.table("sliced", 40000, 1, slices=4000)
        outcome: list[object] = []

        def meet() -> None:
            started = time.monotonic()
            try:
                w0.barrier()
                outcome.append(time.monotonic() - started)
            except shoal.ShoalError as exc:
                outcome.append(exc)

        state["armed"] = True
        thread = threading.Thread(target=meet)
        thread.start()
        time.sleep(7.5)  # worker 0 waits alone: its resends back off (1, 2, 4 s, then 8 s apart)
        w1.barrier()
        deadline = time.monotonic() + 10
        while not state["lost"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert state["lost"] == 1, "the barrier's answer was never lost: the test did not run its fault"
        for _ in range(3000):  # about 4.6 KB each, kept: 14 MB of replies
            w1.cluster_status()
        thread.join(timeout=60)
        assert outcome and not isinstance(outcome[0], BaseException), \
            f"worker 0's barrier failed although both workers reached it: {outcome[0]!r}"


def test_replies_to_reads_are_dropped_before_a_pushs_when_replies_fill_their_budget():
    """The byte budget of kept replies dropped the oldest first, whatever they answered: a reader's
    replies pushed out a push's acknowledgement, and a repeat of the push could then only be dropped."""
    guard = ReplayGuard(reply_bytes=100)
    push, reads = new_incarnation(), new_incarnation()
    assert guard.admit(0, push, 1)[0] is Verdict.NEW
    guard.answered(push, 1, [b"ack"], 10)
    for req in range(1, 21):
        assert guard.admit(1, reads, req, redoable=True)[0] is Verdict.NEW
        guard.answered(reads, req, [b"rows"], 30)
    assert guard.admit(0, push, 1) == (Verdict.ANSWERED, [b"ack"])
    assert guard.kept_reply_bytes <= 100


def _lose_one_answer(state: dict[str, Any], which: Callable[[dict], bool]) -> Callable[[dict], bool]:
    """Loses the first OK answer ``which`` picks once ``state["armed"]``, counting it in ``state["lost"]``."""
    def lose(header: dict) -> bool:
        if state["armed"] and header["op"] == int(Op.OK) and which(header):
            state["armed"] = False
            state["lost"] += 1
            return True
        return False

    return lose
