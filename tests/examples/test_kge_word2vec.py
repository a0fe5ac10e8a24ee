"""The adaptive-placement examples run end to end on a local cluster."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def needs(package: str, why: str) -> None:
    """Skip unless ``package`` is installed (only its data files are read: it is never imported)."""
    if importlib.util.find_spec(package) is None:
        pytest.skip(why)


def run(script: str, nodes: int, *args: str, tmp: Path) -> dict:
    out = tmp / "out.json"
    proc = subprocess.run([sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", str(nodes), "--",
                           sys.executable, str(ROOT / "examples" / script), *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_kge_auto_on_kinships_learns(tmp_path):
    needs("pykeen", "Kinships ships in pykeen: pip install --no-deps pykeen==1.11.1")
    r = run("kge/train.py", 2, "--data", "kinships", "--mode", "auto", "--epochs", "40", tmp=tmp_path)
    assert r["mrr"] > 0.4, r
    assert r["counters"]["rows_local"] > 0


@pytest.mark.parametrize("mode", ["classic", "auto"])
def test_word2vec_trains_in_every_mode(tmp_path, mode):
    needs("gensim", "the Lee corpus ships in gensim: pip install --no-deps gensim==4.4.0")
    r = run("word2vec/train.py", 2, "--mode", mode, "--epochs", "2", tmp=tmp_path)
    assert r["pairs_per_s"] > 0 and -1 <= r["wordsim_spearman"] <= 1
    assert r["analogies"] > 100
