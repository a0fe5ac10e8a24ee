"""The demo behind `make demo`: MF on MovieLens 100k on a local 2-node cluster, then a report.

Trains the single-process baseline, then the same model through Shoal on
a local cluster (2 nodes, 1 worker each; ``--mode auto``: each worker declares
the rows it will use, so they are on its node when it does), both from the
same initial rows, and prints RMSE per epoch and ratings/s side by side.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from baseline import train_baseline
from data import load_movielens
from model import Hyper, initial_rows

import shoal.launch.local

HERE = Path(__file__).resolve().parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--workers-per-node", type=int, default=1)
    p.add_argument("--epochs", type=int, default=Hyper.epochs)
    p.add_argument("--mode", default="auto", help="where rows live: static, relocation, replication or auto "
                                                 "(default %(default)s; see train.py)")
    p.add_argument("--report", default="shoal-report", help="where the run report goes (default %(default)s)")
    args = p.parse_args()

    print(f"MovieLens 100k, biased MF rank {Hyper.rank}, SGD, {args.epochs} epochs")
    print("1/2  single-process baseline ...", flush=True)
    data = load_movielens()
    # From the rows the job's tables start from: another draw alone moves the final RMSE by up to 0.005.
    start = initial_rows(data.num_users, data.num_items, Hyper(), 0, one_table=args.mode != "static")
    train_baseline(data, Hyper(epochs=1))  # compile its kernels before timing
    base = train_baseline(data, Hyper(epochs=args.epochs), initial=start)
    train_baseline(data, Hyper(epochs=1), in_place=True)
    in_place = train_baseline(data, Hyper(epochs=args.epochs), in_place=True, initial=start)  # its fastest form

    print(f"2/2  Shoal: {args.nodes} node(s) x {args.workers_per_node} worker(s), {args.mode} ...", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "mf.json"
        status = shoal.launch.local.run(
            [sys.executable, str(HERE / "train.py"), "--epochs", str(args.epochs), "--mode", args.mode,
             "--out", str(out)],
            nodes=args.nodes, workers_per_node=args.workers_per_node, report=args.report,
            fork_from_launcher=True,  # as `shoal run` does: Shoal and numba loaded once, here
        )
        if status != 0 or not out.exists():
            print(f"the Shoal run failed (exit status {status})", file=sys.stderr)
            return status or 1
        ps = json.loads(out.read_text())

    print("\nReport")
    print(f"{'epoch':>5}  {'Shoal RMSE':>10}  {'baseline RMSE':>13}")
    for epoch, (a, b) in enumerate(zip(ps["rmse"], base["rmse"], strict=True), 1):  # type: ignore[arg-type]
        print(f"{epoch:5d}  {a:10.4f}  {b:13.4f}")
    ratio = ps["ratings_per_s"] / base["ratings_per_s"]  # type: ignore[operator]
    shoal_label = f"Shoal ({ps['workers']} workers on {ps['nodes']} nodes):"
    print(f"\n{shoal_label:<36}{ps['ratings_per_s']:>12,.0f} ratings/s")
    print(f"{'single-process baseline:':<36}{base['ratings_per_s']:>12,.0f} ratings/s")
    print(f"{'ratio Shoal / baseline:':<36}{ratio:12.2f}x")
    print(f"{'baseline, SGD in place:':<36}{in_place['ratings_per_s']:>12,.0f} ratings/s  (one compiled step per "
          "rating on its rows;\n  Shoal's `train.py --in-place` takes the same steps on its node's rows: on 2 nodes "
          "0.35-0.7x of it,\n  by the machine's hour; see benchmarks/results/mf_movielens.md)")
    if args.nodes > 1:
        print("  (a batch of MovieLens 100k is about 0.2 ms of compute, so what Shoal spends per batch decides:\n"
              "   with --mode static rows are fetched from the other node, with auto they are read on the\n"
              "   worker's own node; what is left is the checks and locks of each local pull and push, and\n"
              "   two servers sharing the cores with the workers; see benchmarks/results/mf_movielens.md)")
    print(f"final test RMSE: Shoal {ps['rmse'][-1]:.4f}, baseline {base['rmse'][-1]:.4f} "  # type: ignore[index]
          "(from the same initial rows)")
    print(f"run report (plots of RMSE, throughput, per-server load, staleness): {args.report}/report.html")
    return 0


if __name__ == "__main__":
    sys.exit(main())
