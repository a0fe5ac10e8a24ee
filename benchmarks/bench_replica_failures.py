"""What a replica's death costs: acknowledged pushes lost with W=1 and W=2, and MF accuracy.

    python benchmarks/bench_replica_failures.py [--runs 3]

Counting: three workers on a 3-node cluster push +1 to 90 keys of a 3-replica
table (gossip every 20 ms) as fast as they can; 0.4 s in, one server is killed
with SIGKILL. After the run the surviving replicas are read one by one; the
difference between the pushes each worker saw acknowledged and the counts is
the loss (negative: a push applied twice after a failover).

MF: MovieLens 100k on 3-replica tables, with and without a server killed 2 s in.
Writes ``results/replica_failures.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
TRAIN = HERE.parent / "examples" / "mf" / "train.py"
sys.path.insert(0, str(HERE))

from common import write_results  # noqa: E402

PUSHES = 300


def counting_worker(out_dir: str, write_quorum: int) -> None:
    import shoal

    ps = shoal.init()
    keys = np.arange(90)
    table = ps.table("counts", 90, 1, replicas=3, write_quorum=write_quorum, gossip_ms=20)
    if ps.rank == 0:
        Path(out_dir, "servers.json").write_text(json.dumps([s["pid"] for s in ps.server_stats()]))
    ps.barrier()
    acked = 0
    for _ in range(PUSHES):
        table.push(keys, np.ones((90, 1), np.float32))
        acked += 1
    Path(out_dir, f"acked{ps.rank}.json").write_text(json.dumps(acked))
    ps.barrier()
    if ps.rank == 0:
        time.sleep(1.0)  # a few gossip rounds between the survivors
        view = table.access.view
        view.refresh(force=True)
        counts = {}
        for n in view.live([0, 1, 2]):
            try:
                counts[n] = table.access.replica_values(n, keys)[0][:, 0].tolist()
            except shoal.ShoalError:
                pass
        Path(out_dir, "counts.json").write_text(json.dumps(counts))
    ps.barrier()
    ps.shutdown()


def launch(command: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", "3",
                             "--on-server-failure", "continue", "--replica-timeout", "0.5", "--",
                             sys.executable, *command], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_file(path: Path, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_size:
            return json.loads(path.read_text())
        time.sleep(0.05)
    raise SystemExit(f"{path} never appeared")


def counting_run(write_quorum: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        proc = launch([os.path.abspath(__file__), "--count", tmp, str(write_quorum)])
        servers = wait_file(Path(tmp) / "servers.json")
        time.sleep(0.4)
        os.kill(servers[1], signal.SIGKILL)
        if proc.wait(timeout=300) != 0:
            raise SystemExit(f"counting run with W={write_quorum} failed")
        acked = sum(wait_file(Path(tmp) / f"acked{r}.json") for r in range(3))
        counts = wait_file(Path(tmp) / "counts.json")
    per_replica = {n: float(np.mean(c)) for n, c in counts.items()}
    return {"acked": acked, "counts": per_replica,
            "loss": {n: acked - c for n, c in per_replica.items()},
            "identical": len({json.dumps(c) for c in counts.values()}) == 1}


def mf_run(kill: bool) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        info, out = Path(tmp) / "info.json", Path(tmp) / "out.json"
        proc = launch([str(TRAIN), "--quiet", "--epochs", "8", "--replicas", "3", "--gossip-ms", "20",
                       "--info", str(info), "--out", str(out)])
        if kill:
            pids = wait_file(info)["server_pids"]
            time.sleep(2.0)
            os.kill(pids[1], signal.SIGKILL)
        if proc.wait(timeout=600) != 0:
            raise SystemExit("MF run failed")
        return float(json.loads(out.read_text())["rmse"][-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--count", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.count:
        counting_worker(args.count[0], int(args.count[1]))
        return
    results: dict[str, Any] = {}
    lines = ["One of three replicas killed with SIGKILL 0.4 s into a counting run (3 workers x "
             f"{PUSHES} pushes of +1 to 90 keys); loss = acknowledged pushes - count on a surviving replica.", "",
             "| write quorum | run | acknowledged | loss per surviving replica | replicas identical |",
             "|---:|---:|---:|---|---|"]
    for w in (1, 2):
        runs = [counting_run(w) for _ in range(args.runs)]
        results[f"W={w}"] = runs
        for i, r in enumerate(runs, 1):
            loss = ", ".join(f"node {n}: {v:g}" for n, v in r["loss"].items())
            lines.append(f"| {w} | {i} | {r['acked']} | {loss} | {r['identical']} |")
    clean, killed = mf_run(False), mf_run(True)
    results["mf"] = {"rmse_clean": clean, "rmse_killed": killed}
    lines += ["", f"MF on MovieLens 100k, 3 replicas (W=1, R=1), 8 epochs: test RMSE {clean:.4f} without a failure, "
                  f"{killed:.4f} with a server killed 2 s in (difference {abs(killed - clean):.4f})."]
    table_md = "\n".join(lines)
    print(table_md)
    write_results("replica_failures", results, table_md)


if __name__ == "__main__":
    main()
