"""A job process's life: tied to its launcher's (no child outlives a killed job), its memory habits,
and the launcher's wait for its children."""

from __future__ import annotations

import ctypes
import gc
import os
import select
import signal
import time
from collections.abc import Iterable
from typing import Any, Protocol

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15

_prctl: Any
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # pragma: no cover - non-Linux
    _prctl = None


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent exits (Linux).

    Safe to call between fork and exec: it only makes one system call.
    """
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def name_process(name: str) -> None:
    """Name this process as ``ps -o comm`` and ``top`` show it (Linux; at most 15 bytes): a process
    forked from the launcher would otherwise go by the launcher's name."""
    if _prctl is not None:
        _prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_large_buffers() -> None:
    """Stop glibc from returning every large buffer to the kernel on free.

    Pulls and pushes allocate and free buffers of megabytes many times a
    second; by default each one is a fresh mmap whose pages fault in on first
    touch. Serving them from the heap instead keeps the pages mapped.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        return
    mallopt(_M_MMAP_THRESHOLD, 256 << 20)
    mallopt(_M_TRIM_THRESHOLD, 512 << 20)


def keep_startup_objects() -> None:
    """Take what the process has made so far (its modules, classes, the imported libraries' objects)
    out of the cyclic collector's sight: they live as long as the process, yet every full collection
    walked them all, and so did the interpreter's exit, about 0.1 s of every job process's end."""
    gc.freeze()


def bind_to_launcher(launcher: int | None) -> None:
    """For a process started by a launcher: die with it, and exit now if it is gone already."""
    if launcher is None:
        return
    if os.getppid() == launcher:
        die_with_parent()
        if os.getppid() != launcher:  # the launcher died before the call above took effect
            os._exit(1)
    else:
        try:
            os.kill(launcher, 0)
        except ProcessLookupError:
            os._exit(1)


class ChildProcess(Protocol):
    """What the launcher's wait needs of a child: a ``subprocess.Popen`` or a forked one."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...


def wait_for_an_exit(children: Iterable[ChildProcess], timeout_s: float) -> None:
    """Return as soon as one of ``children`` has ended, or after ``timeout_s``: a launcher that slept
    its whole polling period would add it to every job's end."""
    exits: list[int] = []
    try:
        for child in children:
            if child.returncode is None:
                try:
                    exits.append(os.pidfd_open(child.pid))
                except OSError:  # reaped meanwhile, or no pidfd here: the timeout still bounds the wait
                    pass
        if not exits:
            time.sleep(timeout_s)
            return
        poller = select.poll()
        for fd in exits:
            poller.register(fd, select.POLLIN)
        poller.poll(timeout_s * 1000)
    finally:
        for fd in exits:
            os.close(fd)
