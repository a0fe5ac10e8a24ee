"""A worker for scale-out and scale-in tests.

    elastic_worker.py INFO_DIR

Every worker pushes +1 to 50 keys per round (a pattern fixed by rank and round)
until rank 0 raises the stop flag. Rank 0 writes INFO_DIR/cluster.json (what a
server needs to join), waits for INFO_DIR/joined (the test started node 2),
waits until slices have moved onto it, drains server 1, lets everyone push a
little longer, then stops them. After a barrier, rank 0 checks every key
against the rounds each worker reports and writes INFO_DIR/result.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

import shoal

KEYS = 600


def keys_of(rank: int, round_: int) -> np.ndarray:
    return (np.arange(50) * 13 + round_ * 7 + rank * 101) % KEYS


def main() -> None:
    info = Path(sys.argv[1])
    ps = shoal.init()
    table = ps.table("elastic", KEYS, 2, optimizer=shoal.optim.Sum(), slices=12)
    control = ps.table("elastic.control", ps.num_workers + 1, 1, optimizer=shoal.optim.Sum())
    ones = np.ones((50, 2), np.float32)
    ps.barrier()
    events: dict[str, float] = {}
    if ps.rank == 0:
        env = {k: v for k, v in os.environ.items() if k.startswith("SHOAL_") and k != "SHOAL_LAUNCHER_PID"}
        (info / "cluster.json").write_text(json.dumps(env))
    rounds = 0
    start = time.monotonic()
    phase = "wait-join"
    while True:
        table.push(keys_of(ps.rank, rounds), ones)
        rounds += 1
        if ps.rank == 0:
            if phase == "wait-join" and (info / "joined").exists():
                deadline = time.monotonic() + 60
                while not any(o == 2 for o in ps.cluster_status()["layouts"]["elastic"]["owners"]):
                    table.push(keys_of(ps.rank, rounds), ones)  # training goes on while slices move
                    rounds += 1
                    if time.monotonic() > deadline:
                        raise SystemExit("no slice moved to the joined server within 60 s")
                table.refresh_layout()
                events["joined_owners"] = table.layout.owners.tolist()
                phase = "drain"
            elif phase == "drain":
                ps.remove_server(1)
                events["drained_owners"] = table.layout.owners.tolist()
                phase, drained_at = "after", rounds
            elif phase == "after" and rounds > drained_at + 50:
                control.push(np.array([ps.num_workers]), np.ones((1, 1), np.float32))
                break
        elif rounds % 10 == 0 and control.pull(np.array([ps.num_workers]))[0, 0] > 0:
            break
        if time.monotonic() - start > 120:
            raise SystemExit(f"rank {ps.rank}: still running after 120 s in phase {phase}")
    control.push(np.array([ps.rank]), np.full((1, 1), rounds, np.float32))
    ps.barrier()
    if ps.rank == 0:
        per_rank = control.pull(np.arange(ps.num_workers))[:, 0].astype(int)
        expected = np.zeros(KEYS)
        for rank, count in enumerate(per_rank):
            for r in range(count):
                expected[keys_of(rank, r)] += 1
        got = table.pull(np.arange(KEYS))[:, 0]
        stats = {s["node"]: s.get("tables", {}).get("elastic", {}).get("shards") for s in ps.server_stats()}
        (info / "result.json").write_text(json.dumps({
            "rounds": per_rank.tolist(), "lost": int((expected - got).sum()), "exact": bool((got == expected).all()),
            "servers": {str(k): v for k, v in stats.items()}, **events}))
    ps.shutdown()


if __name__ == "__main__":
    main()
