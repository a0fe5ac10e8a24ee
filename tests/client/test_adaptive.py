"""Adaptive tables through real servers (threads): relocation, replication, intents, sampling."""

from __future__ import annotations

import secrets
import threading
import time

import numpy as np
import pytest

import shoal
from shoal.placement.adaptive_table import Effects, Send
from shoal.placement.intent import ANNOUNCEMENTS_PER_PROCESS_BITS
from shoal.placement.messages import Replicate
from shoal.server.metrics import server_families
from shoal.server.server import ParameterServer
from shoal.storage.kernels import ABSENT, OWNED, REPLICA
from shoal.transport.faulty import Faults, FaultyTransport
from shoal.transport.zmq_transport import ZmqTransport
from shoal.wire.ops import Op
from tests.support.clock import ManualClock
from tests.support.cluster import ThreadCluster
from tests.support.losing import LosingTransport
from tests.support.waiting import wait_until


def test_localize_moves_keys_and_later_access_is_local():
    with ThreadCluster(nodes=2) as c:
        w0, w1 = c.worker(0), c.worker(1)
        t0 = w0.table("a", 20, 2, techniques="relocation", init=shoal.Constant(1.0))
        t1 = w1.table("a", 20, 2, techniques="relocation", init=shoal.Constant(1.0))
        odd = np.arange(1, 20, 2)  # home node 1
        t0.push(odd, np.ones((10, 2), np.float32))
        t0.localize(odd)
        wait_until(lambda: c.servers[0].adaptive.describe()["a"]["owned"] == 20)
        before = t0.counters["requests"]
        np.testing.assert_array_equal(t0.pull(odd), 2.0)
        assert t0.counters["requests"] == before  # all local now
        t1.push(odd, np.ones((10, 2), np.float32))  # node 1 follows the keys to node 0
        np.testing.assert_array_equal(t1.pull(np.arange(20))[odd], 3.0)
        # Their home moved them: its workers read where from the node's cache, no "moved" answer.
        assert t1.counters["moved_retries"] == 0



def test_a_push_nobody_waits_for_follows_moved_keys_and_lands_once():
    # A push's keys answered "moved" were sent again only while its caller waited for it: a push
    # started and never waited for (the usual asynchronous loop) lost those keys' updates, and a
    # barrier after it did not wait for them.
    with ThreadCluster(nodes=3) as c:
        w0 = c.worker(0)
        t0, t1 = w0.table("k", 30, 1, techniques="relocation"), c.worker(1).table("k", 30, 1, techniques="relocation")
        c.worker(2).table("k", 30, 1, techniques="relocation")
        keys = np.arange(2, 30, 3)  # home node 2; node 0's worker believes they are there
        t1.localize(keys)
        wait_until(lambda: c.servers[1].adaptive.describe()["k"]["owned"] == 20)
        for _ in range(5):
            t0.push_async(keys, np.ones((10, 1), np.float32))  # answered "moved" by node 2, never waited for
        w0.wait_all()
        np.testing.assert_array_equal(t1.pull(keys), 5.0)  # every push exactly once, read on node 1's rows
        assert t0.counters["moved_retries"] >= 1


def test_relocated_keys_are_counted_in_the_servers_metrics():
    # The counters of keys moved lived with each table, while the metrics read the service's: the
    # family shoal_server_relocated_keys_total stayed at zero however many keys moved.
    with ThreadCluster(nodes=2) as c:
        t0 = c.worker(0).table("a", 20, 2, techniques="relocation")
        c.worker(1).table("a", 20, 2, techniques="relocation")
        t0.localize(np.arange(1, 20, 2))  # the ten keys homed on node 1
        wait_until(lambda: c.servers[0].adaptive.describe()["a"]["owned"] == 20)

        def relocated(server: int) -> dict[str, float]:
            (family,) = [f for f in server_families(c.servers[server]) if f.name == "shoal_server_relocated_keys_total"]
            return {labels["direction"]: value for labels, value in family.samples}

        assert relocated(0) == {"here": 10, "away": 0} and relocated(1) == {"here": 0, "away": 10}


def test_the_placement_messages_a_server_sends_are_counted_by_kind_with_their_keys_and_bytes():
    with ThreadCluster(nodes=2) as c:
        t0 = c.worker(0).table("a", 20, 2, techniques="relocation")
        c.worker(1).table("a", 20, 2, techniques="relocation")
        t0.localize(np.arange(1, 20, 2))  # node 0 asks their home, node 1, which owns them and gives them
        wait_until(lambda: c.servers[0].adaptive.describe()["a"]["owned"] == 20)

        def sent(server: int, what: str) -> dict[str, float]:
            name = f"shoal_server_placement_{what}_sent_total"
            (family,) = [f for f in server_families(c.servers[server]) if f.name == name]
            return {labels["kind"]: value for labels, value in family.samples if value}

        assert sent(0, "messages") == {"relocate": 1} and sent(0, "keys") == {"relocate": 10}
        assert sent(0, "bytes") == {"relocate": 10 * 8}
        # Its state: per key the key, its row (2 float32), interest, a number per node, replicas, epoch, step.
        assert sent(1, "messages") == {"state": 1} and sent(1, "keys") == {"state": 10}
        assert sent(1, "bytes") == {"state": 10 * (8 + 2 * 4 + 8 + 2 * 8 + 8 + 8 + 8)}
        events = [f for f in server_families(c.servers[1]) if f.name == "shoal_server_events_total"]
        assert not [labels for f in events for labels, _ in f.samples if "state" in labels["event"]]
        rows_cpu = "shoal_server_placement_rows_cpu_seconds_total"
        for server in c.servers:  # the rows given, and taken in
            (family,) = [f for f in server_families(server) if f.name == rows_cpu]
            assert family.samples[0][1] > 0


def test_each_kind_of_placement_message_is_charged_its_cpu_where_it_is_received():
    with ThreadCluster(nodes=2) as c:
        t0 = c.worker(0).table("a", 20, 2, techniques="relocation")
        c.worker(1).table("a", 20, 2, techniques="relocation")
        t0.localize(np.arange(1, 20, 2))  # node 0 asks their home, node 1, which owns them and gives them

        def received() -> list[dict[str, int]]:
            return [{kind: count for kind, (count, _) in s.cpu_use()["placement"].items()} for s in c.servers]

        # A message is charged once handled: the rows of a state are in before its charge, and a test
        # that looked only at the rows could read the account in between (it failed once in a suite run).
        wait_until(lambda: c.servers[0].adaptive.describe()["a"]["owned"] == 20 and "state" in received()[0])
        assert received() == [{"state": 1}, {"relocate": 1}]
        assert c.servers[0].cpu_use()["activities"]["LOCALIZE"][0] == 1

def test_the_adaptive_timers_passes_are_charged_by_whether_they_sent_placement_messages():
    with ThreadCluster(nodes=2) as c:
        c.worker(0).table("b", 8, 2, techniques="replication", init=shoal.Constant(1.0))
        c.servers[0].adaptive.carry_out(Effects(sends=[Send("b", 1, Replicate(np.array([0]), np.ones((1, 2),
                                                                                                np.float32)))]))

        def passes() -> dict[str, int]:
            return {outcome: count for outcome, (count, _) in c.servers[1].cpu_use()["adaptive_passes"].items()}

        # Node 1 has no interest in the replica it was given: its next sync sends it back, a pass that
        # sends; the passes around it find nothing due.
        wait_until(lambda: passes().get("sent placement messages", 0) >= 1 and passes().get("nothing due", 0) >= 1)
        counted = sum(passes().values())
        timer_runs = c.servers[1].cpu_use()["activities"]["timer adaptive"][0]
        assert counted <= timer_runs + 1  # a pass inside each run of the timer (the one running may be half-charged)
        metric = "shoal_server_adaptive_pass_cpu_seconds_total"
        (family,) = [f for f in server_families(c.servers[1]) if f.name == metric]
        assert {labels["outcome"] for labels, _ in family.samples} >= {"sent placement messages", "nothing due"}


def test_what_one_event_sends_one_node_goes_as_one_message():
    with ThreadCluster(nodes=2) as c:
        c.worker(0).table("b", 8, 2, techniques="replication", init=shoal.Constant(1.0))
        rows = np.ones((1, 2), np.float32)
        sends = [Send("b", 1, Replicate(np.array([key]), rows)) for key in (0, 2, 4)]  # keys homed on node 0
        before = c.servers[0].adaptive.stats["placement_messages_sent"]
        held_before = c.servers[1].adaptive.stats["replicas_held"]

        c.servers[0].adaptive.carry_out(Effects(sends=sends))
        # Counted at once: once node 1 holds the replicas, its first sync has node 0 answer it, which
        # is another placement message.
        assert c.servers[0].adaptive.stats["placement_messages_sent"] - before == 1

        # Counted, not seen: node 1 has no interest in these keys, so its replicas go with their first
        # sync, which a busy machine can finish between two looks at their presence.
        wait_until(lambda: c.servers[1].adaptive.stats["replicas_held"] - held_before >= 3)
        assert c.servers[1].adaptive.stats["replicas_held"] - held_before == 3


def test_requests_during_a_move_are_answered_and_lose_nothing():
    with ThreadCluster(nodes=2) as c:
        w0, w1 = c.worker(0), c.worker(1)
        t0 = w0.table("m", 200, 1, techniques="relocation")
        t1 = w1.table("m", 200, 1, techniques="relocation")
        keys = np.arange(200)
        for i in range(20):
            (t0 if i % 2 else t1).localize(keys)  # keys keep moving back and forth
            t0.push(keys, np.ones((200, 1), np.float32))
            t1.push(keys, np.ones((200, 1), np.float32))
            t0.pull(keys)
        wait_until(lambda: sum(s.adaptive.describe()["m"]["owned"] for s in c.servers) == 200)
        np.testing.assert_array_equal(t0.pull(keys)[:, 0], 40.0)
        np.testing.assert_array_equal(t1.pull(keys)[:, 0], 40.0)


@pytest.mark.parametrize("technique", ["replication", "auto"])
def test_intents_replicate_hot_keys_and_counts_stay_exact(technique):
    with ThreadCluster(nodes=2) as c:
        def body(w):
            t = w.table("hot", 40, 1, techniques=technique, sync_ms=5)
            hot = np.arange(10)
            for clock in range(30):
                if clock < 20:
                    t.intent(hot, clock + 1, clock + 3)
                t.push(hot, np.ones((10, 1), np.float32))
                w.advance_clock()
                time.sleep(0.005)
            w.barrier()
            return dict(t.counters)

        counters = c.run_workers(body)
        stats = [s.adaptive.describe()["hot"] for s in c.servers]
        assert sum(s.get("replicas_made", 0) for s in stats) > 0

        w = c.worker(0)
        t = w.table("hot", 40, 1, techniques=technique, sync_ms=5)
        wait_until(lambda: sum(s.adaptive.describe()["hot"]["replicas"] for s in c.servers) == 0)
        np.testing.assert_array_equal(t.pull(np.arange(10))[:, 0], 60.0)
        assert all(cn["rows_local"] > 0 for cn in counters)


@pytest.mark.parametrize("technique", ["replication", "relocation", "auto"])
def test_counts_stay_exact_over_a_network_that_loses_repeats_and_reorders_messages(technique):
    """Placement messages between servers carry the only copy of rows (a key's state, a replica's
    change): over a network losing 5% of all messages (and repeating and reordering some), every
    push still counts once and every replica gets the answer to its last sync and goes. Before
    servers kept each placement message until acknowledged, replicas waited for a lost sync's
    answer for good (replication failed 4 runs of 4 at 3% loss) and a push waited for keys whose
    state message was lost."""
    seed = secrets.randbelow(1 << 30)
    lossy = FaultyTransport(ZmqTransport(), Faults(loss=0.05, duplicate=0.02, jitter_s=0.003, seed=seed))
    timeouts = shoal.Timeouts(connect_s=10.0, request_s=30.0, barrier_s=60.0)  # a lost answer waits its resend
    keys = np.arange(20)
    with ThreadCluster(nodes=2, transport=lossy, timeouts=timeouts) as c:
        def body(w):
            t = w.table("hot", 40, 1, techniques=technique, sync_ms=5)
            for clock in range(40):
                if clock < 30:  # the nodes swap halves of the keys every three clocks
                    t.intent(keys[(clock // 3 + w.rank) % 2::2], clock + 1, clock + 2)
                t.push(keys, np.ones((20, 1), np.float32))
                w.advance_clock()
                time.sleep(0.003)
            w.barrier()

        c.run_workers(body)
        t = c.worker(0).table("hot", 40, 1, techniques=technique, sync_ms=5)
        wait_until(lambda: sum(s.adaptive.describe()["hot"]["replicas"] for s in c.servers) == 0, timeout=30,
                   what=f"every replica's last sync answered (faults seeded {seed})")
        np.testing.assert_array_equal(t.pull(keys)[:, 0], 80.0, err_msg=f"faults seeded {seed}")
        moved = sum(s.adaptive.stats[k] for s in c.servers for k in ("keys_relocated_here", "replicas_made"))
        assert moved > 0  # (intents go one way, unacknowledged: some are lost, and their moves with them)


@pytest.mark.heavy
def test_counts_stay_exact_when_the_servers_cannot_hear_each_other_for_seconds():
    """Every placement message between the two servers lost for 2.5 s in the middle of a job of 300
    clocks (the nodes swapping halves of 200 keys every three clocks), then the link back: once the
    servers have settled (no replica left, no sync unanswered, nothing unacknowledged), each key holds
    every push. Settled means all three: in most runs a replica became the row (its key's state
    arrived) while its last sync, 239 pushes, still waited behind a message lost in the cut, so with
    every replica gone half the keys read 239 short until that sync landed a moment later."""
    cut = threading.Event()
    lossy = LosingTransport(ZmqTransport(), lambda header: cut.is_set() and header["op"] == int(Op.PLACEMENT))
    timeouts = shoal.Timeouts(connect_s=10.0, request_s=30.0, barrier_s=60.0)
    keys = np.arange(200)
    with ThreadCluster(nodes=2, transport=lossy, timeouts=timeouts) as c:
        def body(w):
            t = w.table("cut", 400, 1, techniques="auto", sync_ms=5)
            for clock in range(300):
                if clock == 60 and w.rank == 0:
                    cut.set()
                    threading.Timer(2.5, cut.clear).start()
                t.intent(keys[(clock // 3 + w.rank) % 2::2], clock + 1, clock + 2)
                t.push(keys, np.ones((200, 1), np.float32))
                w.advance_clock()
                time.sleep(0.01)
            w.barrier()

        c.run_workers(body)
        t = c.worker(0).table("cut", 400, 1, techniques="auto", sync_ms=5)

        def settled() -> bool:
            return all(not s.adaptive.machines["cut"].unsettled() and s.adaptive.describe()["cut"]["replicas"] == 0
                       and s.adaptive.links.unacknowledged() == 0 for s in c.servers)

        wait_until(settled, timeout=30, what="the servers settled")
        totals = t.pull(keys)[:, 0]
        np.testing.assert_array_equal(totals, 600.0, err_msg=f"keys short: {np.flatnonzero(totals != 600)[:10]}")

def test_a_replica_wanted_again_before_its_last_sync_is_kept():
    clock = ManualClock()  # the servers' syncs run when the test moves it
    with ThreadCluster(nodes=2, now=clock) as c:
        w1 = c.worker(1)
        t = w1.table("r", 10, 1, techniques="replication", sync_ms=1000)
        store = c.servers[1].adaptive.tables["r"]
        t.intent([0], 1, 2)  # key 0 lives on node 0; node 1 wants it at clock 1
        w1.advance_clock()
        wait_until(lambda: store.presence[0] == REPLICA)
        w1.advance_clock()  # clock 2: the intent is over; the replica goes with its next sync
        # An ASP worker tells its clock at most every 5 ms, or before it waits: the replica can be
        # here sooner than that after the last tick.
        w1.wait_all()
        wait_until(lambda: bool(store.dropping[0]))
        t.intent([0], 3, 50)  # wanted again before that sync
        w1.advance_clock()
        wait_until(lambda: not store.dropping[0])  # the new intent reached the server first
        for _ in range(2):  # two syncs: a drop still pending would have gone out
            clock.advance(1.1)
            wait_until(lambda: store.next_sync > clock())
        assert store.presence[0] == REPLICA
        requests = t.counters["requests"]
        t.pull([0])
        assert t.counters["requests"] == requests


def test_a_replica_only_read_follows_the_owners_row_while_the_owner_is_pushed_to():
    """A node that only reads a replica sends its owner no change: its syncs still bring back the
    owner's rows in turn (it read the value the replica came with for as long as the intent lasted)."""
    with ThreadCluster(nodes=2) as c:
        w0, w1 = c.worker(0), c.worker(1)
        writer = w0.table("r", 10, 1, techniques="replication", init=shoal.Constant(0.0), sync_ms=5)
        reader = w1.table("r", 10, 1, techniques="replication", init=shoal.Constant(0.0), sync_ms=5)
        here = c.servers[1].adaptive.tables["r"]
        reader.intent([0, 2, 4], 1, 10_000)  # homed on node 0
        w1.advance_clock()
        wait_until(lambda: (here.presence[[0, 2, 4]] == REPLICA).all())
        pushes = 200
        seen: list[float] = []

        def write() -> None:
            for _ in range(pushes):
                writer.push([0, 2, 4], np.ones((3, 1), np.float32))
                time.sleep(0.001)
            w0.wait_all()

        pushing = threading.Thread(target=write)
        pushing.start()
        try:
            deadline = time.monotonic() + 20.0
            while time.monotonic() < deadline:
                rows = reader.pull([0, 2, 4])[:, 0]
                seen.append(float(rows.min()))
                if (rows == pushes).all():
                    break
                time.sleep(0.005)
        finally:
            pushing.join()
        assert (here.presence[[0, 2, 4]] == REPLICA).all()  # read here all along, not moved here
        assert seen[-1] == pushes, f"the replica stayed at {seen[-1]} of {pushes}"
        assert len(set(seen)) > 2  # it followed the owner on the way, not only at the end


def test_a_restarted_workers_earlier_intents_end_and_their_replicas_go():
    """Worker 1's process declared keys 0, 2, 4 (homed on node 0) until clock 1,000 and got replicas;
    it is started again, at clock 0. Its node's clock went back with it, and the earlier intents
    would have held the replicas (synced every period) until the new process reached clock 1,000."""
    with ThreadCluster(nodes=2) as c:
        first = c.worker(1)
        t = first.table("r", 10, 1, techniques="replication", init=shoal.Constant(0.0), sync_ms=5)
        here = c.servers[1].adaptive.tables["r"]
        t.intent([0, 2, 4], 1, 1000)
        first.advance_clock()
        wait_until(lambda: (here.presence[[0, 2, 4]] == REPLICA).all())
        first.tracker.close()
        c.workers.remove(first)
        again = c.worker(1)  # tells the servers its clock (0) before it starts
        again.table("r", 10, 1, techniques="replication", init=shoal.Constant(0.0), sync_ms=5)
        wait_until(lambda: not (here.presence[[0, 2, 4]] == REPLICA).any(), what="the replicas going")
        assert c.servers[1].sync.clocks.learned[1] == 0


def test_a_server_started_again_numbers_its_announcements_from_its_incarnation():
    """An owner takes a node's announcement only if it is numbered past the last it took from that
    node. A server started again numbers its own from the rendezvous's count of its node's
    registrations, not from the time of day, which a clock set back across the restart would turn
    into numbers below its earlier process's."""
    with ThreadCluster(nodes=2) as c:
        first = c.worker(0)
        first.table("n", 10, 1, techniques="relocation", init=shoal.Constant(0.0))
        wait_until(lambda: "n" in c.servers[1].adaptive.tables, what="the table on server 1")
        first.shutdown()  # done with both servers: nothing of it waits for the one started again
        c.workers.remove(first)
        assert c.servers[1].adaptive.tables["n"].intents.stamp() >> ANNOUNCEMENTS_PER_PROCESS_BITS == 1
        c.servers[1].stop()
        c.threads[1].join(timeout=10)
        again = ParameterServer(1, c.spec, c.transport, bind="inproc://*")
        c.servers[1] = again
        c.threads[1] = threading.Thread(target=again.run, daemon=True, name="server-1-again")
        c.threads[1].start()
        wait_until(lambda: "n" in again.adaptive.tables, what="the table on the server started again")
        assert again.adaptive.tables["n"].intents.stamp() >> ANNOUNCEMENTS_PER_PROCESS_BITS == 2


@pytest.mark.parametrize("sync_ms", [None, 1000.0])
def test_replicas_without_a_sync_period_of_their_own_sync_at_each_clock_of_their_node(sync_ms):
    """Without ``sync_ms`` a replica's change goes to its owner once the node's workers have moved on a
    clock, no sooner than 10 ms after the last sync (a fast job on a small hot table read rows an epoch
    old with syncs every 50 ms); with a period of its own, at that period only."""
    clock = ManualClock()  # the servers' syncs run when the test moves it
    with ThreadCluster(nodes=2, now=clock) as c:
        w1 = c.worker(1)
        period = {} if sync_ms is None else {"sync_ms": sync_ms}  # None: the tables' default
        t = w1.table("r", 10, 1, techniques="replication", init=shoal.Constant(0.0), **period)
        owner, here = c.servers[0].adaptive.tables["r"], c.servers[1].adaptive.tables["r"]
        t.intent([0], 1, 1000)  # key 0 lives on node 0; node 1 wants it from clock 1 on
        w1.advance_clock()
        wait_until(lambda: here.presence[0] == REPLICA)
        t.push([0], np.ones((1, 1), np.float32))
        clock.advance(1.1)  # a sync by the period: the node's clock as of now is synced
        wait_until(lambda: owner.store.values[0, 0] == 1.0 and 0 not in here.syncs_in_flight)
        t.push([0], np.ones((1, 1), np.float32))  # into the replica
        clock.advance(0.011)
        time.sleep(0.2)  # timer passes: no clock has moved since the last sync
        assert owner.store.values[0, 0] == 1.0
        w1.advance_clock()
        w1.wait_all()  # the clock reaches the server
        if sync_ms is None:
            wait_until(lambda: owner.store.values[0, 0] == 2.0)
        else:
            time.sleep(0.2)
            assert owner.store.values[0, 0] == 1.0
            clock.advance(1.0)
            wait_until(lambda: owner.store.values[0, 0] == 2.0)


def test_replicas_without_a_sync_period_sync_at_clocks_their_server_learns_from_shared_memory_alone():
    """A worker whose tables are all ASP sends its servers a clock at most every quiet period; its node's server
    reads the clocks in between from the worker's slot in shared memory, which wakes nobody. A server
    that slept until its next 50-ms sync (or tick) synced a replica changed every 12 ms at most twice per
    50 ms, where the rule is once per clock, no sooner than 10 ms after the last sync (MF on 2 nodes:
    replicas up to an epoch behind, test RMSE 0.0016 higher). Counted over 40 clocks, every one
    changing the replica, so that every sync carries it and is counted."""
    with ThreadCluster(nodes=2) as c:
        w1 = c.worker(1)
        t = w1.table("r", 10, 1, techniques="replication", init=shoal.Constant(0.0))
        t.intent([0], 1, 10_000)  # key 0 lives on node 0; node 1 wants it from clock 1 on
        w1.advance_clock()
        here = c.servers[1].adaptive.tables["r"]
        wait_until(lambda: here.presence[0] == REPLICA)
        w1.wait_all()
        sent_before = here.stats["sync_sent"]
        clocks = 40
        for _ in range(clocks):
            t.push([0], np.ones((1, 1), np.float32))  # into the replica, in shared memory
            time.sleep(0.012)
            w1.advance_clock()
        syncs = here.stats["sync_sent"] - sent_before
        assert syncs >= 0.6 * clocks, f"{syncs} syncs over {clocks} clocks 12 ms apart"
        owner = c.servers[0].adaptive.tables["r"]
        wait_until(lambda: owner.store.values[0, 0] >= clocks, what="every push at the owner")
        time.sleep(0.1)  # a few more syncs: none adds a push again
        assert owner.store.values[0, 0] == clocks


def test_after_an_intent_message_is_lost_the_next_tick_lets_the_server_read_the_clock_in_shared_memory():
    """A node's server takes a worker's clock from its slot in shared memory only once it has read
    every intent message the worker had sent by then (the slot holds both), else it goes by the clocks
    ticks told it, every quiet period under ASP (50 ms then). An intent message lost on the way held
    that count back until the worker's next one, which an app that declares its intents at the start
    (MF) never sends: the
    server's clock lagged the worker's by up to 50 ms for the rest of the run, and so did its syncs
    by clock and its rounds of intents. A tick says how many the worker had sent: those not read by
    then were lost (they travel ahead of it, in order, on the one connection)."""
    armed = threading.Event()
    lost = []

    def lose(header: dict) -> bool:  # the first intent message, once armed
        if armed.is_set() and not lost and header["op"] == int(Op.INTENT):
            lost.append(header)
            return True
        return False

    with ThreadCluster(nodes=2, transport=LosingTransport(ZmqTransport(), lose)) as c:
        w1 = c.worker(1)
        t = w1.table("lost", 10, 1, techniques="replication", init=shoal.Constant(0.0))
        server = c.servers[1]
        armed.set()
        t.intent([0], 1, 10_000)
        w1.advance_clock()  # the intent message goes, and is lost
        wait_until(lambda: bool(lost), what="the intent message lost")
        w1._ticks._ticked_at = -1e9  # a tick to every server is due at the next clock
        w1.advance_clock()
        wait_until(lambda: int(server.clocks.clocks[1]) == w1.clock, what="the tick at the server")
        for _ in range(3):  # clocks within the quiet period: no tick, the slot alone moves
            w1.advance_clock()
        assert int(server.clocks.clocks[1]) < w1.clock
        assert server.adaptive._node_clock() == w1.clock


def test_a_nodes_pace_is_its_own_workers_while_another_nodes_worker_stands_still():
    """A server turns the clocks intents name into time by its node's workers' pace. It took the pace
    of the slowest worker of the whole job: while another node's worker stood still (a long
    evaluation, a slow start) it measured none, and where that worker told its clock only every quiet
    period, the estimate jumped with each of its ticks."""
    with ThreadCluster(nodes=2) as c:
        w0 = c.worker(0)
        t0 = w0.table("pace", 10, 1, techniques="relocation")
        c.worker(1).table("pace", 10, 1, techniques="relocation")  # worker 1 stays at clock 0
        adaptive = c.servers[0].adaptive
        t0.intent(np.arange(1, 10, 2), 1, 10_000)  # keys homed on node 1: node 0's server acts on them
        for _ in range(30):
            time.sleep(0.01)
            w0.advance_clock()
        wait_until(lambda: adaptive.seconds_per_clock > 0, what="node 0's pace measured")
        assert 0.005 <= adaptive.seconds_per_clock < 1.0


def test_the_syncs_of_several_tables_to_one_node_go_as_one_message_and_every_push_lands_once():
    clock = ManualClock()  # the servers' syncs run when the test moves it
    with ThreadCluster(nodes=2, now=clock) as c:
        w1 = c.worker(1)
        a = w1.table("a", 10, 1, techniques="replication", sync_ms=1000, init=shoal.Constant(0.0))
        b = w1.table("b", 10, 1, techniques="replication", sync_ms=1000, init=shoal.Constant(0.0))
        a.intent([0], 1, 50)  # keys homed on node 0, wanted on node 1: replicated there
        b.intent([0, 2], 1, 50)
        w1.advance_clock()
        here = c.servers[1].adaptive
        wait_until(lambda: (here.tables["a"].presence[[0]] == REPLICA).all()
                   and (here.tables["b"].presence[[0, 2]] == REPLICA).all())
        for _ in range(3):
            a.push([0], np.ones((1, 1), np.float32))  # into the replicas here, sent on by the next syncs
        for _ in range(2):
            b.push([0, 2], np.ones((2, 1), np.float32))
        owner = c.servers[0].adaptive
        sent = [s.stats["placement_messages_sent"] for s in (owner, here)]
        clock.advance(1.1)  # both tables' syncs are due in the same pass
        wait_until(lambda: 0 not in here.tables["a"].syncs_in_flight and 0 not in here.tables["b"].syncs_in_flight
                   and here.stats["sync_sent"] >= 2)
        assert here.stats["sync_sent"] == 2
        assert [s.stats["placement_messages_sent"] - n for s, n in zip((owner, here), sent, strict=True)] == [1, 1]
        assert owner.tables["a"].store.values[[0], 0].tolist() == [3.0]  # each push once, at the owner
        assert owner.tables["b"].store.values[[0, 2], 0].tolist() == [2.0, 2.0]


def test_what_a_timer_pass_decided_goes_out_even_when_another_tables_timer_fails(caplog):
    with ThreadCluster(nodes=2) as c:
        c.worker(0).table("a", 8, 2, techniques="replication", init=shoal.Constant(1.0))
        c.worker(1).table("b", 8, 2, techniques="replication")
        machines = c.servers[0].adaptive.machines
        tick_a, tick_b = machines["a"].tick, machines["b"].tick
        once = {"a": True, "b": True}

        def decided(now: float, clock: int, clock_s: float) -> Effects:  # key 0 (homed here) copied to node 1
            if once.pop("a", False):
                return Effects(sends=[Send("a", 1, Replicate(np.array([0]), np.ones((1, 2), np.float32)))])
            return tick_a(now, clock, clock_s)

        def failing(now: float, clock: int, clock_s: float) -> Effects:  # a bug in the next table's timer
            if once.pop("b", False):
                raise RuntimeError("a timer's bug")
            return tick_b(now, clock, clock_s)

        machines["a"].tick, machines["b"].tick = decided, failing  # type: ignore[method-assign]
        wait_until(lambda: not once)
        # Sent all the same. (Counted on arrival: unwanted there, the replica goes at its first sync.)
        wait_until(lambda: c.servers[1].adaptive.stats["replicas_held"] == 1)
    assert "a timer's bug" in caplog.text


def test_adaptive_tables_check_their_settings():
    with pytest.raises(shoal.ConfigError, match="additive update rule"):
        shoal.TableSpec("x", 10, 1, techniques="auto", optimizer=shoal.optim.Adagrad())
    with pytest.raises(shoal.ConfigError, match="techniques must be one of"):
        shoal.TableSpec("x", 10, 1, techniques="teleport")
    for period in (0, 0.5, 60_001, True, "50"):
        with pytest.raises(shoal.ConfigError, match="act_ms must be None or lie in"):
            shoal.TableSpec("x", 10, 1, techniques="auto", act_ms=period)
    assert shoal.TableSpec.from_dict(shoal.TableSpec("x", 10, 1, techniques="auto", act_ms=100).to_dict()).act_ms == 100
    with ThreadCluster(nodes=1) as c:
        t = c.worker(0).table("s", 10, 1)
        with pytest.raises(shoal.TableError, match="is not adaptive"):
            t.localize([1])
        t.intent([1], 0, 1)  # static tables ignore intents


def test_on_one_node_intents_send_nothing():
    with ThreadCluster(nodes=1) as c:
        w = c.worker(0)
        t = w.table("one", 10, 1, techniques="auto")
        t.intent([1, 2], 1, 2)
        w.advance_clock()
        assert t.counters["intents_skipped"] == 1 and t.counters["intents_sent"] == 0
        assert c.servers[0].adaptive.describe()["one"].get("intents_announced", 0) == 0


def test_a_workers_intents_for_every_table_go_to_its_server_in_one_message_per_clock():
    # Each table's intents went to the node's server in a message of their own at each clock: with
    # a few tables (KGE: entities and relations) the most frequent message a server received.
    names = ("e", "r", "x")
    with ThreadCluster(nodes=2) as c:
        w = c.worker(1)
        tables = [w.table(name, 40, 1, techniques="auto") for name in names]
        for name in names:
            c.worker(0).table(name, 40, 1, techniques="auto")
        received: list[tuple[str, list[int], int, int]] = []
        for name in names:  # what the server's machines are told, in order
            machine = c.servers[1].adaptive.machines[name]
            intend = machine.intend

            def recording(keys, start, end, name=name, intend=intend):
                received.append((name, keys.tolist(), start, end))
                intend(keys, start, end)

            machine.intend = recording  # type: ignore[method-assign]
        before = c.servers[1].stats["op_intent"]
        declared = []
        for clock in range(5):
            for i, t in enumerate(tables):  # keys homed on node 0, one per table and clock
                declared.append((names[i], [2 * (clock + 5 * i)], w.clock + 2, w.clock + 3))
                t.intent(declared[-1][1], declared[-1][2], declared[-1][3])
            declared.append(("e", [30 + clock], w.clock + 2, w.clock + 4))  # a second intent of one table
            tables[0].intent(declared[-1][1], declared[-1][2], declared[-1][3])
            w.advance_clock()
        wait_until(lambda: len(received) >= len(declared))
        assert sorted(received) == sorted(declared)  # every intent, once
        assert c.servers[1].stats["op_intent"] - before == 5  # in one message per clock
        assert [t.counters["intents_sent"] for t in tables] == [10, 5, 5]


def test_wait_local_sends_the_intents_and_returns_once_their_keys_are_here():
    # Intents waited in the worker for its next clock tick, and nothing told a worker when the rows
    # it declared had arrived: its first batches asked other nodes while they moved.
    with ThreadCluster(nodes=2) as c:
        w0, w1 = c.worker(0), c.worker(1)
        t0 = w0.table("w", 400, 4, techniques="auto", init=shoal.Constant(1.0))
        t1 = w1.table("w", 400, 4, techniques="auto", init=shoal.Constant(1.0))
        mine, shared = np.arange(1, 200, 2), np.arange(200, 400, 2)  # node 1's keys; node 0's, wanted by both
        t0.intent(mine, w0.clock, w0.clock + 100)
        t0.intent(shared, w0.clock, w0.clock + 100)
        t1.intent(shared, w1.clock, w1.clock + 100)
        waiting = [None, None]
        threads = [threading.Thread(target=lambda: waiting.__setitem__(1, t1.wait_local(shared, timeout=20)))]
        threads[0].start()
        waiting[0] = t0.wait_local(np.concatenate([mine, shared]), timeout=20)  # no clock advanced meanwhile
        threads[0].join()
        assert waiting == [0, 0]
        here, there = (c.servers[n].adaptive.tables["w"].presence for n in (0, 1))
        assert (here[mine] == OWNED).all()
        # Whichever node announced first owns a shared key (alone then, it moved there), the other
        # holds a replica.
        assert (np.sort(np.stack([here[shared], there[shared]]), axis=0) == [[OWNED], [REPLICA]]).all()
        requests = t0.counters["requests"]
        np.testing.assert_array_equal(t0.pull(np.concatenate([mine, shared])), 1.0)
        assert t0.counters["requests"] == requests  # every row read here


def test_placement_messages_for_a_server_that_registered_later_go_out_within_a_few_heartbeats(monkeypatch):
    # A server learns its peers' addresses from its heartbeats (every 0.5 s); what it had to send to a
    # server that registered after its last one waited for the next, and with it every wait_local of a
    # job that started quickly (0.4 s of a Kinships job's set-up). Heartbeats are made rare here so
    # that waiting for the next one cannot pass.
    from shoal.server import server as server_module

    monkeypatch.setattr(server_module, "_HEARTBEAT_S", 60.0)
    run = server_module.ParameterServer.run
    first: list[server_module.ParameterServer] = []

    def run_late(self: server_module.ParameterServer) -> None:
        if self.node == 0:
            first.append(self)
        else:  # once node 0's first heartbeat has been answered, without node 1 in it
            wait_until(lambda: bool(first) and first[0]._next_heartbeat > 0 and first[0]._heartbeat_req is None,
                       timeout=20)
        run(self)

    monkeypatch.setattr(server_module.ParameterServer, "run", run_late)
    with ThreadCluster(nodes=2) as c:
        c.rendezvous.dead_after_s = 120.0  # rare heartbeats do not make a server dead here
        w0, w1 = c.worker(0), c.worker(1)
        t0 = w0.table("w", 100, 2, techniques="auto", init=shoal.Constant(1.0))
        w1.table("w", 100, 2, techniques="auto", init=shoal.Constant(1.0))
        theirs = np.arange(1, 100, 2)  # home node 1: node 0's server asks node 1's for them
        t0.intent(theirs, w0.clock, w0.clock + 100)
        assert t0.wait_local(theirs, timeout=20) == 0


def test_wait_local_gives_up_at_its_timeout_and_refuses_static_tables():
    with ThreadCluster(nodes=2) as c:
        t = c.worker(0).table("w", 100, 1, techniques="auto")
        started = time.monotonic()
        assert t.wait_local(np.arange(1, 100, 2), timeout=0.3) == 50  # node 1's keys, no intent for them
        assert 0.3 <= time.monotonic() - started < 5
        assert t.wait_local(np.arange(0, 100, 2), timeout=0.3) == 0  # here from the start
        with pytest.raises(shoal.TableError, match="not adaptive"):
            c.worker(0).table("s", 10, 1).wait_local([1, 2])
        for bad in (float("nan"), -1.0, float("inf"), "5"):
            with pytest.raises(shoal.ConfigError, match="timeout"):
                t.wait_local([1], timeout=bad)
        with pytest.raises(shoal.ConfigError, match="finite"):
            t.register_sampling(np.r_[np.inf, np.ones(99)])


@pytest.mark.parametrize("scheme", ["naive", "preloc", "pool", "local"])
def test_sampling_schemes_return_rows_of_the_drawn_keys(scheme):
    with ThreadCluster(nodes=2) as c:
        w = c.worker(0)
        t = w.table("neg", 1000, 3, techniques="auto", init=shoal.Uniform(-1, 1))
        weights = np.ones(1000)
        weights[:10] = 100.0  # a skewed distribution
        t.register_sampling(weights, scheme=scheme, reuse=2, pool_size=64)
        handles = [t.prepare_sample(16, clock=None) for _ in range(5)]
        for h in handles:
            keys, rows = t.pull_sample(h)
            assert keys.shape == (16,) and rows.shape == (16, 3)
            np.testing.assert_array_equal(rows, t.pull(keys))
            if scheme == "local":
                assert (keys % 2 == 0).all()  # node 0's keys (home = key % 2)
        with pytest.raises(shoal.TableError, match="no prepared sample"):
            t.pull_sample(handles[0])


def test_preloc_samples_are_here_by_the_clock_they_were_prepared_for():
    with ThreadCluster(nodes=2) as c:
        w = c.worker(0)
        t = w.table("neg", 400, 2, techniques="relocation", init=shoal.Uniform(-1, 1))
        t.register_sampling(scheme="preloc", seed=3)
        handle = t.prepare_sample(100, clock=w.clock + 2)
        keys = t._sampler._handles[handle].keys  # the sample is drawn now, from the whole table
        assert (keys % 2 == 1).any(), "no key of node 1 drawn"
        requests = t.counters["requests"]
        w.advance_clock()  # the intent goes to this node's server, which has the keys moved here
        wait_until(lambda: (c.servers[0].adaptive.tables["neg"].presence[keys] != ABSENT).all())
        w.advance_clock()
        drawn, rows = t.pull_sample(handle)
        np.testing.assert_array_equal(drawn, keys)
        assert t.counters["requests"] == requests  # every row was read here
        np.testing.assert_array_equal(rows, t.pull(keys))
    with ThreadCluster(nodes=1) as c:
        with pytest.raises(shoal.ConfigError, match="preloc"):
            c.worker(0).table("static", 10, 1).register_sampling(scheme="preloc")


def test_local_sampling_draws_only_keys_still_here_after_some_moved_away():
    with ThreadCluster(nodes=2) as c:
        w0, w1 = c.worker(0), c.worker(1)
        t0 = w0.table("neg", 4000, 2, techniques="relocation")
        t1 = w1.table("neg", 4000, 2, techniques="relocation")
        t0.register_sampling(scheme="local")
        keys, _ = t0.pull_sample(t0.prepare_sample(50))  # lists node 0's keys: the even ones
        assert (keys % 2 == 0).all()
        leaving = np.arange(0, 2000, 2)
        t1.localize(leaving)
        wait_until(lambda: c.servers[0].adaptive.describe()["neg"]["owned"] == 1000)
        requests = t0.counters["requests"]
        for _ in range(4):  # the list is made again after 250 keys drawn: it is older than the move
            keys, rows = t0.pull_sample(t0.prepare_sample(50))
            assert ((keys % 2 == 0) & (keys >= 2000)).all(), "drew a key that left this node"
            assert rows.shape == (50, 2)
        assert t0.counters["requests"] == requests  # nothing asked of a server
        assert t0.counters["samples_redrawn"] > 0
        keys = t0.sample_keys(100)  # keys only, for the caller's own pull
        assert ((keys % 2 == 0) & (keys >= 2000)).all()
        t0.pull(keys)
        assert t0.counters["requests"] == requests


@pytest.mark.parametrize("scheme", ["naive", "local"])
def test_weighted_samples_follow_the_weights_renormalised_to_the_keys_drawn_from(scheme):
    with ThreadCluster(nodes=2) as c:
        t = c.worker(0).table("neg", 200, 1, techniques="auto")
        weights = np.arange(200, dtype=np.float64) % 7  # every seventh key never drawn
        t.register_sampling(weights, scheme=scheme, seed=5)
        counts = np.bincount(np.concatenate([t.sample_keys(10_000) for _ in range(20)]), minlength=200)
        among = np.arange(200) % 2 == 0 if scheme == "local" else np.ones(200, bool)  # node 0 holds the even keys
        want = np.where(among, weights, 0.0)
        want /= want.sum()
        assert counts[want == 0].sum() == 0
        # 200,000 draws: a key of probability p is off by more than 5 standard deviations by chance
        # about once in three million tries.
        assert (np.abs(counts / counts.sum() - want) <= 5 * np.sqrt(want * (1 - want) / counts.sum())).all()


def test_sample_keys_follows_the_scheme():
    with ThreadCluster(nodes=2) as c:
        t = c.worker(0).table("neg", 100, 1, techniques="auto")
        weights = np.zeros(100)
        weights[[3, 7]] = 1.0
        t.register_sampling(weights, scheme="naive")
        assert set(t.sample_keys(50).tolist()) <= {3, 7}
        t.register_sampling(scheme="pool", pool_size=4, reuse=3, seed=5)
        keys = np.concatenate([t.sample_keys(1) for _ in range(12)])
        assert len(set(keys.tolist())) <= 4  # one pool of 4 draws, each handed out 3 times


def test_relocation_under_concurrent_pushes_from_four_processes_loses_nothing(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = str(Path(__file__).resolve().parents[1] / "scripts" / "adaptive_worker.py")
    rounds = 60
    proc = subprocess.run([sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", "2", "--workers-per-node",
                           "2", "--", sys.executable, script, str(tmp_path), str(rounds)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "counts.json").read_text())
    np.testing.assert_array_equal(result["counts"], 4.0 * rounds)
    moved = sum(s["adaptive"]["moving"].get("keys_relocated_here", 0) for s in result["servers"])
    assert moved > 500  # keys really moved, many times


def test_pool_samples_have_as_many_keys_as_asked_for() -> None:
    # A new pool was drawn only when fewer uses than asked for were left, though a sample's keys are
    # distinct: several uses left on fewer keys than asked for made a short sample.
    with ThreadCluster(nodes=1) as c:
        t = c.worker(0).table("neg", 100, 2, techniques="auto")
        t.register_sampling(scheme="pool", pool_size=4, reuse=3, seed=1)
        assert [t.pull_sample(t.prepare_sample(3))[0].shape[0] for _ in range(10)] == [3] * 10


def test_local_samples_never_draw_keys_of_weight_zero() -> None:
    # Node 0 holds the even keys, all of weight zero: renormalised over them, the local scheme drew
    # them uniformly; it falls back to the true distribution, as when no key is here.
    with ThreadCluster(nodes=2) as c:
        t = c.worker(0).table("neg", 100, 1, techniques="auto")
        weights = np.zeros(100)
        weights[[3, 7]] = 1.0
        t.register_sampling(weights, scheme="local", seed=0)
        assert set(t.sample_keys(50).tolist()) <= {3, 7}


@pytest.mark.parametrize("start", [None, float("nan"), "x", 2**63, -1, True])
def test_an_intent_with_a_start_that_is_no_clock_is_refused_at_the_call(start: object) -> None:
    # ``int(start)`` raised TypeError or ValueError; 2**63 went out, and the server refused the
    # message carrying every table's intents of the clock, so another table's intents were lost too.
    with ThreadCluster(nodes=2) as c:
        w = c.worker(0)
        t = w.table("a", 10, 1, techniques="auto")
        with pytest.raises(shoal.ConfigError, match="must be a clock"):
            t.intent([1], start)
        if start is not None:  # an end of None is the start's clock alone
            with pytest.raises(shoal.ConfigError, match="must be a clock"):
                t.intent([1], 0, start)
        assert w.tables["a"].access.take_intents() == []


@pytest.mark.parametrize("n", [-1, 2.5, None])
def test_a_sample_of_a_bad_size_is_refused_at_the_call(n: object) -> None:
    with ThreadCluster(nodes=1) as c:
        t = c.worker(0).table("neg", 100, 1, techniques="auto")
        t.register_sampling(scheme="naive")
        with pytest.raises(shoal.ConfigError, match="sample's size"):
            t.prepare_sample(n)
        with pytest.raises(shoal.ConfigError, match="sample's size"):
            t.sample_keys(n)


def test_a_pull_answered_moved_goes_where_the_answer_said_not_back_to_the_home():
    # Key 2 (homed on node 2) moved to node 1. Worker 0's cache still says node 2; node 2 answers
    # "moved, to node 1". A push then goes to node 1 (two requests). A pull counted the attempt twice
    # (when answered "moved", and again when read again), so its second try was "after two hops": to
    # the home again, which said node 1 again; the third request reached the key, after a back-off.
    with ThreadCluster(nodes=3) as c:
        w0 = c.worker(0)
        t0 = w0.table("k", 30, 1, techniques="relocation")
        t1 = c.worker(1).table("k", 30, 1, techniques="relocation")
        c.worker(2).table("k", 30, 1, techniques="relocation")
        t1.localize(np.array([2, 5]))
        deadline = time.monotonic() + 10
        while (c.servers[1].adaptive.tables["k"].presence[[2, 5]] != OWNED).any():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        before = t0.counters["requests"]
        t0.push(np.array([5]), np.ones((1, 1), np.float32))
        push_requests = t0.counters["requests"] - before
        before = t0.counters["requests"]
        t0.pull(np.array([2]))
        pull_requests = t0.counters["requests"] - before
        assert push_requests == 2
        assert pull_requests == push_requests, f"a pull took {pull_requests} requests where a push took 2"


def test_an_adaptive_read_holds_the_readers_own_earlier_push_when_that_push_is_lost_once():
    """Under ASP a read by worker w returns every update w pushed before the read, whatever table kind
    (DESIGN §10). Worker 0 pushes +1 to a key whose home is node 1 (no intent: the key stays there) with
    ``push_async`` and then pulls it. The push's message is lost once and sent again; the pull, sent
    after it, overtook it and read 0: adaptive requests travel outside the workers' ordered streams.
    A read of keys the worker pushed to other nodes now waits for those pushes' acknowledgements."""
    lost = []

    def lose(header: dict) -> bool:
        if header["op"] == int(Op.PUSH) and header.get("table") == "own" and not lost:
            lost.append(header["req"])
            return True
        return False

    timeouts = shoal.Timeouts(connect_s=10.0, request_s=20.0, barrier_s=30.0, resend_s=0.3)
    with ThreadCluster(nodes=2, transport=LosingTransport(ZmqTransport(), lose), timeouts=timeouts) as c:
        w0 = c.worker(0)
        t = w0.table("own", 8, 1, techniques="relocation")
        key = np.array([3])  # home node 1 (key % nodes); worker 0 is on node 0
        pending = t.push_async(key, np.ones((1, 1), np.float32))
        seen = float(t.pull(key)[0, 0])
        pending.wait()
        assert lost, "the push was never lost: the test did not run its fault"
        after = float(t.pull(key)[0, 0])
        assert after == 1.0  # the push did land, once
        assert seen == 1.0, f"a read after the worker's own push read {seen}, without it"


def test_a_local_read_includes_the_readers_own_push_still_on_its_way_to_the_rows_old_owner():
    """Worker 0 starts a push to key 1 (owned by node 1), the key then comes to node 0, and worker 0's
    pull read the row in shared memory at once, without its own push, still on its way to node 1 (to
    be forwarded from there and land later): 0 where 1 was pushed before the read. Static tables keep
    this (a read waits for the worker's pushes routed by an older layout); an adaptive read now waits
    for the worker's own pushes of the keys it reads."""
    from shoal.wire.ops import Op

    transport, delayed = _delaying_transport(
        lambda header: header["op"] == int(Op.PUSH) and header.get("table") == "a", delay_s=1.5)
    with ThreadCluster(nodes=2, transport=transport) as c:
        w0, w1 = c.worker(0), c.worker(1)
        t0 = w0.table("a", 10, 1, techniques="relocation", init=shoal.Constant(0.0))
        w1.table("a", 10, 1, techniques="relocation", init=shoal.Constant(0.0))
        key = np.array([1])  # odd: lives at node 1
        assert t0.access.presence[1] == 0
        pushed = t0.push_async(key, np.ones((1, 1), np.float32))
        t0.localize(key)
        assert t0.wait_local(key, 10.0) == 0, "key 1 did not come to node 0"
        assert delayed["held"], "the push was not the one held back"
        seen = float(t0.pull(key)[0, 0])
        pushed.wait()
        final = float(t0.pull(key)[0, 0])
        assert final == 1.0, f"the push landed {final} times"
        assert seen == 1.0, (f"worker 0 read key 1 as {seen} after its own push to it (the push was started "
                             "before the read and landed later)")


def test_an_owners_intent_over_by_the_clock_its_worker_reached_is_not_counted_while_the_end_tick_is_unread():
    """Worker 0 used the even keys (homed, and owned, on node 0) in clocks [1, 4) and has reached clock
    4; worker 1 declares them next. Its server announces them to node 0, whose server has not read
    worker 0's end tick yet (a server off the CPU for a while reads its queue in no set order: here
    the tick is held back). The owner counted its own interest as still on and sent node 1 a replica
    where the keys should have moved (word2vec in blocks on a busy machine: a group of output words
    copied). Co-located workers now write the clock they reached into their node's shared memory,
    which the server reads with the intents they sent by then."""
    end = 4
    transport, delayed = _delaying_transport(
        lambda header: header["op"] == int(Op.CLOCK) and header["sender"] == 0 and header["clock"] == end,
        delay_s=10.0)  # past both waits below, on a busy machine too
    with ThreadCluster(nodes=2, transport=transport) as c:
        w0, w1 = c.worker(0), c.worker(1)
        t0 = w0.table("g", 16, 2, techniques="auto", init=shoal.Constant(0.0))
        t1 = w1.table("g", 16, 2, techniques="auto", init=shoal.Constant(0.0))
        owner, user = c.servers[0].adaptive.tables["g"], c.servers[1].adaptive.tables["g"]
        delayed["at"] = c.servers[0].address  # the owner's server; a tick to node 1 passes
        keys = np.arange(0, 16, 2)
        t0.intent(keys, 1, end)
        w0.advance_clock()
        wait_until(lambda: (owner.interest.interest[keys] == 1 << 0).all(), what="the owner's own interest")
        for _ in range(w0.clock, end):
            t0.push(keys, np.ones((keys.size, 2), np.float32))
            w0.advance_clock()
        assert w0.clock == end
        w0.wait_all()  # its clock goes now, if the tick was not due yet
        wait_until(lambda: bool(delayed["held"]), timeout=4.0, what="worker 0's end tick at node 0, held back")
        t1.intent(keys, w1.clock + 1, w1.clock + 20)
        w1.advance_clock()
        wait_until(lambda: (user.presence[keys] != ABSENT).all(), timeout=5.0, what="the keys at node 1")
        assert owner.stats["replicas_made"] == 0
        assert (user.presence[keys] == OWNED).all() and (owner.presence[keys] == ABSENT).all()
        assert np.array_equal(t1.pull(keys), np.full((keys.size, 2), end - 1, np.float32))  # every push, once


def test_an_intent_message_lost_on_the_way_is_counted_read_once_a_later_one_comes():
    """The server takes a worker's clock from its slot only once it has read every intent message
    sent by then. Counting the messages read, a lost one left the count one short, and the node's
    clock on the ticks for the rest of the job: each message carries its number instead."""
    lost = []

    def lose(header: dict) -> bool:
        if header["op"] == int(Op.INTENT) and header["sender"] == 0 and not lost:
            lost.append(header["req"])
            return True
        return False

    with ThreadCluster(nodes=2, transport=LosingTransport(ZmqTransport(), lose)) as c:
        w0 = c.worker(0)
        t = w0.table("n", 16, 1, techniques="auto")
        t.intent([0], 1, 3)
        w0.advance_clock()  # intent message 1: lost
        t.intent([2], 2, 4)
        w0.advance_clock()  # intent message 2
        reached = c.servers[0].reached
        wait_until(lambda: int(reached.intents_read[0]) == 2, what="message 2 read, counting the lost one")
        assert lost
        assert c.servers[0].adaptive.tables["n"].intents.until[2] == 4  # its intent taken in
        w0.advance_clock()
        assert reached.clocks([0], 0) == [w0.clock]


def _delaying_transport(pick, delay_s: float):  # type: ignore[no-untyped-def]
    """A ZeroMQ transport whose listeners hold back the first arriving message that ``pick(its decoded
    header)`` selects for ``delay_s`` (one slow request); every other message passes at once. Set the
    returned state's ``"at"`` to a listener's address to hold back only what arrives there."""
    import random
    import time

    import msgspec

    from shoal.transport.faulty import Faults, FaultyTransport, _Delayed
    from shoal.transport.zmq_transport import ZmqTransport

    state: dict[str, object] = {"held": False, "at": None}

    class _Slow(_Delayed):
        def __init__(self, address: str) -> None:
            super().__init__(Faults(), random.Random(0))
            self.address = address

        def admit(self, item):  # type: ignore[no-untyped-def]
            frames = item[1] if isinstance(item, tuple) else item
            here = state.get("at") in (None, self.address)
            if here and not state["held"] and pick(msgspec.msgpack.decode(bytes(frames[0]))):
                state["held"] = True
                import heapq
                heapq.heappush(self.heap, (time.monotonic() + delay_s, next(self._seq), item))
                return
            super().admit(item)

    class _Transport(FaultyTransport):
        def listen(self, address, max_frame_bytes=None):  # type: ignore[no-untyped-def]
            listener = super().listen(address, max_frame_bytes)
            listener.delayed = _Slow(listener.address)
            return listener

    return _Transport(ZmqTransport(), Faults()), state
