"""MF on MovieLens 100k through a real local cluster reaches the target RMSE."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "mf" / "train.py"

pytest.importorskip("recbole", reason="MovieLens 100k ships in recbole: pip install --no-deps recbole==1.2.1")


def train(tmp_path: Path, nodes: int, *extra: str) -> dict:
    out = tmp_path / f"mf-{nodes}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", str(nodes), *extra, "--",
         sys.executable, str(TRAIN), "--quiet", "--out", str(out)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_mf_reaches_rmse_094_on_one_and_two_nodes_alike(tmp_path):
    one = train(tmp_path, 1)
    two = train(tmp_path, 2)
    assert len(one["rmse"]) == 20 and len(two["rmse"]) == 20
    assert min(one["rmse"]) <= 0.94, one["rmse"]
    assert min(two["rmse"]) <= 0.94, two["rmse"]
    assert abs(one["rmse"][-1] - two["rmse"][-1]) <= 0.01, (one["rmse"][-1], two["rmse"][-1])
