"""Shared memory that never outlives its job, and row locks that die with their holder.

A segment is an anonymous ``memfd``: it has a label (visible in
``/proc/<pid>/fd``) but no name in ``/dev/shm``, so there is nothing to unlink.
The kernel frees it when the last process holding the descriptor or a mapping
exits, however it exits (SIGKILL of a worker, a server, or the whole job). Other
processes on the node receive the descriptor over a Unix socket
(``shoal.cluster.fdshare``).

Locks are POSIX record locks (``lockf``) on byte ranges of that same
descriptor. The kernel drops them when the holder dies, so a killed worker can
never leave a row locked. One byte stands for one stripe of rows.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading

import numpy as np
import numpy.typing as npt

from shoal.api.errors import ShoalError

PAGE = mmap.PAGESIZE
_HUGE_PAGE_WORTH = 4 << 20  # as numpy: ask for huge pages from 4 MiB up


def align(offset: int, to: int = PAGE) -> int:
    return (offset + to - 1) // to * to


class Segment:
    """A mapped shared-memory block, created here or attached from a descriptor."""

    def __init__(self, fd: int, label: str) -> None:
        self.fd = fd
        self.label = label
        self.size = os.fstat(fd).st_size
        self._map: mmap.mmap | None = mmap.mmap(fd, self.size) if self.size else None
        if self._map is not None and self.size >= _HUGE_PAGE_WORTH:
            # Rows are read at random: huge pages spare a TLB miss per row (1.35x on gathers here
            # with private memory). Shared memory gets them only where the kernel allows it for
            # shmem (transparent_hugepage/shmem_enabled "advise"); elsewhere this does nothing.
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
            except (AttributeError, OSError):
                pass

    @classmethod
    def create(cls, label: str, size: int) -> Segment:
        try:
            fd = os.memfd_create(label, os.MFD_CLOEXEC)
        except OSError as exc:  # pragma: no cover - platform specific
            raise ShoalError(f"cannot create shared memory segment {label!r}: {exc}") from exc
        try:
            os.ftruncate(fd, max(size, 1))
            return cls(fd, label)
        except OSError as exc:  # no memory or no descriptor left to map it with
            os.close(fd)
            raise ShoalError(f"cannot map shared memory segment {label!r} of {size} bytes: {exc}") from None

    @classmethod
    def attach(cls, fd: int, label: str) -> Segment:
        return cls(fd, label)

    def array(self, offset: int, shape: tuple[int, ...], dtype: npt.DTypeLike) -> np.ndarray:
        """A numpy view of part of the segment; writes are seen by every process."""
        dt = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        if self._map is None:
            raise ShoalError(f"segment {self.label!r} is closed")
        if offset + count * dt.itemsize > self.size:
            raise ShoalError(f"view of {count} x {dt} at {offset} overruns segment {self.label!r}")
        return np.frombuffer(self._map, dtype=dt, count=count, offset=offset).reshape(shape)

    def close(self) -> None:
        """Unmap and close. Views still alive keep the mapping until they are freed."""
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # numpy views still export the buffer; the GC unmaps later
            self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# Each range held costs two system calls (lock, unlock): beyond this many, holding every stripe (one
# range) costs less than the stripes left free could save (a few rows in scattered stripes took 24 calls).
_MAX_RUNS = 4

_THREAD_LOCKS: dict[tuple[int, int], threading.Lock] = {}
_THREAD_LOCKS_GUARD = threading.Lock()


def _thread_lock(fd: int) -> threading.Lock:
    """One thread lock per segment per process, however many descriptors map it here."""
    st = os.fstat(fd)
    with _THREAD_LOCKS_GUARD:
        return _THREAD_LOCKS.setdefault((st.st_dev, st.st_ino), threading.Lock())


class StripedLocks:
    """Reader/writer locks on stripes of rows, shared by every process of a node.

    Record locks belong to a process, not a thread, so a thread lock is taken
    first to exclude other threads of the same process, shared by every view
    of the segment in this process (a server and a worker may share one).
    """

    def __init__(self, fd: int, num_stripes: int = 64) -> None:
        self.fd = fd
        self.num_stripes = num_stripes
        self._threads = _thread_lock(fd)
        # Every stripe, the hold of most calls of more than a few rows: made once and shared, as what it
        # keeps between its enter and exit (how many ranges it locked) changes only under the thread lock.
        self._every = {exclusive: _Held(self, [(0, num_stripes)], fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
                       for exclusive in (True, False)}

    @property
    def thread_lock(self) -> threading.Lock:
        """The lock that excludes this process's other threads, taken before any record lock."""
        return self._threads

    def hold(self, rows: np.ndarray | None, exclusive: bool, first_stripe: bool = False) -> _Held:
        """Lock the stripes that ``rows`` touch (all stripes if ``rows`` is None), and stripe 0 too where
        ``first_stripe`` (it guards what the node's processes share beside the rows)."""
        if rows is None or rows.shape[0] * 4 >= self.num_stripes:
            return self._every[exclusive]
        runs = self._runs(rows)
        if first_stripe and runs[0][0] != 0:
            runs.insert(0, (0, 1))
        if len(runs) > _MAX_RUNS:
            return self._every[exclusive]
        return _Held(self, runs, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)

    def _runs(self, rows: np.ndarray) -> list[tuple[int, int]]:
        """Contiguous byte ranges to lock, as (start, length)."""
        if rows.shape[0] == 1:  # the most frequent request of all: no array work
            return [(int(rows[0]) % self.num_stripes, 1)]
        stripes = np.unique(rows % self.num_stripes)
        runs: list[tuple[int, int]] = []
        for s in stripes.tolist():
            if runs and runs[-1][0] + runs[-1][1] == s:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((s, 1))
        return runs


class _Held:
    """The stripes of one ``StripedLocks.hold``, locked for the ``with`` block (a plain class: a
    generator-based context manager costs more than the locking on small requests)."""

    __slots__ = ("locks", "runs", "mode", "taken")

    def __init__(self, locks: StripedLocks, runs: list[tuple[int, int]], mode: int) -> None:
        self.locks, self.runs, self.mode = locks, runs, mode
        self.taken = 0

    def __enter__(self) -> None:
        fd = self.locks.fd
        self.locks._threads.acquire()
        try:
            for start, length in self.runs:  # ascending order: no deadlock between holders
                fcntl.lockf(fd, self.mode, length, start, os.SEEK_SET)
                self.taken += 1
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc: object) -> None:
        fd = self.locks.fd
        try:
            for start, length in reversed(self.runs[: self.taken]):
                fcntl.lockf(fd, fcntl.LOCK_UN, length, start, os.SEEK_SET)
        finally:
            self.taken = 0
            self.locks._threads.release()
