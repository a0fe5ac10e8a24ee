"""A worker for fault-injection scenarios: counts that must come out exact, reads that must stay fresh.

    fault_worker.py INFO_DIR [--model ssp] [--staleness 1] [--rounds 200] [--slices 0] [--sleep-ms 2]
                    [--checkpoint-every 0] [--techniques auto]

Every round each worker pushes +1 to 40 keys (a pattern fixed by rank and
round) and waits for the acknowledgement, records how many rounds were
acknowledged (INFO_DIR/acked<rank>), reads 40 other keys, and advances its
clock. Rank 0 first writes INFO_DIR/pids.json (its own, and the servers').
At the end, after a barrier, rank 0 compares every key with the acknowledged
rounds of all workers and writes INFO_DIR/result.json; each worker writes
INFO_DIR/w<rank>.json with the largest staleness it read at. With
``--techniques`` the table is adaptive (ASP) and each worker declares its keys of
two rounds ahead as intent, so keys move and are copied between the nodes while
the counts run; rank 0 compares once every replica's last change reached its
key's owner.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

import shoal

KEYS = 2000
MODELS = {"bsp": lambda s: shoal.BSP(), "ssp": lambda s: shoal.SSP(s), "essp": lambda s: shoal.ESSP(s),
          "asp": lambda s: shoal.ASP()}


def keys_of(rank: int, round_: int) -> np.ndarray:
    return (np.arange(40) * 37 + round_ * 11 + rank * 101) % KEYS


def write(path: Path, data: object) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("info", type=Path)
    p.add_argument("--model", default="ssp", choices=sorted(MODELS))
    p.add_argument("--staleness", type=int, default=1)
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--slices", type=int, default=0, help="slices per table (0: one per server)")
    p.add_argument("--sleep-ms", type=float, default=2.0)
    p.add_argument("--checkpoint-every", type=int, default=0, help="rounds between checkpoints (0: none)")
    p.add_argument("--techniques", help="an adaptive table: relocation, replication or auto")
    args = p.parse_args()
    ps = shoal.init()
    if args.techniques:
        table = ps.table("faults", KEYS, 2, optimizer=shoal.optim.Sum(), techniques=args.techniques, sync_ms=10)
    else:
        options = {"slices": args.slices} if args.slices else {}
        table = ps.table("faults", KEYS, 2, optimizer=shoal.optim.Sum(),
                         consistency=MODELS[args.model](args.staleness), mapping="hash", **options)
    write(args.info / f"pid{ps.rank}.json", {"pid": os.getpid()})
    if ps.rank == 0:
        write(args.info / "pids.json", {"servers": [s["pid"] for s in ps.server_stats()]})
    ps.barrier()
    ones = np.ones((40, 2), np.float32)
    rng = np.random.default_rng(ps.rank)
    for r in range(args.rounds):
        if args.techniques:
            table.intent(keys_of(ps.rank, r + 2), ps.clock + 2, ps.clock + 3)
        table.push(keys_of(ps.rank, r), ones)
        write(args.info / f"acked{ps.rank}.json", {"acked": r + 1})
        table.pull(rng.integers(0, KEYS, 40))
        ps.advance_clock()
        if args.checkpoint_every and (r + 1) % args.checkpoint_every == 0:
            ps.checkpoint(args.info / "ckpt")
        time.sleep(args.sleep_ms / 1000)
    write(args.info / f"w{ps.rank}.json", {"staleness_max": table.staleness.max(), "reads": table.staleness.total,
                                           "resent": ps.tracker.resent})
    for _ in range(args.staleness + 1):  # a read now must see every round, whatever the bound
        ps.advance_clock()
    ps.barrier()
    if ps.rank == 0 and args.techniques:  # no intent is left: every replica goes with its last change
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(s["adaptive"]["faults"]["replicas"] for s in ps.server_stats()):
            time.sleep(0.05)
    if ps.rank == 0:
        expected = np.zeros(KEYS)
        for rank in range(ps.num_workers):
            for r in range(args.rounds):
                expected[keys_of(rank, r)] += 1
        got = table.pull(np.arange(KEYS))[:, 0]
        write(args.info / "result.json", {"exact": bool((got == expected).all()),
                                          "lost": float(np.clip(expected - got, 0, None).sum()),
                                          "extra": float(np.clip(got - expected, 0, None).sum())})
    ps.barrier()
    ps.shutdown()


if __name__ == "__main__":
    main()
