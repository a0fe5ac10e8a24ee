"""Local pull and push through Shoal against raw gather and scatter-add on the same arrays.

    python benchmarks/bench_local_access.py

The script runs itself as the only worker of a one-node cluster, so every key
is local: Shoal reads and updates the node's shared-memory shard in this
process. The raw contenders work on the very same shared-memory array, in the
same process, with no checks and no locks:

* gather: ``np.take(out=)``, fancy indexing, and a compiled loop;
* scatter-add: ``np.add.at``, ``a[keys] += g`` (correct here: keys are distinct),
  and a compiled loop.

The bar is the fastest raw method. Shoal runs with exact locking (the default)
and in hogwild mode (no locks).

A second part times what one call costs beyond the work on its rows: pulls and
pushes of 1, 100 and 1,000 keys on a static and an adaptive table (the sizes an
app's batch asks for: MF's users and items, a word2vec batch's words), against
the compiled loop on the same keys, and what holding those rows in place for a
kernel costs (``Table.in_place``: locking them, finding their slots; the kernel
then works on them with no copy).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import numba
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import interleaved, write_results  # noqa: E402

NUM_KEYS = 100_000
DIM = 64
BATCH = 10_000
CALL_SIZES = (1, 100, 1_000)


@numba.njit(nogil=True, cache=True)
def loop_gather(src: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
    for i in range(rows.shape[0]):
        r = rows[i]
        for j in range(src.shape[1]):
            out[i, j] = src[r, j]


@numba.njit(nogil=True, cache=True)
def loop_scatter_add(dst: np.ndarray, rows: np.ndarray, src: np.ndarray) -> None:
    for i in range(rows.shape[0]):
        r = rows[i]
        for j in range(dst.shape[1]):
            dst[r, j] += src[i, j]


def worker() -> None:
    import shoal

    ps = shoal.init()
    exact = ps.table("local.exact", NUM_KEYS, DIM, init=shoal.Normal(std=0.1))
    hogwild = ps.table("local.hogwild", NUM_KEYS, DIM, init=shoal.Normal(std=0.1), locking="hogwild")
    values = next(iter(exact.local.values())).values  # the shared-memory array itself
    rng = np.random.default_rng(0)
    keys = rng.choice(NUM_KEYS, size=BATCH, replace=False).astype(np.int64)
    grads = (rng.standard_normal((BATCH, DIM)) * 1e-6).astype(np.float32)
    out = np.empty((BATCH, DIM), dtype=np.float32)

    pulls = interleaved({
        "raw np.take": lambda: np.take(values, keys, axis=0, out=out),
        "raw fancy index": lambda: values[keys],
        "raw compiled loop": lambda: loop_gather(values, keys, out),
        "Shoal pull (exact)": lambda: exact.pull(keys, out=out),
        "Shoal pull (hogwild)": lambda: hogwild.pull(keys, out=out),
        "Shoal pull, new array": lambda: exact.pull(keys),
    })
    pushes = interleaved({
        "raw np.add.at": lambda: np.add.at(values, keys, grads),
        "raw a[keys] += g": lambda: values.__setitem__(keys, values[keys] + grads),
        "raw compiled loop": lambda: loop_scatter_add(values, keys, grads),
        "Shoal push (exact)": lambda: exact.push(keys, grads),
        "Shoal push (hogwild)": lambda: hogwild.push(keys, grads),
    })
    adaptive = ps.table("local.adaptive", NUM_KEYS, DIM, init=shoal.Normal(std=0.1), techniques="auto")
    per_call = {size: _per_call(size, values, {"static": exact, "adaptive": adaptive}) for size in CALL_SIZES}
    ps.shutdown()

    report = {}
    lines = [f"{BATCH:,} keys x {DIM} float32, table of {NUM_KEYS:,} rows, all local", ""]
    for label, times in (("pull", pulls), ("push", pushes)):
        best_raw = min(t for name, t in times.items() if name.startswith("raw"))
        lines += [f"| {label} | µs | M rows/s | vs fastest raw |", "|---|---:|---:|---:|"]
        for name, t in times.items():
            lines.append(f"| {name} | {t * 1e6:.1f} | {BATCH / t / 1e6:.1f} | {best_raw / t:.2f} |")
            report[f"{label}: {name}"] = {"us": t * 1e6, "rows_per_s": BATCH / t, "vs_fastest_raw": best_raw / t}
        lines.append("")
    lines += ["What one call costs beyond its rows (µs per call; overhead: Shoal's call less the compiled loop "
              "on the same keys)", "",
              "| keys | op | compiled loop | static table | adaptive table | overhead static | overhead adaptive |",
              "|---:|---|---:|---:|---:|---:|---:|"]
    for size, times in per_call.items():
        for op in ("pull", "push"):
            raw, static, adapt = (times[f"{op}: {kind}"] * 1e6 for kind in ("raw", "static", "adaptive"))
            lines.append(f"| {size:,} | {op} | {raw:.1f} | {static:.1f} | {adapt:.1f} | {static - raw:.1f} | "
                         f"{adapt - raw:.1f} |")
            report[f"per call {size}: {op}"] = {"raw_us": raw, "static_us": static, "adaptive_us": adapt}
        hold = times["hold: adaptive"] * 1e6
        lines.append(f"| {size:,} | hold in place | | | {hold:.1f} | | {hold:.1f} |")
        report[f"per call {size}: hold in place"] = {"adaptive_us": hold}
    table_md = "\n".join(lines)
    print(table_md)
    write_results("local_access", {"batch": BATCH, "dim": DIM, "num_keys": NUM_KEYS, "results": report}, table_md)


def _per_call(size: int, values: np.ndarray, tables: dict[str, Any]) -> dict[str, float]:
    """Seconds per pull and push of ``size`` distinct keys through each table and by the compiled loop."""
    keys = np.random.default_rng(size).choice(NUM_KEYS, size=size, replace=False).astype(np.int64)
    grads = np.full((size, DIM), 1e-7, dtype=np.float32)
    out = np.empty((size, DIM), dtype=np.float32)
    contenders: dict[str, Callable[[], object]] = {"pull: raw": lambda: loop_gather(values, keys, out),
                                                   "push: raw": lambda: loop_scatter_add(values, keys, grads)}
    for kind, table in tables.items():
        contenders[f"pull: {kind}"] = functools.partial(table.pull, keys, out=out)
        contenders[f"push: {kind}"] = functools.partial(table.push, keys, grads)
    contenders["hold: adaptive"] = functools.partial(_hold, tables["adaptive"], keys)
    return interleaved(contenders)


def _hold(table: Any, keys: np.ndarray) -> None:
    with table.in_place(keys):
        pass


def main() -> int:
    if "SHOAL_RENDEZVOUS" in os.environ:
        worker()
        return 0
    import shoal.launch.local

    return shoal.launch.local.run([sys.executable, os.path.abspath(__file__)], nodes=1, prefix_output=False)


if __name__ == "__main__":
    sys.exit(main())
