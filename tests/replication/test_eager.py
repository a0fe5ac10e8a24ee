"""A replica's subscribers under ESSP: each message carries the rows changed since the last one."""

from __future__ import annotations

import numpy as np

import shoal
from shoal.replication.eager import Subscribers
from shoal.replication.replica import ShardReplica


def test_each_message_carries_the_subscribed_rows_changed_since_the_last_one_numbered_per_worker():
    spec = shoal.TableSpec("t", 8, 1, replicas=2, consistency=shoal.ESSP(1), optimizer=shoal.optim.Sum())
    replica = ShardReplica(spec, 0, np.arange(8), node=0)
    subs = Subscribers()
    replica.push(np.array([1]), np.ones((1, 1)), origin=5, seq=1)  # before the read: in its answer
    assert subs.subscribe(0, b"w0", replica, np.array([1, 2, 3])) == 0
    replica.push(np.array([2, 6]), np.ones((2, 1)), origin=5, seq=2)  # row 6: nobody reads it
    [due] = subs.due(replica, clock=4)
    assert (due.worker, due.seq, due.covers, due.rows.tolist()) == (0, 1, 4, [2])
    assert subs.due(replica, clock=4) == [] and not subs.waiting(0, 4)
    assert subs.waiting(0, 5)
    [due] = subs.due(replica, clock=5)  # nothing changed: a message all the same, saying clock 5
    assert (due.seq, due.rows.tolist()) == (2, [])
    assert subs.subscribe(0, b"w0", replica, np.array([6])) == 2  # read again: the series goes on
    subs.drop(0)
    assert len(subs) == 0
