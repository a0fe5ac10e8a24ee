"""A one-line progress bar on stderr (redrawn with \\r), no dependencies."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, label: str = "", width: int = 30, every_s: float = 0.2) -> None:
        self.total = max(total, 1)
        self.label = label
        self.width = width
        self.every_s = every_s
        self.done = 0
        self.start = time.perf_counter()
        self._last = 0.0

    def update(self, n: int, note: str = "") -> None:
        self.done += n
        now = time.perf_counter()
        if now - self._last >= self.every_s or self.done >= self.total:
            self._last = now
            frac = min(self.done / self.total, 1.0)
            bar = "#" * int(frac * self.width)
            sys.stderr.write(f"\r{self.label} [{bar:<{self.width}}] {frac:6.1%} {note}")
            sys.stderr.flush()

    def close(self, note: str = "") -> None:
        self.update(0, note)
        sys.stderr.write("\n")
        sys.stderr.flush()
