"""A worker script for bounded reads of a replicated table while replicas fail.

    bounded_replica_worker.py INFO_DIR ITERATIONS STALENESS [ssp|essp]

Each worker owns counter ``rank`` of a 3-replica table read under SSP(STALENESS) (or ESSP)
with a write quorum of 2 and a read quorum of 1, and every iteration reads every
counter, checks it against the bound (a read at clock ``c`` must see at least
``c - STALENESS``), pushes +1 to its own and advances its clock. Rank 0 writes
INFO_DIR/servers.json (server pids) first. At the end, once every clock has
passed the bound, every worker reads every counter, which must equal the
pushes acknowledged. Each rank writes INFO_DIR/rank{r}.json.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

import shoal


def main() -> None:
    info_dir, iterations, staleness = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    model = shoal.ESSP(staleness) if sys.argv[4:] == ["essp"] else shoal.SSP(staleness)
    ps = shoal.init()
    table = ps.table("counters", ps.num_workers, 1, replicas=3, write_quorum=2, read_quorum=1, gossip_ms=20,
                     consistency=model)
    if ps.rank == 0:
        with open(os.path.join(info_dir, "servers.json"), "w") as fh:
            json.dump({"pids": [s["pid"] for s in ps.server_stats()]}, fh)
    ps.barrier()
    everyone = np.arange(ps.num_workers)
    violations = []
    for _ in range(iterations):
        clock = ps.clock
        seen = table.pull(everyone)[:, 0]
        if (seen < clock - staleness).any():
            violations.append([clock, seen.tolist()])
        table.push([ps.rank], [[1.0]])
        time.sleep(0.01)
        ps.advance_clock()
    ps.barrier()
    for _ in range(staleness + 1):
        ps.advance_clock()
    final = table.pull(everyone)[:, 0].tolist()
    with open(os.path.join(info_dir, f"rank{ps.rank}.json"), "w") as fh:
        json.dump({"violations": violations, "final": final, "counters": dict(table.counters)}, fh)
    ps.barrier()
    ps.shutdown()


if __name__ == "__main__":
    main()
