"""The efficient single-process baseline: the same ComplEx step on numpy arrays, no parameter server."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from complex_model import Hyper, adagrad_delta, complex_step, filtered_ranks, mrr_hits, row_width
from graphs import Graph, load

from shoal.storage.kernels import add_rows, gather_rows


def init_rows(n: int, h: Hyper, rng: np.random.Generator) -> np.ndarray:
    rows = np.zeros((n, row_width(h)), dtype=np.float32)
    rows[:, : 2 * h.dim] = rng.standard_normal((n, 2 * h.dim)) * h.init_std
    return rows


def train(graph: Graph, h: Hyper, epochs: float = 1.0, seconds: float | None = None, seed: int = 0,
          loss_target: float | None = None) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    ent = init_rows(graph.num_entities, h, rng)
    rel = init_rows(graph.num_relations, h, rng)
    d = h.dim
    n = graph.train.shape[0]
    steps = int(epochs * n / h.batch)
    losses: list[tuple[float, float]] = []
    start = time.perf_counter()
    cpu_start = time.process_time()
    done = 0
    time_to_target = None
    for step in range(steps):
        if seconds is not None and time.perf_counter() - start > seconds:
            break
        idx = rng.integers(0, n, h.batch)
        heads, rels, tails = graph.train[idx].T
        negs = rng.integers(0, graph.num_entities, (h.batch, h.negatives))
        keys, inv = np.unique(np.concatenate([heads, tails, negs.reshape(-1)]), return_inverse=True)
        rkeys, rinv = np.unique(rels, return_inverse=True)
        # Shoal's compiled row kernels (no parameter server): its shared-memory path uses the same.
        e = np.empty((keys.shape[0], ent.shape[1]), ent.dtype)
        gather_rows(ent, keys, e)
        r = np.empty((rkeys.shape[0], rel.shape[1]), rel.dtype)
        gather_rows(rel, rkeys, r)
        b = h.batch
        g_e = np.zeros((keys.shape[0], 2 * d), np.float32)
        g_r = np.zeros((rkeys.shape[0], 2 * d), np.float32)
        loss = complex_step(e, r, inv[:b], rinv, inv[b:2 * b], inv[2 * b:].reshape(b, h.negatives),
                            np.arange(keys.shape[0]), np.arange(rkeys.shape[0]), d, h.reg, g_e, g_r)
        delta_e = np.empty_like(e)
        adagrad_delta(e, g_e, h.lr, d, delta_e)
        add_rows(ent, keys, delta_e, 1.0)
        delta_r = np.empty_like(r)
        adagrad_delta(r, g_r, h.lr, d, delta_r)
        add_rows(rel, rkeys, delta_r, 1.0)
        done += h.batch
        if step % 20 == 0:
            losses.append((time.perf_counter() - start, loss))
            recent = np.mean([x for _, x in losses[-5:]])
            if loss_target is not None and time_to_target is None and recent <= loss_target:
                time_to_target = time.perf_counter() - start
    elapsed = time.perf_counter() - start
    return {"triples_per_s": done / elapsed, "seconds": elapsed, "cpu_s": time.process_time() - cpu_start,
            "losses": losses, "time_to_target": time_to_target,
            "ent": ent, "rel": rel}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data", default="kinships")
    p.add_argument("--epochs", type=float, default=200)
    p.add_argument("--dim", type=int, default=100)
    p.add_argument("--out")
    args = p.parse_args()
    graph = load(args.data)
    h = Hyper(dim=args.dim, batch=min(Hyper.batch, graph.train.shape[0]))
    result = train(graph, h, epochs=args.epochs)
    known = {tuple(t) for t in np.concatenate([graph.train, graph.valid, graph.test]).tolist()}
    mrr, hits = mrr_hits(filtered_ranks(result["ent"], result["rel"], graph.test, known, h.dim))  # type: ignore[arg-type]
    print(f"{args.data}: {result['triples_per_s']:,.0f} triples/s, filtered MRR {mrr:.4f}, Hits@10 {hits:.4f}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"mrr": mrr, "hits10": hits, "triples_per_s": result["triples_per_s"]}, fh)


if __name__ == "__main__":
    main()
