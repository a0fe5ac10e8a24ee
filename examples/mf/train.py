"""Biased matrix factorisation on MovieLens 100k, trained through Shoal.

Run it on a local cluster:

    shoal run --nodes 2 --workers-per-node 1 -- python examples/mf/train.py

Each worker takes every ``num_workers``-th training rating, pulls the rows of a
batch's users and items, computes gradients, and pushes them; the servers (or,
for local rows, the worker itself) apply SGD. Rank 0 reports test RMSE after
each epoch and, with ``--out``, writes the results as JSON.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from data import load_movielens
from model import Hyper, gradients, rmse
from progress import Progress

import shoal


def parse() -> tuple[Hyper, argparse.Namespace]:
    d = Hyper()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--rank", type=int, default=d.rank)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--reg", type=float, default=d.reg)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--mapping", default="range", help="key mapping rule of both tables")
    p.add_argument("--out", help="rank 0 writes results as JSON here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args()
    return Hyper(rank=args.rank, lr=args.lr, reg=args.reg, batch=args.batch, epochs=args.epochs), args


def main() -> None:
    hyper, args = parse()
    ps = shoal.init()
    data = load_movielens()
    options = dict(init=shoal.Normal(std=hyper.init_std), optimizer=shoal.optim.SGD(lr=hyper.lr),
                   mapping=args.mapping)
    users = ps.table("mf.users", data.num_users, hyper.rank + 1, **options)
    items = ps.table("mf.items", data.num_items, hyper.rank + 1, **options)
    mine = data.train.take(np.arange(ps.rank, len(data.train), ps.num_workers))
    mu = float(data.train.values.mean())
    lead = ps.rank == 0
    history: list[float] = []
    train_seconds = 0.0
    batches_per_epoch = -(-len(mine) // hyper.batch)
    progress = Progress(hyper.epochs * batches_per_epoch, "training") if lead and not args.quiet else None

    ps.barrier()
    for epoch in range(hyper.epochs):
        order = np.random.default_rng((1000 + epoch) * 7919 + ps.rank).permutation(len(mine))
        start = time.perf_counter()
        for s in range(0, len(mine), hyper.batch):
            idx = order[s : s + hyper.batch]
            u, i = mine.users[idx], mine.items[idx]
            user_rows = users.pull_async(u)
            item_rows = items.pull_async(i)
            grad_u, grad_i, _ = gradients(user_rows.wait(), item_rows.wait(), mine.values[idx], mu, hyper.reg)
            pushed = [users.push_async(u, grad_u), items.push_async(i, grad_i)]
            for f in pushed:
                f.wait()
            ps.advance_clock()
            if progress:
                note = f"epoch {epoch + 1}/{hyper.epochs}" + (f"  RMSE {history[-1]:.4f}" if history else "")
                progress.update(1, note)
        ps.barrier()  # every worker's epoch is applied before anyone evaluates
        train_seconds += time.perf_counter() - start
        if lead:
            all_users = users.pull(np.arange(data.num_users))
            all_items = items.pull(np.arange(data.num_items))
            history.append(rmse(all_users, all_items, data.test.users, data.test.items, data.test.values, mu))
        ps.barrier()

    if lead:
        if progress:
            progress.close(f"done  RMSE {history[-1]:.4f}")
        rate = len(data.train) * hyper.epochs / train_seconds
        for epoch, value in enumerate(history, 1):
            print(f"epoch {epoch:2d}  test RMSE {value:.4f}")
        print(f"{ps.num_workers} worker(s) on {ps.num_nodes} node(s): {rate:,.0f} ratings/s")
        if args.out:
            with open(args.out, "w") as fh:
                json.dump({"rmse": history, "ratings_per_s": rate, "train_seconds": train_seconds,
                           "nodes": ps.num_nodes, "workers": ps.num_workers}, fh, indent=2)
    ps.shutdown()


if __name__ == "__main__":
    main()
