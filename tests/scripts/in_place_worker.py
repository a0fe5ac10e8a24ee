"""A worker script for rows written in place while they move, with real processes.

    in_place_worker.py OUT_DIR ROUNDS TECHNIQUE

Every worker adds 1 to all 300 keys of an adaptive table ROUNDS times: in place
for the keys on its node, by push for the rest. Each round it also declares an
intent for a random third of the keys (so with TECHNIQUE=auto keys two nodes
want are replicated) and asks for another third to move to its node, so rows
keep moving and replicating while they are written. Rank 0 writes
OUT_DIR/counts.json once the replicas
have gone, and each worker its counters to OUT_DIR/worker<rank>.json.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

import shoal

NUM_KEYS = 300


def main() -> None:
    out_dir, rounds, technique = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    ps = shoal.init()
    table = ps.table("moving", NUM_KEYS, 1, techniques=technique, sync_ms=5)
    keys = np.arange(NUM_KEYS)
    ones = np.ones((NUM_KEYS, 1), np.float32)
    rng = np.random.default_rng(ps.rank)
    ps.barrier()
    for _ in range(rounds):
        table.intent(rng.choice(NUM_KEYS, NUM_KEYS // 3, replace=False), ps.clock + 1, ps.clock + 3)
        table.localize(rng.choice(NUM_KEYS, NUM_KEYS // 3, replace=False))
        with table.in_place(keys) as rows:
            here = rows.slots[rows.slots >= 0]
            rows.values[here] += 1.0
            absent = rows.absent
        table.push(keys[absent], ones[absent])
        ps.advance_clock()
        time.sleep(0.002)
    for _ in range(4):  # every intent ends
        ps.advance_clock()
        time.sleep(0.01)
    with open(os.path.join(out_dir, f"worker{ps.rank}.json"), "w") as fh:
        json.dump({name: table.counters[name] for name in ("rows_in_place", "replica_rows_in_place")}, fh)
    ps.barrier()
    if ps.rank == 0:
        # The intents have ended: replicas send their last changes to the owners and go.
        deadline = time.monotonic() + 60
        while any(s["adaptive"]["moving"]["replicas"] for s in ps.server_stats()):
            assert time.monotonic() < deadline, "replicas did not go"
            time.sleep(0.05)
        time.sleep(0.2)  # relocations still in flight settle
        with open(os.path.join(out_dir, "counts.json"), "w") as fh:
            json.dump({"counts": table.pull(keys)[:, 0].tolist(), "servers": ps.server_stats()}, fh)
    ps.barrier()
    ps.shutdown()


if __name__ == "__main__":
    main()
