"""Replicated tables through real servers (threads): quorums, gossip, read-your-writes, a dead replica."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

import shoal
from shoal.api.config import Timeouts
from shoal.client.replica_view import DOWN_FOR_S
from shoal.client.replicated import QUORUM_EVERY_S
from shoal.transport.zmq_transport import ZmqTransport
from shoal.wire.ops import Op
from tests.support.clock import ManualClock
from tests.support.cluster import ThreadCluster
from tests.support.losing import LosingTransport
from tests.support.waiting import wait_until

QUICK = Timeouts(connect_s=10, request_s=10, barrier_s=10, replica_s=0.5)


def converged(cluster: ThreadCluster, name: str, timeout: float = 5.0) -> list[bytes]:
    """Wait until every replica of every shard holds the same bytes; return them per shard."""
    deadline = time.monotonic() + timeout
    while True:
        per_shard: dict[int, set[bytes]] = {}
        for server in cluster.servers:
            table = server.replication.tables.get(name)
            for shard, replica in (table.replicas.items() if table else []):
                per_shard.setdefault(shard, set()).add(replica.read(np.arange(replica.num_rows)).tobytes())
        if all(len(v) == 1 for v in per_shard.values()) or time.monotonic() > deadline:
            return [next(iter(v)) if len(v) == 1 else b"" for _, v in sorted(per_shard.items())]
        time.sleep(0.02)


@pytest.mark.parametrize("write_quorum, read_quorum", [(1, 1), (1, 3), (2, 2), (3, 1)])
def test_every_quorum_reads_what_was_written_and_replicas_converge(write_quorum, read_quorum):
    with ThreadCluster(nodes=3, timeouts=QUICK) as c:
        w = c.worker(0)
        t = w.table("rep", 90, 2, replicas=3, write_quorum=write_quorum, read_quorum=read_quorum, gossip_ms=10,
                    optimizer=shoal.optim.SGD(lr=1.0))
        keys = np.arange(90)
        for _ in range(4):
            t.push(keys, np.ones((90, 2), np.float32))
        np.testing.assert_array_equal(t.pull(keys), -4.0)  # read-your-writes, whatever the quorums
        assert all(converged(c, "rep"))


def test_reads_merge_replicas_so_a_quorum_of_two_sees_writes_gossip_has_not_spread():
    with ThreadCluster(nodes=3, timeouts=QUICK) as c:
        writer, reader = c.worker(0), c.worker(1)
        spec = dict(replicas=3, gossip_ms=60_000)  # gossip effectively off
        t = writer.table("merge", 30, 1, **spec)
        r1 = reader.table("merge", 30, 1, **spec)
        t.push(np.arange(30), np.ones((30, 1), np.float32))  # lands on the writer's replica (node 0) only
        seen = {float(r1.pull(np.arange(10))[0, 0]) for _ in range(40)}  # R=1 reads a random replica
        assert seen == {0.0, 1.0}
        r3 = reader.table("merge3", 30, 1, **spec, read_quorum=3)
        writer.table("merge3", 30, 1, **spec, read_quorum=3).push(np.arange(30), np.ones((30, 1), np.float32))
        np.testing.assert_array_equal(r3.pull(np.arange(30)), 1.0)  # R=3 merges in the writer's replica


def test_dynamic_quorum_is_chosen_from_the_model_again_as_the_workers_clock_moves():
    clock = ManualClock()
    with ThreadCluster(nodes=3, timeouts=QUICK) as c:
        w = c.worker(0, now=clock)
        t = w.table("dyn", 30, 1, replicas=3, read_quorum=shoal.Dynamic(p=0.9, latency_ms=200), gossip_ms=5)

        def choices() -> int:
            return sum(v for k, v in t.counters.items() if k.startswith("quorum_choice_r"))

        for _ in range(30):
            t.push(np.arange(30), np.ones((30, 1), np.float32))
            t.pull(np.arange(30))
        shards = len(t.access.shards)
        assert choices() == shards  # once per shard at the first read; the clock has not moved since
        shard = t.access.shards[0]
        deadline = time.monotonic() + 20  # gossip has to carry a push first (a loaded machine: a while)
        while True:
            # Pushes go on, as in a job: a replica that caught up by a whole state (one that was not
            # yet known to be alive when the first pushes went out) samples no delay until a next one.
            t.push(np.arange(30), np.ones((30, 1), np.float32))
            clock.advance(QUORUM_EVERY_S)
            t.pull(np.arange(30))
            if shard.measured or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert choices() >= 2 * shards and 1 <= shard.read_quorum <= 3 and shard.predicted


def test_a_dynamic_quorum_reads_every_replica_until_the_model_has_measurements():
    """Before any push, or before gossip has carried one, the model predicts no miss for any R and R=1
    was chosen; pushes that followed within the next 2 s were then missed by most reads (MF on 3
    replicas: 93 reads at R=1 missed 7 pushes on average). With nothing measured, every live replica
    is read, and the model is asked again soon."""
    clock = ManualClock()
    with ThreadCluster(nodes=3, timeouts=QUICK) as c:
        w = c.worker(0, now=clock)
        t = w.table("young", 30, 1, replicas=3, read_quorum=shoal.Dynamic(p=0.5, latency_ms=1000), gossip_ms=5)
        t.pull(np.arange(30))
        shard = t.access.shards[0]
        assert shard.read_quorum == 3 and not shard.measured and t.counters["quorum_unmeasured"] >= 1
        deadline = time.monotonic() + 20  # gossip rounds carry the pushes: delays are sampled
        while not shard.measured and time.monotonic() < deadline:
            t.push(np.arange(30), np.ones((30, 1), np.float32))
            time.sleep(0.02)
            clock.advance(QUORUM_EVERY_S)
            t.pull(np.arange(30))
        assert shard.measured and shard.predicted


def test_a_replica_that_did_not_answer_is_left_alone_for_a_while_on_the_workers_clock():
    clock = ManualClock()
    with ThreadCluster(nodes=3, timeouts=QUICK) as c:
        view = c.worker(0, now=clock).replica_view
        view.mark_down(1)
        assert view.live([0, 1, 2]) == [0, 2]
        clock.advance(DOWN_FOR_S * 0.99)
        assert view.live([0, 1, 2]) == [0, 2] and view.reachable([1]) == [1]  # alive by the heartbeats
        clock.advance(DOWN_FOR_S * 0.02)
        assert view.live([0, 1, 2]) == [0, 1, 2]


def test_reads_and_writes_route_around_a_dead_replica():
    with ThreadCluster(nodes=3, timeouts=QUICK) as c:
        w = c.worker(0)
        t = w.table("fail", 30, 1, replicas=3, write_quorum=2, read_quorum=2, gossip_ms=10)
        t.push(np.arange(30), np.ones((30, 1), np.float32))
        c.servers[1].stop()
        c.threads[1].join(timeout=5)
        for _ in range(3):
            t.push(np.arange(30), np.ones((30, 1), np.float32))
        np.testing.assert_array_equal(t.pull(np.arange(30)), 4.0)
        assert t.counters["replica_timeouts"] >= 1


def test_replicated_tables_check_their_settings():
    with pytest.raises(shoal.ConfigError, match="write_quorum > 1 needs an additive"):
        shoal.TableSpec("x", 10, 1, replicas=3, write_quorum=2, optimizer=shoal.optim.Adagrad())
    with pytest.raises(shoal.ConfigError, match="without a lazy pull buffer"):
        shoal.TableSpec("x", 10, 1, replicas=3, consistency=shoal.SSP(1, lazy=shoal.LazyPull()))
    with pytest.raises(shoal.ConfigError, match="exceeds replicas"):
        shoal.TableSpec("x", 10, 1, replicas=2, write_quorum=3)
    with ThreadCluster(nodes=2, timeouts=QUICK) as c:
        with pytest.raises(shoal.ConfigError, match="wants 3 replicas on 2 server"):
            c.worker(0).table("x", 10, 1, replicas=3)


@pytest.mark.parametrize("write_quorum", [1, 2])
def test_a_push_sent_to_another_replica_when_one_stalls_is_counted_once(write_quorum):
    """A worker's push to a replica that stalls (a GC pause, SIGSTOP) times out and goes to another
    replica; the stalled one applies its queued copy when it resumes. Both are the same numbered
    push of the same worker: every replica counts it once (W=1 counted it twice, once per replica
    that took it)."""
    with ThreadCluster(nodes=3, timeouts=Timeouts(connect_s=10, request_s=10, barrier_s=10, replica_s=0.3)) as c:
        w = c.worker(0)
        t = w.table("stall", 30, 1, replicas=3, write_quorum=write_quorum, gossip_ms=20)
        keys = np.arange(30)
        t.push(keys, np.ones((30, 1), np.float32))
        assert all(converged(c, "stall"))  # gossiped (a push only node 0 had would wait for it)
        stalled, resume = c.servers[0], threading.Event()  # node 0: the worker's first choice
        handle = stalled.handle

        def stall(peer: bytes, frames: list) -> None:
            resume.wait(10)
            handle(peer, frames)

        stalled.handle = stall  # type: ignore[method-assign]
        started = time.monotonic()
        t.push(keys, np.ones((30, 1), np.float32))  # times out on node 0, acknowledged elsewhere
        assert time.monotonic() - started < 1.5 and t.counters["push_failovers"] >= 1
        stalled.handle = handle  # type: ignore[method-assign]
        resume.set()  # node 0 now handles the copy it held
        replicas = converged(c, "stall")
        assert all(replicas)
        for shard_bytes in replicas:
            np.testing.assert_array_equal(np.frombuffer(shard_bytes, np.float32), 2.0)


@pytest.mark.parametrize("write_quorum", [1, 2])
def test_a_restarted_worker_numbers_its_pushes_afresh_and_none_is_taken_for_a_retry(write_quorum):
    """torchrun's elastic agent restarts a worker that died: the new process is a new incarnation of
    its rank (the rendezvous counts them), so its pushes 1, 2, ... are new pushes, not repeats of
    its earlier self's (they were dropped as retries under W > 1)."""
    with ThreadCluster(nodes=3, timeouts=QUICK) as c:
        keys = np.arange(30)
        first = c.worker(0)
        t = first.table("again", 30, 1, replicas=3, write_quorum=write_quorum, gossip_ms=10)
        for _ in range(3):
            t.push(keys, np.ones((30, 1), np.float32))
        first.tracker.close()  # it dies without a word
        restarted = c.worker(0)
        assert restarted.streams.incarnation == first.streams.incarnation + 1
        again = restarted.table("again", 30, 1, replicas=3, write_quorum=write_quorum, gossip_ms=10)
        again.push(keys, np.ones((30, 1), np.float32))
        np.testing.assert_array_equal(again.pull(keys), 4.0)
        assert all(converged(c, "again"))


def test_the_gossip_period_changes_during_training():
    """Gossip every 20 ms, then every 30 s, then every 20 ms again: a push taken by one replica
    reaches another while the period is short, and not within a second while it is long."""
    with ThreadCluster(nodes=2, timeouts=QUICK) as c:
        w = c.worker(0)
        t = w.table("g", 8, 1, replicas=2, gossip_ms=20)
        key = np.array([0])
        access = t.access

        def reaches_the_other_replica(expected: float, within: float = 10.0) -> bool:
            deadline = time.monotonic() + within  # long enough for a loaded machine, short against 30 s
            while time.monotonic() < deadline:
                if access.replica_values(1, key)[0][0, 0] == expected:
                    return True
                time.sleep(0.02)
            return False

        t.push(key, [[1.0]])  # worker 0 writes its own node's replica first
        assert reaches_the_other_replica(1.0)
        t.set_gossip_ms(30_000)
        time.sleep(0.1)  # a round already due may still go
        t.push(key, [[1.0]])
        assert not reaches_the_other_replica(2.0, within=1.0)
        t.set_gossip_ms(20)
        assert reaches_the_other_replica(2.0)
        with pytest.raises(shoal.ConfigError, match=r"gossip_ms must lie in \[1, 60000\]"):
            t.set_gossip_ms(0.5)
        with pytest.raises(shoal.ConfigError, match="not replicated"):
            w.table("plain", 8, 1).set_gossip_ms(20)


def test_a_read_after_an_acknowledged_async_push_holds_it() -> None:
    # The worker's own writes and the replicas holding them were noted when the push was waited for:
    # a read after the acknowledgement, before the wait, read any replica (gossip every 60 s here),
    # which lacked the push.
    with ThreadCluster(nodes=3, timeouts=QUICK) as c:
        w = c.worker(0)
        keys = np.arange(30)
        for i in range(6):  # fresh tables: each first read picks a replica at random
            t = w.table(f"ryw{i}", 30, 1, replicas=3, gossip_ms=60_000, optimizer=shoal.optim.Sum())
            pushed = t.push_async(keys, np.ones((30, 1), np.float32))
            deadline = time.monotonic() + 5
            while not pushed.done() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert pushed.done()
            np.testing.assert_array_equal(t.pull(keys)[:, 0], 1.0)
            pushed.wait()


def test_w2_push_delayed_to_both_replicas_is_given_up_after_an_unrelated_death_yet_acknowledged():
    """W=2 over 3 replicas; replica 2 died long ago (a recorded death). Worker 0's push #2 is lost on
    the way to both of its write replicas (0 and 1) and sent again by the request tracker; push #3
    arrives at both. Each replica holds #3 waiting for #2, sees a death of a replica of the shard,
    asks its only live peer, which lacks #2 as well, and gives #2 up. The resent #2 is then answered
    as 'already applied' by both: an acknowledged W=2 push that no replica ever applied."""
    armed = threading.Event()
    given_up = threading.Event()
    lost = {"n": 0}

    def lose(header: dict[str, Any]) -> bool:
        body = header.get("body") or {}
        if (armed.is_set() and not given_up.is_set() and header.get("op") == int(Op.PUSH)
                and header.get("table") == "w2gap" and body.get("seq") == 2):
            lost["n"] += 1
            return True
        return False

    timeouts = Timeouts(connect_s=10.0, request_s=20.0, barrier_s=20.0, replica_s=8.0)
    with ThreadCluster(nodes=3, transport=LosingTransport(ZmqTransport(), lose), timeouts=timeouts) as c:
        w = c.worker(0, local_access=False)
        keys = np.arange(30)
        t = w.table("w2gap", 30, 1, replicas=3, write_quorum=2, gossip_ms=10, optimizer=shoal.optim.Sum())
        t.push(keys, np.ones((30, 1), np.float32))  # push #1, on replicas 0 and 1
        c.servers[2].stop()  # replica 2 dies: a death of a replica of every shard, recorded by 0 and 1
        c.threads[2].join(timeout=10)
        wait_until(lambda: all(2 in c.servers[n].replication._died_at for n in (0, 1)), timeout=15.0,
                   what="both live replicas seeing replica 2's death")
        armed.set()
        second = t.push_async(keys, np.ones((30, 1), np.float32))  # #2: lost on the way, sent again later
        third = t.push_async(keys, np.ones((30, 1), np.float32))  # #3: arrives, waits for #2
        stats = [c.servers[n].replication.stats for n in (0, 1)]
        # Give the replicas time to give #2 up (they do within a few gossip rounds), then let it through.
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and not all(s["pushes_given_up_with_dead_replica"] for s in stats):
            time.sleep(0.02)
        given_up.set()
        second.wait()  # acknowledged by two replicas
        third.wait()
        assert lost["n"] >= 2
        for node in (0, 1):
            values, version = t.access.replica_values(node, keys)
            # three acknowledged pushes of 1.0 each: every replica must count 3
            assert values[:, 0].tolist() == [3.0] * 30, (node, values[:3, 0].tolist(), version,
                                                         [dict(s) for s in stats])


def test_bounded_read_after_a_worker_restarts_behind_the_slowest_clock_is_not_a_server_failure():
    """SSP(1) on a replicated table; both workers reach clock 5, then worker 1 dies and is started
    again (a new incarnation, at clock 0: its first tick says so). Worker 0's read at clock 5 must
    cover every push before clock 4: it is held until the new worker 1 gets there, as on a static
    table (ClockTable.restart holds readers back again). Instead the server's push counts, whose
    slowest clock never goes back, index past the restarted worker's single tick and the read fails
    with ServerError (an IndexError inside the server)."""
    timeouts = Timeouts(connect_s=10.0, request_s=15.0, barrier_s=15.0)
    model = shoal.SSP(1)
    with ThreadCluster(nodes=2, timeouts=timeouts) as c:
        keys = np.arange(2)

        def make(w):
            return w.table("restart_bound", 2, 1, replicas=2, consistency=model, gossip_ms=10,
                           optimizer=shoal.optim.Sum())

        first = [c.worker(r, local_access=False) for r in (0, 1)]
        tables = [make(w) for w in first]

        def run(rank: int, clocks: int) -> None:
            for _ in range(clocks):
                tables[rank].pull(keys)
                tables[rank].push([rank], [[1.0]])
                first[rank].advance_clock()

        _on_both_ranks(run, 5)
        assert [w.clock for w in first] == [5, 5]
        first[1].tracker.close()  # worker 1 dies without a word
        restarted = c.worker(1, local_access=False)
        assert restarted.streams.incarnation == first[1].streams.incarnation + 1
        again = make(restarted)

        def catch_up() -> None:
            time.sleep(0.5)
            for _ in range(6):
                again.pull(keys)
                again.push([1], [[1.0]])
                restarted.advance_clock()

        helper = threading.Thread(target=catch_up)
        helper.start()
        try:
            seen = tables[0].pull(keys)[:, 0]  # clock 5, bound 1: held until the new worker 1 reaches 4
        finally:
            helper.join(timeout=30)
        assert seen[0] >= 4.0 and seen[1] >= 4.0, seen.tolist()


def test_bounded_read_after_a_worker_restart_still_covers_its_earlier_incarnations_pushes():
    """BSP, W=1, R=1, gossip effectively off. Worker 1 pushes 1.0 to its key at clocks 0, 1, 2 (taken by
    its own node's replica only), then dies and is started again; the new worker 1 catches up to
    clock 4 without pushing. Worker 0's read at clock 3 must hold every update of every worker
    from clocks before 3: worker 1's three pushes. The replicas' push counts dropped the earlier
    incarnation's counts when the new one ticked, so the read no longer requires them and is
    answered by the replica that lacks them."""
    timeouts = Timeouts(connect_s=10.0, request_s=15.0, barrier_s=15.0)
    with ThreadCluster(nodes=2, timeouts=timeouts) as c:
        keys = np.arange(2)

        def make(w):
            return w.table("restart_old", 2, 1, replicas=2, write_quorum=1, read_quorum=1,
                           consistency=shoal.BSP(), gossip_ms=60_000, optimizer=shoal.optim.Sum())

        first = [c.worker(r, local_access=False) for r in (0, 1)]
        tables = [make(w) for w in first]

        def run(rank: int) -> None:
            for _ in range(3):
                tables[rank].push([rank], [[1.0]])
                first[rank].advance_clock()

        _on_both_ranks(run)
        assert [w.clock for w in first] == [3, 3]
        first[1].tracker.close()  # worker 1 dies without a word
        restarted = c.worker(1, local_access=False)
        make(restarted)
        for _ in range(4):
            restarted.advance_clock()  # catches up (nothing pushed): clock 4
        restarted.wait_all()
        seen = tables[0].pull(keys)[:, 0]  # clock 3, BSP: every push of clocks 0..2 of every worker
        assert seen.tolist() == [3.0, 3.0], seen.tolist()


def _on_both_ranks(run: Any, *args: Any) -> None:
    """``run(rank, *args)`` for ranks 0 and 1 at once, each in a thread; returns when both have."""
    threads = [threading.Thread(target=run, args=(r, *args)) for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
