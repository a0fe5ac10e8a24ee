"""Knowing at once that a process on this machine has ended, whatever ended it.

A co-located worker writes its node's rows into the server's shared memory
itself. If the server dies (SIGKILL), the memory stays mapped and a write into
it would look applied. A pidfd becomes readable when its process ends, a zombie
included, so one non-blocking poll before acknowledging a local call tells.
"""

from __future__ import annotations

import os
import select
import threading


class ProcessExit:
    """Whether process ``pid`` has ended, at the cost of one non-blocking poll."""

    def __init__(self, pidfd: int) -> None:
        self._pidfd = pidfd
        self._poll = select.poll()
        self._lock = threading.Lock()  # a poll object refuses concurrent poll() calls (threads of one worker)
        self._ended = pidfd < 0
        if pidfd >= 0:
            self._poll.register(pidfd, select.POLLIN)

    @classmethod
    def watch(cls, pid: int) -> ProcessExit | None:
        """None where it cannot be watched (no pid, or a kernel without pidfds)."""
        if pid <= 0 or not hasattr(os, "pidfd_open"):
            return None
        try:
            return cls(os.pidfd_open(pid))
        except ProcessLookupError:  # it has ended already
            return cls(-1)
        except OSError:  # pidfds are not available here
            return None

    def happened(self) -> bool:
        if self._ended:
            return True
        with self._lock:
            if not self._ended and self._poll.poll(0):
                self._ended = True
                self.close()
        return self._ended

    def close(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
