"""A worker script for replication failure tests.

    replica_worker.py INFO_DIR WRITE_QUORUM PUSHES [save | restore | retry]

Every worker pushes +1 to keys 0..89 (one shard per server, a replica on every
server up to three) PUSHES times, counting the pushes acknowledged. Rank 0
writes INFO_DIR/servers.json (server pids) first, and at the end, after a
barrier, waits for the live replicas to converge and writes
INFO_DIR/result.json: the counts read from every live replica, whether they are
bit-identical, and the acknowledged total. With ``save`` the job then
checkpoints into INFO_DIR/ckpt; with ``restore`` it pushes nothing, restores
from there and rank 0 writes the counts it reads to INFO_DIR/restored.json.
With ``retry`` a push that fails its write quorum is sent again with the
error's ``retry()`` (as a caller should) and counted as failed: replicas that
took it count it once all the same.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

import shoal

KEYS = np.arange(90)


def main() -> None:
    info_dir, write_quorum, pushes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    then = sys.argv[4] if len(sys.argv) > 4 else ""
    ps = shoal.init()
    replicas = min(3, ps.num_nodes)
    table = ps.table("counts", 90, 1, replicas=replicas, write_quorum=write_quorum, read_quorum=1, gossip_ms=20)
    if then == "restore":
        ps.restore(os.path.join(info_dir, "ckpt"))
        ps.barrier()
        if ps.rank == 0:
            with open(os.path.join(info_dir, "restored.json"), "w") as fh:
                json.dump({"counts": table.pull(KEYS)[:, 0].tolist()}, fh)
        ps.barrier()
        ps.shutdown()
        return
    if ps.rank == 0:
        with open(os.path.join(info_dir, "servers.json"), "w") as fh:
            json.dump({"pids": [s["pid"] for s in ps.server_stats()]}, fh)
    ps.barrier()
    acked = failed = 0
    ones = np.ones((90, 1), np.float32)
    for _ in range(pushes):
        try:
            table.push(KEYS, ones)
            acked += 1
        except shoal.WriteQuorumError as exc:
            if then != "retry":
                raise
            failed += 1
            try:
                exc.retry()
            except shoal.WriteQuorumError:
                pass  # still short of its quorum: applied where it was taken, once
        time.sleep(0.005)
    with open(os.path.join(info_dir, f"acked{ps.rank}.json"), "w") as fh:
        json.dump({"acked": acked, "failed": failed, "counters": dict(table.counters)}, fh)
    ps.barrier()
    if ps.rank == 0:
        view = table.access.view
        deadline = time.monotonic() + 20
        while True:
            view.refresh(force=True)
            reads = {}
            for n in view.live(list(range(replicas))):
                try:
                    reads[n] = table.access.replica_values(n, KEYS)
                except shoal.ShoalError:
                    pass  # a replica that died (and is not yet known dead) does not answer
            live = sorted(reads)
            blobs = {rows.tobytes() for rows, _ in reads.values()}
            alive = [n for n in range(replicas) if view.alive[n]]  # as the rendezvous' heartbeats say
            if (len(blobs) == 1 and live == alive) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        with open(os.path.join(info_dir, "result.json"), "w") as fh:
            json.dump({"live": live, "identical": len(blobs) == 1,
                       "counts": {str(n): rows[:, 0].tolist() for n, (rows, _) in reads.items()}}, fh)
    ps.barrier()
    if then == "save":
        ps.checkpoint(os.path.join(info_dir, "ckpt"))
    ps.shutdown()


if __name__ == "__main__":
    main()
