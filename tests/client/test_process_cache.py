"""The process cache of a static table (``client.process_cache``) through real servers: what it takes
from servers' answers and eager pushes, and what it refuses."""

from __future__ import annotations

import time

import numpy as np

import shoal
from shoal.client.worker import Worker
from shoal.transport.zmq_transport import ZmqTransport
from shoal.wire.ops import Op
from tests.support.cluster import ThreadCluster
from tests.support.losing import workers_with_losses
from tests.support.waiting import wait_until


def _pumped(worker: Worker, seconds: float = 0.01) -> bool:
    worker.tracker.pump(seconds)
    return True


def test_a_reply_read_before_a_lost_eager_message_is_not_vouched_for_after_the_cache_is_forgotten():
    """ESSP(3). Worker 0 (at clock 3) pulls key j of server 1; the reply is lost. Worker 1 pushes +1
    to j at clock 0, and server 1's next eager message to worker 0 (carrying j = 1) is lost too. The
    gap is seen, the cache forgotten (``ProcessCache._lost``). Then worker 0's pull is sent again and
    server 1 answers it with the kept reply: j = 0, read before the lost message. ``forget`` reset
    every row's epoch and ``seen``, so the replayed rows are stored, and the next eager message's bump
    ("rows not resent did not change") vouches for j = 0 at clock 4. A read of j at clock 4 needs
    every update of clocks before 1 (worker 1's clock-0 push) and returns 0 from the cache."""
    state = {"armed": False, "forgotten": False, "rows_lost": 0, "replies_lost": 0}

    def lose(header: dict) -> bool:
        if not state["armed"] or header.get("table") != "t":
            return False
        if header["op"] == int(Op.ROWS) and not state["rows_lost"]:
            state["rows_lost"] += 1  # server 1's first eager message to worker 0: j = 1
            return True
        if header["op"] == int(Op.VALUES) and not state["forgotten"]:
            state["replies_lost"] += 1  # the pull's answer, and its repeats until the cache is forgotten
            return True
        return False

    with ThreadCluster(nodes=2, transport=ZmqTransport()) as c:
        w0, w1 = workers_with_losses(c, lose)
        t0, t1 = (w.table("t", 8, 1, optimizer=shoal.optim.Sum(), slices=2, consistency=shoal.ESSP(3))
                  for w in (w0, w1))
        assert t0.layout.owners.tolist() == [0, 1]
        j = np.array([int(t0.layout.mapping.keys_of(1)[0])])
        cache = t0.access.cache
        server1 = c.servers[1]
        for _ in range(3):
            w0.advance_clock()
        wait_until(lambda: _pumped(w0) and int(server1.sync.clocks.learned[0]) == 3, what="worker 0 at clock 3")

        state["armed"] = True
        pending = t0.pull_async(j)  # at clock 3, ESSP(3): served at once (j = 0); the answer is lost
        wait_until(lambda: _pumped(w0) and 0 in server1.tables["t"].subscribers(1), what="server 1 serving the pull")
        t1.push(j, np.ones((1, 1), np.float32))  # worker 1, clock 0
        w1.advance_clock()  # slowest 1 at server 1: eager message 1 (j = 1) to worker 0, lost
        wait_until(lambda: _pumped(w0) and state["rows_lost"] == 1, what="the first eager message lost")
        w1.advance_clock()  # slowest 2: eager message 2 (nothing changed) arrives: a gap
        wait_until(lambda: _pumped(w0) and bool(cache._eager_gap_since), what="worker 0 seeing the gap")
        time.sleep(0.2)
        w1.advance_clock()  # slowest 3: eager message 3; message 1 is taken as lost, the cache forgotten
        wait_until(lambda: _pumped(w0) and t0.counters["eager_gaps"] >= 1, what="worker 0 forgetting its cache")
        state["forgotten"] = True
        first = pending.result()  # the pull sent again, answered with the kept reply (j = 0, read at clock 0)
        assert state["replies_lost"] >= 1, "the pull's answer was never lost"
        np.testing.assert_array_equal(first[:, 0], [0.0])  # fine for a read at clock 3 under ESSP(3)

        # Counted before the clocks move: advance_clock takes in what has arrived, eager message 4 too.
        eager = t0.counters["eager_messages"]
        w1.advance_clock()
        w0.advance_clock()  # slowest 4 at server 1: eager message 4 bumps slice 1 to clock 4
        wait_until(lambda: _pumped(w0) and t0.counters["eager_messages"] > eager, what="eager message 4")
        np.testing.assert_array_equal(server1.tables["t"].pull(j)[:, 0], [1.0])
        read = t0.pull(j)  # clock 4, ESSP(3): must hold worker 1's clock-0 push
        assert read[0, 0] == 1.0, (f"read at clock 4 missed worker 1's clock-0 push: got {read[0, 0]} "
                                   f"(from cache: {t0.counters['rows_from_cache']} row(s))")
