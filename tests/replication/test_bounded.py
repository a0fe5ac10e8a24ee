"""BSP, SSP and ESSP over the multi-master replicated store.

Each worker owns a counter and adds 1 to it every iteration, through a write
quorum of 1: its pushes land on one replica and reach the others by gossip. A
read at clock ``c`` under bound ``s``, from any read quorum (or, under ESSP,
from the rows a replica pushed), must see at least ``c - s`` in every counter:
counting, not agreement between replicas.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import shoal
from shoal import ClusterSpec
from shoal.api.config import TableSpec, Timeouts
from shoal.api.ids import worker_origin
from shoal.client.worker import Worker
from shoal.consistency.clocks import FINISHED
from shoal.replication.bounds import PushCounts
from shoal.server.server import ParameterServer
from shoal.transport.base import Transport
from shoal.transport.faulty import Faults, FaultyTransport
from shoal.transport.zmq_transport import ZmqTransport
from shoal.wire import Message, Op, bodies
from tests.support.cluster import FAST, ThreadCluster

WORKERS = 3

# ----------------------------------------------------------------- pure


def test_a_read_must_cover_every_push_each_worker_made_before_its_clock_minus_the_bound():
    counts = PushCounts(num_workers=2, num_shards=2, bound=1)
    assert counts.required(0, 0) == {} and counts.required(0, 1) is None
    assert not counts.report(0, 7, 1, [3, 0])
    assert counts.report(1, 9, 1, [2, 5])  # every worker has reported clock 1
    assert counts.required(0, 1) == {worker_origin(0, 7): 3, worker_origin(1, 9): 2}
    assert counts.required(1, 1) == {worker_origin(1, 9): 5}  # worker 0 pushed nothing to shard 1
    assert counts.required(0, 2) is None  # worker 1 has not reached clock 2
    counts.report(0, 7, 3, [6, 1])  # clock 2's tick was overtaken: clock 3's counts stand in for it
    counts.report(1, 9, 2, None)  # no push to the table since its last tick
    assert counts.required(0, 2) == {worker_origin(0, 7): 6, worker_origin(1, 9): 2}


def test_a_worker_that_left_holds_nobody_back_and_a_restarted_one_is_a_new_origin_beside_its_earlier_one():
    counts = PushCounts(num_workers=2, num_shards=1, bound=0, start=[4, 4])  # made at clock 4: nothing pushed
    assert counts.required(0, 4) == {}
    counts.report(0, 1, 5, [2])
    assert counts.finish(1, 1, [1])
    assert counts.slowest == 5 and counts.required(0, 5) == {worker_origin(0, 1): 2, worker_origin(1, 1): 1}
    counts.report(0, 2, 6, [1])  # rank 0 started again: its pushes count under a new origin, and its
    # earlier process's still count (reads left them out, and a replica lacking them could answer)
    assert counts.required(0, 6) == {worker_origin(0, 2): 1, worker_origin(0, 1): 2, worker_origin(1, 1): 1}
    assert counts.slowest == 6 and counts.finish(0, 2, None) and counts.slowest == FINISHED


def test_ticks_too_old_to_matter_are_dropped_and_malformed_ones_ignored():
    counts = PushCounts(num_workers=1, num_shards=1, bound=2)
    for clock in range(1, 50):
        counts.report(0, 1, clock, [clock])
    assert counts.required(0, 47) == {worker_origin(0, 1): 47}
    assert len(counts._workers[0].clocks) <= 3
    assert not counts.report(0, 1, 60, [1, 2])  # not one count per shard
    assert not counts.report(5, 1, 60, [1])  # no such worker
    assert counts.slowest == 49


# --------------------------------------------------------- on a cluster


def _counting(model, read_quorum: int = 1, iterations: int = 10, straggle_s: float = 0.02,
              gossip_ms: float = 40.0, transport: Transport | None = None) -> list[dict]:
    def body(w: Worker) -> dict:
        counters = w.table("counters", WORKERS, 1, consistency=model, replicas=3, read_quorum=read_quorum,
                           gossip_ms=gossip_ms)
        violations = []
        pending = []
        for _ in range(iterations):
            clock = w.clock
            seen = counters.pull(np.arange(WORKERS))[:, 0]
            need = clock - model.bound
            if (seen < need).any():
                violations.append((clock, seen.tolist()))
            pending.append(counters.push_async([w.rank], [[1.0]]))  # in flight across the tick
            if w.rank == WORKERS - 1:
                time.sleep(straggle_s)
            w.advance_clock()
        for future in pending:
            future.wait()
        w.barrier()
        for _ in range(model.bound + 1):
            w.advance_clock()
        final = counters.pull(np.arange(WORKERS))[:, 0]  # the bound now covers every push: all of them, once
        return {"violations": violations, "final": final.tolist(), "counters": dict(counters.counters)}

    timeouts = Timeouts(connect_s=20.0, request_s=30.0, barrier_s=60.0, resend_s=0.05) if transport else FAST
    with ThreadCluster(nodes=WORKERS, transport=transport, timeouts=timeouts) as cluster:
        return cluster.run_workers(body)


@pytest.mark.parametrize("model", [shoal.BSP(), shoal.SSP(1), shoal.SSP(3), shoal.ESSP(1), shoal.ESSP(3)],
                         ids=["BSP", "SSP1", "SSP3", "ESSP1", "ESSP3"])
@pytest.mark.parametrize("read_quorum", [1, 2])
def test_no_read_of_a_replicated_table_violates_its_bound(model, read_quorum):
    results = _counting(model, read_quorum)
    for result in results:
        assert result["violations"] == []
        assert result["final"] == [10.0, 10.0, 10.0]
    if model.eager:  # reads the bound allowed came from the rows the replicas pushed: no message
        assert sum(r["counters"].get("eager_reads_served", 0) for r in results) > 0, [r["counters"] for r in results]


def test_essp_reads_stay_within_the_bound_when_pushed_rows_come_twice_or_out_of_order():
    """Every message delayed by up to 2 ms more (so they overtake each other) and a tenth delivered
    twice: pushed rows that arrive after a later message, or twice, must not be taken for current
    (``tests/client/test_replica_cache.py`` counts the cases one by one)."""
    faults = Faults(delay_s=0.0005, jitter_s=0.002, duplicate=0.1, seed=3)
    results = _counting(shoal.ESSP(1), transport=FaultyTransport(ZmqTransport(), faults))
    for result in results:
        assert result["violations"] == []
        assert result["final"] == [10.0, 10.0, 10.0]
    counters = [r["counters"] for r in results]
    assert sum(c.get("eager_reads_served", 0) for c in counters) > 0, counters


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_reads_and_counts_stay_exact_when_a_thirtieth_of_all_messages_are_lost(seed):
    """3% of every message lost, and sent again after its resend timeout. Two faults showed: a read
    answered with per-origin totals (a read of two replicas) was never remembered as answered, so
    every repeat of it after a lost answer was dropped as still in progress and the read timed out;
    and a server took the peers not yet registered when it started for dead ones, so a push that
    arrived before an earlier one (lost, then sent again) was applied past the gap, and the earlier
    one, arriving then, was acknowledged as applied already and never added (a count of 9 of 10)."""
    results = _counting(shoal.SSP(1), transport=FaultyTransport(ZmqTransport(), Faults(loss=0.03, seed=seed)))
    for result in results:
        assert result["violations"] == []
        assert result["final"] == [10.0, 10.0, 10.0]


def test_servers_that_register_after_a_server_are_not_dead_to_it():
    with ThreadCluster(nodes=3, timeouts=FAST) as cluster:
        cluster.worker(0).table("r", 3, 1, replicas=3)
        assert [s.replication._died_at for s in cluster.servers] == [{}, {}, {}]


def test_a_bounded_read_waits_for_gossip_where_its_replicas_lack_updates():
    """With gossip every 300 ms, a replica rarely holds the other workers' latest pushes when a BSP
    read comes: the read asks more replicas, or asks again, until the merge covers them."""
    results = _counting(shoal.BSP(), read_quorum=1, iterations=6, gossip_ms=300.0)
    for result in results:
        assert result["violations"] == [] and result["final"] == [6.0, 6.0, 6.0]
    widened = sum(r["counters"].get("bounded_reads_widened", 0) + r["counters"].get("bounded_reads_again", 0)
                  for r in results)
    assert widened > 0


def test_replicated_tables_take_no_lazy_buffer():
    with pytest.raises(shoal.ConfigError, match="without a lazy pull buffer"):
        shoal.TableSpec("t", 8, 1, replicas=2, consistency=shoal.SSP(1, lazy=shoal.LazyPull()))
    shoal.TableSpec("t", 8, 1, replicas=2, consistency=shoal.ESSP(1))


def test_a_read_held_by_its_bound_does_not_mark_its_replicas_down():
    """A straggler takes 2 s per clock, longer than the replica timeout (0.3 s): BSP reads of the
    others wait that long at replicas that are alive and well. They are waited for, not taken for
    dead (every replica was marked down, reads went round all of them, pushes lost their targets),
    and their waiting is not taken for the replicas' latency."""
    STRAGGLE_S = 2.0  # noqa: N806 (longer than the wait a replica's measured round trips allow, too)

    def body(w: Worker) -> dict:
        t = w.table("slow", WORKERS, 1, consistency=shoal.BSP(), replicas=3, gossip_ms=20)
        seen = []
        for _ in range(3):
            seen.append(t.pull(np.arange(WORKERS))[:, 0].tolist())
            t.push([w.rank], [[1.0]])
            if w.rank == WORKERS - 1:
                time.sleep(STRAGGLE_S)
            w.advance_clock()
        latency = max((max(d.values(), default=0.0) for d in t.access.read_latency.values()), default=0.0)
        return {"seen": seen, "counters": dict(t.counters), "latency": latency}

    quick = Timeouts(connect_s=10, request_s=20, barrier_s=20, replica_s=0.3)
    with ThreadCluster(nodes=WORKERS, timeouts=quick) as cluster:
        results = cluster.run_workers(body)
    for result in results:
        assert all(min(seen) >= clock for clock, seen in enumerate(result["seen"]))  # BSP: every earlier push
        assert result["counters"].get("replica_timeouts", 0) == 0, result["counters"]
        # Round trips as the dynamic quorum's model sees them: not the time reads waited for the straggler.
        assert result["latency"] < STRAGGLE_S / 4, result["latency"]


def test_a_push_waiting_for_one_only_a_peer_had_is_answered_when_that_peer_registered_and_died_unseen():
    """A short job on a busy machine: server 1 registered, took a worker's first push (W=1) and was
    killed before any status that server 0 received called it alive. It died all the same: the
    worker's next push, waiting at server 0 for the first, is given up on and answered, not held
    until the worker's request times out (it was: 120 s, seen under load)."""
    cluster = ClusterSpec("gap", num_nodes=2, workers_per_node=1, rendezvous="tcp://127.0.0.1:1")
    transport = ZmqTransport()
    server = ParameterServer(0, cluster, transport, share_memory=False)
    replies: list[Message] = []
    try:
        service = server.replication
        service.reply = lambda peer, reply: replies.append(reply)
        spec = TableSpec("rep", 4, 1, replicas=2, write_quorum=1)
        service.install(spec, service.build(spec))
        service.on_status({"alive": [True, False], "incarnations": [1, 0]})  # server 0 registers first
        second = bodies.Push(shard=0, seq=2, inc=1, floor=2).to_message(  # push 1 was acknowledged
            table="rep", sender=1, arrays=[np.array([0], np.int64), np.ones((1, 1), np.float32)])
        assert service.handle(b"w1", second) is None  # push 1 went to server 1 only: this one waits
        service.on_status({"alive": [True, False], "incarnations": [1, 1]})  # server 1 came and went
        service.tick()
        assert [r.op for r in replies] == [Op.OK] and replies[0].body["seq"] == 2
        assert service.stats["pushes_given_up_with_dead_replica"] == 1
    finally:
        server.close()
        transport.close()


def test_a_worker_started_again_behind_the_slowest_clock_takes_it_back_and_reads_wait_for_it():
    # Both workers at clock 5; rank 1's new process ticks clock 0. ``slowest`` stayed at 5, and a read
    # at clock 4 looked past the new process's only report: IndexError at the server.
    counts = PushCounts(num_workers=2, num_shards=1, bound=1)
    counts.report(0, 1, 5, [3])
    counts.report(1, 1, 5, [4])
    assert counts.slowest == 5
    assert not counts.report(1, 2, 0, [0])
    assert counts.slowest == 0 and counts.required(0, 4) is None  # held until rank 1 gets there
    assert counts.report(1, 2, 4, [1])
    assert counts.required(0, 4) == {worker_origin(0, 1): 3, worker_origin(1, 1): 4, worker_origin(1, 2): 1}
