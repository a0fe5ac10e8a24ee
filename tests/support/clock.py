"""A clock a test moves by hand, for the timers that take one (``now=``)."""

from __future__ import annotations

import threading


class ManualClock:
    """Starts at ``start`` seconds and moves only by ``advance``; safe to read from server threads."""

    def __init__(self, start: float = 1000.0) -> None:
        self._t = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._t

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._t += seconds
