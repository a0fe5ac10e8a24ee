"""A cluster across three emulated hosts (network namespaces, veth, a bridge, a 1 Gbit cap).

Started the way any scheduler would start it: a server per host with
``python -m shoal.launch.server_main`` and a worker per host, each given only the
documented ``SHOAL_*`` variables. Authentication is on (the hosts are not
loopback) and every process adds 1 ms of delay on arrival through the
fault-injecting transport.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.netns import EmulatedHosts, run_cluster, unavailable_reason

ROOT = Path(__file__).resolve().parents[2]
REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"emulated hosts unavailable: {REASON}")
MF = [sys.executable, str(ROOT / "examples" / "mf" / "train.py"), "--quiet", "--epochs", "6"]


def test_mf_across_three_emulated_hosts_matches_the_local_launcher(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("5e" * 32)
    with EmulatedHosts(3, rate="1gbit") as hosts:
        run_cluster(hosts, [*MF, "--out", str(tmp_path / "across.json")], str(secret),
                    faults="delay_ms=1,jitter_ms=0.5,seed=7")
    local = subprocess.run([sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", "3", "--", *MF, "--out",
                            str(tmp_path / "local.json")], capture_output=True, text=True, timeout=300)
    assert local.returncode == 0, local.stdout + local.stderr
    across = json.loads((tmp_path / "across.json").read_text())
    expected = json.loads((tmp_path / "local.json").read_text())["rmse"][-1]
    assert across["nodes"] == 3
    assert abs(across["rmse"][-1] - expected) <= 0.01, (across["rmse"], expected)


def test_a_worker_with_the_wrong_secret_is_refused_by_name(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("5e" * 32)
    wrong = tmp_path / "wrong"
    wrong.write_text("a1" * 32)
    probe = ("import shoal\n"
             "try:\n    shoal.init()\nexcept shoal.ShoalError as exc:\n"
             "    print(type(exc).__name__, exc); raise SystemExit(3)\n")
    with EmulatedHosts(1, rate=None) as hosts:
        server = hosts.popen(0, [sys.executable, "-m", "shoal.launch.server_main"], {
            "SHOAL_CLUSTER_ID": "auth", "SHOAL_NUM_NODES": "1", "SHOAL_WORKERS_PER_NODE": "1",
            "SHOAL_RENDEZVOUS": f"tcp://{hosts.addresses[0]}:29400", "SHOAL_HOST_RENDEZVOUS": "1", "SHOAL_NODE": "0",
            "SHOAL_BIND": f"tcp://{hosts.addresses[0]}:0", "SHOAL_SECRET_FILE": str(secret)})
        try:
            done = hosts.run(0, [sys.executable, "-c", probe], timeout=60, capture_output=True, env={
                "SHOAL_CLUSTER_ID": "auth", "SHOAL_NUM_NODES": "1", "SHOAL_WORKERS_PER_NODE": "1",
                "SHOAL_RENDEZVOUS": f"tcp://{hosts.addresses[0]}:29400", "SHOAL_NODE": "0", "SHOAL_RANK": "0",
                "SHOAL_SECRET_FILE": str(wrong), "SHOAL_CONNECT_TIMEOUT": "3", "PATH": "/usr/bin:/bin"})
        finally:
            server.kill()
            server.wait(timeout=10)
    assert done.returncode == 3, done.stdout + done.stderr
    assert done.stdout.startswith("AuthError"), done.stdout
    assert "REGISTER to the rendezvous" in done.stdout and "same secret" in done.stdout, done.stdout
