"""A worker that keeps a cluster busy until told to stop, for metrics and status tests.

    busy_worker.py INFO_DIR

Each worker pulls and pushes random keys of an SSP(1) table, advancing its clock
every round, until INFO_DIR/stop appears (or 60 s pass). Rank 0 first writes
INFO_DIR/ready once every worker has started.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

import shoal


def main() -> None:
    info = Path(sys.argv[1])
    ps = shoal.init()
    table = ps.table("busy", 20_000, 8, optimizer=shoal.optim.SGD(lr=0.01), consistency=shoal.SSP(staleness=1))
    ps.barrier()
    if ps.rank == 0:
        (info / "ready").touch()
    rng = np.random.default_rng(ps.rank)
    deadline = time.monotonic() + 60
    while not (info / "stop").exists() and time.monotonic() < deadline:
        keys = rng.integers(0, 20_000, 512)
        rows = table.pull(keys)
        table.push(keys, 0.1 * rows)
        ps.advance_clock()
        time.sleep(0.002)
    ps.shutdown()


if __name__ == "__main__":
    main()
