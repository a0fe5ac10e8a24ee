"""Co-located workers update shared-memory rows exactly, beside remote pushes to the same rows."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import shoal
from tests.support.cluster import ThreadCluster

PROBE = str(Path(__file__).resolve().parents[1] / "scripts" / "probe_worker.py")


def test_counting_four_workers_on_two_nodes_lose_no_update(tmp_path):
    """W=4 workers (2 per node) each push +1 to all 1000 keys M times, 4 pushes in flight."""
    repeats = 25
    proc = subprocess.run(
        [sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", "2", "--workers-per-node", "2", "--",
         sys.executable, PROBE, str(tmp_path), "count", str(repeats)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    counts = np.array(json.loads((tmp_path / "counts.json").read_text()))
    expected = np.full(1000, 4 * repeats * 4, dtype=np.float64)
    expected[[7, 993]] *= 2  # each push names these keys twice
    np.testing.assert_array_equal(counts, expected)


def test_local_and_remote_access_give_identical_results():
    """The same pushes through shared memory and through a server land identically."""
    results = []
    for local_access in (True, False):
        with ThreadCluster(nodes=2) as c:
            w = c.worker(0, local_access=local_access)
            t = w.table("adagrad", 200, 8, init=shoal.Normal(std=0.1), optimizer=shoal.optim.Adagrad(lr=0.05))
            rng = np.random.default_rng(0)
            for _ in range(20):
                keys = rng.integers(0, 200, 64)
                t.push(keys, rng.standard_normal((64, 8)).astype(np.float32))
            results.append(t.pull(np.arange(200)))
    np.testing.assert_array_equal(results[0], results[1])


@pytest.mark.parametrize("locking", ["exact", "hogwild"])
def test_local_threads_of_one_worker_process_share_rows(locking):
    """Threads of one process share one record lock; the thread lock must still exclude them."""
    import threading

    with ThreadCluster(nodes=1) as c:
        t = c.worker(0).table("threads", 16, 4, locking=locking)
        keys = np.arange(16)
        ones = np.ones((16, 4), np.float32)

        def hammer() -> None:
            for _ in range(200):
                t.push(keys, ones)

        threads = [threading.Thread(target=hammer) for _ in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        total = t.pull(keys)
        if locking == "exact":
            np.testing.assert_array_equal(total, 800.0)
        else:
            assert (total <= 800.0).all()


def test_an_adaptive_tables_segment_is_not_held_after_the_worker_shut_down_and_the_job_ended():
    """A worker maps its node's rows and ``Worker.shutdown`` closes each table's access. An adaptive
    table's store never was closed (``AdaptiveAccess`` had no ``close``, nor did ``lose_local`` keep
    it to close), so the worker process kept the memfd of the whole node-wide table open after the job
    ended, even once every object was collected: a notebook, an actor or a process running jobs one
    after another never freed the table's memory."""
    with ThreadCluster(nodes=1) as c:
        cluster_id = c.spec.cluster_id
        w = c.worker(0)
        t = w.table("leak", 1000, 16, techniques="relocation")
        t.push(np.arange(10), np.ones((10, 16), np.float32))
        assert t.pull(np.arange(10))[0, 0] == 1.0
        w.shutdown()
    del t, w, c
    gc.collect()
    left = _memfds_of(cluster_id)
    assert left == [], f"segments of the ended job still open in this process: {left}"


def _memfds_of(cluster_id: str) -> list[str]:
    """The descriptors of this process that are memfd segments of cluster ``cluster_id``."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(f"/memfd:shoal-{cluster_id}-"):
            found.append(target)
    return found
