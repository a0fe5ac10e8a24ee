"""Replicated tables through real servers (threads): quorums, gossip, read-your-writes, a dead replica."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import shoal
from shoal.api.config import Timeouts
from shoal.client.replica_view import DOWN_FOR_S
from shoal.client.replicated import QUORUM_EVERY_S
from tests.support.clock import ManualClock
from tests.support.cluster import ThreadCluster

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
