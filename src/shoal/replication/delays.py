"""Bounded samples of delays, and the survival function the model needs."""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable

import numpy as np

#: samples taken this close together came with one gossip round (one message's updates, added at once)
_ONE_ROUND_S = 0.05


class DelaySamples:
    """The most recent ``capacity`` delays (seconds) of one kind, with when each was taken."""

    def __init__(self, capacity: int = 4096, now: Callable[[], float] = time.monotonic) -> None:
        self._samples: deque[float] = deque(maxlen=capacity)
        self._taken: deque[float] = deque(maxlen=capacity)
        self._sorted: np.ndarray | None = None
        self.now = now

    def add(self, seconds: float) -> None:
        self._samples.append(max(0.0, float(seconds)))
        self._taken.append(self.now())
        self._sorted = None

    def extend(self, values: list[float]) -> None:
        for v in values:
            self.add(v)

    def __len__(self) -> int:
        return len(self._samples)

    def sorted(self) -> np.ndarray:
        if self._sorted is None:
            self._sorted = np.sort(np.fromiter(self._samples, dtype=np.float64, count=len(self._samples)))
        return self._sorted

    def survival(self, x: np.ndarray) -> np.ndarray:
        """P(delay > x) for each x, from the samples (0 where there are none)."""
        s = self.sorted()
        if not s.size:
            return np.zeros_like(x, dtype=np.float64)
        return 1.0 - np.searchsorted(s, x, side="right") / s.size

    def quantile(self, q: float) -> float:
        s = self.sorted()
        return float(np.quantile(s, q)) if s.size else 0.0

    def values(self) -> list[float]:
        return list(self._samples)

    def recent(self, window_s: float, at_least: int, at_most: int) -> list[float]:
        """The samples of the last ``window_s`` seconds (at least the ``at_least`` latest), evenly
        thinned to at most ``at_most``: delays change when gossip does, and a model fitted from older
        samples goes on promising what the old delays allowed. Thinned, not cut to the latest: a
        gossip round brings its updates oldest first, so the latest samples of a window are the
        shortest delays of the last round, and a model fitted from them promised fresh reads that
        the longer delays broke."""
        n = len(self._samples)
        start = bisect.bisect_left(self._taken, self.now() - window_s)
        if n - start < at_least and n:
            # Too few that recent (gossip slower than the window): the latest rounds whole, not only
            # their last samples, which are their shortest delays.
            start = bisect.bisect_left(self._taken, self._taken[max(n - at_least, 0)] - _ONE_ROUND_S)
        count = n - start
        if not count:
            return []
        window = list(self._samples)[-count:]
        if count <= at_most:
            return window
        return [window[i * count // at_most] for i in range(at_most)]
