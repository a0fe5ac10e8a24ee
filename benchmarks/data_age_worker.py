"""One worker of the data-age probe (``bench_consistency.py``): how many updates each read misses.

    data_age_worker.py OUT_DIR COUNTERS --model essp --staleness 3 [--iterations 300]
        [--delay-ms 2] [--straggle-ms 0] [--lazy-ms 0] [--seed 0]

Every worker re-reads the same working set each iteration, the rows its node holds (read through
shared memory) and the rows of the other node (from its cache, or pulled), and pushes +1 to a
random quarter of the rows, so a row's value counts the pushes it includes. Just before a push, the
worker counts it in its own row of ``COUNTERS``, a file in /dev/shm that every worker of the job
maps: a read's data age is, per row, the pushes issued before the read began that the value read
does not include. Between iterations a worker sleeps a random time (exponential, mean
``--delay-ms``); the last rank sleeps ``--straggle-ms`` more. At the end, once every worker's clock
has passed the bound, every row must hold exactly the pushes issued for it (each acknowledged
update applied once), and rank 0 says so.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import shoal

ROWS = 64
MODELS = {"asp": lambda s, lazy: shoal.ASP(), "bsp": lambda s, lazy: shoal.BSP(lazy=lazy),
          "ssp": lambda s, lazy: shoal.SSP(s, lazy=lazy), "essp": lambda s, lazy: shoal.ESSP(s, lazy=lazy)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("counters", type=Path)
    p.add_argument("--model", choices=sorted(MODELS), default="essp")
    p.add_argument("--staleness", type=int, default=3)
    p.add_argument("--iterations", type=int, default=300)
    p.add_argument("--delay-ms", type=float, default=2.0)
    p.add_argument("--straggle-ms", type=float, default=0.0)
    p.add_argument("--lazy-ms", type=float, default=0.0, help="lazy pull buffer timeout (0: off)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    ps = shoal.init()
    lazy = shoal.LazyPull(timeout_ms=args.lazy_ms) if args.lazy_ms > 0 else None
    table = ps.table("probe", ROWS, 1, optimizer=shoal.optim.Sum(), slices=8,
                     consistency=MODELS[args.model](args.staleness, lazy))
    issued = np.memmap(args.counters, dtype=np.int64, mode="r+", shape=(ps.num_workers, ROWS))
    rows = np.arange(ROWS)
    here = table.layout.route(rows)[0] == ps.node
    sets = {"local": rows[here], "remote": rows[~here]}
    rng = np.random.default_rng(args.seed * 1000 + ps.rank)
    ones = np.ones((ROWS // 4, 1), np.float32)
    # missing[kind][m]: rows read that lacked m updates issued before their read began
    missing: dict[str, dict[int, int]] = {"local": {}, "cache": {}, "pull": {}, "mixed": {}}
    ps.barrier()
    started = time.perf_counter()
    for _ in range(args.iterations):
        for where, keys in sets.items():
            if keys.size == 0:
                continue
            before = issued[:, keys].sum(axis=0)
            hits = table.counters["rows_from_cache"]
            values = table.pull(keys)[:, 0]
            hits = table.counters["rows_from_cache"] - hits
            kind = "local" if where == "local" else "cache" if hits == keys.size else "pull" if hits == 0 else "mixed"
            lacking = np.maximum(before - values.astype(np.int64), 0)
            counts = missing[kind]
            for m, c in zip(*np.unique(lacking, return_counts=True), strict=True):
                counts[int(m)] = counts.get(int(m), 0) + int(c)
        chosen = rng.choice(ROWS, ROWS // 4, replace=False)
        issued[ps.rank, chosen] += 1
        table.push_async(chosen, ones)
        pause = rng.exponential(args.delay_ms) + (args.straggle_ms if ps.rank == ps.num_workers - 1 else 0.0)
        time.sleep(pause / 1000)
        ps.advance_clock()
    ps.wait_all()
    seconds = time.perf_counter() - started
    ps.barrier()
    for _ in range(args.staleness + 1):  # a read at the clock after these covers every iteration above
        ps.advance_clock()
    ps.barrier()
    # Every rank reads every row: through shared memory the rows its node holds, the others remotely.
    off = table.pull(rows)[:, 0].astype(np.int64) - issued.sum(axis=0)
    exact = not off.any()
    difference = {int(k): int(d) for k, d in zip(rows, off, strict=True) if d}
    record = {"rank": ps.rank, "seconds": seconds, "iterations": args.iterations, "missing": missing,
              "counters": dict(table.counters), "requests": dict(ps.tracker.sent), "exact": exact,
              "difference": difference}
    (args.out / f"rank{ps.rank}.json").write_text(json.dumps(record))
    ps.barrier()
    ps.shutdown()


if __name__ == "__main__":
    main()
