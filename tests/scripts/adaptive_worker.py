"""A worker script for relocation tests with real processes.

    adaptive_worker.py OUT_DIR ROUNDS

Every worker pushes +1 to all 500 keys of an adaptive table ROUNDS times; in
each round it also asks for a random third of the keys to move to its node,
so keys keep moving between nodes while pushes from every worker land on them.
Rank 0 writes OUT_DIR/counts.json after a barrier.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

import shoal


def main() -> None:
    out_dir, rounds = sys.argv[1], int(sys.argv[2])
    ps = shoal.init()
    table = ps.table("moving", 500, 1, techniques="relocation")
    keys = np.arange(500)
    rng = np.random.default_rng(ps.rank)
    ps.barrier()
    for _ in range(rounds):
        table.localize(rng.choice(500, 170, replace=False))
        table.push(keys, np.ones((500, 1), np.float32))
    ps.barrier()
    time.sleep(0.5)  # moves still in flight settle
    ps.barrier()
    if ps.rank == 0:
        with open(os.path.join(out_dir, "counts.json"), "w") as fh:
            json.dump({"counts": table.pull(keys)[:, 0].tolist(), "servers": ps.server_stats()}, fh)
    ps.barrier()
    ps.shutdown()


if __name__ == "__main__":
    main()
