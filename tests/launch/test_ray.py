"""The Ray backend on a local Ray instance that the tests start and stop."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import shoal

ray = pytest.importorskip("ray", reason="the Ray backend needs the ray extra: pip install 'shoal[ray]'")
import shoal.ray  # noqa: E402
from tests.conftest import LONG_LIVED, _children  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def local_ray():
    # Logical CPUs: 2 nodes x (1 server + 1 worker) bundles of 1 CPU each, on a 2-core machine.
    ray.init(num_cpus=4, include_dashboard=False, configure_logging=False)
    daemons = set(_children(os.getpid()))
    LONG_LIVED.update(daemons)
    try:
        yield
    finally:
        ray.shutdown()
        LONG_LIVED.difference_update(daemons)
        deadline = time.monotonic() + 20
        while _children(os.getpid()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _children(os.getpid()), "Ray left processes behind after ray.shutdown()"


def count_pushes(rounds: int) -> dict:
    ps = shoal.init()
    table = ps.table("ray.counts", num_keys=64, dim=2, init=shoal.Constant(0.0))
    for _ in range(rounds):
        table.push(np.arange(64), np.ones((64, 2), np.float32))
    ps.barrier()
    total = float(table.pull(np.arange(64)).sum())
    stats = ps.server_stats()
    result = {"rank": ps.rank, "node": ps.node, "total": total, "server_pids": [s["pid"] for s in stats]}
    ps.shutdown()
    return result


def fail_on_rank_one() -> None:
    ps = shoal.init()
    if ps.rank == 1:
        raise ValueError("rank one gives up")
    ps.shutdown()


def _alive(pid: int) -> bool:
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return bool(state) and not state.startswith("Z")


def test_a_function_runs_on_every_worker_and_the_servers_leave(local_ray):
    results = shoal.ray.run(count_pushes, nodes=2, workers_per_node=1, args=(10,))
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["node"] for r in results] == [0, 1]
    assert all(r["total"] == 2 * 10 * 64 * 2 for r in results)
    deadline = time.monotonic() + 10
    pids = results[0]["server_pids"]
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


def test_a_failed_worker_fails_the_job_with_its_error(local_ray):
    with pytest.raises(shoal.ClusterError, match="rank one gives up"):
        shoal.ray.run(fail_on_rank_one, nodes=1, workers_per_node=2, worker_resources={"CPU": 1},
                      job_timeout_s=60)


def test_a_node_that_cannot_be_placed_is_named(local_ray):
    with pytest.raises(shoal.ClusterError, match="could not place node 0"):
        shoal.ray.run(count_pushes, nodes=1, workers_per_node=1, args=(1,), worker_resources={"CPU": 64},
                      timeouts=shoal.Timeouts(connect_s=2.0))


def test_the_mf_example_trains_on_ray(local_ray, tmp_path):
    out = tmp_path / "ray.json"
    shoal.ray.run_script(str(ROOT / "examples" / "mf" / "train.py"), ["--quiet", "--epochs", "8", "--out", str(out)],
                         nodes=2, workers_per_node=1)
    rmse = json.loads(out.read_text())["rmse"][-1]
    local = subprocess.run([sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", "2", "--", sys.executable,
                            str(ROOT / "examples" / "mf" / "train.py"), "--quiet", "--epochs", "8", "--out",
                            str(tmp_path / "local.json")], capture_output=True, text=True, timeout=300)
    assert local.returncode == 0, local.stdout + local.stderr
    assert abs(rmse - json.loads((tmp_path / "local.json").read_text())["rmse"][-1]) <= 0.01


def shutdown_then_finish(seconds: float) -> int:
    ps = shoal.init()
    table = ps.table("ray.after", num_keys=4, dim=1, init=shoal.Constant(0.0))
    table.push(np.arange(4), np.ones((4, 1), np.float32))
    ps.barrier()
    rank = ps.rank
    ps.shutdown()  # done with the parameter server; the function goes on (write results, evaluate)
    time.sleep(seconds)
    return rank


def test_a_worker_that_goes_on_after_shutdown_does_not_fail_the_ray_job(local_ray):
    """shoal.ray.run returns every worker's result when every worker succeeded. The servers leave
    once every worker has called ``ps.shutdown()`` (the rendezvous is finished), which can be before
    the training functions return; the backend saw a server process exited (status 0) while a
    worker call was still pending and raised ``ClusterError: the server of node 0 exited with
    status 0 before the workers finished`` for a job in which nothing failed."""
    assert shoal.ray.run(shutdown_then_finish, nodes=1, workers_per_node=1, args=(4.0,),
                         job_timeout_s=120) == [0]


def kill_the_server_then_wait(seconds: float) -> None:
    ps = shoal.init()
    os.kill(ps.server_stats()[0]["pid"], 9)
    time.sleep(seconds)  # the job must end on the server's death, not on this worker


def test_a_server_that_dies_while_the_workers_run_fails_the_ray_job(local_ray):
    """A server's clean exit (0, after every worker's goodbye) is no failure; its death is, at once."""
    started = time.monotonic()
    with pytest.raises(shoal.ClusterError, match="server of node 0 exited with status -9"):
        shoal.ray.run(kill_the_server_then_wait, nodes=1, workers_per_node=1, args=(60.0,), job_timeout_s=90)
    assert time.monotonic() - started < 45
