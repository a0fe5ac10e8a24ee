"""ComplEx knowledge-graph embeddings trained through Shoal, with intent signals.

    shoal run --nodes 2 -- python examples/kge/train.py --data zipf --mode auto --seconds 30

Entities and relations share one table, ``kge.embeddings``: a relation's key is
its number after the entities'.

Modes:

* ``classic``: every row through a server (no shared-memory access, no intent), naive negative sampling;
* ``static``: rows stay on their home node; co-located rows are accessed directly;
* ``relocation`` / ``replication`` / ``auto``: the data loader looks ``--lookahead`` batches
  ahead or more and declares the entities and relations of each future batch as intent,
  ``--lookahead`` batches at a time (one message to the node's server for them all);
  the servers relocate or replicate rows in time; negatives are sampled locally.

Each triple is scored against 6 corrupted tails and 6 corrupted heads, as filtered MRR ranks
both sides (``complex_model``). With ``--step S`` (adaptive modes) a batch is trained as Adagrad
steps of S triples on this node's rows where they lie (``Table.in_place``: no gather, no
scatter, no message), and only the triples with a row on another node go through pull and
push. Every worker draws its own batches; rank 0 reports triples/s, the loss over time and, for
Kinships and UMLS, filtered MRR and Hits@10 on the test set (``--eval-every E``: also the
validation MRR every E epochs, against seconds of training).
"""

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
from graphs import load

import shoal

MODES = ("classic", "static", "relocation", "replication", "auto")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="kinships", help="kinships, umls, nations or zipf")
    p.add_argument("--mode", default="auto", choices=MODES)
    p.add_argument("--epochs", type=float, default=None, help="stop after this many passes over the data")
    p.add_argument("--seconds", type=float, default=None, help="stop after this long")
    p.add_argument("--dim", type=int, default=Hyper.dim)
    p.add_argument("--batch", type=int, default=Hyper.batch, help="triples per worker per step")
    p.add_argument("--step", type=int, default=None,
                   help="Adagrad steps of this many triples on the rows where they lie (Table.in_place; adaptive "
                        "modes), triples with a row elsewhere through pull and push")
    p.add_argument("--lookahead", type=int, default=None,
                   help="batches ahead declared as intent (at least; this many at a time; default: 8 on the Zipf "
                        "graph, 4 on the others)")
    p.add_argument("--sync-ms", type=float, default=None,
                   help="how often replicas send their changes to the owner (default: 200 ms on the Zipf graph, "
                        "the tables' default on the others: at each clock, at most every 10 ms)")
    p.add_argument("--act-ms", type=float, default=None,
                   help="how often a node's server acts on the declared intents at most (default: 200 ms on "
                        "the Zipf graph, the tables' default of 50 ms on the others)")
    p.add_argument("--loss-target", type=float, default=None)
    p.add_argument("--eval-every", type=float, default=None,
                   help="epochs between validation MRRs (rank 0 evaluates while the others wait; not timed)")
    p.add_argument("--seed", type=int, default=0, help="seeds the initial rows and the batches")
    p.add_argument("--out", help="rank 0 writes results as JSON here")
    args = p.parse_args()
    began = time.perf_counter()  # the job's phases: set-up (join, tables, data), training, the final report

    graph = load(args.data)
    h = Hyper(dim=args.dim, batch=min(args.batch, graph.train.shape[0]))
    d = h.dim
    adaptive = args.mode in ("relocation", "replication", "auto")
    if args.step and not adaptive:
        p.error("--step updates rows in place: an adaptive mode (relocation, replication or auto) only")
    ps = shoal.init(local_access=args.mode != "classic")
    options = dict(init=shoal.Normal(std=h.init_std, columns=2 * d), optimizer=shoal.optim.Sum(), seed=args.seed,
                   techniques=args.mode if adaptive else "static", mapping="round_robin")
    if adaptive:
        # On the small graphs every entity is in nearly every batch, so each node holds replicas of the
        # whole (small) table: a sync is cheap, and at 50 ms a replica lagged the other node by more than
        # an epoch (2-node test MRR after 100 epochs 0.77-0.79 against 0.80-0.82 synced every 10 ms, at
        # the same speed). On the Zipf graph syncs every 10 ms cost the servers a tenth of a core for no
        # gain, and every 200 ms 0.05 cores less than every 50, at the same speed and time to loss
        # (``server_cpu.md``).
        options["sync_ms"] = args.sync_ms if args.sync_ms is not None else 200.0 if args.data == "zipf" else None
        # On the Zipf graph (clocks of 30-50 ms) rounds every 100 ms instead of 50 reach a clock further
        # ahead: fewer rounds and remote pushes, the servers 6% less CPU at the same triples a second or
        # more (eleven alternating pairs); every 200 ms, as often as the replicas sync, 8% less again
        # (lower in 12 of 12 pairs with 100 ms, at about the same training loss; 400 and 800 ms no lower than
        # 200, ``server_cpu.md``).
        options["act_ms"] = args.act_ms if args.act_ms is not None else 200.0 if args.data == "zipf" else None
    # A round of the servers' actions reaches its period's clocks ahead (200 ms of ~25 ms clocks on the Zipf
    # graph: 8). An intent declared fewer clocks ahead came into the action window before the next round,
    # and the server acted on it in a pass of its own: declared 8 batches ahead instead of 4, the servers
    # handled 215 events a second instead of 251 and took 0.204 cores instead of 0.226, at the same triples
    # a second and time to loss (``server_cpu.md``).
    lookahead = args.lookahead if args.lookahead is not None else 8 if args.data == "zipf" else 4
    # Entities and relations in one key space, as a ps-lite app keeps every parameter: a batch is one
    # pull and one push (or one hold in place), not two each, and one intent; adaptive servers sync,
    # announce and act once a round, not once per table.
    embeddings = ps.table("kge.embeddings", graph.num_entities + graph.num_relations, row_width(h), **options)
    rel_base = graph.num_entities  # a relation's key: its number after the entities'
    entities_only = np.concatenate([np.ones(graph.num_entities), np.zeros(graph.num_relations)])
    embeddings.register_sampling(entities_only, scheme="local" if adaptive else "naive")

    rng = np.random.default_rng([args.seed, ps.rank])
    n = graph.train.shape[0]
    budget = int((args.epochs or 1e9) * n / (h.batch * ps.num_workers))
    schedule = [rng.integers(0, n, h.batch) for _ in range(min(budget, lookahead + 1))]
    if adaptive:
        for ahead, idx in enumerate(schedule):
            heads, rels, tails = graph.train[idx].T
            embeddings.intent(np.concatenate([heads, tails, rels + rel_base]), ahead, ahead + 1)
    if args.mode in ("replication", "auto"):
        # The first batch's rows here before the clock starts, not asked of other nodes while they
        # move (relocation alone cannot bring a row two workers use to both).
        heads, rels, tails = graph.train[schedule[0]].T
        embeddings.wait_local(np.concatenate([heads, tails, rels + rel_base]), timeout=10)

    # What the run costs in CPU: each worker adds its own seconds into its row of a small table.
    cpu = ps.table("kge.cpu_seconds", ps.num_workers, 1, init=shoal.Constant(0.0), optimizer=shoal.optim.Sum())
    servers_before = ps.server_stats() if ps.rank == 0 else []
    warm_up(h)  # load the compiled step now, as the baseline does: set-up, not training
    losses: list[tuple[float, float]] = []
    pushes: list[shoal.Future[None]] = []
    time_to_target = None
    ps.barrier()
    eval_steps = max(1, round(args.eval_every * n / (h.batch * ps.num_workers))) if args.eval_every else 0
    known = {tuple(t) for t in np.concatenate([graph.train, graph.valid, graph.test]).tolist()} if eval_steps else set()
    curve: list[tuple[float, float, float]] = []  # (epoch, training seconds, validation filtered MRR)
    start = time.perf_counter()
    setup_s = start - began
    cpu_start = time.process_time()
    step = 0

    def trained() -> float:
        """Seconds of training so far: evaluations are left out."""
        return time.perf_counter() - start

    def step_through_messages(heads: np.ndarray, rels: np.ndarray, tails: np.ndarray, negatives: np.ndarray
                              ) -> float:
        """One Adagrad step for these triples, as the baseline does: one gather of their distinct entities
        (heads, tails and negatives) and one of their relations, pulled; the change pushed."""
        nonlocal pushes
        b = heads.shape[0]
        keys_e, inv = np.unique(np.concatenate([heads, tails, negatives]), return_inverse=True)
        keys_r, inv_r = np.unique(rels, return_inverse=True)
        m = keys_e.shape[0]
        keys = np.concatenate([keys_e, keys_r + rel_base])
        pulled = embeddings.pull(keys)
        grads = np.zeros((keys.shape[0], 2 * d), np.float32)
        corrupt = inv[2 * b:].reshape(2, b, h.negatives)
        loss = complex_step(pulled[:m], pulled[m:], inv[:b], inv_r, inv[b:2 * b], corrupt[0], corrupt[1],
                            np.arange(m), np.arange(keys_r.shape[0]), d, h.reg, grads[:m], grads[m:])
        delta = np.empty_like(pulled)
        adagrad_delta(pulled, grads, h.lr, d, delta)
        for f in pushes:  # the last step's updates of rows elsewhere are in: one step in flight at most
            f.wait()
        pushes = [embeddings.push_async(keys, delta)]
        return float(loss)

    ent_map = np.full(embeddings.num_keys, -1, np.int64)  # scratch of the steps in place
    rel_map = np.full(embeddings.num_keys, -1, np.int64)

    def steps_in_place(heads: np.ndarray, rels: np.ndarray, tails: np.ndarray, negatives: np.ndarray
                       ) -> tuple[float, np.ndarray]:
        """Steps of ``--step`` triples on this node's rows where they lie, for the triples whose rows are
        all here, the batch's rows held meanwhile (the node's server waits for them as long: a few
        milliseconds on Kinships, 25 on the Zipf graph); the mean loss per score, and the positions of
        the other triples."""
        b = heads.shape[0]
        keys_e, inv = np.unique(np.concatenate([heads, tails, negatives]), return_inverse=True)
        keys_r, inv_r = np.unique(rels, return_inverse=True)
        with embeddings.in_place(np.concatenate([keys_e, keys_r + rel_base])) as here:
            slots, rel_slots = here.slots[inv], here.slots[keys_e.shape[0] + inv_r]
            negs = slots[2 * b:].reshape(2, b, h.negatives)
            whole = (slots[:b] >= 0) & (slots[b:2 * b] >= 0) & (rel_slots >= 0) & (negs >= 0).all(axis=(0, 2))
            which = np.flatnonzero(whole)
            loss = complex_steps_in_place(here.values, here.values, slots[:b], rel_slots, slots[b:2 * b],
                                          negs[0], negs[1], which, args.step, d, h.lr, h.reg, ent_map, rel_map)
        return float(loss), np.flatnonzero(~whole)

    while step < budget and (args.seconds is None or trained() < args.seconds):
        idx = schedule.pop(0)
        # Once only `lookahead` batches are known ahead, the next `lookahead` are drawn and declared
        # together: their intents go to the node's server in one message, not one message a clock (the
        # servers took 8% less CPU, at the same triples a second or more).
        if len(schedule) <= lookahead:
            while len(schedule) < 2 * lookahead and step + len(schedule) + 1 <= budget:
                ahead = rng.integers(0, n, h.batch)
                schedule.append(ahead)
                if adaptive:
                    heads_a, rels_a, tails_a = graph.train[ahead].T
                    clock = ps.clock + len(schedule)
                    embeddings.intent(np.concatenate([heads_a, tails_a, rels_a + rel_base]), clock, clock + 1)
        heads, rels, tails = (np.ascontiguousarray(x) for x in graph.train[idx].T)
        negatives = embeddings.sample_keys(2 * h.batch * h.negatives)  # tails' corruptions, then heads'
        loss = 0.0
        if args.step:
            loss, rest = steps_in_place(heads, rels, tails, negatives)
            loss *= 1 - rest.size / h.batch  # the mean over the whole batch, with the rest's below
            heads, rels, tails = heads[rest], rels[rest], tails[rest]
            negatives = negatives.reshape(2, h.batch, h.negatives)[:, rest].reshape(-1)
        if heads.size:
            loss += step_through_messages(heads, rels, tails, negatives) * heads.size / h.batch
        ps.advance_clock()
        step += 1
        if step % 20 == 0:
            losses.append((trained(), loss))
            recent = np.mean([x for _, x in losses[-5:]])
            if args.loss_target is not None and time_to_target is None and recent <= args.loss_target:
                time_to_target = trained()
        if eval_steps and step % eval_steps == 0:
            paused = time.perf_counter()
            for f in pushes:
                f.wait()
            ps.barrier()  # every worker's updates are in
            if ps.rank == 0:
                every = embeddings.pull(np.arange(embeddings.num_keys))
                valid_mrr, _ = mrr_hits(filtered_ranks(every[:rel_base], every[rel_base:], graph.valid, known, d))
                curve.append((step * h.batch * ps.num_workers / n, trained() - (time.perf_counter() - paused),
                              valid_mrr))
                print(f"epoch {curve[-1][0]:6.1f}  {curve[-1][1]:6.2f} s  validation filtered MRR {valid_mrr:.4f}",
                      flush=True)
            ps.barrier()
            start += time.perf_counter() - paused
    for f in pushes:
        f.wait()
    elapsed = trained()
    cpu.push(np.array([ps.rank]), np.array([[time.process_time() - cpu_start]], np.float32))
    ps.barrier()
    total_triples = step * h.batch * ps.num_workers  # every worker runs the same number of steps or time
    result = {"mode": args.mode, "data": args.data, "nodes": ps.num_nodes, "workers": ps.num_workers,
              "steps": step, "seconds": elapsed, "triples_per_s": total_triples / elapsed, "losses": losses,
              "time_to_target": time_to_target, "curve": curve, "counters": dict(embeddings.counters)}
    if ps.rank == 0:
        if args.data != "zipf":
            every = embeddings.pull(np.arange(embeddings.num_keys))
            known = {tuple(t) for t in np.concatenate([graph.train, graph.valid, graph.test]).tolist()}
            result["mrr"], result["hits10"] = mrr_hits(filtered_ranks(every[:rel_base], every[rel_base:], graph.test,
                                                                      known, d))
            print(f"filtered MRR {result['mrr']:.4f}, Hits@10 {result['hits10']:.4f}")
        result["servers"] = ps.server_stats()
        result["servers_before"] = servers_before  # from before training: what it cost is the difference
        # Cores busy on average during training: what bounds the speed-up on a small machine.
        result["worker_cores"] = float(cpu.pull(np.arange(ps.num_workers)).sum()) / elapsed
        result["server_cores"] = sum(a["cpu_s"] - b["cpu_s"]
                                     for a, b in zip(result["servers"], servers_before, strict=True)) / elapsed
        print(f"{args.mode} on {ps.num_nodes} node(s): {result['triples_per_s']:,.0f} triples/s, "
              f"final loss {losses[-1][1] if losses else float('nan'):.4f}")
        result["setup_s"] = setup_s
        result["report_s"] = time.perf_counter() - began - setup_s - elapsed  # evaluations during training too
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(result, fh)
    ps.barrier()
    ps.shutdown()


if __name__ == "__main__":
    main()
