"""Skip-gram word2vec with negative sampling, trained through Shoal on the Lee corpus.

    shoal run --nodes 2 -- python examples/word2vec/train.py --mode auto --epochs 10

Each worker trains on its share of the (centre, context) pairs of each pass.
Modes as in the KGE example: ``classic``, ``static``, ``relocation``,
``replication``, ``auto`` (intent for the next batches' words, negatives drawn
locally from the noise distribution). Rank 0 reports pairs/s and the WordSim-353
and analogy scores.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from corpus import load_lee
from sgns import Hyper, evaluate, noise_weights, pairs, sgns_step

import shoal

MODES = ("classic", "static", "relocation", "replication", "auto")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", default="auto", choices=MODES)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lookahead", type=int, default=2)
    p.add_argument("--out")
    args = p.parse_args()
    h = Hyper()
    corpus = load_lee()
    adaptive = args.mode in ("relocation", "replication", "auto")
    ps = shoal.init(local_access=args.mode != "classic")
    common = dict(optimizer=shoal.optim.Sum(), techniques=args.mode if adaptive else "static", mapping="round_robin")
    vin = ps.table("w2v.in", corpus.vocab, h.dim, init=shoal.Uniform(-0.5 / h.dim, 0.5 / h.dim), **common)
    vout = ps.table("w2v.out", corpus.vocab, h.dim, **common)
    vout.register_sampling(noise_weights(corpus.counts), scheme="local" if adaptive else "naive")
    done = 0
    ps.barrier()
    start = time.perf_counter()
    for epoch in range(args.epochs):
        lr = h.lr * (1 - epoch / args.epochs)
        mine = pairs(corpus, h, np.random.default_rng(epoch))[ps.rank::ps.num_workers]
        batches = [mine[s : s + h.batch] for s in range(0, mine.shape[0], h.batch)]
        for i, batch in enumerate(batches):
            if adaptive and i + args.lookahead < len(batches):
                ahead, clock = batches[i + args.lookahead], ps.clock + args.lookahead
                vin.intent(ahead[:, 0], clock, clock + 1)
                vout.intent(ahead[:, 1], clock, clock + 1)
            n = batch.shape[0]
            ins = np.unique(batch[:, 0])
            ctx = np.unique(batch[:, 1])
            in_rows, ctx_rows = vin.pull_async(ins), vout.pull_async(ctx)
            neg_keys, neg_rows = vout.pull_sample(vout.prepare_sample(n * h.negatives))
            out_keys = np.concatenate([ctx, neg_keys])
            out_rows = np.concatenate([ctx_rows.wait(), neg_rows])
            keys_out, out_slot = np.unique(out_keys, return_inverse=True)
            d_in = np.zeros((ins.shape[0], h.dim), np.float32)
            d_out = np.zeros((keys_out.shape[0], h.dim), np.float32)
            negs = (ctx.shape[0] + np.arange(n * h.negatives)).reshape(n, h.negatives)
            sgns_step(in_rows.wait(), out_rows, np.searchsorted(ins, batch[:, 0]), np.searchsorted(ctx, batch[:, 1]),
                      negs, np.arange(ins.shape[0]), out_slot, lr, d_in, d_out)
            pushes = [vin.push_async(ins, d_in), vout.push_async(keys_out, d_out)]
            for f in pushes:
                f.wait()
            ps.advance_clock()
            done += n
    elapsed = time.perf_counter() - start
    ps.barrier()
    if ps.rank == 0:
        result = {"mode": args.mode, "nodes": ps.num_nodes, "pairs_per_s": done * ps.num_workers / elapsed,
                  **evaluate(vin.pull(np.arange(corpus.vocab)), corpus)}
        print(json.dumps(result))
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(result, fh)
    ps.barrier()
    ps.shutdown()


if __name__ == "__main__":
    main()
