"""What a bounded read of a replicated shard must cover, from the clocks workers report. Pure.

A worker numbers its pushes to each shard 1, 2, 3, ... (the same number on
every replica it sends one to), and replicas apply each worker's pushes in
that order, so "every push of worker ``w`` made before clock ``t``" is one
entry of a version vector: origin ``w``, sequence number ``n_w(t)``, the
pushes ``w`` had numbered when it advanced to ``t``. Each clock tick carries
those counts. A read at clock ``c`` under bound ``s`` must cover
``{w: n_w(c - s)}`` for every worker: known once every worker has reported a
clock of at least ``c - s``. A replica holds the read until then and answers
with the requirement; the reader merges the replicas it reads and asks more of
them, or again, until the merge covers it (gossip brings what a replica lacks).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from shoal.api.ids import worker_origin
from shoal.consistency.clocks import FINISHED

_UNKNOWN = -1  # the incarnation of a worker not heard from since the table was made

@dataclass
class _Reports:
    """One worker's ticks: the clocks it reported and its push counts per shard at each."""

    incarnation: int
    clocks: list[int] = field(default_factory=list)
    counts: list[list[int]] = field(default_factory=list)


class PushCounts:
    """Per worker, its push counts per shard at each clock it reported (one replicated table)."""

    def __init__(self, num_workers: int, num_shards: int, bound: int, start: list[int] | None = None) -> None:
        """``start``: each worker's clock when the table was made, if known (it had pushed nothing to it)."""
        self.num_workers = num_workers
        self.num_shards = num_shards
        self.bound = bound
        self._workers: dict[int, _Reports] = {}
        #: per earlier process of a worker started again (its origin): its last push counts per shard,
        #: which every later read must still cover
        self._retired: dict[int, list[int]] = {}
        for rank, clock in enumerate(start or []):
            self._workers[rank] = _Reports(_UNKNOWN, [clock], [[0] * num_shards])
        #: every worker has reported a clock of at least this
        self.slowest = 0
        self._advance()

    def report(self, rank: int, incarnation: int, clock: int, counts: list[int] | None) -> bool:
        """Worker ``rank`` reached ``clock`` having numbered ``counts[s]`` pushes to shard ``s`` (None: as
        it last reported); True if the slowest reported clock advanced."""
        if not 0 <= rank < self.num_workers:
            return False
        reports = self._workers.get(rank)
        if reports is not None and reports.incarnation == _UNKNOWN:
            reports.incarnation = incarnation
        restarted = reports is not None and incarnation != reports.incarnation
        if reports is not None and restarted:
            if incarnation < reports.incarnation:
                return False  # a late tick of an earlier process
            # A new origin, from its new clock: its earlier process's pushes stay required, and the
            # slowest clock may go back (the new process holds readers back until it catches up).
            if reports.counts and any(reports.counts[-1]):
                self._retired[worker_origin(rank, reports.incarnation)] = list(reports.counts[-1])
        if reports is None or restarted:
            reports = self._workers[rank] = _Reports(incarnation)
        if reports.clocks and clock <= reports.clocks[-1]:
            return False  # a tick sent again, or overtaken by a later one
        if counts is None:
            counts = reports.counts[-1] if reports.counts else [0] * self.num_shards
        elif len(counts) != self.num_shards:
            return False
        reports.clocks.append(clock)
        reports.counts.append(list(counts))
        if restarted and len(self._workers) >= self.num_workers:
            self.slowest = min(r.clocks[-1] for r in self._workers.values())
            return False
        return self._advance()

    def finish(self, rank: int, incarnation: int, counts: list[int] | None) -> bool:
        """The worker has left: its last counts hold for every later clock."""
        return self.report(rank, incarnation, FINISHED, counts)

    def required(self, shard: int, clock: int) -> dict[int, int] | None:
        """The version vector a read covering every push made before ``clock`` must reach on ``shard``
        (origin -> seq); None while a worker has not reported ``clock`` yet."""
        if clock <= 0:
            return {}
        if clock > self.slowest:
            return None
        need = {origin: counts[shard] for origin, counts in self._retired.items() if counts[shard]}
        for rank, reports in self._workers.items():
            # A tick may be overtaken: the first clock reported at or after ``clock`` counts a few
            # pushes more than needed, which arrive all the same.
            at = bisect.bisect_left(reports.clocks, clock)
            count = reports.counts[at][shard]
            if count:
                need[worker_origin(rank, reports.incarnation)] = count
        return need

    def _advance(self) -> bool:
        if len(self._workers) < self.num_workers:
            return False
        slowest = min(r.clocks[-1] for r in self._workers.values())
        if slowest <= self.slowest:
            return False
        self.slowest = slowest
        # Reads come at clocks of at least the slowest: older ticks than the bound reaches are not needed.
        oldest = slowest - self.bound
        for reports in self._workers.values():
            drop = bisect.bisect_left(reports.clocks, oldest)
            if drop:
                del reports.clocks[:drop], reports.counts[:drop]
        return True
