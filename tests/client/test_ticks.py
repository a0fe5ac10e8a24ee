"""When a worker whose tables are all ASP tells servers its clock (``client.ticks``), and whom."""

import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

import shoal
from shoal.client.ticks import TICK_EVERY_S, TICK_QUIET_S, TickSchedule
from shoal.client.worker import Worker
from shoal.transport.base import Connection
from shoal.transport.zmq_transport import ZmqTransport
from shoal.wire.ops import Op
from tests.support.cluster import ThreadCluster
from tests.support.waiting import wait_until

KEYS = np.arange(5, dtype=np.int64)


def clocked(every_s: float, clocks: int) -> tuple[TickSchedule, float]:
    """A schedule that has seen ``clocks`` clocks ``every_s`` apart, and the time of the last."""
    ticks = TickSchedule()
    now = 100.0
    for _ in range(clocks):
        now += every_s
        ticks.advanced(now)
    return ticks, now


def test_without_intents_ticks_are_spaced_by_the_quiet_period():
    ticks, now = clocked(0.001, 5)
    assert ticks.due(5, now)  # never ticked
    ticks.ticked(5, now)
    assert not ticks.due(6, now + TICK_EVERY_S * 2)
    assert not ticks.due(40, now + TICK_QUIET_S * 0.9)
    assert ticks.due(60, now + TICK_QUIET_S + 1e-6)


def test_near_an_intent_boundary_a_tick_goes_once_the_short_spacing_allows():
    ticks, now = clocked(0.001, 5)  # 1 ms a clock: the lead is 5 ms of clocks and two more
    ticks.ticked(5, now)
    ticks.note_intents([("t", KEYS, 30, 40)])
    assert ticks.lead() == 7
    assert not ticks.due(22, now + 0.017)  # 30 is more than the lead away
    assert not ticks.due(23, now + 0.001)  # within the lead, but the short spacing has not passed
    assert ticks.due(23, now + 0.018)
    ticks.ticked(23, now + 0.018)  # the start is served: quiet again until the end
    assert not ticks.due(28, now + 0.023)
    assert not ticks.due(39, now + 0.034)
    assert ticks.due(40, now + 0.035)


def test_slow_clocks_tick_every_other_clock_up_to_a_round_of_the_servers_action():
    # About 25 ms a clock (KGE on 2 nodes): a tick every clock was twice what the server acts on.
    ticks, now = clocked(0.025, 5)
    ticks.ticked(5, now)
    ticks.note_intents([("t", KEYS + 10 * clock, clock, clock + 1) for clock in range(6, 20)])  # a boundary every clock
    assert not ticks.due(6, now + 0.025)
    assert ticks.due(7, now + 0.049)  # a little faster than the average: still every other clock
    ticks.ticked(7, now + 0.049)
    assert not ticks.due(8, now + 0.074)
    assert not ticks.everywhere(now + 0.098) and ticks.due(9, now + 0.098)  # for the boundary
    slow, now = clocked(0.1, 5)  # slower than the servers' rounds: every clock
    slow.ticked(5, now)
    slow.note_intents([("t", KEYS + 10 * clock, clock, clock + 1) for clock in range(6, 20)])
    assert slow.due(6, now + 0.1)
    fast, now = clocked(0.001, 5)  # fast clocks keep the short spacing
    assert fast.spacing() == TICK_EVERY_S


def test_an_end_is_served_only_by_a_tick_at_or_past_it():
    # The server withdraws an intent's keys by the clock it heard: a tick a lead before the end
    # left them announced until the quiet period was over, and the keys' next user got a replica.
    ticks, now = clocked(0.001, 5)  # a lead of 7 clocks
    ticks.ticked(5, now)
    ticks.note_intents([("t", KEYS, 10, 12)])
    ticks.ticked(6, now + TICK_EVERY_S * 1.1)  # 10 and 12 both within the lead: only the start is served
    assert not ticks.due(11, now + TICK_EVERY_S * 2.2)
    assert ticks.due(12, now + TICK_EVERY_S * 2.2)
    ticks.ticked(12, now + TICK_EVERY_S * 2.2, everywhere=False)
    assert not ticks.due(13, now + TICK_EVERY_S * 3.3)  # nothing left to serve


def test_slower_clocks_shorten_the_lead_and_a_boundary_passed_unticked_is_dropped_at_the_next_tick():
    ticks, now = clocked(0.01, 5)
    assert ticks.lead() == 3  # 5 ms is under one clock
    ticks.note_intents([("t", KEYS, 10, 12)])
    ticks.ticked(20, now)
    assert not ticks.due(21, now + TICK_EVERY_S)  # nothing ahead any more
    assert ticks.lead() == 3


def test_a_look_of_the_nodes_server_at_the_clock_in_shared_memory_serves_as_a_tick():
    # A server that is awake reads the clock in the worker's slot anyway: a tick near a boundary told it
    # nothing new, and cost it a message (about 17 a second a worker on KGE's 2 nodes).
    ticks, now = clocked(0.001, 5)  # a lead of 7 clocks
    ticks.ticked(5, now)
    ticks.note_intents([("t", KEYS, 10, 11)])
    ticks.looked(9, now + TICK_EVERY_S * 1.1)  # the server took clock 9: the start at 10 is served
    assert not ticks.due(10, now + TICK_EVERY_S * 1.5)
    assert not ticks.due(11, now + TICK_EVERY_S * 1.6)  # the end: the short spacing counts from the look
    ticks.looked(8, now + TICK_EVERY_S * 1.0)  # an earlier look changes nothing
    assert ticks.due(11, now + TICK_EVERY_S * 2.2)  # no look since: a tick
    ticks.looked(11, now + TICK_EVERY_S * 2.3)
    assert not ticks.due(12, now + TICK_EVERY_S * 9)  # nothing left to serve


def test_before_any_clock_is_timed_the_lead_is_the_narrowest():
    ticks = TickSchedule()
    ticks.note_intents([("t", KEYS, 50, 60)])
    ticks.ticked(1, 0.0)  # the first tick does not serve an intent 49 clocks away
    assert ticks.due(48, TICK_EVERY_S)


def test_ticks_for_intents_go_to_the_nodes_server_and_every_server_hears_once_the_quiet_period_is_over():
    ticks, now = clocked(0.001, 5)
    ticks.ticked(5, now)
    ticks.note_intents([("t", KEYS, 10, 11), ("t", KEYS, 20, 21)])
    later = now + TICK_EVERY_S * 1.1
    assert ticks.due(6, later) and not ticks.everywhere(later)  # 10 is within the lead of 7 clocks
    ticks.ticked(6, later, everywhere=False)  # the node's server alone
    assert not ticks.due(14, later + TICK_EVERY_S * 0.5)  # the short spacing counts from that tick
    assert ticks.due(14, later + TICK_EVERY_S * 1.1)  # the next boundary, 20, is near
    # The node's ticks leave the quiet period counted from the last tick to every server.
    assert not ticks.everywhere(now + TICK_QUIET_S * 0.9) and ticks.everywhere(now + TICK_QUIET_S * 1.01)


def test_where_an_intent_hands_its_keys_on_to_the_next_on_the_same_table_no_tick_is_needed():
    # An app declaring an epoch's rows epoch by epoch: the server keeps them throughout, so only the
    # first start and the last end are boundaries.
    ticks, now = clocked(0.001, 5)  # a lead of 7 clocks
    ticks.ticked(0, now)
    epoch_rows = np.arange(100, dtype=np.int64)
    ticks.note_intents([("items", epoch_rows, 10, 50), ("items", epoch_rows, 50, 90),
                        ("items", epoch_rows.copy(), 90, 130)])  # equal keys, another array
    assert ticks.due(4, now + TICK_EVERY_S * 1.1)  # the first start
    ticks.ticked(4, now + TICK_EVERY_S * 1.1)
    for clock in (44, 48, 52, 86, 92):  # near the hand-overs, within the quiet period
        assert not ticks.due(clock, now + TICK_EVERY_S * 3)
    assert not ticks.due(129, now + TICK_EVERY_S * 3)
    assert ticks.due(130, now + TICK_EVERY_S * 3)  # the last end


def test_a_hand_over_to_other_keys_or_another_table_or_after_a_gap_is_still_a_boundary():
    for second in (("items", np.arange(1, 101, dtype=np.int64), 50, 90), ("users", np.arange(100), 50, 90),
                   ("items", np.arange(100), 51, 90)):
        ticks, now = clocked(0.001, 5)
        ticks.ticked(5, now)
        ticks.note_intents([("items", np.arange(100), 10, 50), second])
        ticks.ticked(20, now + TICK_EVERY_S * 1.1)  # the first start served
        assert ticks.due(45, now + TICK_EVERY_S * 3), second


def test_an_intent_declared_after_the_one_it_carries_on_has_ended_is_a_boundary_again():
    ticks, now = clocked(0.001, 5)
    ticks.note_intents([("items", KEYS, 10, 20)])
    ticks.ticked(30, now)  # past its end
    ticks.note_intents([("items", KEYS, 20, 40)])  # carries on nothing any more: its end is a boundary
    assert ticks.due(40, now + TICK_EVERY_S * 1.1)


def test_carrying_on_an_intent_whose_end_was_already_served_leaves_other_boundaries_at_that_clock():
    ticks, now = clocked(0.001, 5)  # a lead of 7 clocks
    ticks.note_intents([("items", KEYS, 10, 20)])
    ticks.ticked(20, now)  # past 10 and at 20: both served
    ticks.note_intents([("users", KEYS, 20, 30), ("items", KEYS, 20, 40)])  # the users' start is a boundary
    assert ticks.due(21, now + TICK_EVERY_S * 1.1)


def test_an_array_filled_anew_with_the_next_clocks_keys_is_not_taken_for_the_same_keys():
    ticks, now = clocked(0.001, 5)  # a lead of 7 clocks
    ticks.ticked(0, now)
    buffer = np.arange(10, dtype=np.int64)
    ticks.note_intents([("ent", buffer, 10, 30)])
    buffer[:] = np.arange(10, 20)  # the app's next keys, in the same array
    ticks.note_intents([("ent", buffer, 30, 50)])
    ticks.ticked(4, now + TICK_EVERY_S * 1.1)  # the first start served
    assert ticks.due(23, now + TICK_EVERY_S * 2.2)  # 30 is where other keys start


class _CountingClocks(ZmqTransport):
    """Real sockets; counts the clock ticks sent on each connection, by the address it reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.clocks: Counter[str] = Counter()

    def connect(self, address: str) -> Connection:
        conn = super().connect(address)
        send = conn.send

        def counted(frames: Sequence[Any], block: bool = True) -> bool:
            if msgspec.msgpack.decode(bytes(frames[0]))["op"] == int(Op.CLOCK):
                self.clocks[address] += 1
            return send(frames, block)

        conn.send = counted  # type: ignore[method-assign]
        return conn


def test_a_worker_stops_telling_its_clock_to_a_server_whose_process_ended():
    """A tick to a server whose process ended only fills its socket's queue (nobody reads it; ticks
    are sent again until answered): a thousand in, the next tick waited 5 s for room and failed the
    worker, and with it a job that was to go on without that server (MF with a killed replica next
    to busy loops). The final clock at shutdown went the same way."""
    transport = _CountingClocks()
    with ThreadCluster(nodes=2, transport=ZmqTransport()) as c:
        w = Worker(c.spec, 0, 0, transport, local_access=False)
        c.workers.append(w)
        w.table("t", 100, 1, optimizer=shoal.optim.Sum()).push(np.arange(100), np.ones((100, 1), np.float32))
        live, dead = w.servers[0], w.servers[1]
        assert live is not None and dead is not None
        c.servers[1].stop()
        c.threads[1].join(timeout=10)
        c.rendezvous.server_exited(1)  # as its launcher says when the process ends
        w.replica_view.refresh(force=True)
        assert w.replica_view.exited == {1}
        told_live, told_dead = transport.clocks[live], transport.clocks[dead]
        end = time.monotonic() + 4 * TICK_QUIET_S  # ticks to every server at most every quiet period
        while time.monotonic() < end:
            w.advance_clock()
            time.sleep(0.002)
        assert transport.clocks[live] > told_live  # the live one still hears
        assert transport.clocks[dead] == told_dead
        started = time.monotonic()
        w.shutdown()
        assert transport.clocks[dead] == told_dead  # no final clock either, and no wait for one
        assert time.monotonic() - started < 2.0


def test_a_worker_whose_server_reads_its_clock_in_shared_memory_ticks_only_while_that_server_does_not():
    """Near an intent's start or end a worker ticked its node's server, so that it acted on the clock in
    time, though a server that is awake reads the clock in the worker's slot anyway. It now says when it
    last did, and a look since the clock was written serves as a tick: on KGE's 2 nodes the ticks to the
    two servers went from 50 a second to 27 (``server_cpu.md``)."""
    transport = _CountingClocks()
    with ThreadCluster(nodes=2, transport=ZmqTransport()) as c:
        w = Worker(c.spec, 0, 0, transport)  # co-located: its clock in shared memory
        c.workers.append(w)
        t = w.table("t", 100, 1, techniques="relocation")
        c.worker(1).table("t", 100, 1, techniques="relocation")
        here, adaptive = w.servers[0], c.servers[0].adaptive
        assert here is not None
        for _ in range(3):
            w.advance_clock()
        for clock in range(5, 45):  # a start and an end at every clock, in one intent message
            t.intent([2 * clock + 1], clock, clock + 1)
        w.send_intents()
        wait_until(lambda: int(adaptive.reached.intents_read[0]) == 1, what="the intents read")

        def ticks_over_clocks(look: bool) -> int:
            told = transport.clocks[here]
            for _ in range(15):  # clocks of 10 ms: near a boundary a tick every other clock
                time.sleep(0.01)
                if look:
                    adaptive._node_clock()  # the server looks, as its loop does whenever it is awake
                w.advance_clock()
            return transport.clocks[here] - told

        looked = ticks_over_clocks(True)
        assert looked <= 2, f"{looked} ticks with the server looking at every clock"  # the quiet period's
        # Without those looks the server's loop reads the slot at its own passes only: ticks go between.
        assert ticks_over_clocks(False) >= 3  # 6 here on a quiet machine


def test_a_worker_of_asp_tables_alone_ticks_every_clock_once_a_server_serves_a_table_read_under_a_bound():
    """A worker whose own tables are all ASP told servers its clock once a quiet period. A reader of a
    bounded table it never made waits on that clock all the same: its reads were answered up to a
    quiet period (250 ms) after the worker reached their clock. A server holding a table read under
    a bound says so in its answer to a tick, and the worker ticks every clock from then on. (A request
    of the worker tells a server its clock too: this one sends none.)"""
    pace_s, clocks = 0.03, 20
    reached: dict[int, float] = {}  # clock -> when the ASP worker reached it
    answered: dict[int, float] = {}  # clock -> when the bounded reader's read at that clock was answered
    with ThreadCluster(nodes=2, transport=ZmqTransport()) as c:

        def body(w: Worker) -> None:
            if w.rank == 0:
                bounded = w.table("bounded", 10, 1, consistency=shoal.BSP())
                w.barrier()
                for _ in range(clocks):
                    bounded.pull(KEYS)  # waits until every worker reached this clock
                    answered[w.clock] = time.monotonic()
                    w.advance_clock()
            else:
                w.table("free", 10, 1)  # ASP: reads never wait on clocks
                w.barrier()
                for _ in range(clocks):
                    time.sleep(pace_s)  # the slower worker, sending nothing else: the reader waits on it
                    w.advance_clock()
                    reached[w.clock] = time.monotonic()
            w.barrier()

        c.run_workers(body)
    lags = sorted(answered[clock] - reached[clock] for clock in range(1, clocks))
    # A tick a clock: the read follows the clock by a message's trip; by the quiet period, the median
    # read waited half a period (0.11-0.13 s here).
    assert lags[len(lags) // 2] < 0.05, f"reads answered {lags} s after the clock they waited for"
