"""word2vec (skip-gram, negative sampling) on the Lee corpus: the single-process baseline against Shoal.

    python benchmarks/bench_word2vec.py [--epochs 10] [--seeds 3]

Every contender trains the same number of passes over gensim's Lee corpus, over
several seeds: the baseline (numpy rows, compiled step and row kernels; batches
of 2,048 pairs, and pair by pair on its arrays in place), then Shoal in classic
(no shared memory, no intent), static, relocation-only and replication-only
modes on 2 nodes and auto on 1 and 2 (intents a pass long; on 2 nodes also with
replicas synced every 10, 5 and 2 ms instead of 50, and with each worker
training the pairs of its own centre words, synced every 10 ms, and in blocks:
phases in which each worker trains its centre words' pairs with the context
words of one group, so that no row has two users at once and none is copied),
auto on 2 nodes with intents a batch long, and auto on 2 nodes pair by pair on the node's rows in
place (``--step 1``), also with each worker training the pairs of its own centre
words (``--split centre``); and what a word2vec user would
pick instead, gensim's ``Word2Vec`` with 1 and 2 threads (same hyperparameters;
``pip install smart_open`` lets gensim import). Throughput in words/s (corpus
tokens per second, as gensim reports it) and pairs/s. It records pairs/s and
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
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
W2V = HERE.parent / "examples" / "word2vec"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(W2V))

import numpy as np  # noqa: E402
from baseline import train as train_baseline  # noqa: E402
from corpus import Corpus, load_lee, planted  # noqa: E402
from sgns import Hyper, evaluate, pairs  # noqa: E402

from common import run_example, write_results  # noqa: E402

#: SGD pair by pair on the rows where they lie (``Table.in_place``), as word2vec itself updates
IN_PLACE = ["--step", "1"]
#: each worker trains the pairs of its own centre words: a word's input row is used on one node only
BY_CENTRE = ["--split", "centre"]
#: ... in phases by the context word's group (``sgns.phases``): an output row has one user at a time and moves
#: to the next between phases (the workers start each phase together); no row is ever a replica
IN_BLOCKS = ["--split", "blocks"]

#: replicas' sync periods besides the example's 50 ms: fresher replicas (quality on the planted clusters)
#: for more rows copied between the nodes (speed)
SYNC_PERIODS_MS = (10, 5, 2)

#: (name, mode, nodes, more arguments); the adaptive modes declare each pass's words for the pass
CONTENDERS: list[tuple[str, str, int, list[str]]] = [
    ("classic PS", "classic", 2, []), ("static", "static", 2, []), ("relocation only", "relocation", 2, []),
    ("replication only", "replication", 2, []), ("auto", "auto", 1, []), ("auto", "auto", 2, []),
    *[(f"auto, replicas synced every {ms} ms", "auto", 2, ["--sync-ms", str(ms)]) for ms in SYNC_PERIODS_MS],
    ("auto, pairs by centre word, synced every 10 ms", "auto", 2, [*BY_CENTRE, "--sync-ms", "10"]),
    ("auto, in blocks (phases by context word's group)", "auto", 2, IN_BLOCKS),
    ("auto, batch-long intents", "auto", 2, ["--intents", "batch"]),
    ("auto, pair by pair in place", "auto", 2, IN_PLACE),
    ("auto, pair by pair in place, pairs by centre word", "auto", 2, [*IN_PLACE, *BY_CENTRE]),
    ("auto, pair by pair in place, pairs by centre word, synced every 10 ms", "auto", 2,
     [*IN_PLACE, *BY_CENTRE, "--sync-ms", "10"])]


#: quality where it can be seen: on the planted-cluster corpus, these contenders (name, mode, nodes, more
#: arguments); replicas that sync more often read fresher rows, at a cost in servers' CPU
PLANTED: list[tuple[str, str, int, list[str]]] = [
    ("static", "static", 2, []), ("auto", "auto", 2, []),
    *[(f"auto, replicas synced every {ms} ms", "auto", 2, ["--sync-ms", str(ms)]) for ms in SYNC_PERIODS_MS],
    ("auto, pairs by centre word, synced every 10 ms", "auto", 2, [*BY_CENTRE, "--sync-ms", "10"]),
    ("auto, in blocks (phases by context word's group)", "auto", 2, IN_BLOCKS),
    ("auto, pair by pair in place, pairs by centre word", "auto", 2, [*IN_PLACE, *BY_CENTRE]),
    ("auto, pair by pair in place, pairs by centre word, synced every 10 ms", "auto", 2,
     [*IN_PLACE, *BY_CENTRE, "--sync-ms", "10"])]


def run_cluster(mode: str, nodes: int, epochs: int, seed: int, more: list[str]) -> dict[str, Any]:
    return run_example(W2V / "train.py", ["--mode", mode, "--epochs", str(epochs), "--seed", str(seed), *more],
                       nodes=nodes)


def train_gensim(corpus: Corpus, h: Hyper, epochs: int, threads: int, seed: int) -> dict[str, Any]:
    """What a word2vec user would pick instead: gensim's ``Word2Vec`` (skip-gram, the same dimension,
    window, negatives, subsampling, learning rate, min_count and passes), on the same token stream."""
    from gensim.models import Word2Vec  # pip install smart_open (gensim's own dependencies)

    text = [corpus.words[t] for t in corpus.tokens]
    sentences = [text[s : s + 10_000] for s in range(0, len(text), 10_000)]  # gensim's longest sentence
    model = Word2Vec(vector_size=h.dim, window=h.window, negative=h.negatives, sample=h.subsample, alpha=h.lr,
                     min_count=1, sg=1, workers=threads, seed=seed)  # min_count: the corpus is filtered already
    model.build_vocab(sentences)
    started = time.perf_counter()
    model.train(sentences, total_examples=len(sentences), epochs=epochs)
    elapsed = time.perf_counter() - started
    vectors = np.stack([model.wv[w] for w in corpus.words])
    return {"words_per_s": corpus.tokens.shape[0] * epochs / elapsed, **evaluate(vectors, corpus)}


def planted_quality(epochs: int, seeds: int) -> list[tuple[str, int, tuple[float, float, float], float]]:
    """Cluster purity of the baseline, gensim (2 threads) and Shoal on the planted corpus."""
    corpus, h = planted(), Hyper()

    def spread(values: list[float]) -> tuple[float, float, float]:
        return sum(values) / len(values), min(values), max(values)

    rows = []
    for name, step in (("single-process baseline", None), ("single-process baseline, pair by pair in place", 1)):
        base = [train_baseline(epochs, h, seed=s, corpus_name="planted", step=step) for s in range(seeds)]
        rows.append((name, 1, spread([float(r["cluster_purity"]) for r in base]),
                     sum(float(r["pairs_per_s"]) for r in base) / seeds))
    try:
        import gensim.models  # noqa: F401
    except ImportError:
        pass
    else:
        runs = [train_gensim(corpus, h, epochs, 2, s) for s in range(seeds)]
        rows.append(("gensim Word2Vec, 2 threads", 1, spread([r["cluster_purity"] for r in runs]), float("nan")))
    for name, mode, nodes, more in PLANTED:
        runs = [run_cluster(mode, nodes, epochs, s, ["--corpus", "planted", *more]) for s in range(seeds)]
        rows.append((name, nodes, spread([r["cluster_purity"] for r in runs]),
                     sum(r["pairs_per_s"] for r in runs) / seeds))
        print(f"planted: {name} on {nodes} node(s): purity {rows[-1][2][0]:.3f}", flush=True)
    return rows


def summary(name: str, nodes: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    def stats(key: str) -> tuple[float, float, float]:
        values = [float(r[key]) for r in runs]
        return sum(values) / len(values), min(values), max(values)

    return {"name": name, "nodes": nodes, "runs": runs, "pairs_per_s": stats("pairs_per_s")[0],
            "words_per_s": stats("words_per_s")[0], "wordsim": stats("wordsim_spearman"),
            "analogy": stats("analogy_accuracy")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--seeds", type=int, default=3)
    args = p.parse_args()

    corpus, h = load_lee(), Hyper()
    # Words/s as gensim counts them (tokens of the corpus per pass): a pass makes about this many pairs each.
    per_word = np.mean([pairs(corpus, h, np.random.default_rng([s, 0])).shape[0] for s in range(3)]) \
        / corpus.tokens.shape[0]

    def with_words(run: dict[str, Any]) -> dict[str, Any]:
        return {**run, "words_per_s": run["pairs_per_s"] / per_word}

    train_baseline(1, h)  # compile and warm up
    train_baseline(1, h, step=1)
    rows = [summary("single-process baseline", 1, [with_words(train_baseline(args.epochs, h, seed=s))
                                                   for s in range(args.seeds)])]
    rows.append(summary("single-process baseline, pair by pair in place", 1,
                        [with_words(train_baseline(args.epochs, h, seed=s, step=1)) for s in range(args.seeds)]))
    print(f"baseline: {rows[0]['pairs_per_s']:,.0f} pairs/s, in place {rows[1]['pairs_per_s']:,.0f}", flush=True)
    try:
        import gensim.models  # noqa: F401
    except ImportError as exc:  # the corpus needs only gensim's files; its models need smart_open too
        print(f"gensim's Word2Vec left out ({exc}): pip install smart_open", flush=True)
    else:
        for threads in (1, 2):
            runs = [train_gensim(corpus, h, args.epochs, threads, s) for s in range(args.seeds)]
            rows.append(summary(f"gensim Word2Vec, {threads} thread(s)", 1,
                                [{**r, "pairs_per_s": r["words_per_s"] * per_word} for r in runs]))
            print(f"gensim, {threads} thread(s): {rows[-1]['words_per_s']:,.0f} words/s", flush=True)
    for name, mode, nodes, more in CONTENDERS:
        rows.append(summary(name, nodes, [with_words(run_cluster(mode, nodes, args.epochs, s, more))
                                          for s in range(args.seeds)]))
        print(f"{name} on {nodes} node(s): {rows[-1]['pairs_per_s']:,.0f} pairs/s", flush=True)

    base, in_place = rows[0]["pairs_per_s"], rows[1]["pairs_per_s"]
    classic = next(r for r in rows if r["name"] == "classic PS")["pairs_per_s"]
    gensim2 = next((r["words_per_s"] for r in rows if r["name"] == "gensim Word2Vec, 2 thread(s)"), float("nan"))
    lines = [f"Lee corpus (gensim's test data), skip-gram d=100, window 5, 5 negatives, batches of 2,048 pairs, "
             f"{args.epochs} passes; mean (and range) over {args.seeds} seeds. Words/s: corpus tokens per "
             f"second, as gensim counts them (a pass makes {per_word:.2f} pairs per token here; gensim's figure "
             "is its own).", "",
             "| contender | nodes | words/s | pairs/s | vs baseline | vs baseline in place | vs gensim, 2 threads "
             "| vs classic PS (2 nodes) | WordSim-353 Spearman | analogy accuracy |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ws, an = r["wordsim"], r["analogy"]
        lines.append(f"| {r['name']} | {r['nodes']} | {r['words_per_s']:,.0f} | {r['pairs_per_s']:,.0f} "
                     f"| {r['pairs_per_s'] / base:.2f} | {r['pairs_per_s'] / in_place:.2f} "
                     f"| {r['words_per_s'] / gensim2:.2f} "
                     f"| {r['pairs_per_s'] / classic:.2f} | {ws[0]:.3f} ({ws[1]:.3f}-{ws[2]:.3f}) "
                     f"| {an[0]:.4f} ({an[1]:.4f}-{an[2]:.4f}) |")
    planted_rows = planted_quality(args.epochs, args.seeds)
    lines += ["", f"Planted word clusters (40 clusters of 50 words, 60% of each sentence's words drawn from anywhere, "
              f"60,000 tokens), {args.epochs} passes: share of each word's 10 nearest vectors in its own cluster "
              f"(by chance 0.02), mean (and range) over {args.seeds} seeds.", "",
              "| contender | nodes | cluster purity | pairs/s |", "|---|---:|---:|---:|"]
    for name, nodes, purity, rate in planted_rows:
        shown = "-" if rate != rate else f"{rate:,.0f}"  # gensim's own rate is in the table above
        lines.append(f"| {name} | {nodes} | {purity[0]:.3f} ({purity[1]:.3f}-{purity[2]:.3f}) | {shown} |")
    table_md = "\n".join(lines)
    print("\n" + table_md)
    write_results("word2vec", {"epochs": args.epochs, "seeds": args.seeds, "rows": rows,
                               "planted": planted_rows}, table_md)


if __name__ == "__main__":
    main()
