"""Knowledge-graph embeddings: the single-process baseline against Shoal's placement modes.

    python benchmarks/bench_kge.py [--seconds 20]

On the synthetic Zipf(1.1) graph (200,000 entities, 200 relations, 1,000,000
triples, ComplEx dimension 100, 6 negatives) every contender trains for the
same wall-clock budget: the single-process baseline, then Shoal in classic
(no shared memory, no intent), static, relocation-only, replication-only and
auto modes, on 1 and 2 nodes. It records triples/s and the time to reach a
fixed training loss. On Kinships it compares the filtered MRR of auto on 2
nodes with the baseline's after the same number of epochs. Writes
``results/kge.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
KGE = HERE.parent / "examples" / "kge"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(KGE))

from baseline import train as train_baseline  # noqa: E402
from complex_model import Hyper, filtered_ranks, mrr_hits  # noqa: E402
from graphs import load  # noqa: E402

import shoal.launch.local  # noqa: E402
from common import RESULTS, write_results  # noqa: E402

LOSS_TARGET = 0.30
CONTENDERS = [("classic PS", "classic", 2), ("static", "static", 1), ("static", "static", 2),
              ("relocation only", "relocation", 2), ("replication only", "replication", 2),
              ("auto", "auto", 1), ("auto", "auto", 2)]


def run_cluster(mode: str, nodes: int, extra: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        status = shoal.launch.local.run([sys.executable, str(KGE / "train.py"), "--mode", mode, "--out", str(out),
                                         *extra], nodes=nodes, prefix_output=False)
        if status != 0:
            raise SystemExit(f"{mode} on {nodes} node(s) failed with status {status}")
        return json.loads(out.read_text())  # type: ignore[no-any-return]


def time_to(losses: list[list[float]], target: float) -> float | None:
    for i in range(len(losses)):
        window = [x for _, x in losses[max(0, i - 4): i + 1]]
        if sum(window) / len(window) <= target:
            return float(losses[i][0])
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--kinships-epochs", type=float, default=150)
    args = p.parse_args()

    graph = load("zipf")
    train_baseline(graph, Hyper(), seconds=2)  # compile and warm up
    base = train_baseline(graph, Hyper(), seconds=args.seconds)
    rows: list[dict[str, Any]] = [{"name": "single-process baseline", "nodes": 1,
                                   "triples_per_s": base["triples_per_s"], "losses": base["losses"]}]
    print(f"baseline: {base['triples_per_s']:,.0f} triples/s", flush=True)
    for name, mode, nodes in CONTENDERS:
        r = run_cluster(mode, nodes, ["--data", "zipf", "--seconds", str(args.seconds)])
        rows.append({"name": name, "mode": mode, "nodes": nodes, "triples_per_s": r["triples_per_s"],
                     "losses": r["losses"], "servers": [s.get("adaptive", {}) for s in r["servers"]]})
        print(f"{name} on {nodes} node(s): {r['triples_per_s']:,.0f} triples/s", flush=True)

    kin = load("kinships")
    h = Hyper(batch=min(Hyper.batch, kin.train.shape[0]))
    kb = train_baseline(kin, h, epochs=args.kinships_epochs)
    known = {tuple(t) for t in (kin.train.tolist() + kin.valid.tolist() + kin.test.tolist())}
    base_mrr, base_hits = mrr_hits(filtered_ranks(kb["ent"], kb["rel"], kin.test, known, h.dim))  # type: ignore[arg-type]
    ka = run_cluster("auto", 2, ["--data", "kinships", "--epochs", str(args.kinships_epochs)])

    base_rate = rows[0]["triples_per_s"]
    classic2 = next(r for r in rows if r["name"] == "classic PS")["triples_per_s"]
    lines = [f"Synthetic Zipf(1.1) graph, ComplEx d=100, 6 negatives, {args.seconds:.0f} s per contender; "
             f"time to a training loss of {LOSS_TARGET} (mean of the last 5 readings).", "",
             "| contender | nodes | triples/s | vs baseline | vs classic PS (2 nodes) | time to loss s |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        t = time_to(r["losses"], LOSS_TARGET)
        r["time_to_target"] = t
        lines.append(f"| {r['name']} | {r['nodes']} | {r['triples_per_s']:,.0f} | {r['triples_per_s'] / base_rate:.2f} "
                     f"| {r['triples_per_s'] / classic2:.2f} | {'-' if t is None else f'{t:.1f}'} |")
    lines += ["", f"Kinships, {args.kinships_epochs:.0f} epochs: filtered MRR {base_mrr:.4f} (baseline) vs "
                  f"{ka['mrr']:.4f} (auto, 2 nodes), difference {abs(ka['mrr'] - base_mrr):.4f}; Hits@10 "
                  f"{base_hits:.4f} vs {ka['hits10']:.4f}."]
    table_md = "\n".join(lines)
    print("\n" + table_md)
    write_results("kge", {"seconds": args.seconds, "loss_target": LOSS_TARGET, "zipf": rows,
                          "kinships": {"baseline_mrr": base_mrr, "auto_mrr": ka["mrr"], "baseline_hits10": base_hits,
                                       "auto_hits10": ka["hits10"]}}, table_md)
    plot(rows)


def plot(rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    for r in rows:
        label = f"{r['name']} ({r['nodes']} node{'s' if r['nodes'] > 1 else ''})"
        a.plot([t for t, _ in r["losses"]], [x for _, x in r["losses"]], label=label)
    a.axhline(LOSS_TARGET, color="grey", ls=":", lw=0.8)
    a.set_xlabel("seconds")
    a.set_ylabel("training loss")
    a.legend(fontsize=7)
    names = [f"{r['name']}\n{r['nodes']}n" for r in rows]
    b.bar(range(len(rows)), [r["triples_per_s"] for r in rows])
    b.set_xticks(range(len(rows)), names, fontsize=7, rotation=30)
    b.set_ylabel("triples/s")
    fig.tight_layout()
    fig.savefig(RESULTS / "kge.png", dpi=110)


if __name__ == "__main__":
    main()
