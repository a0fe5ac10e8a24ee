"""The same training script under two torchrun invocations (two "hosts" on this machine)."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = shutil.which("torchrun", path=os.path.dirname(sys.executable))


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun comes with the torch extra: pip install torch==2.13.0")
def test_two_torchrun_nodes_train_mf_like_the_local_launcher(tmp_path):
    port = random.randint(20000, 40000)
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
    deadline = time.monotonic() + 10  # the detached servers leave once the workers are done
    while time.monotonic() < deadline and b"server_main" in subprocess.run(["ps", "ax"], capture_output=True).stdout:
        time.sleep(0.2)
    assert b"shoal.launch.server_main" not in subprocess.run(["ps", "ax"], capture_output=True).stdout
