"""Worker clocks as one server knows them."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

#: the clock of a worker that has left: it never holds anyone back again
FINISHED = np.iinfo(np.int64).max // 4


class ClockTable:
    """``clocks[w]`` = iterations worker ``w`` has completed, as learned from its messages.

    A worker's messages to a server are handled in the order it sent them
    (``server.streams``), so one carrying clock ``c`` comes after every push the
    worker made to this server in iterations before ``c``. A slice that moved
    here may still receive pushes the worker first sent elsewhere (by an older
    layout), which come here once refused: until the worker confirms it knows
    the move and those pushes have landed, its clock here is *fenced*: counted
    only up to its settled clock, the iteration of its oldest push not yet
    acknowledged, which every message of it reports. ``clocks`` (which may live
    in shared memory, so co-located workers check bounds without asking) holds
    the clocks counted.
    """

    def __init__(self, clocks: np.ndarray) -> None:
        self.clocks = clocks
        self.learned = clocks.copy()
        #: per worker, every push of iterations before this was acknowledged (as last reported)
        self.settled = clocks.copy()
        self.fenced: set[int] = set()
        #: called with a worker's number when it was started again (``restart``), as it is learnt
        self.on_restart: list[Callable[[int], None]] = []
        self._min = int(clocks.min()) if clocks.size else FINISHED

    @classmethod
    def fresh(cls, num_workers: int) -> ClockTable:
        return cls(np.zeros(num_workers, dtype=np.int64))

    @property
    def num_workers(self) -> int:
        return int(self.clocks.shape[0])

    @property
    def slowest(self) -> int:
        """``m``: every update of iterations before ``m`` has arrived from every worker."""
        return self._min

    def observe(self, worker: int, clock: int, settled: int | None = None) -> bool:
        """Learn that ``worker`` reached ``clock`` (with every push before ``settled`` acknowledged);
        True if the slowest clock advanced."""
        if not 0 <= worker < self.clocks.shape[0]:
            return False
        if settled is not None and settled > self.settled[worker]:
            self.settled[worker] = settled
        elif clock <= self.learned[worker]:
            return False
        self.learned[worker] = max(clock, int(self.learned[worker]))
        return self._set(worker)

    def restart(self, worker: int, clock: int, settled: int) -> None:
        """``worker`` was started again (a new incarnation) and goes on from ``clock``: what its earlier
        process reached, or a ``finish``, no longer counts; it holds readers back again until it
        catches up."""
        if not 0 <= worker < self.clocks.shape[0]:
            return
        self.learned[worker] = clock
        self.settled[worker] = settled
        self._set(worker)
        for restarted in self.on_restart:
            restarted(worker)

    def finish(self, worker: int) -> bool:
        """The worker has left, every push of it applied: it never holds anyone back again."""
        if not 0 <= worker < self.clocks.shape[0]:
            return False
        self.fenced.discard(worker)
        self.learned[worker] = self.settled[worker] = FINISHED
        return self._set(worker)

    def fence(self, worker: int) -> None:
        """Count ``worker`` only up to its settled clock until ``unfence``."""
        if 0 <= worker < self.clocks.shape[0] and self.learned[worker] < FINISHED:
            self.fenced.add(worker)
            self._set(worker)

    def unfence(self, worker: int) -> bool:
        """Lift ``worker``'s fence; True if the slowest clock advanced."""
        if worker not in self.fenced:
            return False
        self.fenced.discard(worker)
        return self._set(worker)

    def _set(self, worker: int) -> bool:
        clock = int(self.learned[worker])
        if worker in self.fenced:
            clock = min(clock, int(self.settled[worker]))
        if clock == self.clocks[worker]:
            return False
        was_slowest = self.clocks[worker] == self._min
        self.clocks[worker] = clock
        if clock < self._min:  # a fence lowered it
            self._min = clock
            return False
        if was_slowest:
            new_min = int(self.clocks.min())
            if new_min > self._min:
                self._min = new_min
                return True
        return False

    def behind(self, required: int) -> list[int]:
        """Workers whose clock is below ``required``."""
        return [int(w) for w in np.flatnonzero(self.clocks < required)]
