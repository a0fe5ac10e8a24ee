"""The worker of the soak run (benchmarks/soak.py): sustained, mixed load for a fixed time.

    shoal run --nodes 2 --workers-per-node 2 -- python benchmarks/soak_worker.py WORK_DIR SECONDS

Every round a worker pulls and pushes random keys of a static SSP table (rows on
its own node through shared memory, the others over the network), random keys
of a table kept on two replicas, and every few rounds the whole of a dense
parameter; then it advances its clock and sleeps a little, so that a small
machine stays loaded without being starved.

Checkpoints and the end of the run are collective, so no rank may decide them
from its own wall clock: every ``SYNC_ROUNDS`` rounds all ranks meet at a
barrier where rank 0's note says what everyone does next (go on, checkpoint,
stop). Rank 0 asks for a checkpoint once ``checkpoint_s`` has passed since the
last one and stops everyone once ``SECONDS`` have passed, so all ranks
checkpoint and stop at the same round. Each rank writes ``WORK_DIR/rank-<r>.json``
(rounds, checkpoints, seconds) before it shuts down; rank 0 writes
``WORK_DIR/started`` (the wall time the load began) after the setup barrier.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import shoal

SYNC_ROUNDS = 50  # rounds between the barriers where rank 0 says go / checkpoint / stop
SSP_KEYS, SSP_DIM, SSP_BATCH = 100_000, 16, 512
REPLICATED_KEYS, REPLICATED_DIM, REPLICATED_BATCH = 20_000, 8, 256
DENSE_SHAPE = (256, 64)
DENSE_EVERY = 5  # rounds between pulls and pushes of the dense parameter
LOG_EVERY = 25  # rounds between ps.log(...) calls; the run log stays in memory until shutdown

GO, CHECKPOINT, STOP = "go", "checkpoint", "stop"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("work", type=Path)
    parser.add_argument("seconds", type=float)
    parser.add_argument("--checkpoint-s", type=float, default=60.0)
    parser.add_argument("--sleep-ms", type=float, default=4.0)
    args = parser.parse_args()

    ps = shoal.init()
    ssp = ps.table("soak.ssp", SSP_KEYS, SSP_DIM, init=shoal.Normal(std=0.01),
                   optimizer=shoal.optim.Adagrad(lr=0.01), consistency=shoal.SSP(staleness=2))
    replicated = ps.table("soak.replicated", REPLICATED_KEYS, REPLICATED_DIM, replicas=2,
                          init=shoal.Normal(std=0.01), optimizer=shoal.optim.SGD(lr=0.01))
    dense = ps.dense("soak.dense", DENSE_SHAPE, init=shoal.Normal(std=0.01), optimizer=shoal.optim.SGD(lr=0.01))
    static_tables = [ssp.name, dense.name]  # checkpoints cover static tables only
    rng = np.random.default_rng(1000 + ps.rank)
    dense_grad = np.full(DENSE_SHAPE, 1e-4, np.float32)

    ps.barrier()
    start = time.time()
    if ps.rank == 0:
        (args.work / "started").write_text(f"{start}\n")
    last_checkpoint = time.monotonic()
    rounds = checkpoints = 0
    while True:
        keys = rng.integers(0, SSP_KEYS, SSP_BATCH)
        rows = ssp.pull(keys)
        ssp.push(keys, 0.1 * rows)
        keys = rng.integers(0, REPLICATED_KEYS, REPLICATED_BATCH)
        rows = replicated.pull(keys)
        replicated.push(keys, 0.1 * rows)
        if rounds % DENSE_EVERY == 0:
            dense.pull()
            dense.push(dense_grad)
        if rounds % LOG_EVERY == 0:
            ps.log(loss=float(np.mean(rows * rows)))
        ps.advance_clock()
        rounds += 1
        if rounds % SYNC_ROUNDS == 0:
            note = None
            if ps.rank == 0:
                if time.time() - start >= args.seconds:
                    note = shoal.BarrierNote(True, STOP)
                elif time.monotonic() - last_checkpoint >= args.checkpoint_s:
                    note = shoal.BarrierNote(True, CHECKPOINT)
                else:
                    note = shoal.BarrierNote(True, GO)
            said = ps.barrier(note).get(0)
            decision = said.detail if said is not None else STOP
            if decision == STOP:
                break
            if decision == CHECKPOINT:
                ps.checkpoint(args.work / "checkpoints", tables=static_tables, keep=2)
                checkpoints += 1
                last_checkpoint = time.monotonic()
        time.sleep(args.sleep_ms / 1000)

    summary = {"rank": ps.rank, "rounds": rounds, "checkpoints": checkpoints, "seconds": time.time() - start,
               "clock": ps.clock}
    (args.work / f"rank-{ps.rank}.json").write_text(json.dumps(summary) + "\n")
    ps.shutdown()


if __name__ == "__main__":
    main()
