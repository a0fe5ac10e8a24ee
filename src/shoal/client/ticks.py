"""When a worker whose reads never wait on clocks (every table ASP) tells servers its clock.

No read waits on such a worker's clock, and servers learn it from every request it
sends, so it need not tick every clock: a fast loop (MF: about 1 ms a clock here)
spent 40% of its time on ticks, and the servers as much again answering them. What
does use the clock is the node's server acting on intents: it announces an intent's
keys a few clocks before the intent starts (its action window) and withdraws them
when it ends, by the clock it last heard. So a worker ticks to every server at most
every ``TICK_QUIET_S``, and to its node's server alone more often (at most every
``TICK_EVERY_S``, and at most every other clock up to ``ACT_EVERY_S``: ``spacing``)
from a few clocks before each clock where an intent it declared starts, and from each
clock where one ends, until a tick has gone out there. A tick
before an end serves nothing: the server withdraws the keys only once it has heard a
clock at or past it, and until then the keys' next user, announcing them, finds them
still held here and is sent a replica instead of the rows.

A clock where one intent ends and the next on the same table and keys starts (an
app declaring an epoch's rows epoch by epoch) changes nothing the server acts on:
it keeps a key while any intent holds it. It is no boundary here. MF declares its
items so, epochs of ~40 clocks, and with a lead of ~20 clocks half its clocks were
near one: its workers ticked every 5 ms for nothing, and the servers handled each
(``mf_movielens.md``).

Where clocks are slow, a tick per clock told the server more than it acts on: it acts on
intents in rounds at most every ``ACT_EVERY_S``, and reaches a few clocks ahead when it does.
KGE on 2 nodes (a clock about every 25 ms a worker) ticked every clock, 113 ticks a second to
the two servers; every other clock, 81, and the servers took 0.222 cores instead of 0.236, at the
same throughput and time to loss, with intents declared 4 batches ahead (at 8, the app's default
now, the difference is within the noise; ``server_cpu.md``, ``versions.md``). Fast clocks keep
the 5 ms spacing: MF (about a millisecond a clock) ticking every 50 ms instead ran 4-6% slower,
its rows moved later at epoch boundaries.

The quiet period is 250 ms. The node's server reads its workers' clocks in shared memory and
measures their pace from them (``AdaptiveService.seconds_per_clock``); what another node's server
does with a worker's clock under ASP alone is report staleness. At 50 ms the quiet ticks were
half of KGE's ticks on 2 nodes (79 a second to the two servers, 50 at 250 ms), and the servers took
0.183 cores instead of 0.204 at the same throughput (``server_cpu.md``). While the servers measured
the pace by the slowest clock of the whole job, a longer period made it jump with each tick from
another node, and the servers acted on intents in more, smaller rounds.

A worker's own tables are not all the job's: a reader of a bounded table it never made waits on its
clock too, and answered a quiet period after the clock it waited for (up to 250 ms a read). A server
serving a table read under a bound says so in its answer to a tick (the answers to the last ticks
are read at the clocks that follow, also in a worker that sends nothing else), and the worker ticks
every clock from then on.

A tick near a boundary tells the node's server a clock it reads in the worker's slot anyway, at
every pass of its loop, whenever it is awake. The server writes beside the slot when it last took
the clock there (``consistency.reached``), and a look since the worker wrote its clock counts as a
tick of it to that server: it serves the boundaries near that clock, and the spacing counts from it
(``looked``). So a co-located worker ticks its server only while the server sleeps. On KGE's 2
nodes the ticks to the two servers went from 51 a second to 27, and the servers took 0.178 cores
instead of 0.191 (``server_cpu.md``).
"""

from __future__ import annotations

import heapq
import itertools
import math

import numpy as np

from shoal.placement.intent import ACT_EVERY_S, ACTION_S

TICK_EVERY_S = 0.005
TICK_QUIET_S = 0.25
TICK_CLOCKS = 2  # clocks a tick to the node's server may stand for, where they are slow
_MAX_LEAD = 64  # clocks: the action window's own ceiling (``placement.intent.smoothed_window``)


class TickSchedule:
    """Whether a tick is due, given the clocks where declared intents start and end."""

    def __init__(self) -> None:
        self._starts: list[tuple[int, int]] = []  # a heap of (clock, id) where an intent starts
        self._stops: list[tuple[int, int]] = []  # a heap of (clock, id) where an intent ends
        self._queued: set[int] = set()  # the ids in the heaps
        self._dropped: set[int] = set()  # ids of ends found to be no boundary after all
        self._ends: dict[tuple[str, int], list[tuple[np.ndarray, int]]] = {}  # (table, end) -> (keys, id of end)
        self._ids = itertools.count()
        self._clock = 0  # the last clock ticked
        self._ticked_at = -math.inf  # the last tick to every server
        self._ticked_here_at = -math.inf  # the last tick to the node's server
        self._clock_s = 0.0  # seconds per clock lately
        self._clock_at: float | None = None

    def note_intents(self, intents: list[tuple[str, np.ndarray, int, int]]) -> None:
        """Intents (table, keys, start and end clocks) just told to the node's server."""
        for table, keys, start, end in intents:
            if end <= start:
                continue
            before = self._ends.get((table, start), [])
            carried = next((i for i, (k, _) in enumerate(before) if _same_keys(k, keys)), None)
            if carried is not None:  # the intent ending at start goes on: no boundary there
                _, end_id = before.pop(carried)
                if not before:
                    del self._ends[table, start]
                if end_id in self._queued:
                    self._dropped.add(end_id)
            else:
                self._push(self._starts, start)
            # A copy: an app may fill the same array with the next clock's keys (what the node's server
            # was sent is its own already).
            self._ends.setdefault((table, end), []).append((keys.copy(), self._push(self._stops, end)))

    def advanced(self, now: float) -> None:
        """The worker's clock moved on at ``now``."""
        if self._clock_at is not None:
            elapsed = now - self._clock_at
            self._clock_s = elapsed if not self._clock_s else 0.8 * self._clock_s + 0.2 * elapsed
        self._clock_at = now

    def everywhere(self, now: float) -> bool:
        """Whether a tick to every server is due: the quiet period has passed."""
        return now - self._ticked_at >= TICK_QUIET_S

    def due(self, clock: int, now: float) -> bool:
        """Whether a tick is due: to every server, or (the quiet period not over) to the node's."""
        if self.everywhere(now):
            return True
        if now - self._ticked_here_at < self.spacing():
            return False
        served_from = self._next_served_from()
        return served_from is not None and served_from <= clock

    def ticked(self, clock: int, now: float, everywhere: bool = True) -> None:
        """A tick of ``clock`` went out (to every server, or to the node's alone): the starts it came
        near and the ends it reached are served."""
        self._ticked_here_at = now
        if everywhere:
            self._ticked_at = now
        lead = self.lead()
        while self._starts and self._starts[0][0] - lead <= clock:
            self._queued.discard(heapq.heappop(self._starts)[1])
        while (end := self._next_end()) is not None and end <= clock:
            self._queued.discard(heapq.heappop(self._stops)[1])
        if clock > self._clock:  # intents over by now can no longer be carried on
            self._clock = clock
            for over in [at for at in self._ends if at[1] < clock]:
                del self._ends[over]

    def looked(self, clock: int, at: float) -> None:
        """The node's server took ``clock`` from this worker's slot in shared memory at ``at`` (its own
        look, ``consistency.reached``): as good as a tick of it to that server, sent then."""
        if at > self._ticked_here_at:
            self.ticked(clock, at, everywhere=False)

    def spacing(self) -> float:
        """The least time between two ticks to the node's server near a boundary: ``TICK_EVERY_S``, or
        where clocks take longer, a tick every ``TICK_CLOCKS`` clocks, up to ``ACT_EVERY_S`` (slower
        clocks each tick). Half a clock short of ``TICK_CLOCKS``: clocks a little faster than the
        average still tick every ``TICK_CLOCKS``, not one later."""
        return max(TICK_EVERY_S, min((TICK_CLOCKS - 0.5) * self._clock_s, ACT_EVERY_S))

    def _push(self, heap: list[tuple[int, int]], clock: int) -> int:
        boundary_id = next(self._ids)
        heapq.heappush(heap, (clock, boundary_id))
        self._queued.add(boundary_id)
        return boundary_id

    def _next_end(self) -> int | None:
        """The soonest end (entries found to be none dropped on the way)."""
        while self._stops and self._stops[0][1] in self._dropped:
            _, boundary_id = heapq.heappop(self._stops)
            self._dropped.discard(boundary_id)
            self._queued.discard(boundary_id)
        return self._stops[0][0] if self._stops else None

    def _next_served_from(self) -> int | None:
        """The first clock whose tick serves a boundary: a lead before the soonest start, or the
        soonest end."""
        candidates = [self._starts[0][0] - self.lead()] if self._starts else []
        if (end := self._next_end()) is not None:
            candidates.append(end)
        return min(candidates, default=None)

    def lead(self) -> int:
        """Clocks before a boundary from which a tick must go: more than the server's action window
        (``ACTION_S`` over the time a clock takes, plus one)."""
        if not self._clock_s:  # no clock timed yet: the narrowest window (a tick too early serves nothing)
            return 2
        return min(_MAX_LEAD, math.ceil(ACTION_S / self._clock_s) + 2)


def _same_keys(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two intents name the same keys in the same order."""
    return a.shape == b.shape and bool(np.array_equal(a, b))
