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
    for run in (one, two):  # the epochs' barriers are part of the training time reported, not all of it
        assert 0 < run["barrier_s"] < run["train_seconds"], (run["barrier_s"], run["train_seconds"])


def test_mf_free_running_evaluated_at_the_end_only_times_training_alone_and_reaches_rmse_094(tmp_path):
    """``--free-running --eval-at-end``: no barrier between epochs and no evaluation inside the timed loop
    (rank 0's evaluations held up its own training while the other worker went on)."""
    out = tmp_path / "mf-free.json"
    proc = subprocess.run(
        [sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", "2", "--", sys.executable, str(TRAIN), "--quiet",
         "--mode", "auto", "--epochs", "15", "--free-running", "--eval-at-end", "--out", str(out)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert len(run["rmse"]) == 1 and run["rmse"][0] <= 0.94, run["rmse"]
    assert 0 < run["seconds"][0] - run["train_seconds"], (run["seconds"], run["train_seconds"])  # evaluated after
    assert 0 <= run["barrier_s"] < run["train_seconds"], (run["barrier_s"], run["train_seconds"])


def test_mf_with_intents_on_two_nodes_reads_its_rows_locally_and_reaches_rmse_094(tmp_path):
    """``--mode auto``: each worker's users declared for the run and its items for each epoch; the rows
    come to (or are copied onto) the worker's node, so nearly every row is read there, not fetched."""
    out, stats = tmp_path / "mf-auto.json", tmp_path / "stats"
    stats.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", "2", "--", sys.executable, str(TRAIN), "--quiet",
         "--mode", "auto", "--epochs", "15", "--stats-dir", str(stats), "--out", str(out)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Still falling 0.003 an epoch at ten (0.937-0.941 there, one run in about eight above 0.94 with
    # the same seed: the workers' timing decides the rest); 0.926-0.928 at fifteen.
    assert min(json.loads(out.read_text())["rmse"]) <= 0.94
    for rank in (0, 1):
        seen = json.loads((stats / f"rank{rank}.json").read_text())
        batches = seen["clock"]
        counters = [t["counters"] for t in seen["tables"].values()]
        local = sum(c.get("rows_local", 0) for c in counters)
        remote = sum(c.get("rows_remote", 0) for c in counters)
        requests = sum(c.get("requests", 0) for c in counters)
        assert remote < 0.05 * (local + remote), (rank, local, remote)
        # Intents a batch long would move or copy items anew every few clocks: a request most batches.
        assert requests < 0.1 * batches, (rank, requests, batches)
    # Rank 1 does not evaluate: every row it used was here from its first batch on, since the set-up
    # waited for the rows its intents declared (its first batches asked node 0 while they moved).
    assert (requests, remote) == (0, 0)
    # The items were declared rank by rank: those both rate are owned on node 0 and replicas on node 1
    # only, so that the replicas' syncs go one way (declared at once, in about one run in four each
    # node kept the items it was home to and held replicas of the others').
    servers = sorted(json.loads(out.read_text())["servers"], key=lambda server: server["node"])
    items = [server["adaptive"]["mf.factors"] for server in servers]
    assert items[0].get("replicas_held", 0) == 0 and items[1].get("replicas_held", 0) > 500, items


def test_mf_sgd_in_place_on_two_nodes_steps_on_its_nodes_rows_and_reaches_rmse_094(tmp_path):
    """``--in-place``: one SGD step per rating on the rows of the worker's node where they lie; only the
    ratings with a row elsewhere go through messages."""
    out, stats = tmp_path / "mf-in-place.json", tmp_path / "stats"
    stats.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", "2", "--", sys.executable, str(TRAIN), "--quiet",
         "--mode", "auto", "--in-place", "--epochs", "15", "--stats-dir", str(stats), "--out", str(out)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert min(json.loads(out.read_text())["rmse"]) <= 0.94
    for rank in (0, 1):
        counters = [t["counters"] for t in json.loads((stats / f"rank{rank}.json").read_text())["tables"].values()]
        in_place = sum(c.get("rows_in_place", 0) for c in counters)
        other = sum(c.get("rows_local", 0) + c.get("rows_remote", 0) for c in counters)
        assert in_place > 20 * other, (rank, in_place, other)
