"""Waiting in tests: for a condition, bounded in time, failing with what was awaited."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def wait_until(check: Callable[[], bool], timeout: float = 10.0, what: str = "the condition") -> None:
    """Poll ``check`` every 10 ms until it holds; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout}s"
        time.sleep(0.01)


def wait_for_json(path: Path, timeout: float = 60) -> Any:
    """The JSON a process writes to ``path`` once it is there whole; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            try:
                return json.loads(path.read_text())
            except json.JSONDecodeError:
                pass  # still being written
        time.sleep(0.05)
    raise AssertionError(f"{path} did not appear within {timeout}s")
