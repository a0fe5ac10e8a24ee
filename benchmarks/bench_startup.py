"""Where a job's start-up goes: a trivial 2-node job end to end, and what each process pays.

    python benchmarks/bench_startup.py [--runs 5]

The job is ``shoal run --nodes 2 --workers-per-node 1`` of a script that calls
``shoal.init()``, one barrier and ``shutdown()`` (and once more with a first
table, pushed and pulled, between them), with its processes forked from
the launcher (the default), as fresh interpreters (``--fresh-interpreters``),
and forked from a warm launcher (``shoal warm start``, run once before the
rounds; its own start is timed too), alternating. Its workers print when each phase ended (time since the launcher
started), and the costs every process pays
are timed alone, each in a fresh interpreter: the interpreter itself, ``import
shoal`` (which leaves the worker out), the worker's and the server's imports,
the launcher's import, what numba and prometheus_client cost where they are
first used (a job's first table, a process's first scrape), the launcher's
preload (all of that once, before it forks), and how long an interpreter holding
the worker's imports takes to exit. Medians over ``--runs``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import write_results  # noqa: E402

WORKER = r"""
import os, time
t0 = float(os.environ["BENCH_T0"])
def mark(what): print(f"phase {what} {time.time() - t0:.4f}", flush=True)
mark("worker started")
import shoal
ps = shoal.init()
mark("init done")
ps.barrier()
mark("barrier done")
if os.environ.get("BENCH_TABLE"):  # a job's first table: a push and a pull of rows on both nodes
    import numpy as np
    table = ps.table("t", 1000, 16)
    table.push(np.arange(1000), np.ones((1000, 16), np.float32))
    table.pull(np.arange(1000))
    ps.barrier()
    mark("first table pushed and pulled")
ps.shutdown()
mark("shutdown done")
"""

ALONE = {
    "python -c pass": "pass",
    "import shoal": "import shoal",
    "import the worker": "import shoal.client.worker",
    "import the server": "import shoal.launch.server_main",
    "import the launcher": "import shoal.launch.cli",
    "prometheus_client, at a process's first scrape": (
        "import shoal.client.worker, time; t = time.perf_counter(); import shoal.cluster.exposition; "
        "print(time.perf_counter() - t)"),
    "numba's import and first call, at a job's first table": (
        "import shoal.client.worker, time; t = time.perf_counter(); from shoal.storage import kernels; "
        "kernels.warm_up(); print(time.perf_counter() - t)"),
    "the launcher's preload, once per job (the processes are forked from it)": (
        "import shoal.launch.cli, time; t = time.perf_counter(); from shoal.launch.forked import preload; "
        "preload(); print(time.perf_counter() - t)"),
}

#: what an interpreter that imported the worker takes to exit, without and with ``gc.freeze``
EXIT = {
    "exit after the worker's imports": "import shoal.client.worker, time; print(time.time())",
    "the same after gc.freeze (shoal.init does it)": (
        "import shoal.client.worker, gc, time; gc.freeze(); print(time.time())"),
}


def alone(code: str) -> float:
    """Seconds a fresh interpreter takes to run ``code`` (or what it prints, if it prints a number)."""
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    return float(out) if out else time.perf_counter() - started


def exit_cost(code: str) -> float:
    """Seconds from the end of ``code`` (it prints ``time.time()`` last) to its interpreter's exit."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    return time.time() - float(out)


#: how each contender's job starts: ``shoal run``'s options
STARTS = {"forked from the launcher": ["--cold"], "fresh interpreters": ["--cold", "--fresh-interpreters"],
          "forked from a warm launcher": []}


def job(script: Path, options: list[str], table: bool, home: str) -> tuple[float, dict[str, float]]:
    env = {**os.environ, "TMPDIR": home, "BENCH_T0": repr(time.time()), "BENCH_TABLE": "1" if table else ""}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", "2", "--workers-per-node",
                           "1", *options, "--", sys.executable, str(script)],
                          capture_output=True, text=True, env=env, check=True, timeout=120)
    if not options and "warm launcher" in done.stderr:
        raise SystemExit(f"the warm launcher was not used: {done.stderr}")
    wall = time.perf_counter() - started
    phases: dict[str, float] = {}
    for line in done.stdout.splitlines() + done.stderr.splitlines():
        if "phase " in line:
            what, _, at = line.split("phase ", 1)[1].rpartition(" ")
            phases[what] = max(phases.get(what, 0.0), float(at))  # the later of the two workers
    return wall, phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    costs = {name: statistics.median(alone(code) for _ in range(args.runs)) for name, code in ALONE.items()}
    costs |= {name: statistics.median(exit_cost(code) for _ in range(args.runs)) for name, code in EXIT.items()}
    starts = STARTS
    kinds = {"the trivial 2-node job": False, "the same with a first table": True}
    runs: dict[str, dict[str, list[tuple[float, dict[str, float]]]]] = {k: {n: [] for n in starts} for k in kinds}
    with tempfile.TemporaryDirectory(prefix="sb", dir="/tmp") as home:  # the warm launcher's, private and short
        script = Path(home) / "trivial.py"
        script.write_text(WORKER)
        shoal = [sys.executable, "-m", "shoal.launch.cli", "warm"]
        began = time.perf_counter()
        subprocess.run([*shoal, "start"], env={**os.environ, "TMPDIR": home}, check=True, capture_output=True)
        costs["the warm launcher's start, once (`shoal warm start`)"] = time.perf_counter() - began
        try:
            for _ in range(args.runs):  # alternating
                for kind, with_table in kinds.items():
                    for name, options in starts.items():
                        runs[kind][name].append(job(script, options, with_table, home))
        finally:
            subprocess.run([*shoal, "stop"], env={**os.environ, "TMPDIR": home}, capture_output=True)
    wall = {k: {n: statistics.median(w for w, _ in rs) for n, rs in by.items()} for k, by in runs.items()}
    phases = {k: {n: {p: statistics.median(ph[p] for _, ph in rs) for p in rs[0][1]} for n, rs in by.items()}
              for k, by in runs.items()}

    lines = []
    for kind in kinds:
        lines += [f"| {kind} (median), s since the launcher started | " + " | ".join(starts) + " |",
                  "|---|" + "---:|" * len(starts)]
        lines += [f"| workers: {p} | " + " | ".join(f"{phases[kind][n][p]:.2f}" for n in starts) + " |"
                  for p in phases[kind]["fresh interpreters"]]
        lines += ["| **launcher exited** | " + " | ".join(f"**{wall[kind][n]:.2f}**" for n in starts) + " |", ""]
    lines += ["| each process pays, alone on the machine (median) | s |", "|---|---:|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in costs.items()]
    imports = costs["import the worker"] + costs["import the server"]
    lines.append(f"\nAs fresh interpreters, each node's worker and server import {imports:.2f} s of Python before "
                 f"the job runs (the launcher {costs['import the launcher']:.2f} s before it starts them); on "
                 f"{os.cpu_count()} cores the four processes' imports overlap only two at a time, and numba loads "
                 "in each where it is first needed (a job's first table). Forked from the launcher (`shoal run`'s "
                 "default), the processes start with all of it loaded once: the launcher's preload is the cost, "
                 "paid before the processes start, once per job. Forked from a warm launcher (`shoal warm start`, "
                 "then `shoal run` as before), that cost is paid once for every job that follows. "
                 "prometheus_client loads at a process's first scrape either way.")
    table = "\n".join(lines)
    print("\n" + table)
    write_results("startup", {"runs": args.runs, "wall_s": wall, "phases_s": phases, "alone_s": costs}, table)


if __name__ == "__main__":
    main()
