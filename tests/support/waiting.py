"""Waiting in tests: for a condition, bounded in time, failing with what was awaited."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(check: Callable[[], bool], timeout: float = 10.0, what: str = "the condition") -> None:
    """Poll ``check`` every 10 ms until it holds; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout}s"
        time.sleep(0.01)
