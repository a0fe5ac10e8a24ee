"""Replicated tables with real server processes that die, pause and come back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shoal
from shoal.transport.zmq_transport import ZmqTransport
from shoal.wire.ops import Op
from tests.support.cluster import ThreadCluster
from tests.support.load import BusyCPUs
from tests.support.losing import LosingTransport
from tests.support.waiting import wait_for_json

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "scripts" / "replica_worker.py")
BOUNDED = str(ROOT / "tests" / "scripts" / "bounded_replica_worker.py")
TRAIN = str(ROOT / "examples" / "mf" / "train.py")


def launch(args: list[str], policy: str = "continue", nodes: int = 3, options: tuple[str, ...] = ()
           ) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", str(nodes), "--on-server-failure", policy,
           "--replica-timeout", "0.5", "--connect-timeout", "30", *options, "--", sys.executable, *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen[str], timeout: float = 240) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def counting(tmp: Path, write_quorum: int, disturb, policy: str = "continue", pushes: int = 150,
             then: str = "", nodes: int = 3, options: tuple[str, ...] = ()) -> dict:
    proc = launch([SCRIPT, str(tmp), str(write_quorum), str(pushes), *([then] if then else [])], policy, nodes,
                  options)
    servers = wait_for_json(tmp / "servers.json")["pids"]
    disturb(servers)
    finish(proc)
    result = wait_for_json(tmp / "result.json")
    ranks = [wait_for_json(tmp / f"acked{r}.json") for r in range(nodes)]
    return {**result, "acked": sum(r["acked"] for r in ranks), "failed": sum(r["failed"] for r in ranks)}


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
    restored = wait_for_json(tmp_path / "restored.json")
    assert restored["counts"] == [float(r["acked"])] * 90


def test_with_write_quorum_1_a_dead_replica_costs_at_most_its_unsynchronised_pushes(tmp_path):
    r = counting(tmp_path, 1, kill_one_after(0.4))
    assert r["identical"]
    counts = np.array(next(iter(r["counts"].values())))
    # Pushes acknowledged by the dead replica and not yet gossiped are lost, never applied twice: with
    # 20 ms gossip that is a small fraction.
    assert (counts <= r["acked"]).all() and (r["acked"] - counts).max() <= 0.1 * r["acked"]


@pytest.mark.parametrize("model", ["ssp", "essp"])
@pytest.mark.parametrize("disturb", ["kill", "pause"])
def test_bounded_reads_keep_their_bound_and_count_every_push_once_when_a_replica_fails(tmp_path, disturb, model):
    """SSP(1) (or ESSP(1), reads served from the rows replicas push) over 3 replicas with W=2 and R=1:
    one replica killed (or paused past its heartbeats) 0.4 s in. Every read of every worker stays
    within the bound, and once the bound has passed every worker reads each counter as exactly the
    iterations its worker ran."""
    iterations = 60
    proc = launch([BOUNDED, str(tmp_path), str(iterations), "1", model])
    servers = wait_for_json(tmp_path / "servers.json")["pids"]
    (kill_one_after(0.4) if disturb == "kill" else pause_one(0.4, 2.0))(servers)
    finish(proc)
    for rank in range(3):
        result = wait_for_json(tmp_path / f"rank{rank}.json")
        assert result["violations"] == []
        assert result["final"] == [float(iterations)] * 3, result
        if model == "essp":
            assert result["counters"].get("eager_reads_served", 0) > 0, result


def pause_one(after: float, for_s: float):
    def disturb(servers: list[int]) -> None:
        time.sleep(after)
        os.kill(servers[2], signal.SIGSTOP)
        time.sleep(for_s)
        os.kill(servers[2], signal.SIGCONT)
    return disturb


@pytest.mark.parametrize("write_quorum", [1, 2])
def test_a_paused_replica_counts_every_acknowledged_push_exactly_once(tmp_path, write_quorum):
    """Pushes to a replica that stops for a second time out and go to another replica under the same
    number; the stopped one applies its queued copies when it resumes. Every replica counts every
    acknowledged push once (it counted 451 of 450 when a resent push was a new update)."""
    r = counting(tmp_path, write_quorum, pause_one(0.3, 1.0))
    assert r["live"] == [0, 1, 2]
    assert r["identical"]
    for counts in r["counts"].values():
        assert counts == [float(r["acked"])] * 90


@pytest.mark.heavy
@pytest.mark.parametrize("write_quorum", [1, 2])
def test_a_replica_paused_past_its_heartbeats_is_never_counted_twice(tmp_path, write_quorum):
    """Paused 3.2 s, longer than the failure detector waits (2 s): the others go on without it and
    give up what only it had. With W=2 every acknowledged push is elsewhere too: exactly once.
    With W=1 a push it alone had taken may be lost, never counted twice (1,201,643 of 1,200,000
    before pushes were numbered by their worker)."""
    r = counting(tmp_path, write_quorum, pause_one(0.3, 3.2), pushes=300)
    assert r["identical"]
    counts = np.array(next(iter(r["counts"].values())))
    if write_quorum == 2:
        assert (counts == r["acked"]).all()
    else:
        assert (counts <= r["acked"]).all() and (r["acked"] - counts).max() <= 0.1 * r["acked"]


def test_a_push_short_of_its_write_quorum_is_applied_once_where_it_was_taken_also_when_retried(tmp_path):
    """Two servers, W=2, one killed: every later push is taken by the survivor alone and fails with
    WriteQuorumError; the worker sends it again with the error's retry(), which the survivor
    recognises. It counts every push once, failed or not (retrying used to count them twice)."""
    r = counting(tmp_path, 2, kill_one_after(0.4), then="retry", nodes=2)
    assert r["live"] == [0] and r["failed"] > 0
    assert next(iter(r["counts"].values())) == [float(r["acked"] + r["failed"])] * 90


def test_a_restarted_replica_rejoins_and_catches_up(tmp_path):
    r = counting(tmp_path, 2, kill_one_after(0.3), policy="restart", pushes=250)
    assert r["live"] == [0, 1, 2]
    assert r["identical"]
    for counts in r["counts"].values():
        assert counts == [float(r["acked"])] * 90


@pytest.mark.parametrize("busy_loops", [
    0, pytest.param(5, marks=pytest.mark.heavy, id="oversubscribed")])
def test_mf_training_survives_a_killed_replica_with_the_same_accuracy(tmp_path, busy_loops):
    """Also while busy loops compete for the cores: a replica slow to answer was taken for dead
    (every replica of a shard marked down, and the read failed: 'no replica ... answered')."""
    with BusyCPUs(busy_loops, limit_s=400):
        results = _mf_with_a_killed_replica(tmp_path, write_quorum=1)
    # Runs are not deterministic (thread timing decides which updates a read sees): the final test
    # RMSE of identical clean runs measured 0.9454 to 0.9530, so two runs differ by up to about 0.01
    # by chance (a clean 0.9530 and a killed 0.9417 failed a 0.01 bound): the bound is twice that.
    assert abs(results["killed"] - results["clean"]) <= 0.02, results


def _mf_with_a_killed_replica(tmp_path: Path, write_quorum: int) -> dict[str, float]:
    results = {}
    for label, kill in (("clean", False), ("killed", True)):
        out = tmp_path / f"{label}.json"
        info = tmp_path / f"{label}-info.json"
        proc = launch([TRAIN, "--quiet", "--epochs", "8", "--replicas", "3", "--write-quorum", str(write_quorum),
                       "--gossip-ms", "20", "--info", str(info), "--out", str(out)])
        if kill:
            pids = wait_for_json(info)["server_pids"]
            time.sleep(2.0)
            os.kill(pids[1], signal.SIGKILL)
        finish(proc)
        results[label] = json.loads(out.read_text())["rmse"][-1]
    return results


POLICY = str(ROOT / "tests" / "scripts" / "policy_worker.py")


def _after_server_1_dies(tmp: Path, policy: str) -> list[dict]:
    proc = launch([POLICY, str(tmp), policy], policy, nodes=2)
    pid = wait_for_json(tmp / "servers.json")["pids"][1]
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.3)
    (tmp / "go").touch()
    finish(proc)
    return [wait_for_json(tmp / f"result{r}.json") for r in range(2)]


def test_continue_fails_calls_that_need_a_dead_servers_rows_at_once_and_goes_on_with_the_rest(tmp_path):
    """A plain table's rows on a dead server are gone: calls that need them fail at once naming it (they
    waited the 30 s request timeout); the worker co-located with the dead server never has a write
    into its memory acknowledged; calls that need only live servers go on."""
    far, near = _after_server_1_dies(tmp_path, "continue")
    for call in ("pull_node1", "push_node1"):
        assert far[call]["error"] == "ClusterError" and "1" in far[call]["message"], far[call]
        assert "died" in far[call]["message"] and far[call]["seconds"] < 2.0, far[call]
    for call in ("pull_node1", "push_node1"):  # its own node's memory: never read or written once dead
        assert near[call]["error"] == "ClusterError", near[call]
        assert "died" in near[call]["message"] and near[call]["seconds"] < 2.0, near[call]
    for worker in (far, near):
        assert worker["push_node0"]["ok"] and worker["rep_push"]["ok"] and worker["rep_pull"]["ok"], worker


def test_a_stopped_server_is_waited_for_not_declared_dead(tmp_path):
    """Silence is not death: server 1 stopped (SIGSTOP) for longer than the rendezvous takes to stop
    calling it alive (2 s) is waited for, under the default policy; the calls made meanwhile complete
    once it resumes, each push counted once (they failed with 'server 1 died')."""
    proc = launch([POLICY, str(tmp_path), "fail"], "fail", nodes=2)
    pid = wait_for_json(tmp_path / "servers.json")["pids"][1]
    os.kill(pid, signal.SIGSTOP)
    try:
        (tmp_path / "go").touch()
        time.sleep(3.0)
    finally:
        os.kill(pid, signal.SIGCONT)
    finish(proc)
    far, near = (wait_for_json(tmp_path / f"result{r}.json") for r in range(2))
    for worker in (far, near):
        assert all(worker[call]["ok"] for call in ("pull_node1", "push_node1", "push_node0")), worker
    assert far["pull_node1"]["seconds"] > 1.0, far  # it did wait for the stopped server
    assert far["final_node1"]["value"] == [4.0] * 3, far  # 2 workers x (one push before, one during)


def test_restart_brings_the_server_back_its_plain_rows_refused_as_lost_and_replicas_in_use(tmp_path):
    """The restarted server is used (workers follow its new address): its replica takes pushes. A plain
    table's rows there went with its previous process: calls for them fail naming that, instead of
    serving them reset to their initial values."""
    far, near = _after_server_1_dies(tmp_path, "restart")
    for worker in (far, near):
        for call in ("pull_node1", "push_node1"):
            assert worker[call]["error"] == "ClusterError", worker[call]
            assert "lost with" in worker[call]["message"] or "died" in worker[call]["message"], worker[call]
        assert worker["push_node0"]["ok"] and worker["rep_push"]["ok"] and worker["rep_pull"]["ok"], worker
    assert far["node1_replicated_pushes"] > 0


def _losing_push(seq: int) -> tuple[threading.Event, Any]:
    """An event, and a loss rule: every copy of a worker's push ``seq`` (each shard's) is lost while
    the event is set (a link down for longer than the request timeout)."""
    blocked = threading.Event()

    def lose(header: dict[str, Any]) -> bool:
        body = header.get("body") or {}
        return blocked.is_set() and Op(header["op"]) == Op.PUSH and body.get("seq") == seq

    return blocked, lose


@pytest.mark.parametrize("form", ["sync", "async"])
def test_a_push_that_failed_its_quorum_is_applied_once_and_does_not_hold_the_workers_later_pushes(form):
    """A push that failed its write quorum (every copy lost) and was not sent again left a hole in its
    worker's numbering: the worker gave it up, so its floor moved past it, but replicas apply a
    worker's pushes in order and held every later one for it while no replica had died. Every later
    push of the worker to the shard failed with WriteQuorumError, for good. A failed push is now
    kept and sent again ahead of the worker's next push to the shard: applied once, the next one
    too, and a retry() after that applies nothing more."""
    blocked, lose = _losing_push(2)
    timeouts = shoal.Timeouts(connect_s=10.0, request_s=2.0, barrier_s=10.0, replica_s=0.5)
    with ThreadCluster(nodes=2, transport=LosingTransport(ZmqTransport(), lose), timeouts=timeouts) as c:
        w = c.worker(0, local_access=False)
        t = w.table("c", 4, 1, replicas=2, write_quorum=2, read_quorum=2, gossip_ms=20)
        keys, ones = np.arange(4), np.ones((4, 1), np.float32)
        t.push(keys, ones)
        blocked.set()
        failed = []
        if form == "sync":
            with pytest.raises(shoal.WriteQuorumError) as caught:
                t.push(keys, ones)  # every copy lost, also those its failover sends
            failed.append(caught.value)
        else:  # the lost one, and two after it that replicas hold for it
            futures = [t.push_async(keys, ones) for _ in range(3)]
            for f in futures:
                with pytest.raises(shoal.WriteQuorumError) as caught:
                    f.wait()
                failed.append(caught.value)
        blocked.clear()
        t.push(keys, ones)  # the link is back: sent with the failed ones ahead of it
        pushed = 2 + len(failed)
        np.testing.assert_array_equal(t.pull(keys)[:, 0], pushed)
        for error in failed:
            error.retry()  # taken already: nothing is applied again
        np.testing.assert_array_equal(t.pull(keys)[:, 0], pushed)
        for server in c.servers:  # each replica counted each push once
            replicas = server.replication.tables["c"].replicas
            assert [float(r.lattice.value().sum()) for r in replicas.values()] == [2 * pushed] * 2
