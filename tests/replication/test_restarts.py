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
