"""Warnings that may come in floods (bad messages from a hostile or broken peer, a full queue):
logged once per interval per kind, with how many there were."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable

#: at most one warning of a kind this often
EVERY_S = 10.0


class ThrottledWarnings:
    """Each kind's first warning is logged at once; the next only ``every_s`` later, saying how many
    of that kind came meanwhile. A peer cannot flood the log (thousands of lines a second)."""

    def __init__(self, log: logging.Logger, every_s: float = EVERY_S,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.log = log
        self.every_s = every_s
        self.now = now
        self._since: dict[Hashable, tuple[int, float]] = {}  # kind -> (count since logged, logged at)

    def warn(self, kind: Hashable, message: str, *args: object) -> None:
        count, logged_at = self._since.get(kind, (0, -self.every_s))
        count += 1
        now = self.now()
        if now - logged_at < self.every_s:
            self._since[kind] = (count, logged_at)
            return
        if count > 1:
            message += f" ({count} such in the last {now - logged_at:.0f}s)"
        self.log.warning(message, *args)
        self._since[kind] = (0, now)

    def forget(self, kind: Hashable) -> None:
        """Drop what is kept of ``kind`` (a peer that left)."""
        self._since.pop(kind, None)
