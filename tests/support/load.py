"""An oversubscribed CPU: busy-loop processes beside a job, as other jobs of a shared machine would be.

Each loop is a separate process (the GIL would serialise threads) that ends by itself after
``limit_s`` even if its parent dies, and is killed when the context ends.
"""

from __future__ import annotations

import subprocess
import sys
from types import TracebackType

_LOOP = """
import time
end = time.monotonic() + {limit_s}
while time.monotonic() < end:
    sum(range(10_000))
"""


class BusyCPUs:
    """``count`` busy loops for at most ``limit_s`` seconds each."""

    def __init__(self, count: int = 3, limit_s: float = 300.0) -> None:
        self.count, self.limit_s = count, limit_s
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> BusyCPUs:
        code = _LOOP.format(limit_s=self.limit_s)
        self.procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(self.count)]
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait(timeout=10)
