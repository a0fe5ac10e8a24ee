"""Fixtures every test gets: no child process and no shared memory outlives a test."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings

from shoal.storage import kernels

# First calls compile numba kernels; a per-example deadline would flag that, not a bug.
settings.register_profile("shoal", deadline=None)
settings.load_profile("shoal")


#: processes a module fixture keeps for several tests (a local Ray instance); they and
#: their descendants are that fixture's to reap, not each test's
LONG_LIVED: set[int] = set()


def _children(pid: int, skip: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """Live descendants of ``pid`` (from /proc), not entering ``skip``."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z":
            parents[int(entry.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p and c not in skip]
        found += kids
        frontier += kids
    return found


def shoal_segment_holders(cluster_id: str = "") -> list[int]:
    """Pids of processes that still map or hold a Shoal shared-memory segment."""
    holders = []
    needle = f"memfd:shoal-{cluster_id}"
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "maps").read_text():
                holders.append(int(entry.name))
        except OSError:
            continue
    return holders


@pytest.fixture(autouse=True)
def reap_children():
    """Fail a test that leaves child processes behind, after killing them."""
    yield
    deadline = time.monotonic() + 5
    left = _children(os.getpid(), LONG_LIVED)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = _children(os.getpid(), LONG_LIVED)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"test left child processes behind: {left}"


@pytest.fixture(scope="session", autouse=True)
def kernels_compiled():
    """numba's kernels compiled (or loaded from its cache) before the first test. From a cold cache
    (a fresh checkout) that takes about 9 s of CPU, which on a busy machine outlasted the 10-s
    request timeout of the first test to create a table: a test of compile time, not of Shoal.
    Processes the tests start load the kernels from the cache this writes."""
    for dtype in (np.float32, np.float64):
        kernels.warm_up(dtype)
    _lane_compiled()


def _lane_compiled() -> None:
    """The lane's kernels (``server.lane``, ``client.lane``) too, by a read on a lane of this process's
    own: each launched server and worker compiles them at its first lane request otherwise, all at
    once on a fresh checkout."""
    import zmq

    from shoal.client.lane import WorkerLane
    from shoal.server.lane import ServerLane
    from shoal.server.streams import StreamOrder

    ctx = zmq.Context()
    served = ServerLane(0, ctx, "127.0.0.1", bytes(32), np.zeros(1, np.int64), StreamOrder(1), resend_s=1.0)
    asking = WorkerLane(ctx, served.address, bytes(32), timeout_s=10.0)
    try:
        served.warm()
        rows = np.zeros(1, np.int64)
        pending = asking.send(lambda: (1, 1), 0, 1, rows, rows, 0, (0, 0), np.empty((1, 1), np.float32))
        assert pending is not None
        served.pump({}, {}, set())
        asking.collect(pending, wait=True)
    finally:
        asking.close()
        served.close()
        ctx.term()


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left():
    """The suite leaves nothing in /dev/shm."""
    before = {p.name for p in Path("/dev/shm").iterdir()} if Path("/dev/shm").exists() else set()
    yield
    after = {p.name for p in Path("/dev/shm").iterdir()} if Path("/dev/shm").exists() else set()
    leaked = sorted(after - before)
    assert not leaked, f"tests left shared memory in /dev/shm: {leaked}"
