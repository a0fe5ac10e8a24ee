"""Eager pushes of a replicated table's rows to the workers that read them (ESSP). Pure.

A worker's pull with ``subscribe`` makes the replica it asks the worker's home
for that shard and adds the rows read to the worker's subscription there.
Each time the workers' clock ticks tell what a read at a later clock ``t``
must cover and the replica holds all of it, the replica sends the worker its
subscribed rows that changed since its previous message, saying that its rows
cover ``t``. Messages are numbered per worker and shard: the rows a message
leaves out did not change, which the worker relies on only while it has had
every message before it (``client.replica_cache``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shoal.replication.replica import ShardReplica


@dataclass
class Subscription:
    """What one worker reads of one shard here, and what it has been sent."""

    peer: bytes
    rows: np.ndarray  # one flag per row of the shard
    sent_at: int  # the replica's change count when its rows last went out (or were read)
    covers: int = 0  # the clock the last message covered
    seq: int = 0  # the last message's number


@dataclass(frozen=True)
class EagerRows:
    """One message due: the subscribed rows of ``shard`` that changed, for ``worker``."""

    worker: int
    peer: bytes
    shard: int
    rows: np.ndarray
    seq: int
    covers: int


class Subscribers:
    """The subscriptions to one replicated table's replicas on this server."""

    def __init__(self) -> None:
        self._subs: dict[tuple[int, int], Subscription] = {}

    def subscribe(self, worker: int, peer: bytes, replica: ShardReplica, rows: np.ndarray) -> int:
        """Add ``rows`` to the worker's subscription to ``replica`` (read just now, so they count as sent);
        returns the number of the last message sent to it."""
        sub = self._subs.get((worker, replica.shard))
        if sub is None:
            sub = self._subs[(worker, replica.shard)] = Subscription(
                peer, np.zeros(replica.num_rows, dtype=np.bool_), replica.changes)
        sub.peer = peer  # a worker that reconnected is reached at its new address
        sub.rows[rows] = True
        return sub.seq

    def waiting(self, shard: int, clock: int) -> bool:
        """Whether a subscriber of ``shard`` has not been told of ``clock`` yet."""
        return any(s == shard and sub.covers < clock for (_, s), sub in self._subs.items())

    def due(self, replica: ShardReplica, clock: int) -> list[EagerRows]:
        """The messages telling every subscriber of ``replica`` not told of ``clock`` yet that its rows
        cover it (the caller has checked that they do), each with its rows changed since its last one."""
        due = []
        for (worker, shard), sub in self._subs.items():
            if shard != replica.shard or sub.covers >= clock:
                continue
            rows = np.flatnonzero(sub.rows & (replica.changed_at > sub.sent_at))
            sub.sent_at, sub.covers, sub.seq = replica.changes, clock, sub.seq + 1
            due.append(EagerRows(worker, sub.peer, shard, rows, sub.seq, clock))
        return due

    def drop(self, worker: int) -> None:
        """``worker`` has left: nothing more goes to it."""
        self._subs = {key: sub for key, sub in self._subs.items() if key[0] != worker}

    def __len__(self) -> int:
        return len(self._subs)
