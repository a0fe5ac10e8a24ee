"""When a worker whose reads never wait on clocks (every table ASP) tells servers its clock.

No read waits on such a worker's clock, and servers learn it from every request it
sends, so it need not tick every clock: a fast loop (MF: about 1 ms a clock here)
spent 40% of its time on ticks, and the servers as much again answering them. What
does use the clock is the node's server acting on intents: it announces an intent's
keys a few clocks before the intent starts (its action window) and withdraws them
when it ends, by the clock it last heard. So a worker ticks to every server at most
every ``TICK_QUIET_S``, and to its node's server alone more often (at most every
``TICK_EVERY_S``) from a few clocks before each clock where an intent it declared
starts or ends, until a tick has gone out there.
"""

from __future__ import annotations

import heapq
import math

from shoal.placement.intent import ACTION_S

TICK_EVERY_S = 0.005
TICK_QUIET_S = 0.05
_MAX_LEAD = 64  # clocks: the action window's own ceiling (``placement.intent.smoothed_window``)


class TickSchedule:
    """Whether a tick is due, given the clocks where declared intents start and end."""

    def __init__(self) -> None:
        self._boundaries: list[int] = []  # a heap of clocks where an intent starts or ends
        self._ticked_at = -math.inf  # the last tick to every server
        self._ticked_here_at = -math.inf  # the last tick to the node's server
        self._clock_s = 0.0  # seconds per clock lately
        self._clock_at: float | None = None

    def note_intents(self, intents: list[tuple[int, int]]) -> None:
        """Intents (start and end clocks) just told to the node's server."""
        for start, end in intents:
            heapq.heappush(self._boundaries, start)
            heapq.heappush(self._boundaries, end)

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
        if now - self._ticked_here_at < TICK_EVERY_S:
            return False
        return bool(self._boundaries) and self._boundaries[0] - self.lead() <= clock

    def ticked(self, clock: int, now: float, everywhere: bool = True) -> None:
        """A tick of ``clock`` went out (to every server, or to the node's alone): the boundaries it
        came near or passed are served."""
        self._ticked_here_at = now
        if everywhere:
            self._ticked_at = now
        lead = self.lead()
        while self._boundaries and self._boundaries[0] - lead <= clock:
            heapq.heappop(self._boundaries)

    def lead(self) -> int:
        """Clocks before a boundary from which a tick must go: more than the server's action window
        (``ACTION_S`` over the time a clock takes, plus one)."""
        if not self._clock_s:  # no clock timed yet: the narrowest window (a tick too early serves nothing)
            return 2
        return min(_MAX_LEAD, math.ceil(ACTION_S / self._clock_s) + 2)
