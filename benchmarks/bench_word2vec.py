"""word2vec (skip-gram, negative sampling) on the Lee corpus: the single-process baseline against Shoal.

    python benchmarks/bench_word2vec.py [--epochs 10] [--seeds 3]

Every contender trains the same number of passes over gensim's Lee corpus, over
several seeds: the baseline (numpy rows, compiled step and row kernels), then
Shoal in classic (no shared memory, no intent), static, relocation-only and
replication-only modes on 2 nodes and auto on 1 and 2 (intents a pass long),
and auto on 2 nodes with intents a batch long. It records pairs/s and
the WordSim-353 Spearman correlation and analogy accuracy of the input vectors.
The corpus is small (57,000 tokens, 4,000 words), so those scores are low for
every contender and vary by seed: the table gives their mean and range, which is
what a difference must exceed to mean anything. The model is small too
(dimension 100, batches of 2,048 pairs), so per-step costs weigh more than for
the KGE benchmark. Writes ``results/word2vec.{json,md}``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
W2V = HERE.parent / "examples" / "word2vec"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(W2V))

from baseline import train as train_baseline  # noqa: E402
from sgns import Hyper  # noqa: E402

from common import run_example, write_results  # noqa: E402

#: (name, mode, nodes, more arguments); the adaptive modes declare each pass's words for the pass
CONTENDERS: list[tuple[str, str, int, list[str]]] = [
    ("classic PS", "classic", 2, []), ("static", "static", 2, []), ("relocation only", "relocation", 2, []),
    ("replication only", "replication", 2, []), ("auto", "auto", 1, []), ("auto", "auto", 2, []),
    ("auto, batch-long intents", "auto", 2, ["--intents", "batch"])]


def run_cluster(mode: str, nodes: int, epochs: int, seed: int, more: list[str]) -> dict[str, Any]:
    return run_example(W2V / "train.py", ["--mode", mode, "--epochs", str(epochs), "--seed", str(seed), *more],
                       nodes=nodes)


def summary(name: str, nodes: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    def stats(key: str) -> tuple[float, float, float]:
        values = [float(r[key]) for r in runs]
        return sum(values) / len(values), min(values), max(values)

    return {"name": name, "nodes": nodes, "runs": runs, "pairs_per_s": stats("pairs_per_s")[0],
            "wordsim": stats("wordsim_spearman"), "analogy": stats("analogy_accuracy")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--seeds", type=int, default=3)
    args = p.parse_args()

    train_baseline(1, Hyper())  # compile and warm up
    rows = [summary("single-process baseline", 1, [train_baseline(args.epochs, Hyper(), seed=s)
                                                   for s in range(args.seeds)])]
    print(f"baseline: {rows[0]['pairs_per_s']:,.0f} pairs/s", flush=True)
    for name, mode, nodes, more in CONTENDERS:
        rows.append(summary(name, nodes, [run_cluster(mode, nodes, args.epochs, s, more)
                                          for s in range(args.seeds)]))
        print(f"{name} on {nodes} node(s): {rows[-1]['pairs_per_s']:,.0f} pairs/s", flush=True)

    base = rows[0]["pairs_per_s"]
    classic = next(r for r in rows if r["name"] == "classic PS")["pairs_per_s"]
    lines = [f"Lee corpus (gensim's test data), skip-gram d=100, window 5, 5 negatives, batches of 2,048 pairs, "
             f"{args.epochs} passes; mean (and range) over {args.seeds} seeds.", "",
             "| contender | nodes | pairs/s | vs baseline | vs classic PS (2 nodes) | WordSim-353 Spearman "
             "| analogy accuracy |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ws, an = r["wordsim"], r["analogy"]
        lines.append(f"| {r['name']} | {r['nodes']} | {r['pairs_per_s']:,.0f} | {r['pairs_per_s'] / base:.2f} "
                     f"| {r['pairs_per_s'] / classic:.2f} | {ws[0]:.3f} ({ws[1]:.3f}-{ws[2]:.3f}) "
                     f"| {an[0]:.4f} ({an[1]:.4f}-{an[2]:.4f}) |")
    table_md = "\n".join(lines)
    print("\n" + table_md)
    write_results("word2vec", {"epochs": args.epochs, "seeds": args.seeds, "rows": rows}, table_md)


if __name__ == "__main__":
    main()
