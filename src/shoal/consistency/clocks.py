"""Worker clocks as one server knows them."""

from __future__ import annotations

import numpy as np

#: the clock of a worker that has left: it never holds anyone back again
FINISHED = np.iinfo(np.int64).max // 4


class ClockTable:
    """``clocks[w]`` = iterations worker ``w`` has completed, as learned from its messages.

    A message a worker sends at clock ``c`` comes after every push it made in
    iterations before ``c`` on the same connection, so any message carrying
    ``c`` proves those pushes have arrived. The array may live in shared memory
    so that co-located workers check bounds without asking.
    """

    def __init__(self, clocks: np.ndarray) -> None:
        self.clocks = clocks
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

    def observe(self, worker: int, clock: int) -> bool:
        """Learn that ``worker`` reached ``clock``; True if the slowest clock advanced."""
        if not 0 <= worker < self.clocks.shape[0] or clock <= self.clocks[worker]:
            return False
        was_slowest = self.clocks[worker] == self._min
        self.clocks[worker] = clock
        if was_slowest:
            new_min = int(self.clocks.min())
            if new_min > self._min:
                self._min = new_min
                return True
        return False

    def finish(self, worker: int) -> bool:
        return self.observe(worker, int(FINISHED))

    def behind(self, required: int) -> list[int]:
        """Workers whose clock is below ``required``."""
        return [int(w) for w in np.flatnonzero(self.clocks < required)]
