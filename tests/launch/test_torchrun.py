"""The same training script under two torchrun invocations (two "hosts" on this machine)."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import shoal

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = shutil.which("torchrun", path=os.path.dirname(sys.executable))


def _master_port() -> int:
    """A port torchrun's store can bind, and the one after it (Shoal's rendezvous), below the range
    the kernel hands out for ephemeral ports: servers bind those, and torchrun's elastic agent binds
    its store again when it restarts workers (EADDRINUSE when a server had taken the port)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(100):
        port = random.randint(20000, max(20001, low - 3))
        try:
            for candidate in (port, port + 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port
    raise AssertionError("no free port pair below the ephemeral range")


def _assert_servers_leave() -> None:
    """The detached servers leave once the workers are done."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and b"server_main" in subprocess.run(["ps", "ax"], capture_output=True).stdout:
        time.sleep(0.2)
    assert b"shoal.launch.server_main" not in subprocess.run(["ps", "ax"], capture_output=True).stdout


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun comes with the torch extra: pip install torch==2.13.0")
def test_two_torchrun_nodes_train_mf_like_the_local_launcher(tmp_path):
    port = _master_port()
    procs = []
    for node in (0, 1):
        cmd = [TORCHRUN, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1", "--master-addr",
               "127.0.0.1", "--master-port", str(port), str(ROOT / "examples" / "mf" / "train.py"), "--quiet",
               "--epochs", "8", "--out", str(tmp_path / "torchrun.json")]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    local = subprocess.run([sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", "2", "--", sys.executable,
                            str(ROOT / "examples" / "mf" / "train.py"), "--quiet", "--epochs", "8", "--out",
                            str(tmp_path / "local.json")], capture_output=True, text=True, timeout=300)
    assert local.returncode == 0, local.stdout + local.stderr
    a = json.loads((tmp_path / "torchrun.json").read_text())["rmse"][-1]
    b = json.loads((tmp_path / "local.json").read_text())["rmse"][-1]
    assert abs(a - b) <= 0.01, (a, b)
    _assert_servers_leave()


RESTARTING_SCRIPT = """
import os, sys
import numpy as np
import shoal

ps = shoal.init()
counts = ps.table("restart.counts", num_keys=4, dim=1, init=shoal.Constant(0.0))
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
for step in range(20):
    counts.push(np.array([ps.rank]), np.ones((1, 1), np.float32))
    if attempt == 0 and ps.rank == 1 and step == 4:
        os._exit(3)  # five acknowledged pushes, then the worker dies
ps.barrier()
if ps.rank == 0:
    print("COUNTS", counts.pull(np.arange(2))[:, 0].tolist(), "ATTEMPT", attempt, flush=True)
ps.shutdown()
"""


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun comes with the torch extra: pip install torch==2.13.0")
def test_workers_restarted_by_the_elastic_agent_rejoin_and_keep_the_parameters(tmp_path):
    script = tmp_path / "restarting.py"
    script.write_text(RESTARTING_SCRIPT)
    port = _master_port()
    cmd = [TORCHRUN, "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "1", "--master-addr", "127.0.0.1",
           "--master-port", str(port), "--rdzv-backend", "static", str(script)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(x for x in done.stdout.splitlines() if "COUNTS" in x)
    counts = json.loads(line.split("COUNTS", 1)[1].split("ATTEMPT")[0])
    assert line.rstrip().endswith("ATTEMPT 1")
    assert counts[1] == 25.0  # 5 before the crash + 20 after the restart: the server kept them
    assert counts[0] >= 20.0
    _assert_servers_leave()


_TORCHRUN_ENV = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none",
                 "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "RANK": "0",
                 "LOCAL_RANK": "0", "WORLD_SIZE": "2", "SHOAL_SECRET": "ab" * 16}


def test_an_ipv6_master_address_fails_with_a_shoal_error():
    """``shoal.init()`` under torchrun reads MASTER_ADDR; input it cannot use must fail with a ShoalError
    naming the variable. An IPv6 master (torchrun accepts one) made the local address probe open an
    AF_INET socket and raise a bare ``socket.gaierror``."""
    from shoal.launch import torchrun
    try:
        torchrun.role({**_TORCHRUN_ENV, "MASTER_ADDR": "fd00::1"})
    except shoal.ShoalError:
        pass
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"untyped {type(exc).__name__}: {exc}")


def test_torchrun_ranks_that_disagree_on_the_world_are_refused_at_once():
    """torchrun allows a different --nproc-per-node on each node; Shoal takes LOCAL_WORLD_SIZE as every
    node's worker count and never checked it against WORLD_SIZE. Run for real (node 0 with 2
    processes, node 1 with 1), node 1's rank 2 got a RoleError from its own server while node 0's
    workers stalled for the whole request timeout on a PUSH to node 1. The inconsistent world is
    visible in the environment: a ConfigError at init now."""
    from shoal.launch import torchrun
    with pytest.raises(shoal.ConfigError):
        r = torchrun.role({**_TORCHRUN_ENV, "GROUP_RANK": "1", "RANK": "2", "WORLD_SIZE": "3"})
        pytest.fail(f"accepted rank {r.rank} of a cluster of {r.cluster.num_workers} workers")
