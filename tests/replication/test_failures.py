"""Replicated tables with real server processes that die, pause and come back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "scripts" / "replica_worker.py")
TRAIN = str(ROOT / "examples" / "mf" / "train.py")


def launch(args: list[str], policy: str = "continue") -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", "3", "--on-server-failure", policy,
           "--replica-timeout", "0.5", "--connect-timeout", "30", "--", sys.executable, *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(path: Path, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            try:
                return json.loads(path.read_text())
            except json.JSONDecodeError:
                pass
        time.sleep(0.05)
    raise AssertionError(f"{path} did not appear within {timeout}s")


def finish(proc: subprocess.Popen[str], timeout: float = 240) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def counting(tmp: Path, write_quorum: int, disturb, policy: str = "continue", pushes: int = 150,
             then: str = "") -> dict:
    proc = launch([SCRIPT, str(tmp), str(write_quorum), str(pushes), *([then] if then else [])], policy)
    servers = wait_for(tmp / "servers.json")["pids"]
    disturb(servers)
    finish(proc)
    result = wait_for(tmp / "result.json")
    acked = sum(wait_for(tmp / f"acked{r}.json")["acked"] for r in range(3))
    return {**result, "acked": acked}


def kill_one_after(delay: float):
    def disturb(servers: list[int]) -> None:
        time.sleep(delay)
        os.kill(servers[1], signal.SIGKILL)
    return disturb


def test_with_write_quorum_2_no_acknowledged_push_is_lost_when_a_replica_dies(tmp_path):
    r = counting(tmp_path, 2, kill_one_after(0.4))
    assert r["live"] == [0, 2]
    assert r["identical"]
    for counts in r["counts"].values():
        assert counts == [float(r["acked"])] * 90


def test_a_checkpoint_after_a_replica_died_keeps_every_acknowledged_push(tmp_path):
    """W=2: the two live replicas settle by gossip and write the table; a fresh cluster restores it."""
    r = counting(tmp_path, 2, kill_one_after(0.4), then="save")
    assert r["live"] == [0, 2]
    finish(launch([SCRIPT, str(tmp_path), "2", "0", "restore"]))
    restored = wait_for(tmp_path / "restored.json")
    assert restored["counts"] == [float(r["acked"])] * 90


def test_with_write_quorum_1_a_dead_replica_costs_at_most_its_unsynchronised_pushes(tmp_path):
    r = counting(tmp_path, 1, kill_one_after(0.4))
    assert r["identical"]
    counts = np.array(next(iter(r["counts"].values())))
    # Pushes acknowledged by the dead replica and not yet gossiped are lost (or, when a reply was
    # lost, applied twice after failover). With 20 ms gossip that is a small fraction.
    assert np.abs(counts - r["acked"]).max() <= 0.1 * r["acked"]


def test_a_paused_replica_converges_bit_identically_once_it_resumes(tmp_path):
    def pause(servers: list[int]) -> None:
        time.sleep(0.3)
        os.kill(servers[2], signal.SIGSTOP)
        time.sleep(1.0)
        os.kill(servers[2], signal.SIGCONT)

    r = counting(tmp_path, 1, pause)
    assert r["live"] == [0, 1, 2]
    assert r["identical"]
    assert len({tuple(c) for c in r["counts"].values()}) == 1


def test_a_restarted_replica_rejoins_and_catches_up(tmp_path):
    r = counting(tmp_path, 2, kill_one_after(0.3), policy="restart", pushes=250)
    assert r["live"] == [0, 1, 2]
    assert r["identical"]
    for counts in r["counts"].values():
        assert counts == [float(r["acked"])] * 90


@pytest.mark.parametrize("write_quorum", [1])
def test_mf_training_survives_a_killed_replica_with_the_same_accuracy(tmp_path, write_quorum):
    results = {}
    for label, kill in (("clean", False), ("killed", True)):
        out = tmp_path / f"{label}.json"
        info = tmp_path / f"{label}-info.json"
        proc = launch([TRAIN, "--quiet", "--epochs", "8", "--replicas", "3", "--write-quorum", str(write_quorum),
                       "--gossip-ms", "20", "--info", str(info), "--out", str(out)])
        if kill:
            pids = wait_for(info)["server_pids"]
            time.sleep(2.0)
            os.kill(pids[1], signal.SIGKILL)
        finish(proc)
        results[label] = json.loads(out.read_text())["rmse"][-1]
    assert abs(results["killed"] - results["clean"]) <= 0.01, results
