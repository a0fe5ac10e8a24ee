"""A worker script for launcher and lifecycle tests.

    probe_worker.py INFO_DIR MODE

Every worker joins, creates a table, and writes INFO_DIR/w<rank>.json with its
pid, the cluster id and the servers' pids. Then, by MODE:

* ``ok``: barrier, exit 0;
* ``crash``: rank 1 exits with status 3, the others wait in a barrier;
* ``hang``: wait in a long sleep (to be killed from outside);
* ``count M``: push +1 to overlapping keys M times (see test_colocation).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

import shoal


def main() -> None:
    info_dir, mode = sys.argv[1], sys.argv[2]
    ps = shoal.init()
    table = ps.table("probe", 1000, 4)
    servers = ps.server_stats()
    info = {"rank": ps.rank, "pid": os.getpid(), "cluster_id": os.environ["SHOAL_CLUSTER_ID"],
            "server_pids": [s["pid"] for s in servers], "server_addresses": [s["address"] for s in servers],
            "rendezvous": os.environ["SHOAL_RENDEZVOUS"], "secret_file": os.environ.get("SHOAL_SECRET_FILE"),
            "secret_in_environment": "SHOAL_SECRET" in os.environ}
    path = os.path.join(info_dir, f"w{ps.rank}.json")
    with open(path + ".part", "w") as fh:  # whole or not there: a worker torn down mid-write leaves no half file
        json.dump(info, fh)
    os.replace(path + ".part", path)
    print(f"worker {ps.rank} ready", flush=True)
    if mode == "ok":
        ps.barrier()
    elif mode == "crash":
        ps.barrier()  # every worker has written its info before one crashes and the job is torn down
        if ps.rank == 1:
            sys.exit(3)
        ps.barrier()
    elif mode == "hang":
        time.sleep(120)
    elif mode == "count":
        repeats = int(sys.argv[3])
        # Keys 0..999 span both nodes; 7 and 993 appear twice per push.
        keys = np.concatenate([np.arange(1000), [7, 993]])
        ones = np.ones((keys.shape[0], 4), np.float32)
        for _ in range(repeats):
            pending = [table.push_async(keys, ones) for _ in range(4)]
            for f in pending:
                f.wait()
        ps.barrier()
        if ps.rank == 0:
            with open(os.path.join(info_dir, "counts.json"), "w") as fh:
                json.dump(table.pull(np.arange(1000))[:, 0].tolist(), fh)
    ps.shutdown()


if __name__ == "__main__":
    main()
