"""Biased matrix factorisation on MovieLens 100k (or a synthetic Zipf matrix), trained through Shoal.

Run it on a local cluster:

    shoal run --nodes 2 --workers-per-node 1 -- python examples/mf/train.py

Each worker takes every ``num_workers``-th training rating, pulls the rows of a
batch's users and items, computes gradients, and pushes them; the servers (or,
for local rows, the worker itself) apply SGD. Every batch is one clock.

By default every epoch ends with a barrier and rank 0 reports test RMSE. With
``--free-running`` workers never wait for each other except through the
tables' consistency model; rank 0 evaluates at the end of each of its own
epochs, and the last evaluation follows a final barrier. Those evaluations
are rank 0's time inside the training loop, while the other workers go on;
``--eval-at-end`` leaves all but the last out (the job's time is its training).

``--mode relocation|replication|auto`` keeps users and items in one adaptive
table (``mf.factors``, the items' keys after the users'): each worker trains the
ratings of its own users (user ``u`` belongs to rank ``u % num_workers``), and
declares intents as long as the use: its users for the whole run, the items it
rates for each epoch. Its users move to its node once and stay; an item every
worker rates is replicated on their nodes. A batch is then one pull and one
push (or one hold in place), not two each. Static and replicated tables stay two
(``mf.users``, ``mf.items``): they are laid out in slices, and the items' slices
can be set apart.

``--item-slices K`` numbers items by popularity and cuts the item table into
``K`` slices (slice 0 the most-rated items); ``--hot-slices H --hot-staleness S``
then reads the ``H`` hottest slices under bound ``S`` while the others
keep ``--staleness``: a tight bound where rows change every clock, a loose one
where they rarely do. ``--uniform-after E`` sets every slice back to
``--staleness`` from epoch ``E`` on, during training.

``--in-place`` takes the SGD step rating after rating on the rows on the
worker's node where they lie (``Table.in_place``: no gather, no scatter, no
message), and pulls and pushes only the ratings with a row on another node.

``--replicas N`` replicates both tables (``--write-quorum``, ``--read-quorum``
an int or ``dynamic`` with ``--dynamic P,K,LATENCY_MS``); ``--gossip-at E:MS``
changes the gossip period from epoch ``E`` on, and ``--record DIR`` writes what
``benchmarks/bench_dynamic_quorum.py`` checks the model against.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Iterator

import numpy as np
from data import by_popularity, load
from model import ITEMS, ONE_TABLE, USERS, Hyper, gradients, initializer, rmse, sgd_in_place
from progress import Progress
from replicas import dynamic, gossip_schedule, note_epoch, record, write_records

import shoal

MODES = ("static", "relocation", "replication", "auto")
MODELS = {"asp": lambda s, lazy: shoal.ASP(), "bsp": lambda s, lazy: shoal.BSP(lazy=lazy),
          "ssp": lambda s, lazy: shoal.SSP(s, lazy=lazy), "essp": lambda s, lazy: shoal.ESSP(s, lazy=lazy)}


def parse() -> tuple[Hyper, argparse.Namespace]:
    d = Hyper()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="ml-100k", help="ml-100k or zipf")
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--rank", type=int, default=d.rank)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--reg", type=float, default=d.reg)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adagrad"),
                   help="server-side update rule (adagrad copes with very popular items)")
    p.add_argument("--mapping", default="range", help="key mapping rule of both tables")
    p.add_argument("--mode", default="static", choices=MODES, help="where rows live (see above)")
    p.add_argument("--consistency", default="asp", choices=sorted(MODELS))
    p.add_argument("--staleness", type=int, default=1, help="bound s of SSP/ESSP")
    p.add_argument("--lazy-ms", type=float, default=0.0, help="lazy pull buffer timeout (0: off)")
    p.add_argument("--item-slices", type=int, default=0, help="slices of the item table (0: one per server)")
    p.add_argument("--hot-slices", type=int, default=0, help="how many of the most-rated item slices read under "
                   "--hot-staleness (items numbered by popularity)")
    p.add_argument("--hot-staleness", type=int, default=0, help="bound of the hot item slices")
    p.add_argument("--uniform-after", type=int, default=0,
                   help="from this epoch on (1-based), every item slice under --staleness again (0: never)")
    p.add_argument("--straggle-ms", type=float, default=0.0, help="the last rank sleeps this long per batch")
    p.add_argument("--delay-ms", type=float, default=0.0,
                   help="every rank sleeps a random time per batch (exponential, this mean)")
    p.add_argument("--users-by-worker", action="store_true",
                   help="each worker trains its own users' ratings (as in the adaptive modes): item rows are re-read")
    p.add_argument("--in-place", action="store_true",
                   help="SGD steps on this node's rows where they lie (Table.in_place), the rest through messages")
    p.add_argument("--sync-ms", type=float, default=None,
                   help="adaptive modes: how often a replica sends its change to the owner (default: the tables' "
                        "own, at each clock, at most every 10 ms)")
    p.add_argument("--seed", type=int, default=0, help="of batch order and random delays")
    p.add_argument("--init-seed", type=int, default=0, help="of the tables' initial rows")
    p.add_argument("--free-running", action="store_true", help="no barrier between epochs")
    p.add_argument("--eval-at-end", action="store_true", help="rank 0 evaluates after the last epoch only")
    p.add_argument("--replicas", type=int, default=1, help="replicas of every shard (>1: replicated store)")
    p.add_argument("--write-quorum", type=int, default=1)
    p.add_argument("--read-quorum", default="1", help="an int, or 'dynamic'")
    p.add_argument("--dynamic", default="0.95,0,50", help="dynamic read quorum: P,K,LATENCY_MS (P(missing <= K) "
                   ">= P within LATENCY_MS)")
    p.add_argument("--gossip-ms", type=float, default=50.0)
    p.add_argument("--gossip-at", action="append", default=[], metavar="EPOCH:MS",
                   help="from this epoch on (1-based), gossip every MS (rank 0 sets it; repeatable)")
    p.add_argument("--record", help="replicated tables: every rank writes its reads, acknowledged pushes and "
                   "read-quorum choices here, and rank 0 the measurements the model is fitted from")
    p.add_argument("--info", help="rank 0 writes the servers' pids here once the tables exist")
    p.add_argument("--out", help="rank 0 writes results as JSON here")
    p.add_argument("--stats-dir", help="every rank writes its staleness and counters here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args()
    if args.in_place and (args.replicas > 1 or args.optimizer != "sgd"):
        p.error("--in-place takes SGD steps itself on rows held in place: --optimizer sgd, no --replicas")
    return Hyper(rank=args.rank, lr=args.lr, reg=args.reg, batch=args.batch, epochs=args.epochs), args


def main() -> None:
    hyper, args = parse()
    ps = shoal.init()
    data = load(args.data)
    if args.item_slices:
        data = by_popularity(data)
    lazy = shoal.LazyPull(timeout_ms=args.lazy_ms) if args.lazy_ms > 0 else None
    optimizer = shoal.optim.SGD(lr=hyper.lr) if args.optimizer == "sgd" else shoal.optim.Adagrad(lr=hyper.lr)
    options = dict(init=initializer(hyper), seed=args.init_seed, optimizer=optimizer,
                   mapping=args.mapping, consistency=MODELS[args.consistency](args.staleness, lazy))
    if args.replicas > 1:
        options.update(replicas=args.replicas, write_quorum=args.write_quorum, gossip_ms=args.gossip_ms,
                       read_quorum=dynamic(args.dynamic) if args.read_quorum == "dynamic" else int(args.read_quorum))
    adaptive = args.mode != "static"
    if adaptive:
        # Hot items are replicas on every node. An epoch of MovieLens 100k takes 15-50 ms here: synced
        # every 50 ms a replica missed the other node's updates of a whole epoch (test RMSE after 10
        # epochs 0.938-0.950 on 2 nodes against the baseline's 0.936; 0.936-0.938 synced every 10 ms,
        # as the tables' default now does on clocks this fast, about a tenth slower).
        options["techniques"] = args.mode
        if args.sync_ms is not None:
            options["sync_ms"] = args.sync_ms
    if adaptive:
        # One key space, as a ps-lite app keeps every parameter: a local call costs about 50 us in a
        # job, a tenth of a batch here, and two tables made a batch four calls, not two (2 nodes, thirty
        # seeds side by side: 1.02-1.05x the baseline against 0.91-0.95x, `mf_movielens.md`).
        users = items = ps.table(ONE_TABLE, data.num_users + data.num_items, hyper.rank + 1, **options)
        item_base = data.num_users  # an item's key: its number after the users'
    else:
        users = ps.table(USERS, data.num_users, hyper.rank + 1, **options)
        items = ps.table(ITEMS, data.num_items, hyper.rank + 1, **options,
                         **({"slices": args.item_slices} if args.item_slices else {}))
        item_base = 0
    one_table = users is items
    tables = [users] if one_table else [users, items]
    if args.hot_slices:  # every worker, at the same point: the whole job reads those slices alike
        items.set_consistency(MODELS[args.consistency](args.hot_staleness, lazy), list(range(args.hot_slices)))
    if args.record:
        record(tables)
    gossip_at = gossip_schedule(args.gossip_at)
    if args.info and ps.rank == 0:
        with open(args.info, "w") as fh:
            json.dump({"server_pids": [s["pid"] for s in ps.server_stats()]}, fh)
    if adaptive or args.users_by_worker:  # a worker's own users (adaptive: their rows move to its node once)
        owners = data.train.users % ps.num_workers
        mine = data.train.take(np.flatnonzero(owners == ps.rank))
        most = int(np.bincount(owners, minlength=ps.num_workers).max())
    else:
        mine = data.train.take(np.arange(ps.rank, len(data.train), ps.num_workers))
        most = -(-len(data.train) // ps.num_workers)
    mu = float(data.train.values.mean())
    lead = ps.rank == 0
    straggler = ps.rank == ps.num_workers - 1 and ps.num_workers > 1
    history: list[float] = []
    times: list[float] = []
    # As many batches (clocks) per epoch on every worker, a share that runs out first ending in empty
    # ones: under a bound the others wait for the slowest clock, also at the end.
    batches_per_epoch = -(-most // hyper.batch)
    progress = Progress(hyper.epochs * batches_per_epoch, "training") if lead and not args.quiet else None

    def evaluate() -> None:
        all_users = users.pull(np.arange(data.num_users))
        all_items = items.pull(np.arange(data.num_items) + item_base)
        history.append(rmse(all_users, all_items, data.test.users, data.test.items, data.test.values, mu))
        times.append(time.perf_counter() - start)
        ps.log(test_rmse=history[-1])  # for the run report (`shoal run --report DIR`)

    def batches(epoch: int) -> list[np.ndarray]:
        order = np.random.default_rng((1000 + epoch) * 7919 + ps.rank + args.seed * 104729).permutation(len(mine))
        return [order[s : s + hyper.batch] for s in range(0, batches_per_epoch * hyper.batch, hyper.batch)]

    schedule = [b for epoch in range(hyper.epochs) for b in batches(epoch)]
    grad_rows = np.empty((2 * hyper.batch, hyper.rank + 1), np.float32)  # one table: both gradients, one push

    @contextlib.contextmanager
    def held_in_place(u: np.ndarray, i: np.ndarray) -> Iterator[tuple[np.ndarray, ...]]:
        """The batch's user and item rows held in place: each table's values and the rows' slots."""
        if one_table:
            with users.in_place(np.concatenate([u, i])) as held:
                yield held.values, held.slots[: u.shape[0]], held.values, held.slots[u.shape[0] :]
        else:
            with users.in_place(u) as held_u, items.in_place(i) as held_i:  # always in this order
                yield held_u.values, held_u.slots, held_i.values, held_i.slots

    placement_s = 0.0
    if adaptive:
        # Intents as long as the use: a worker's users for the whole run, every item it rates for
        # the epoch it rates it in (an item many workers rate is replicated on their nodes; an item
        # declared batch by batch would be moved or copied anew every few clocks).
        first = ps.clock
        my_users, my_items = np.unique(mine.users), np.unique(mine.items) + item_base
        users.intent(my_users, first, first + len(schedule))
        # Set-up, as loading the data is: the rows of the first batches are brought here before the
        # loop starts, instead of being asked of other nodes while they move. (Relocation alone
        # cannot bring an item two workers rate to both.)
        placing = time.perf_counter()
        users.wait_local(my_users, timeout=10)
        # The items, rank by rank: an item's owner is the first node whose interest reaches it, and
        # declared at once the nodes' interests crossed on the way, each keeping the items it is home
        # to (in about one run in four). Owners on both nodes make every sync of the replicas go both
        # ways, twice the messages. In turn, rank 0's node owns every item it rates; the other nodes
        # hold replicas of those and own only the items no lower rank rates.
        for turn in range(ps.num_workers):
            if turn == ps.rank:
                for epoch in range(hyper.epochs):
                    begin = first + epoch * batches_per_epoch
                    items.intent(my_items, begin, begin + batches_per_epoch)
                if args.mode != "relocation":
                    items.wait_local(my_items, timeout=10)
            if turn < ps.num_workers - 1:
                ps.barrier()
        placement_s = time.perf_counter() - placing
    servers_before = ps.server_stats() if lead else []  # what training costs the servers: the difference
    ps.barrier()
    start = time.perf_counter()
    train_seconds = 0.0
    barrier_seconds = 0.0  # of train_seconds, waiting at barriers (for the slower worker, and the barrier's own trip)
    delays = np.random.default_rng(args.seed * 1009 + ps.rank)
    step = 0
    for epoch in range(hyper.epochs):
        if args.hot_slices and epoch + 1 == args.uniform_after:
            items.set_consistency(MODELS[args.consistency](args.staleness, lazy))
        if epoch in gossip_at and lead:
            for table in tables:
                table.set_gossip_ms(gossip_at[epoch])
        if args.record and lead:
            note_epoch(args.record, epoch, gossip_at.get(epoch))
        epoch_start = time.perf_counter()
        squared_error = 0.0
        for _ in range(batches_per_epoch):
            idx = schedule[step]
            step += 1
            if idx.size and args.in_place:
                u, i = mine.users[idx], mine.items[idx] + item_base
                with held_in_place(u, i) as (user_values, user_slots, item_values, item_slots):
                    here = (user_slots >= 0) & (item_slots >= 0)
                    squared_error += sgd_in_place(user_values, item_values, user_slots, item_slots,
                                                  mine.values[idx], np.flatnonzero(here), mu, hyper.lr, hyper.reg)
                idx = idx[~here]  # ratings with a row on another node: through messages
            if idx.size:
                u, i = mine.users[idx], mine.items[idx] + item_base
                if one_table:
                    keys = np.concatenate([u, i])
                    rows = users.pull_async(keys).wait()
                    grads = grad_rows[: keys.shape[0]]
                    batch_error = gradients(rows[: u.shape[0]], rows[u.shape[0] :], mine.values[idx], mu, hyper.reg,
                                            out=grads)[2]
                    pushed = [users.push_async(keys, grads)]
                else:
                    user_rows = users.pull_async(u)
                    item_rows = items.pull_async(i)
                    grad_u, grad_i, batch_error = gradients(user_rows.wait(), item_rows.wait(), mine.values[idx], mu,
                                                            hyper.reg)
                    pushed = [users.push_async(u, grad_u), items.push_async(i, grad_i)]
                squared_error += batch_error
                for f in pushed:
                    f.wait()
            if straggler and args.straggle_ms:
                time.sleep(args.straggle_ms / 1000)
            if args.delay_ms:
                time.sleep(delays.exponential(args.delay_ms) / 1000)
            ps.advance_clock()
            if progress:
                note = f"epoch {epoch + 1}/{hyper.epochs}" + (f"  RMSE {history[-1]:.4f}" if history else "")
                progress.update(1, note)
        ps.log(train_rmse=(squared_error / len(mine)) ** 0.5)
        if not args.free_running:
            waiting = time.perf_counter()
            ps.barrier()  # every worker's epoch is applied before anyone evaluates
            barrier_seconds += time.perf_counter() - waiting
        train_seconds += time.perf_counter() - epoch_start
        last = epoch == hyper.epochs - 1
        if lead and (last or not args.eval_at_end) and not (last and args.free_running):  # that one comes below
            evaluate()
        if not args.free_running:
            ps.barrier()
    if args.free_running:
        waiting = time.perf_counter()
        ps.barrier()
        barrier_seconds = time.perf_counter() - waiting
        train_seconds = time.perf_counter() - start
    # The servers' CPU while the workers trained (and rank 0 evaluated between epochs), every thread of
    # theirs: on 2 cores what the workers do not get.
    server_cores = 0.0
    if lead:
        servers_after, window = ps.server_stats(), time.perf_counter() - start
        # By process: a server killed meanwhile answers nothing, one started again counts from zero (both
        # left out).
        before = {(s["node"], s["pid"]): s["cpu_s"] for s in servers_before if "cpu_s" in s}
        server_cores = sum(s["cpu_s"] - before[s["node"], s["pid"]] for s in servers_after
                           if "cpu_s" in s and (s["node"], s["pid"]) in before) / window
    if args.free_running and lead:
        evaluate()

    if args.record:
        write_records(args.record, ps.rank, tables)
    if args.stats_dir:
        with open(os.path.join(args.stats_dir, f"rank{ps.rank}.json"), "w") as fh:
            json.dump({"rank": ps.rank, "clock": ps.clock,
                       "bytes": {"sent": ps.tracker.bytes_sent, "received": ps.tracker.bytes_received},
                       "tables": {t.name: {"staleness": t.staleness.as_dict(), "counters": dict(t.counters)}
                                  for t in tables}}, fh)
    if lead:
        if progress:
            progress.close(f"done  RMSE {history[-1]:.4f}")
        rate = len(data.train) * hyper.epochs / train_seconds
        for epoch, value in enumerate(history, 1):
            print(f"epoch {epoch:2d}  test RMSE {value:.4f}")
        print(f"{ps.num_workers} worker(s) on {ps.num_nodes} node(s): {rate:,.0f} ratings/s")
        if args.out:
            with open(args.out, "w") as fh:
                json.dump({"rmse": history, "seconds": times, "ratings_per_s": rate, "train_seconds": train_seconds,
                           "barrier_s": barrier_seconds, "placement_s": placement_s, "server_cores": server_cores,
                           "nodes": ps.num_nodes, "workers": ps.num_workers, "servers": ps.server_stats()},
                          fh, indent=2)
    ps.shutdown()


if __name__ == "__main__":
    main()
