"""MF on MovieLens 100k: Shoal configurations against the single-process baseline.

    python benchmarks/bench_mf.py [--epochs 10] [--rounds 5] [--sync-ms 2,50]

Each round runs the baseline and then every cluster configuration, so all
contenders see the same machine (``auto``: adaptive tables, each worker's own
users declared for the whole run and the items it rates for each epoch, see
``examples/mf/train.py``); the reported figure is the median over rounds
of ratings/s in the training loop (evaluation excluded), with the test RMSE
after the last epoch beside it (median and range over the rounds: round ``r``
seeds the initial rows, and Shoal's batch order: ``--init-seed r --seed r``;
the range is each contender's spread over seeds), and for ``auto`` how long its
set-up waited for the declared rows to reach their nodes before the loop
started (``Table.wait_local``).
Ten epochs train for about 0.3 s here, so a run's speed moves with the
machine's from second to second: the last column divides each configuration's
ratings/s by the baseline's of the same round (run seconds before it) and gives
the median and range of those ratios. Round ``r`` starts at the ``r``-th
configuration and takes them in turn: run in a fixed order, the first after the
baseline ran slower than the same configuration run second (median 0.81x
against 0.89x of the baseline over ten rounds). Beside it, the share of rank 0's training
loop spent at the barrier that ends each epoch (waiting for the slower worker,
and the barrier's own trip through the rendezvous); ``--free-running`` has none
between epochs, only the one at the end, and evaluates once, after it
(``--eval-at-end``: rank 0's evaluations would be inside its training loop). And the
servers' cores: their processes' CPU, every thread, over the training's wall time (what the
workers do not get on 2 cores; rank 0's evaluations between epochs included).

With ``--sync-ms``, auto with no barrier runs again once per period listed, its replicas
synced that often instead of at each clock (at most every 10 ms): a replica is read and
updated where it lies, and what the other node did to its rows since the last sync is
missing from it, so the period trades the servers' work for the rows' age, which shows in the
test RMSE.

What the second node costs auto in test RMSE is told apart from what its initial rows are: the
control, auto on 1 node x 1 worker, starts from the same rows as auto on 2 nodes with the same
seed (one table, its rows drawn per key), where the baseline and the two-table configurations
draw other ones. Each auto configuration on 2 nodes that computes as the control does (not ``SGD
in place``) is given its RMSE minus the control's of the same round, median and range over the
rounds. A seed's rows alone move the RMSE by about as much as the second node does (auto on 1
node x 1 worker spanned 0.9338-0.9365 over five seeds, the baseline 0.9340-0.9355).

Two baselines: the batch's gradients in numpy added to gathered rows (what the
configurations through pull and push compute), and one compiled SGD step per
rating on the rows where they lie (``--in-place``, what the configurations that
hold their node's rows in place compute: ``Table.in_place``); each configuration
is divided by the baseline that computes as it does, and both by the first in
the "vs baseline" column.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MF = HERE.parent / "examples" / "mf"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(MF))

from baseline import train_baseline  # noqa: E402
from data import load_movielens  # noqa: E402
from model import Hyper  # noqa: E402

from common import run_example, write_results  # noqa: E402

#: auto's initial rows and steps, with no second node: what 2 nodes change in auto's test RMSE is
#: measured against it seed by seed (one table draws its rows as two tables or the baseline do not)
CONTROL = "Shoal 1 node x 1 worker, auto (one worker: the control for auto's RMSE)"
#: name -> (cluster options, arguments of train.py)
CONFIGS: dict[str, tuple[dict[str, Any], list[str]]] = {
    "Shoal 1 node x 1 worker": (dict(nodes=1, workers_per_node=1), []),
    "Shoal 1 node x 2 workers": (dict(nodes=1, workers_per_node=2), []),
    "Shoal 2 nodes x 1 worker": (dict(nodes=2, workers_per_node=1), []),
    "Shoal 2 nodes x 1 worker, auto (intents as long as the use)": (dict(nodes=2, workers_per_node=1),
                                                                     ["--mode", "auto"]),
    "Shoal 2 nodes x 1 worker, auto, no barrier between epochs": (
        dict(nodes=2, workers_per_node=1), ["--mode", "auto", "--free-running", "--eval-at-end"]),
    CONTROL: (dict(nodes=1, workers_per_node=1), ["--mode", "auto", "--free-running", "--eval-at-end"]),
    "classic PS 2 nodes x 1 worker (no local access)": (dict(nodes=2, workers_per_node=1, local_access=False), []),
    "Shoal 2 nodes x 1 worker, auto, SGD in place": (dict(nodes=2, workers_per_node=1),
                                                     ["--mode", "auto", "--in-place"]),
    "Shoal 2 nodes x 1 worker, auto, SGD in place, batches of 10,000": (
        dict(nodes=2, workers_per_node=1), ["--mode", "auto", "--in-place", "--batch", "10000"]),
}


def run_cluster(epochs: int, options: dict[str, Any], args: list[str]) -> dict[str, Any]:
    return run_example(MF / "train.py", ["--epochs", str(epochs), "--quiet", *args], **options)


BASELINE = "single-process baseline (compiled row updates)"
IN_PLACE = "single-process baseline, SGD in place (one compiled step per rating)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sync-ms", default="",
                   help="replica sync periods (ms, comma-separated): auto with no barrier again, its replicas "
                        "synced that often, beside the others (what their age costs the test RMSE)")
    args = p.parse_args()
    configs = dict(CONFIGS)
    for ms in (float(ms) for ms in args.sync_ms.split(",") if ms):
        configs[f"Shoal 2 nodes x 1 worker, auto, no barrier between epochs, replicas synced every {ms:g} ms"] = (
            dict(nodes=2, workers_per_node=1),
            ["--mode", "auto", "--free-running", "--eval-at-end", "--sync-ms", f"{ms:g}"])
    data = load_movielens()
    train_baseline(data, Hyper(epochs=1))  # compile its kernels first
    train_baseline(data, Hyper(epochs=1), in_place=True)
    rates: dict[str, list[float]] = {BASELINE: [], IN_PLACE: [], **{k: [] for k in configs}}
    paired: dict[str, list[float]] = {k: [] for k in configs}  # over the baseline of the same round
    placement: dict[str, list[float]] = {k: [] for k in configs}
    waited: dict[str, list[float]] = {k: [] for k in configs}  # share of rank 0's training spent at barriers
    server_cores: dict[str, list[float]] = {k: [] for k in configs}  # the servers' CPU while the workers trained
    rmse: dict[str, list[float]] = {k: [] for k in rates}  # test RMSE after the last epoch, per round
    for r in range(args.rounds):
        bases = {}
        for name, in_place in ((BASELINE, False), (IN_PLACE, True)):
            bases[in_place] = train_baseline(data, Hyper(epochs=args.epochs), seed=r, in_place=in_place)
            rates[name].append(bases[in_place]["ratings_per_s"])  # type: ignore[arg-type]
            rmse[name].append(bases[in_place]["rmse"][-1])  # type: ignore[index]
        turns = list(configs.items())
        for name, (options, train_args) in turns[r % len(turns):] + turns[:r % len(turns)]:
            result = run_cluster(args.epochs, options, [*train_args, "--init-seed", str(r), "--seed", str(r)])
            rates[name].append(result["ratings_per_s"])  # type: ignore[arg-type]
            base = bases["--in-place" in train_args]
            paired[name].append(result["ratings_per_s"] / base["ratings_per_s"])  # type: ignore[operator]
            placement[name].append(result["placement_s"])  # type: ignore[arg-type]
            waited[name].append(result["barrier_s"] / result["train_seconds"])  # type: ignore[operator]
            server_cores[name].append(result["server_cores"])  # type: ignore[arg-type]
            rmse[name].append(result["rmse"][-1])  # type: ignore[index]
            print(f"round {r + 1}: {name}: {result['ratings_per_s']:,.0f} ratings/s", flush=True)

    base_rate = statistics.median(rates[BASELINE])
    lines = [f"MF rank {Hyper.rank} on MovieLens 100k, {args.epochs} epochs, median of {args.rounds} round(s)", "",
             "| configuration | ratings/s | vs baseline | test RMSE after the last epoch: median (range) | "
             "test RMSE minus the control's, same seed: median (range) | "
             "rows placed first, s | training at barriers | servers' cores | "
             "vs the same round's baseline: median (range) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    results = {}
    for name, values in rates.items():
        rate = statistics.median(values)
        placed = statistics.median(placement[name]) if placement.get(name) else 0.0
        ratios = paired.get(name, [])
        results[name] = {"ratings_per_s": rate, "vs_baseline": rate / base_rate, "rmse": rmse[name],
                         "all_rounds": values, "placement_s": placed, "vs_round_baseline": ratios,
                         "at_barriers": waited.get(name, []), "server_cores": server_cores.get(name, [])}
        same_round = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "-"
        at_barriers = f"{statistics.median(waited[name]):.0%}" if waited.get(name) else "-"
        servers = f"{statistics.median(server_cores[name]):.2f}" if server_cores.get(name) else "-"
        quality = f"{statistics.median(rmse[name]):.4f} ({min(rmse[name]):.4f}-{max(rmse[name]):.4f})"
        # Seed by seed against the control, for auto on 2 nodes computing as it does (the same initial rows;
        # the others draw theirs otherwise or take a step per rating, and the difference would be that)
        options, train_args = configs.get(name, ({}, []))
        paired_rmse = [a - b for a, b in zip(rmse[name], rmse[CONTROL], strict=True)] \
            if name != CONTROL and options.get("nodes") == 2 and "auto" in train_args \
            and "--in-place" not in train_args else []
        results[name]["rmse_minus_control"] = paired_rmse
        against_control = (f"{statistics.median(paired_rmse):+.4f} ({min(paired_rmse):+.4f} to "
                           f"{max(paired_rmse):+.4f})") if paired_rmse else "-"
        lines.append(f"| {name} | {rate:,.0f} | {rate / base_rate:.2f} | {quality} | {against_control} | "
                     f"{f'{placed:.3f}' if placed else '-'} | {at_barriers} | {servers} | {same_round} |")
    table_md = "\n".join(lines)
    print("\n" + table_md)
    write_results("mf_movielens", {"epochs": args.epochs, "rounds": args.rounds, "results": results}, table_md)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
