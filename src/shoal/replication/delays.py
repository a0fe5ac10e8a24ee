"""Bounded samples of delays, and the survival function the model needs."""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable

import numpy as np


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
        """The samples of the last ``window_s`` seconds (at least the ``at_least`` latest, at most the
        ``at_most`` latest): delays change when gossip does, and a model fitted from older samples
        goes on promising what the old delays allowed."""
        start = bisect.bisect_left(self._taken, self.now() - window_s)
        count = min(max(len(self._samples) - start, at_least), at_most)
        return list(self._samples)[-count:] if count else []
