"""This tree against an earlier commit, side by side in one run: did a change make anything slower?

    python benchmarks/bench_versions.py [--against REV] [--rounds 3] [--seconds 15]

A restructuring is meant to keep speed; absolute figures move with the machine
(and a shared virtual machine moves a lot from day to day), so the check runs
both versions in the same run, alternating round by round. ``REV`` is checked
out into a temporary git worktree; each contender runs with ``PYTHONPATH``
pointing at its own ``src``. Measured per contender:

* start-up: ``shoal run --nodes 2 --workers-per-node 1`` of a script that
  calls ``shoal.init()``, one barrier and ``shutdown()``, launcher start to
  exit (the median of 3 per round);
* remote pulls through ``shoal run --nodes 1 --classic`` (every key to the
  server over loopback tcp, authenticated): microseconds per pull of 1 key and
  of 10,000 keys of 64 float32, one request at a time;
* KGE (synthetic Zipf graph, ComplEx) with ``--mode auto`` on 2 nodes: triples/s, and the cores
  both servers used; and triples/s again with 5% of all messages lost (``shoal run --faults``,
  seeded by the round, so both contenders lose the same draws of the dice).

Ratios above 1 mean this tree is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from common import write_results  # noqa: E402

PULLS = r"""
import json, sys, time
import numpy as np
import shoal

ps = shoal.init()
table = ps.table("versions", 200_000, 64)
out = {}
for n, calls in ((1, 3000), (10_000, 300)):
    keys = np.arange(0, 200_000, 20)[:n]
    for _ in range(calls // 10):
        table.pull(keys)
    start = time.perf_counter()
    for _ in range(calls):
        table.pull(keys)
    out[str(n)] = (time.perf_counter() - start) / calls * 1e6
ps.shutdown()
open(sys.argv[1], "w").write(json.dumps(out))
"""


TRIVIAL = r"""
import shoal
ps = shoal.init()
ps.barrier()
ps.shutdown()
"""


def trivial_job(src: Path, script: Path) -> float:
    """Seconds ``shoal run`` of the trivial 2-node job takes, launcher start to exit."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", "2", "--workers-per-node", "1", "--",
                    sys.executable, str(script)], env={**os.environ, "PYTHONPATH": str(src)}, capture_output=True,
                   check=True, timeout=120, cwd=ROOT)
    return time.perf_counter() - started


def shoal_run(src: Path, nodes: int, args: list[str], classic: bool = False, faults: str = "") -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", str(nodes),
               *(["--classic"] if classic else []), *(["--faults", faults] if faults else []),
               "--", sys.executable, *args]
        cmd = [c.replace("{out}", str(out)) for c in cmd]
        done = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(src)}, capture_output=True, text=True,
                              timeout=600, cwd=ROOT)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} with {src} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())  # type: ignore[no-any-return]


def measure(src: Path, seconds: float, pulls_script: Path, trivial_script: Path, seed: int) -> dict[str, float]:
    startup = statistics.median(trivial_job(src, trivial_script) for _ in range(3))
    pulls = shoal_run(src, 1, [str(pulls_script), "{out}"], classic=True)
    kge_args = [str(ROOT / "examples" / "kge" / "train.py"), "--mode", "auto", "--data", "zipf",
                "--seconds", str(seconds), "--out", "{out}"]
    kge = shoal_run(src, 2, kge_args)
    lossy = shoal_run(src, 2, kge_args, faults=f"loss=0.05,seed={seed}")
    return {"startup_s": startup, "pull_1_us": pulls["1"], "pull_10000_us": pulls["10000"],
            "kge_auto_triples_per_s": kge["triples_per_s"],
            "kge_auto_server_cores": kge["server_cores"],
            "kge_auto_loss_triples_per_s": lossy["triples_per_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="HEAD", help="the commit to compare this working tree with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=15.0, help="KGE training time per contender")
    args = parser.parse_args()
    rev = subprocess.run(["git", "rev-parse", "--short", args.against], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), rev], capture_output=True, check=True,
                       cwd=ROOT)
        try:
            pulls_script = Path(tmp) / "pulls.py"
            pulls_script.write_text(PULLS)
            trivial_script = Path(tmp) / "trivial.py"
            trivial_script.write_text(TRIVIAL)
            contenders = {"this tree": ROOT / "src", rev: old / "src"}
            for src in contenders.values():
                # Both start from bytecode, as an installed package does: a fresh worktree has none, and
                # with PYTHONDONTWRITEBYTECODE set each of a job's processes would compile every module
                # again (0.4-0.5 s of the trivial job here).
                subprocess.run([sys.executable, "-m", "compileall", "-q", str(src)], check=True,
                               env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"})
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in contenders}
            for round_ in range(args.rounds):
                for name, src in contenders.items():
                    runs[name].append(measure(src, args.seconds, pulls_script, trivial_script, round_ + 1))
                    print(f"round {round_ + 1} {name}: {runs[name][-1]}", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], capture_output=True, cwd=ROOT)
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    new, base = medians["this tree"], medians[rev]
    rows = [("trivial 2-node job, start to exit (s)", "startup_s", True),
            ("remote pull, 1 key (µs)", "pull_1_us", True), ("remote pull, 10,000 keys (µs)", "pull_10000_us", True),
            ("KGE auto, 2 nodes (triples/s)", "kge_auto_triples_per_s", False),
            ("KGE auto, 2 nodes: both servers' cores", "kge_auto_server_cores", True),
            ("KGE auto, 2 nodes, 5% of messages lost (triples/s)", "kge_auto_loss_triples_per_s", False)]
    lines = [f"This tree against {rev}, alternating, {args.rounds} rounds; medians. Ratio > 1: this tree is faster.",
             "", f"| measure | this tree | {rev} | ratio |", "|---|---:|---:|---:|"]
    for label, key, lower_is_better in rows:
        ratio = base[key] / new[key] if lower_is_better else new[key] / base[key]
        lines.append(f"| {label} | {new[key]:,.2f} | {base[key]:,.2f} | {ratio:.2f} |")
    table = "\n".join(lines)
    print("\n" + table)
    write_results("versions", {"against": rev, "rounds": args.rounds, "runs": runs, "medians": medians}, table)


if __name__ == "__main__":
    main()
