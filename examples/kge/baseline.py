"""The efficient single-process baseline: the same ComplEx step on numpy arrays, no parameter server."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from complex_model import (
    Hyper,
    adagrad_delta,
    complex_step,
    complex_steps_in_place,
    filtered_ranks,
    mrr_hits,
    row_width,
    warm_up,
)
from graphs import Graph, load

from shoal.storage.kernels import add_rows, gather_rows


def init_rows(n: int, h: Hyper, rng: np.random.Generator) -> np.ndarray:
    rows = np.zeros((n, row_width(h)), dtype=np.float32)
    rows[:, : 2 * h.dim] = rng.standard_normal((n, 2 * h.dim)) * h.init_std
    return rows


def train(graph: Graph, h: Hyper, epochs: float = 1.0, seconds: float | None = None, seed: int = 0,
          loss_target: float | None = None, eval_every: float | None = None,
          step_size: int | None = None) -> dict[str, object]:
    """Train for ``epochs`` (or ``seconds``); every ``eval_every`` epochs, the filtered MRR on the
    validation triples, with the training seconds so far (evaluating is not counted). ``step_size``:
    Adagrad steps of ``step_size`` triples each on the rows where they lie (no gather, no scatter), not
    one step per batch on gathered rows."""
    warm_up(h)
    scratch = np.zeros((1, row_width(h)), np.float32)
    gather_rows(scratch, np.zeros(1, np.int64), scratch.copy())  # Shoal's kernels compile at their first call
    add_rows(scratch, np.zeros(1, np.int64), scratch.copy(), 1.0)
    rng = np.random.default_rng(seed)
    ent = init_rows(graph.num_entities, h, rng)
    rel = init_rows(graph.num_relations, h, rng)
    d, b = h.dim, h.batch
    ent_map = np.full(graph.num_entities, -1, np.int64)  # scratch of the in-place steps
    rel_map = np.full(graph.num_relations, -1, np.int64)
    n = graph.train.shape[0]
    steps = int(epochs * n / b)
    eval_steps = max(1, round(eval_every * n / b)) if eval_every else 0
    known = {tuple(t) for t in np.concatenate([graph.train, graph.valid, graph.test]).tolist()} if eval_steps else set()
    curve: list[tuple[float, float, float]] = []
    losses: list[tuple[float, float]] = []
    trained = 0.0  # seconds spent training, evaluations left out
    cpu_start = time.process_time()
    done = 0
    time_to_target = None
    for step in range(steps):
        if seconds is not None and trained > seconds:
            break
        started = time.perf_counter()
        idx = rng.integers(0, n, b)
        heads, rels, tails = graph.train[idx].T
        negs = rng.integers(0, graph.num_entities, 2 * b * h.negatives)  # tails' corruptions, then heads'
        if step_size:
            heads, rels, tails = (np.ascontiguousarray(x) for x in (heads, rels, tails))
            corrupt = negs.reshape(2, b, h.negatives)
            loss = complex_steps_in_place(ent, rel, heads, rels, tails, corrupt[0], corrupt[1], np.arange(b),
                                          step_size, d, h.lr, h.reg, ent_map, rel_map)
        else:
            loss = _batch_step(ent, rel, heads, rels, tails, negs, h)
        done += b
        trained += time.perf_counter() - started
        if step % 20 == 0:
            losses.append((trained, loss))
            recent = np.mean([x for _, x in losses[-5:]])
            if loss_target is not None and time_to_target is None and recent <= loss_target:
                time_to_target = trained
        if eval_steps and (step + 1) % eval_steps == 0:
            mrr, _ = mrr_hits(filtered_ranks(ent, rel, graph.valid, known, d))
            curve.append(((step + 1) * b / n, trained, mrr))
    return {"triples_per_s": done / trained if trained else 0.0, "seconds": trained,
            "cpu_s": time.process_time() - cpu_start, "losses": losses, "time_to_target": time_to_target,
            "curve": curve, "ent": ent, "rel": rel}


def _batch_step(ent: np.ndarray, rel: np.ndarray, heads: np.ndarray, rels: np.ndarray, tails: np.ndarray,
                negs: np.ndarray, h: Hyper) -> float:
    """One Adagrad step for a batch: its distinct rows gathered, their summed gradients, the change added."""
    d, b = h.dim, heads.shape[0]
    keys, inv = np.unique(np.concatenate([heads, tails, negs]), return_inverse=True)
    rkeys, rinv = np.unique(rels, return_inverse=True)
    # Shoal's compiled row kernels (no parameter server): its shared-memory path uses the same.
    e = np.empty((keys.shape[0], ent.shape[1]), ent.dtype)
    gather_rows(ent, keys, e)
    r = np.empty((rkeys.shape[0], rel.shape[1]), rel.dtype)
    gather_rows(rel, rkeys, r)
    g_e = np.zeros((keys.shape[0], 2 * d), np.float32)
    g_r = np.zeros((rkeys.shape[0], 2 * d), np.float32)
    corrupt = inv[2 * b:].reshape(2, b, h.negatives)
    loss = complex_step(e, r, inv[:b], rinv, inv[b:2 * b], corrupt[0], corrupt[1],
                        np.arange(keys.shape[0]), np.arange(rkeys.shape[0]), d, h.reg, g_e, g_r)
    delta_e = np.empty_like(e)
    adagrad_delta(e, g_e, h.lr, d, delta_e)
    add_rows(ent, keys, delta_e, 1.0)
    delta_r = np.empty_like(r)
    adagrad_delta(r, g_r, h.lr, d, delta_r)
    add_rows(rel, rkeys, delta_r, 1.0)
    return float(loss)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data", default="kinships")
    p.add_argument("--epochs", type=float, default=200)
    p.add_argument("--dim", type=int, default=Hyper.dim)
    p.add_argument("--batch", type=int, default=Hyper.batch)
    p.add_argument("--lr", type=float, default=Hyper.lr)
    p.add_argument("--reg", type=float, default=Hyper.reg)
    p.add_argument("--negatives", type=int, default=Hyper.negatives, help="corruptions per side")
    p.add_argument("--eval-every", type=float, default=None, help="epochs between validation MRRs")
    p.add_argument("--step", type=int, default=None,
                   help="Adagrad steps of this many triples on the rows where they lie (no gather or scatter)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out")
    args = p.parse_args()
    graph = load(args.data)
    h = Hyper(dim=args.dim, batch=min(args.batch, graph.train.shape[0]), lr=args.lr, reg=args.reg,
              negatives=args.negatives)
    result = train(graph, h, epochs=args.epochs, seed=args.seed, eval_every=args.eval_every,
                   step_size=args.step)
    for epoch, seconds, valid_mrr in result["curve"]:  # type: ignore[attr-defined]
        print(f"epoch {epoch:7.1f}  {seconds:7.2f} s  validation filtered MRR {valid_mrr:.4f}")
    known = {tuple(t) for t in np.concatenate([graph.train, graph.valid, graph.test]).tolist()}
    mrr, hits = mrr_hits(filtered_ranks(result["ent"], result["rel"], graph.test, known, h.dim))  # type: ignore[arg-type]
    print(f"{args.data}: {result['triples_per_s']:,.0f} triples/s, test filtered MRR {mrr:.4f}, Hits@10 {hits:.4f}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"mrr": mrr, "hits10": hits, "triples_per_s": result["triples_per_s"],
                       "curve": result["curve"]}, fh)


if __name__ == "__main__":
    main()
