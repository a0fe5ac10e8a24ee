"""Replicated tables across a replica's restart (``--on-server-failure restart``), with real processes:
what was in flight to the dead process goes on to the live replicas, counted once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support.waiting import wait_for_json


def _launch(tmp: Path, script: str, args: list[str], nodes: int, policy: str = "continue",
            replica_timeout: float = 0.5) -> subprocess.Popen[str]:
    path = tmp / "worker.py"
    path.write_text(textwrap.dedent(script))
    cmd = [sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", str(nodes), "--on-server-failure", policy,
           "--replica-timeout", str(replica_timeout), "--connect-timeout", "30", "--request-timeout", "30", "--",
           sys.executable, str(path), str(tmp), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_file(path: Path, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.02)


INFLIGHT_WORKER = """
import json, os, sys, time
from collections import deque
import numpy as np
import shoal


def main():
    d, pushes, depth = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ps = shoal.init()
    table = ps.table("c", 90, 1, replicas=3, write_quorum=2, read_quorum=1, gossip_ms=20)
    if ps.rank == 0:
        with open(os.path.join(d, "servers.json"), "w") as fh:
            json.dump({"pids": [s["pid"] for s in ps.server_stats()]}, fh)
    ps.barrier()
    mine = np.arange(ps.rank, 90, ps.num_workers)  # every worker its own keys, on every shard
    ones = np.ones((mine.size, 1), np.float32)
    acked = failed = 0
    errors = []
    q = deque()

    def settle():
        nonlocal acked, failed
        try:
            q.popleft().wait()
            acked += 1
        except shoal.WriteQuorumError:
            failed += 1
        except shoal.ShoalError as exc:
            errors.append(repr(exc))

    for _ in range(pushes):
        q.append(table.push_async(mine, ones))  # up to `depth` pushes in flight
        if len(q) >= depth:
            settle()
        time.sleep(0.002)
    while q:
        settle()
    with open(os.path.join(d, f"acked{ps.rank}.json"), "w") as fh:
        json.dump({"acked": acked, "failed": failed, "errors": errors[:5], "nerrors": len(errors)}, fh)
    ps.barrier()
    if ps.rank == 0:
        deadline = time.monotonic() + 20
        while True:
            counts = {}
            for node in (0, 1, 2):
                try:
                    counts[str(node)] = table.access.replica_values(node, np.arange(90))[0][:, 0].tolist()
                except shoal.ShoalError:
                    pass
            if (len(counts) == 3 and len({json.dumps(c) for c in counts.values()}) == 1) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        with open(os.path.join(d, "result.json"), "w") as fh:
            json.dump({"counts": counts}, fh)
    ps.barrier()
    ps.shutdown()


main()
"""


def test_pushes_in_flight_to_a_replica_that_is_restarted_fail_over_instead_of_failing(tmp_path):
    """README: with ``--on-server-failure restart`` "the server is started again, workers follow its
    new address, and its replicas catch up by gossip"; reads and writes of a replicated table go on
    with the live replicas, and with W>=2 an acknowledged push is applied exactly once, whatever
    replica dies. A replica that does not answer is routed around.

    3 servers, W=2, each worker keeps up to 8 push_async calls in flight; server 1 is killed with
    SIGKILL 0.5 s in and the launcher starts it again (replica timeout 3 s, which a fast restart
    beats). Expected: every push is acknowledged through the other replicas (or fails with
    WriteQuorumError), and every replica counts each worker's acknowledged pushes.

    The pushes that were in flight to the dead process failed with a plain ClusterError ("server 1
    was started again: what was in flight to its previous process was lost with it"): the worker
    failed them when it followed the restart, and the replicated access raised any error a request
    ended with as if the replica had answered it, so the push never failed over and the worker
    script died with it. They are ``PeerRestartedError`` now, taken as the replica's silence."""
    proc = _launch(tmp_path, INFLIGHT_WORKER, ["300", "8"], nodes=3, policy="restart", replica_timeout=3.0)
    try:
        pids = wait_for_json(tmp_path / "servers.json")["pids"]
        time.sleep(0.5)
        os.kill(pids[1], signal.SIGKILL)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    ranks = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("acked*.json"))]
    errors = [e for r in ranks for e in r["errors"]]
    assert proc.returncode == 0 and len(ranks) == 3 and not errors, (
        f"rc {proc.returncode}, per-rank results {ranks}; output tail:\n{out[-1500:]}")
    counts = json.loads((tmp_path / "result.json").read_text())["counts"]
    for node, values in counts.items():
        for rank, r in enumerate(ranks):
            assert set(values[rank::3]) == {float(r["acked"])}, (node, rank, r)


PAUSE_WORKER = """
import json, os, sys, time
import numpy as np
import shoal

KEYS = np.arange(8)


def wait_file(p, t=90):
    end = time.monotonic() + t
    while not os.path.exists(p):
        if time.monotonic() > end:
            raise SystemExit(f"no {p}")
        time.sleep(0.02)


def main():
    d = sys.argv[1]
    ps = shoal.init()
    # No gossip round for the first part (the period is jittered in [30, 90] s): the pushes stay
    # where they were taken until the test turns gossip on.
    table = ps.table("c", 8, 1, replicas=2, write_quorum=1, read_quorum=1, gossip_ms=60000)
    if ps.rank == 0:
        with open(os.path.join(d, "servers.json"), "w") as fh:
            json.dump({"pids": [s["pid"] for s in ps.server_stats()]}, fh)
    ps.barrier()
    ones = np.ones((8, 1), np.float32)
    acked = 0
    if ps.rank == 1:
        for _ in range(10):  # taken by this node's replica (server 1), as a worker's pushes are
            table.push(KEYS, ones)
            acked += 1
        open(os.path.join(d, "pushed"), "w").close()
        wait_file(os.path.join(d, "paused"))
        table.push(KEYS, ones)  # server 1 is stopped: routed to server 0
        acked += 1
        open(os.path.join(d, "pushed2"), "w").close()
        wait_file(os.path.join(d, "resumed"))
        time.sleep(1.0)
        table.set_gossip_ms(20)
        view = table.access.view
        deadline = time.monotonic() + 15
        while True:
            view.refresh(force=True)
            reads = {}
            for n in (0, 1):
                try:
                    rows, vv = table.access.replica_values(n, KEYS)
                    reads[str(n)] = {"values": rows[:, 0].tolist(), "vv": sorted(vv.items())}
                except shoal.ShoalError as exc:
                    reads[str(n)] = {"error": repr(exc)}
            values = {json.dumps(r.get("values")) for r in reads.values()}
            if (len(values) == 1 and "error" not in reads["0"]) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        with open(os.path.join(d, "result.json"), "w") as fh:
            json.dump({"acked": acked, "reads": reads, "alive": list(view.alive)}, fh)
    ps.barrier()
    ps.shutdown()


main()
"""


@pytest.mark.heavy  # 20 s
def test_a_replica_paused_past_its_heartbeats_converges_with_the_others_when_it_resumes(tmp_path):
    """README (Replication): replicas converge by gossip; the SumLattice merge means "replicas holding
    the same updates hold bit-identical values"; "a stalled replica's pushes reach the others when it
    resumes; one silent for longer than the failure detector is dead for the others, who give up what
    it alone had".

    W=1, 2 replicas, no gossip yet. Worker 1 pushes +1 ten times (taken by server 1, its node's
    replica). Server 1 is SIGSTOPped; the 11th push goes to server 0, which holds it waiting for
    pushes 1-10, and once server 1 is dead by the heartbeats gives them up and applies push 11 alone
    (``skip_gaps``). Server 1 then resumes (alive again) and gossip runs at 20 ms for many seconds.

    Expected: both live replicas end with the same value. They never converged: server 0 read 1.0,
    server 1 11.0, both at version {worker: 11}: gossip compared sequence numbers only, and the two
    replicas held different sums under the same number, forever (a read at R=1 returned 1 or 11 by
    the replica it picked). A state now counts the updates it gave up, and of two states at one
    version the one with fewer gaps wins."""
    proc = _launch(tmp_path, PAUSE_WORKER, [], nodes=2)
    try:
        pids = wait_for_json(tmp_path / "servers.json")["pids"]
        _wait_file(tmp_path / "pushed")
        os.kill(pids[1], signal.SIGSTOP)
        try:
            (tmp_path / "paused").touch()
            _wait_file(tmp_path / "pushed2")  # takes ~2.5 s: server 0 waits for the failure detector
            time.sleep(0.5)
        finally:
            os.kill(pids[1], signal.SIGCONT)
        (tmp_path / "resumed").touch()
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    reads = result["reads"]
    assert all("values" in r for r in reads.values()), result  # both replicas live and answering
    assert reads["0"]["vv"] == reads["1"]["vv"], result
    assert reads["0"]["values"] == reads["1"]["values"], (
        f"live replicas at the same version vector hold different values after 15 s of gossip: {result}")
    assert set(reads["0"]["values"]) == {11.0}, result  # the ten pushes server 0 gave up came back with server 1


PARTITION_WORKER = """
import json, os, sys, time
import numpy as np
import shoal

KEYS = np.arange(8)


def wait_file(p, t=90):
    end = time.monotonic() + t
    while not os.path.exists(p):
        if time.monotonic() > end:
            raise SystemExit(f"no {p}")
        time.sleep(0.02)


def main():
    d = sys.argv[1]
    ps = shoal.init()
    table = ps.table("c", 8, 1, replicas=2, write_quorum=1, read_quorum=1, gossip_ms=60000)  # no gossip yet
    if ps.rank == 0:
        with open(os.path.join(d, "servers.json"), "w") as fh:
            json.dump({"pids": [s["pid"] for s in ps.server_stats()]}, fh)
    ps.barrier()
    acked = 0
    view = table.access.view
    if ps.rank == 1:
        for k in range(1, 11):  # push k adds 2**k: taken by this node's replica (server 1)
            table.push(KEYS, np.full((8, 1), 2.0**k, np.float32))
            acked += 1
        open(os.path.join(d, "pushed"), "w").close()
        wait_file(os.path.join(d, "paused"))
        deadline = time.monotonic() + 30  # until the heartbeats call server 1 dead: push 11 never reaches it
        while view.alive[1] and time.monotonic() < deadline:
            view.refresh(force=True)
            time.sleep(0.05)
        table.push(KEYS, np.full((8, 1), 2.0**11, np.float32))  # taken by server 0 alone
        acked += 1
        open(os.path.join(d, "pushed2"), "w").close()
        wait_file(os.path.join(d, "paused2"))  # server 1 runs again, server 0 is stopped
        deadline = time.monotonic() + 10  # until server 1 is alive again for this worker
        while not view.live([1]) and time.monotonic() < deadline:
            view.refresh(force=True)
            time.sleep(0.05)
        table.push(KEYS, np.full((8, 1), 2.0**12, np.float32))  # server 1 gives up 11 to apply it
        acked += 1
        open(os.path.join(d, "pushed3"), "w").close()
        wait_file(os.path.join(d, "resumed"))
        deadline = time.monotonic() + 10  # both alive again for this worker: the gossip period goes to both
        while view.live([0, 1]) != [0, 1] and time.monotonic() < deadline:
            view.refresh(force=True)
            time.sleep(0.05)
        table.set_gossip_ms(20)
        deadline = time.monotonic() + 15
        while True:
            view.refresh(force=True)
            reads = {}
            for n in (0, 1):
                try:
                    rows, vv = table.access.replica_values(n, KEYS)
                    reads[str(n)] = {"values": rows[:, 0].tolist(), "vv": sorted(vv.items())}
                except shoal.ShoalError as exc:
                    reads[str(n)] = {"error": repr(exc)}
            values = {json.dumps(r.get("values")) for r in reads.values()}
            if (len(values) == 1 and "error" not in reads["0"]) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        stats = ps.server_stats()
        given_up = [st["stats"].get("pushes_given_up_with_dead_replica", 0) for st in stats]
        with open(os.path.join(d, "result.json"), "w") as fh:
            json.dump({"acked": acked, "reads": reads, "given_up": given_up}, fh)
    ps.barrier()
    ps.shutdown()


main()
"""


@pytest.mark.heavy  # 30 s
def test_two_replicas_that_each_gave_up_a_push_the_other_had_end_with_every_push(tmp_path):
    """W=1, 2 replicas, no gossip until the end. Worker 1 pushes 2**1 .. 2**10 (taken by server 1).
    Server 1 is stopped: push 11 goes to server 0, which gives up 1-10 once server 1 is dead by the
    heartbeats. Server 1 runs again and server 0 is stopped: push 12 goes to server 1, which gives up
    11, only server 0 had it. Server 0 runs again, and gossip runs at 20 ms.

    Every push was acknowledged once, so each replica must read the sum of 2**1 .. 2**12. Before: the
    replicas compared how many updates each lacked, not which: server 1's state (one gap) won over
    server 0's (ten), and both read without push 11, for good."""
    proc = _launch(tmp_path, PARTITION_WORKER, [], nodes=2)
    try:
        pids = wait_for_json(tmp_path / "servers.json")["pids"]
        _wait_file(tmp_path / "pushed")
        os.kill(pids[1], signal.SIGSTOP)
        try:
            (tmp_path / "paused").touch()
            _wait_file(tmp_path / "pushed2")  # server 0 waits for the failure detector
        finally:
            os.kill(pids[1], signal.SIGCONT)
        time.sleep(1.5)  # server 1 alive again for the rendezvous and the worker
        os.kill(pids[0], signal.SIGSTOP)
        try:
            (tmp_path / "paused2").touch()
            _wait_file(tmp_path / "pushed3")
            time.sleep(0.5)
        finally:
            os.kill(pids[0], signal.SIGCONT)
        (tmp_path / "resumed").touch()
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    reads = result["reads"]
    assert result["acked"] == 12 and all("values" in r for r in reads.values()), result
    assert result["given_up"] == [20, 2], result  # the scenario (two shards): each gave up the other's pushes
    assert reads["0"] == reads["1"], (result, out[-6000:])
    assert set(reads["0"]["values"]) == {float(sum(2**k for k in range(1, 13)))}, result  # every push once
