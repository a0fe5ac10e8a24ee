"""LDA by collapsed Gibbs sampling on the Lee corpus, trained through Shoal (Bösen's second application).

    shoal run --nodes 2 --workers-per-node 2 -- python examples/lda/train.py --consistency essp --staleness 2

The word-topic counts (a row per word) and the topic totals (one row) are
tables whose update rule adds. Each worker holds its documents' topic
assignments and document-topic counts. Every clock it sweeps a share of its
documents: it pulls the rows of their words and the totals, resamples every
token against them (its own moves applied as it goes), and pushes what changed.
The rows of frequent words are read by every worker every clock, and are
changed by all of them: the re-read working set where ESSP's eager pushes are
meant to pay. Rank 0 reports the model's log-likelihood after each of its
epochs (a sweep over all its documents).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass

import numpy as np
from corpus import Documents, load_lee
from gibbs import log_likelihood, sweep

import shoal

MODELS = {"asp": lambda s: shoal.ASP(), "bsp": lambda s: shoal.BSP(), "ssp": lambda s: shoal.SSP(s),
          "essp": lambda s: shoal.ESSP(s)}


@dataclass
class Batch:
    """The documents a worker sweeps in one clock, and their sampler state."""

    docs: Documents
    words: np.ndarray  # the distinct words of these documents: the rows pulled
    rows: np.ndarray  # per token, its word's row in ``words``
    topics: np.ndarray  # per token, its topic
    doc_topic: np.ndarray  # per document, tokens per topic


def batches(mine: Documents, per_epoch: int, topics: int, rng: np.random.Generator) -> list[Batch]:
    out = []
    for docs in np.array_split(np.arange(mine.num_docs), per_epoch):
        part = mine.take(docs)
        words, rows = np.unique(part.tokens, return_inverse=True)
        z = rng.integers(0, topics, part.tokens.shape[0])
        doc_topic = np.zeros((part.num_docs, topics), np.int64)
        for d in range(part.num_docs):
            np.add.at(doc_topic[d], z[part.starts[d] : part.starts[d + 1]], 1)
        out.append(Batch(part, words.astype(np.int64), rows.astype(np.int64), z, doc_topic))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--topics", type=int, default=20)
    p.add_argument("--alpha", type=float, default=0.1)
    p.add_argument("--beta", type=float, default=0.01)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--clocks-per-epoch", type=int, default=4, help="each clock sweeps this share of a worker's docs")
    p.add_argument("--consistency", default="ssp", choices=sorted(MODELS))
    p.add_argument("--staleness", type=int, default=1)
    p.add_argument("--delay-ms", type=float, default=0.0, help="every rank sleeps a random time per clock "
                   "(exponential, this mean)")
    p.add_argument("--straggle-ms", type=float, default=0.0, help="the last rank sleeps this long per clock")
    p.add_argument("--seed", type=int, default=0, help="of the initial topics, the sampler and the pauses")
    p.add_argument("--out", help="rank 0 writes results as JSON here")
    p.add_argument("--stats-dir", help="every rank writes its staleness, counters and bytes here")
    args = p.parse_args()

    ps = shoal.init()
    corpus = load_lee()
    model = MODELS[args.consistency](args.staleness)
    k, vocab = args.topics, corpus.vocab
    word_topic = ps.table("lda.word_topic", vocab, k, consistency=model)
    totals = ps.table("lda.totals", 1, k, consistency=model)
    rng = np.random.default_rng(args.seed * 1000 + ps.rank)
    mine = corpus.take(np.arange(ps.rank, corpus.num_docs, ps.num_workers))
    work = batches(mine, args.clocks_per_epoch, k, rng)
    for b in work:  # the initial assignments' counts, before anyone samples
        counts = np.zeros((b.words.shape[0], k), np.float32)
        np.add.at(counts, (b.rows, b.topics), 1.0)
        word_topic.push(b.words, counts)
        totals.push([0], counts.sum(axis=0, keepdims=True))
    ps.advance_clock()
    ps.barrier()
    lead = ps.rank == 0
    straggler = ps.rank == ps.num_workers - 1 and ps.num_workers > 1
    history: list[float] = []
    times: list[float] = []
    start = time.perf_counter()
    for _ in range(args.epochs):
        for b in work:
            rows_f = word_topic.pull_async(b.words)
            total_f = totals.pull_async([0])
            wt, tot = rows_f.wait(), total_f.wait()[0]
            before, tot_before = wt.copy(), tot.copy()
            sweep(b.docs.tokens, b.docs.starts, b.rows, b.topics, b.doc_topic, wt, tot, args.alpha, args.beta,
                  vocab, int(rng.integers(2**31)))
            delta = wt - before
            changed = np.flatnonzero(np.any(delta != 0, axis=1))
            pushed = [word_topic.push_async(b.words[changed], delta[changed]),
                      totals.push_async([0], (tot - tot_before)[None, :])]
            for f in pushed:
                f.wait()
            pause = rng.exponential(args.delay_ms) if args.delay_ms else 0.0
            pause += args.straggle_ms if straggler else 0.0
            if pause:
                time.sleep(pause / 1000)
            ps.advance_clock()
        if lead:
            history.append(log_likelihood(word_topic.pull(np.arange(vocab)), args.beta))
            times.append(time.perf_counter() - start)
            ps.log(log_likelihood=history[-1])
    seconds = time.perf_counter() - start
    ps.barrier()
    for _ in range(args.staleness + 1):  # reads from here on cover every clock of every worker
        ps.advance_clock()
    # Every token is counted once, in its current topic: the counts sum to the corpus' tokens, and the
    # totals to each topic's column.
    counts = word_topic.pull(np.arange(vocab))
    topic_totals = totals.pull([0])[0]
    exact = bool(counts.sum() == corpus.tokens.shape[0] and np.array_equal(counts.sum(axis=0), topic_totals))
    if args.stats_dir:
        with open(os.path.join(args.stats_dir, f"rank{ps.rank}.json"), "w") as fh:
            json.dump({"rank": ps.rank, "clock": ps.clock,
                       "bytes": {"sent": ps.tracker.bytes_sent, "received": ps.tracker.bytes_received},
                       "tables": {t.name: {"staleness": t.staleness.as_dict(), "counters": dict(t.counters)}
                                  for t in (word_topic, totals)}}, fh)
    if lead:
        for epoch, value in enumerate(history, 1):
            print(f"epoch {epoch:2d}  log-likelihood {value:,.0f}")
        print(f"{ps.num_workers} worker(s) on {ps.num_nodes} node(s): "
              f"{corpus.tokens.shape[0] * args.epochs / seconds:,.0f} tokens/s; every token counted once: {exact}")
        if args.out:
            with open(args.out, "w") as fh:
                json.dump({"log_likelihood": history, "seconds": times, "train_seconds": seconds,
                           "tokens": int(corpus.tokens.shape[0]), "counted": float(counts.sum()),
                           "counts_exact": exact, "servers": ps.server_stats()}, fh, indent=2)
    ps.shutdown()


if __name__ == "__main__":
    main()
