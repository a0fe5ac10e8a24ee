"""Slice moves meeting drains and dead servers: held reads are answered, later moves are not held behind a
dead one, a drain completes whatever was on its way to the server."""

from __future__ import annotations

import time

import numpy as np
import pytest

import shoal
from shoal.api.consistency import BSP
from shoal.transport.zmq_transport import ZmqTransport
from tests.support.cluster import ThreadCluster
from tests.support.waiting import wait_until

KEYS = 400


def _table(w, **options):
    return w.table("moving", KEYS, 4, optimizer=shoal.optim.Sum(), slices=8, **options)


def _every_key_counted_once(t, what: str) -> None:
    """A push of 1 to every key of ``t`` (a fresh 1-wide table) reads back as 1 everywhere."""
    keys = np.arange(KEYS)
    errors = []
    try:
        t.push(keys, np.ones((KEYS, 1), np.float32))
        got = t.pull(keys)[:, 0]
    except shoal.ShoalError as exc:
        errors.append(exc)
    assert not errors, f"{what}: {errors[0]!r}"
    np.testing.assert_array_equal(got, np.ones(KEYS))


def test_a_pull_held_for_its_bound_at_a_server_being_drained_is_answered_after_it_leaves():
    """Worker 0 reads keys of server 1 at clock 1 under BSP while worker 1 is still at clock 0: the read
    is held at server 1 for the bound. Server 1 is then drained and leaves; worker 1 reaches clock 1.
    The held read counts as handled in server 1's goodbye, so the worker waits for an answer that never
    comes, and the read fails with a request timeout instead of being read where the slice is now."""
    timeouts = shoal.Timeouts(connect_s=10.0, request_s=6.0, barrier_s=20.0)
    with ThreadCluster(nodes=2, transport=ZmqTransport(), timeouts=timeouts) as c:
        w0, w1 = c.worker(0, local_access=False), c.worker(1, local_access=False)
        t0, t1 = _table(w0, consistency=BSP()), _table(w1, consistency=BSP())
        keys = np.arange(KEYS)
        remote = keys[KEYS // 2 :]  # slices 4..7, on server 1
        t1.push(remote, np.ones((remote.size, 4), np.float32))  # clock 0
        w0.advance_clock()
        future = t0.pull_async(remote)  # clock 1: waits at server 1 for worker 1 to reach clock 1
        wait_until(lambda: bool(c.servers[1].tables["moving"].controller.held), what="the read held at server 1")
        w1.remove_server(1)
        c.threads[1].join(timeout=20)
        assert not c.threads[1].is_alive(), "the drained server did not leave"
        w1.advance_clock()
        started = time.monotonic()
        got = future.result()
        assert time.monotonic() - started < timeouts.request_s
        np.testing.assert_array_equal(got, np.ones((remote.size, 4), np.float32))


def test_a_move_whose_old_owner_dies_does_not_stall_every_later_move_of_its_table():
    """Slice 2 of a table starts moving from server 1 to server 2 (its chunks do not arrive), then
    server 1 dies (--on-server-failure continue). The rendezvous never ends that move, and moves are one
    at a time per table: every later move of any slice of the table -- an operator's, the rebalancer's,
    a drain's -- waits behind it forever."""
    import threading

    from shoal.api.errors import ShoalError
    from shoal.wire.ops import Op
    from tests.server.test_slicing import _move
    from tests.support.losing import LosingTransport

    def lose(header: dict) -> bool:
        return header["op"] == int(Op.SLICE_STATE) and header["body"].get("shard") == 2

    timeouts = shoal.Timeouts(connect_s=10.0, request_s=3.0, barrier_s=20.0)
    with ThreadCluster(nodes=3, transport=LosingTransport(ZmqTransport(), lose), timeouts=timeouts) as c:
        w0 = c.worker(0, local_access=False)
        t0 = w0.table("moving", 600, 1, optimizer=shoal.optim.Sum(), slices=6)
        assert t0.layout.owners.tolist() == [0, 0, 1, 1, 2, 2]
        first = threading.Thread(target=lambda: _ignore_errors(_move, c, "moving", 2, 2), daemon=True)
        first.start()
        wait_until(lambda: 2 in c.servers[1].tables["moving"].moving, what="slice 2 moving off server 1")
        c.servers[1].stop()
        c.threads[1].join(timeout=10)
        wait_until(lambda: not c.rendezvous.alive()[1], timeout=10, what="server 1 called dead")
        errors: list[ShoalError] = []
        try:
            w0.move_slice("moving", 0, to=2, timeout=8)
        except ShoalError as exc:
            errors.append(exc)
        assert not errors, f"moving slice 0 (server 0 -> 2, both alive) failed: {errors[0]!r}"
        assert c.rendezvous.slices.describe("moving")["owners"][0] == 2


@pytest.mark.parametrize("death", ["known before the read", "learnt while the read waits"])
def test_a_slice_its_new_owner_took_is_served_there_when_the_old_owner_dies_before_reporting_the_move(death):
    """Slice 2 moves from server 1 to server 2, which takes its last chunk and serves it, but its answer
    never reaches server 1 (lost each time it is sent); server 1 then dies before reporting the move.
    Only the old owner told the rendezvous a move was done, so the rendezvous gave the move up and kept
    naming the dead server 1 as the slice's owner: a read of rows server 2 holds, with every push in
    them, failed as rows gone with their server. And a worker whose layout still named the dead server
    failed the read so without asking where the slice is now."""
    import threading

    from shoal.api.errors import ShoalError
    from shoal.wire.ops import Op
    from tests.server.test_slicing import _move
    from tests.support.losing import LosingTransport

    moves: set[int] = set()

    def lose(header: dict) -> bool:  # the new owner's answers to the chunks of slice 2
        if header["op"] == int(Op.SLICE_STATE) and header["body"].get("shard") == 2:
            moves.add(header["req"])
        return header["op"] == int(Op.OK) and header["req"] in moves and header["table"] == "moving"

    timeouts = shoal.Timeouts(connect_s=10.0, request_s=3.0, barrier_s=20.0)
    with ThreadCluster(nodes=3, transport=LosingTransport(ZmqTransport(), lose), timeouts=timeouts) as c:
        w0 = c.worker(0, local_access=False)
        t0 = w0.table("moving", 600, 1, optimizer=shoal.optim.Sum(), slices=6)
        assert t0.layout.owners.tolist() == [0, 0, 1, 1, 2, 2]
        keys = np.arange(200, 300)  # slice 2
        t0.push(keys, np.ones((keys.size, 1), np.float32))
        threading.Thread(target=lambda: _ignore_errors(_move, c, "moving", 2, 2), daemon=True).start()
        wait_until(lambda: 2 in c.servers[2].tables["moving"].stores, what="slice 2 served at server 2")
        c.servers[1].stop()
        c.threads[1].join(timeout=10)
        c.rendezvous.server_exited(1)  # as its launcher says when the process ends
        wait_until(lambda: not c.rendezvous.alive()[1], timeout=10, what="server 1 called dead")
        wait_until(lambda: "moving" not in c.rendezvous.slices.active, timeout=10, what="the move settled")
        assert c.rendezvous.slices.describe("moving")["owners"][2] == 2
        if death == "known before the read":
            w0.replica_view.refresh(force=True)
            assert 1 in w0.replica_view.exited
        assert t0.layout.owners[2] == 1  # the worker's layout is of before the move
        try:
            got = t0.pull(keys)
        except ShoalError as exc:
            raise AssertionError(f"the rows server 2 holds were not read: {exc!r}") from exc
        np.testing.assert_array_equal(got, np.ones((keys.size, 1), np.float32))


def _ignore_errors(fn, *args):
    try:
        fn(*args)
    except Exception:  # noqa: BLE001
        pass



def _operator(c: ThreadCluster, msg, timeout: float) -> None:
    """An operator outside the job asking the rendezvous for ``msg`` (a move, a drain); returns once done."""
    from shoal.api.ids import OPERATOR, RENDEZVOUS
    from shoal.cluster import membership
    from shoal.cluster.requests import RequestTracker
    from shoal.wire.codec import Codec

    tracker = RequestTracker(c.transport, Codec(c.spec.limits, c.spec.secret), sender=OPERATOR)
    tracker.connect(RENDEZVOUS, c.spec.rendezvous)
    try:
        membership.call(tracker, RENDEZVOUS, msg, timeout, msg.op.name)
    finally:
        tracker.close()


def test_draining_a_server_while_a_slice_is_moving_to_it_completes():
    """Slice 0 is on its way from server 0 to server 1 (its chunks are slow to arrive) when server 1 is
    drained. The drain plans moves for the slices server 1 holds at that moment; the move under way
    is left to finish, so slice 0 lands on server 1 afterwards and nothing ever moves it off: the
    drain never completes (server 1 stays 'leaving', holding slice 0, and never leaves)."""
    import threading

    from shoal.api.errors import ShoalError
    from shoal.wire import bodies
    from shoal.wire.ops import Op
    from tests.support.losing import LosingTransport

    state = {"armed": True}

    def lose(header: dict) -> bool:
        return state["armed"] and header["op"] == int(Op.SLICE_STATE)

    timeouts = shoal.Timeouts(connect_s=10.0, request_s=3.0, barrier_s=20.0)
    with ThreadCluster(nodes=2, transport=LosingTransport(ZmqTransport(), lose), timeouts=timeouts) as c:
        w0 = c.worker(0, local_access=False)
        t0 = w0.table("moving", 400, 1, optimizer=shoal.optim.Sum(), slices=8)
        assert t0.layout.owners.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
        mover = threading.Thread(target=_operator, args=(c, bodies.MoveSlice(0, 1).to_message(table="moving"), 30),
                                 daemon=True)
        mover.start()
        wait_until(lambda: 0 in c.servers[0].tables["moving"].moving, what="slice 0 moving to server 1")
        drained: list[BaseException | None] = []

        def drain() -> None:
            try:
                _operator(c, bodies.Drain(1).to_message(), 15)
                drained.append(None)
            except ShoalError as exc:
                drained.append(exc)

        drainer = threading.Thread(target=drain, daemon=True)
        drainer.start()
        wait_until(lambda: 1 in c.rendezvous.slices.leaving, what="server 1 leaving")
        state["armed"] = False  # the move to server 1 ends now
        mover.join(timeout=30)
        drainer.join(timeout=30)
        owners = c.rendezvous.slices.describe("moving")["owners"]
        assert drained == [None], f"the drain did not complete: {drained!r}; owners {owners}"
        assert 1 not in owners


def test_a_table_created_after_a_server_was_drained_is_served():
    """After ``remove_server(1)`` completed (server 1 handed over its slices and left), a worker creates a
    new static table. The promise: a drained server holds nothing and the job goes on on the others;
    every acknowledged push is counted. Instead the rendezvous laid the new table out over all the nodes
    the job started with, the departed server 1 included: the slices put there had no server. It lays
    it out over the live servers now, and the servers build that layout."""
    timeouts = shoal.Timeouts(connect_s=10.0, request_s=5.0, barrier_s=20.0)
    with ThreadCluster(nodes=2, transport=ZmqTransport(), timeouts=timeouts) as c:
        w0 = c.worker(0, local_access=False)
        w0.table("before", KEYS, 1, optimizer=shoal.optim.Sum(), slices=4)
        w0.remove_server(1)
        c.threads[1].join(timeout=20)
        assert not c.threads[1].is_alive(), "the drained server did not leave"
        t = w0.table("after", KEYS, 1, optimizer=shoal.optim.Sum(), slices=4)
        owners = t.layout.owners.tolist()
        assert owners == [0, 0, 0, 0]
        _every_key_counted_once(t, f"table made after the drain, owners {owners}")


def test_a_table_planned_before_a_drain_and_built_after_it_began_moves_off_the_leaving_server():
    """Worker 0 creates a table: the rendezvous plans it over servers 0 and 1. Before the servers build
    it, server 1 begins to leave (``remove_server(1)`` from worker 1). The drain moved the slices of the
    tables the rendezvous knew, none, and completed at once: server 1 left, and the new table was
    registered with slices on it that no server serves (pushes to them failed). A drain now waits for
    the tables planned over its server to be registered, and moves their slices off too."""
    import threading

    timeouts = shoal.Timeouts(connect_s=10.0, request_s=5.0, barrier_s=20.0)
    with ThreadCluster(nodes=2, transport=ZmqTransport(), timeouts=timeouts) as c:
        w0, w1 = c.worker(0, local_access=False), c.worker(1, local_access=False)
        drained: list[BaseException | None] = []

        def drain() -> None:
            try:
                w1.remove_server(1)
                drained.append(None)
            except shoal.ShoalError as exc:
                drained.append(exc)

        drainer = threading.Thread(target=drain, daemon=True)
        follow = w0.follow_servers

        def drain_after_the_plan(servers):  # the plan's reply is in: server 1 starts leaving now
            drainer.start()
            wait_until(lambda: 1 in c.rendezvous.slices.leaving, what="server 1 leaving")
            time.sleep(0.3)  # time for a drain of nothing to complete (it did at once before)
            return follow(servers)

        w0.follow_servers = drain_after_the_plan
        t = w0.table("planned", KEYS, 1, optimizer=shoal.optim.Sum(), slices=4)
        w0.follow_servers = follow
        assert t.layout.owners.tolist() == [0, 0, 1, 1]  # as planned: the servers built this
        drainer.join(timeout=30)
        assert drained == [None], f"the drain did not complete: {drained!r}"
        c.threads[1].join(timeout=20)
        assert not c.threads[1].is_alive(), "the drained server did not leave"
        assert c.rendezvous.slices.describe("planned")["owners"] == [0, 0, 0, 0]
        _every_key_counted_once(t, "the table planned before the drain")
