"""The single-process baseline: skip-gram with negative sampling on numpy arrays, the same compiled step.

Rows are gathered and updated, and negatives drawn, with Shoal's compiled kernels (no parameter server): numpy's
fancy indexing is several times slower, and the baseline should be as efficient as Shoal's local path. With
``--step S`` each batch is trained as SGD steps of S pairs on the arrays where they lie (no gather, no
scatter; ``--step 1`` is word2vec's own update, pair by pair), as ``train.py --step S`` does on a node's rows.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from corpus import load
from sgns import Hyper, distinct, evaluate, noise_weights, pairs, sgns_step, sgns_steps_in_place

from shoal.storage.kernels import add_rows, alias_draw, alias_table, gather_rows


def batch_step(vin: np.ndarray, vout: np.ndarray, batch: np.ndarray, negatives: np.ndarray, lr: float,
               scratch: np.ndarray) -> None:
    """One SGD step for a batch of (centre, context) pairs and their ``negatives`` (one row of them per
    pair), as Shoal's worker takes it through pull and push: the distinct rows gathered, the step's
    changes computed from them and added back. ``scratch`` is ``distinct``'s."""
    n, dim = batch.shape[0], vin.shape[1]
    ins, in_slot = distinct(batch[:, 0], scratch)
    outs, out_slot = distinct(np.concatenate([batch[:, 1], negatives.reshape(-1)]), scratch)
    in_rows = np.empty((ins.shape[0], dim), np.float32)
    out_rows = np.empty((outs.shape[0], dim), np.float32)
    gather_rows(vin, ins, in_rows)
    gather_rows(vout, outs, out_rows)
    d_in = np.zeros_like(in_rows)
    d_out = np.zeros_like(out_rows)
    sgns_step(in_rows, out_rows, in_slot, out_slot[:n], out_slot[n:].reshape(negatives.shape), lr, d_in, d_out)
    add_rows(vin, ins, d_in, 1.0)
    add_rows(vout, outs, d_out, 1.0)


def train(epochs: int, h: Hyper, seed: int = 0, corpus_name: str = "lee", step: int | None = None
          ) -> dict[str, object]:
    corpus = load(corpus_name)
    rng = np.random.default_rng(seed)
    vin = ((rng.random((corpus.vocab, h.dim)) - 0.5) / h.dim).astype(np.float32)
    vout = np.zeros((corpus.vocab, h.dim), np.float32)
    noise = alias_table(noise_weights(corpus.counts))
    scratch = np.full(corpus.vocab, -1, np.int64)
    done, start = 0, time.perf_counter()
    for epoch in range(epochs):
        lr = h.lr * (1 - epoch / epochs)
        batches = pairs(corpus, h, rng)
        for s in range(0, batches.shape[0], h.batch):
            batch = batches[s : s + h.batch]
            n = batch.shape[0]
            negs = alias_draw(*noise, rng.random(n * h.negatives))
            if step:
                sgns_steps_in_place(vin, vout, batch[:, 0], batch[:, 1], negs.reshape(n, h.negatives),
                                    np.arange(n), step, lr)
                done += n
                continue
            batch_step(vin, vout, batch, negs.reshape(n, h.negatives), lr, scratch)
            done += n
    elapsed = time.perf_counter() - start
    return {"pairs_per_s": done / elapsed, **evaluate(vin, corpus)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--corpus", default="lee", choices=("lee", "planted"))
    p.add_argument("--step", type=int, default=None, help="SGD steps of this many pairs on the arrays in place")
    p.add_argument("--out")
    args = p.parse_args()
    result = train(args.epochs, Hyper(), corpus_name=args.corpus, step=args.step)
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh)


if __name__ == "__main__":
    main()
