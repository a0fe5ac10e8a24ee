"""Scale out and in while training runs: a server joins and receives slices, another hands its slices
over and leaves; the workers keep pushing throughout and no update is lost."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "elastic_worker.py"


def test_a_server_joins_and_another_leaves_mid_training_without_losing_updates(tmp_path):
    job = subprocess.Popen([sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", "2", "--workers-per-node",
                            "2", "--", sys.executable, str(SCRIPT), str(tmp_path)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    joiner = None
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "cluster.json").exists():
            assert job.poll() is None and time.monotonic() < deadline, job.communicate(timeout=10)[0]
            time.sleep(0.1)
        env = json.loads((tmp_path / "cluster.json").read_text())
        env.update({"SHOAL_NODE": "2", "SHOAL_JOIN": "1"})
        env.pop("SHOAL_RANK", None)
        joiner = subprocess.Popen([sys.executable, "-m", "shoal.launch.server_main"], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        (tmp_path / "joined").touch()
        output = job.communicate(timeout=180)[0]
        assert job.returncode == 0, output
        assert joiner.wait(timeout=20) == 0  # it leaves with the others once the workers are done
    finally:
        for p in (job, joiner):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["exact"] and result["lost"] == 0, result
    assert 2 in result["joined_owners"], result  # the new server received slices
    assert 1 not in result["drained_owners"], result  # the leaving one handed all of its slices over
    assert result["servers"].keys() == {"0", "2"}, result
    # rank 0 pushed through the join, the drain and 50 rounds after; the others until told to stop
    assert result["rounds"][0] > 50 and min(result["rounds"]) >= 10, result
