"""What the replicas' staleness costs word2vec, and what syncing fewer rows buys: an offline model.

    python benchmarks/w2v_staleness.py [--seeds 3]

Auto on 2 nodes makes every word a replica (each is used by both workers): one node
trains on the owners' rows, the other on replicas that send their change and take
the owners' rows back at each sync. This replays that with the baseline's kernels
in one process, the two workers taking turns batch by batch, on the planted-cluster
corpus: a sync every ``period`` batches of each worker; or, between full syncs, only
the rows whose change since their last sync exceeds ``theta`` of the row's norm (a
significance filter, as Gaia's); or with each worker training the pairs of its own
centre words, so that only the output rows are replicas; or in blocks, as
``train.py --split blocks`` trains, where no row is ever a replica and output rows
move between phases. It prints the cluster purity and the rows the syncs sent
(each row sent once each way) or the moves sent, so that the ways of spending rows
can be put on one curve. No messages, no servers: the model of the
algorithm that ``results/word2vec.md`` measures live (where 50 ms is about 20
batches here). Writes ``results/w2v_staleness.{json,md}``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples" / "word2vec"))

import numpy as np  # noqa: E402
from baseline import batch_step  # noqa: E402
from corpus import load  # noqa: E402
from sgns import Hyper, centres_by_worker, evaluate, noise_weights, pairs, phases  # noqa: E402

from common import write_results  # noqa: E402
from shoal.storage.kernels import alias_draw, alias_table  # noqa: E402


@dataclass(frozen=True)
class Syncs:
    period: int  # batches of each worker between syncs
    full_every: int = 1  # every this many syncs send every changed row; the others only significant ones
    theta: float = 0.0  # a row's change is significant above this share of the row's norm
    by_centre: bool = False  # each worker trains the pairs of its own centre words: input rows never replicas

    def __str__(self) -> str:
        said = f"every {self.period} batch(es)"
        if self.full_every > 1:
            said += (f", rows changed by more than {self.theta:g} of their norm; "
                     f"all every {self.period * self.full_every}")
        return said + (", pairs by centre word (output rows only)" if self.by_centre else "")


@dataclass(frozen=True)
class Blocks:
    phase: int  # batches per phase, about (``sgns.phases``)

    def __str__(self) -> str:
        return f"never: in blocks, phases of about {self.phase} batches (rows moved to their next user)"


def train_blocks(blocks: Blocks, seed: int, epochs: int = 10) -> tuple[float, int]:
    """As ``train.py --split blocks`` trains: each worker's phases (``sgns.phases``), the workers taking
    turns batch by batch on one copy of the rows (in a phase no row is used by both), negatives drawn within
    the phase's group. Cluster purity, and the rows moved between the phases."""
    corpus, h = load("planted"), Hyper()
    rng = np.random.default_rng(seed)
    vin = ((rng.random((corpus.vocab, h.dim)) - 0.5) / h.dim).astype(np.float32)
    vout = np.zeros((corpus.vocab, h.dim), np.float32)
    group_of = centres_by_worker(corpus, h, 4)
    weights = noise_weights(corpus.counts)
    words = [np.flatnonzero(group_of == group) for group in range(4)]
    within = [alias_table(weights[w]) for w in words]
    scratch = np.full(corpus.vocab, -1, np.int64)
    moved = 0
    for epoch in range(epochs):
        lr = h.lr * (1 - epoch / epochs)
        every = pairs(corpus, h, rng)
        schedules = [phases(every, group_of, rank, 2, blocks.phase, h.batch) for rank in (0, 1)]
        for now in range(len(schedules[0])):
            for i in range(len(schedules[0][now][1])):
                for schedule in schedules:
                    group, batches = schedule[now]
                    batch = batches[i]
                    n = batch.shape[0]
                    negatives = words[group][alias_draw(*within[group], rng.random(n * h.negatives))]
                    batch_step(vin, vout, batch, negatives.reshape(n, h.negatives), lr, scratch)
            # Each worker's next group comes to its node while this phase runs.
            moved += sum(words[(schedule[now][0] + 1) % 4].shape[0] for schedule in schedules)
    return float(evaluate(vin, corpus)["cluster_purity"]), moved


def train(syncs: Syncs, seed: int, epochs: int = 10) -> tuple[float, int]:
    """Cluster purity of the owners' input rows after ``epochs`` passes, and the rows the syncs sent."""
    corpus, h = load("planted"), Hyper()
    rng = np.random.default_rng(seed)
    owners = [((rng.random((corpus.vocab, h.dim)) - 0.5) / h.dim).astype(np.float32),
              np.zeros((corpus.vocab, h.dim), np.float32)]
    # Split by centre word, a word's input row is trained by one worker and lives on its node: only the
    # output rows are replicas (the one array stands for the input rows of both nodes).
    replicas = [owners[0] if syncs.by_centre else owners[0].copy(), owners[1].copy()]
    worker_of = centres_by_worker(corpus, h, 2)
    base = [rows.copy() for rows in owners]  # each replica row as its last sync left it
    noise = alias_table(noise_weights(corpus.counts))
    scratch = np.full(corpus.vocab, -1, np.int64)
    sent, batches_done, sync_count = 0, 0, 0

    def step(vin: np.ndarray, vout: np.ndarray, batch: np.ndarray, lr: float) -> None:
        n = batch.shape[0]
        batch_step(vin, vout, batch, alias_draw(*noise, rng.random(n * h.negatives)).reshape(n, h.negatives), lr,
                   scratch)

    for epoch in range(epochs):
        lr = h.lr * (1 - epoch / epochs)
        every = pairs(corpus, h, rng)
        if syncs.by_centre:
            shares = (every[worker_of[every[:, 0]] == 0], every[worker_of[every[:, 0]] == 1])
        else:
            shares = (every[0::2], every[1::2])  # as train.py splits a pass between two workers
        for first in range(0, max(share.shape[0] for share in shares), h.batch):
            step(*owners, shares[0][first : first + h.batch], lr)
            step(*replicas, shares[1][first : first + h.batch], lr)
            batches_done += 1
            if batches_done % syncs.period:
                continue
            sync_count += 1
            whole = sync_count % syncs.full_every == 0
            for owner, replica, last in zip(owners, replicas, base, strict=True):
                if replica is owner:
                    continue
                change = replica - last
                if whole:
                    take = np.any(change != 0, axis=1)
                else:
                    norms = np.maximum(np.linalg.norm(last, axis=1), 1e-3)
                    take = np.linalg.norm(change, axis=1) > syncs.theta * norms
                owner[take] += change[take]
                replica[take] = last[take] = owner[take]
                sent += int(take.sum())
    return float(evaluate(owners[0], corpus)["cluster_purity"]), sent


CONTENDERS: list[Syncs | Blocks] = [
    Syncs(1), Syncs(4), Syncs(7), Syncs(10), Syncs(20), Syncs(2, 10, 0.05), Syncs(2, 10, 0.2), Syncs(1, 20, 0.02),
    Syncs(20, by_centre=True), Syncs(8, by_centre=True), Syncs(4, by_centre=True), Blocks(10), Blocks(20)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    args = p.parse_args()
    lines = [f"Planted word clusters, 10 passes, two workers taking turns batch by batch (2,048 pairs), one on "
             f"the owners' rows and one on replicas; mean (and range) over {args.seeds} seeds.", "",
             "| replicas synced | cluster purity | rows sent |", "|---|---:|---:|"]
    rows = []
    for syncs in CONTENDERS:
        runs = [train_blocks(syncs, seed) if isinstance(syncs, Blocks) else train(syncs, seed)
                for seed in range(args.seeds)]
        purity = [r[0] for r in runs]
        rows.append({"syncs": str(syncs), "purity": purity, "rows_sent": [r[1] for r in runs]})
        lines.append(f"| {syncs} | {np.mean(purity):.3f} ({min(purity):.3f}-{max(purity):.3f}) "
                     f"| {np.mean([r[1] for r in runs]):,.0f} |")
        print(lines[-1], flush=True)
    table_md = "\n".join(lines)
    print("\n" + table_md)
    write_results("w2v_staleness", {"seeds": args.seeds, "rows": rows}, table_md)


if __name__ == "__main__":
    main()
