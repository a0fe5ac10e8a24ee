"""Load balance across servers: unsliced placement, static slicing, and live rebalancing.

    sudo python benchmarks/bench_slicing.py [--seconds 40] [--rate 1gbit]

Three emulated hosts (network namespaces on a bridge, each host's egress capped
with ``tc tbf`` at ``--rate``; see tests/support/netns.py), each running a
server and a worker, in classic mode (every key goes through a server, so
server traffic is the whole story). Without root it falls back to loopback,
where all servers share this machine's cores and links and balance shows far
less. Two workloads:

* ``vgg``: a VGG-16-like model scaled by 1/32 (4.3 M float32): 13 conv layers,
  fc6 with 74% of the parameters, fc7, fc8. Every step pulls every tensor
  and pushes a gradient for each, as data-parallel training with a PS does.
* ``zipf``: a 400,000 x 64 embedding table; every step pulls and pushes
  the distinct keys of 32,768 draws from a Zipf(1.1) distribution.

Steps are synchronous (a barrier ends each), so a step takes as long as the
slowest worker, which waits on the busiest server.

Placements, side by side for each workload:

* ``unsliced``: how MXNet and ps-lite place arrays below their split size:
  each tensor whole on one server (``placement="whole"``); for the embedding,
  contiguous key ranges, one per server (hot keys all on server 0);
* ``static``: tensors cut into slices of at most 256 KiB spread over the servers
  (``mapping="bounded"``); the embedding hashed over the servers;
* ``rebalanced``: starts as ``unsliced`` (the embedding in 96 range slices) and
  the rendezvous's rebalancer moves slices while training runs. Slices are not
  split at run time, so the hottest embedding slice (47% of the distinct keys
  drawn) bounds how even Zipf traffic can get: max/mean >= 1.41.

Reported per run: per-server bytes max/mean, and iteration time (median) over
the whole run for the first two, and before the first move and over the last
third of the run for ``rebalanced``. Writes ``results/slicing.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from tests.support.netns import EmulatedHosts, run_cluster, unavailable_reason  # noqa: E402

from common import RESULTS, write_results  # noqa: E402

NODES = 3
SCALE = 32
VGG = {f"conv{i + 1}": n // SCALE for i, n in enumerate(
    [1728, 36864, 73728, 147456, 294912, 589824, 589824, 1179648, 2359296, 2359296, 2359296, 2359296, 2359296])}
VGG.update({"fc6": 102760448 // SCALE, "fc7": 16777216 // SCALE, "fc8": 4096000 // SCALE})
ZIPF_KEYS, ZIPF_DIM, ZIPF_DRAWS = 400_000, 64, 32768


# ----------------------------------------------------------------- worker side

def _tables(ps, workload: str, placement: str):
    import shoal

    sgd = shoal.optim.SGD(lr=1e-4)
    if workload == "vgg":
        if placement == "static":
            options = {"mapping": "bounded", "slice_bytes": 256 * 1024}
        else:
            options = {"mapping": "range", "slices": 16, "placement": "whole"}
        return [ps.dense(f"vgg.{name}", size, optimizer=sgd, **options) for name, size in VGG.items()]
    options = {"unsliced": {"mapping": "range"}, "static": {"mapping": "hash"},
               "rebalanced": {"mapping": "range", "slices": 96}}[placement]
    return [ps.table("zipf", ZIPF_KEYS, ZIPF_DIM, init=shoal.Normal(std=0.01), optimizer=sgd, **options)]


def _server_bytes(ps) -> dict[int, float]:
    return {s["node"]: float(s["stats"].get("bytes_in", 0) + s["stats"].get("bytes_out", 0))
            for s in ps.server_stats() if "stats" in s}


def worker(workload: str, placement: str, out: str, seconds: float) -> None:
    import shoal

    ps = shoal.init()
    tables = _tables(ps, workload, placement)
    rng = np.random.default_rng(ps.rank)
    grads = [np.full(t.shape, 1e-3, np.float32) for t in tables] if workload == "vgg" else None
    stop = ps.table("bench.stop", 1, 1)
    ps.barrier()
    iterations: list[tuple[float, float]] = []
    samples: list[tuple[float, dict[int, float]]] = []
    start = time.monotonic()
    next_sample = start
    while True:
        t = time.perf_counter()
        if workload == "vgg":
            futures = [table.pull_async() for table in tables]
            for f in futures:
                f.wait()
            for f in [table.push_async(g) for table, g in zip(tables, grads, strict=True)]:
                f.wait()
        else:
            keys = np.unique(np.minimum(rng.zipf(1.1, ZIPF_DRAWS) - 1, ZIPF_KEYS - 1))
            tables[0].pull(keys)
            tables[0].push(keys, np.full((keys.shape[0], ZIPF_DIM), 1e-3, np.float32))
        if ps.rank == 0 and time.monotonic() - start >= seconds:
            stop.push(np.zeros(1, np.int64), np.ones((1, 1), np.float32))  # everyone stops after this step
        ps.barrier()  # synchronous steps: a step takes as long as its slowest worker
        iterations.append((time.monotonic() - start, time.perf_counter() - t))
        if stop.pull(np.zeros(1, np.int64))[0, 0] > 0:
            break
        if ps.rank == 0 and time.monotonic() >= next_sample:
            samples.append((time.monotonic() - start, _server_bytes(ps)))
            next_sample += 1.0
    ps.barrier()
    if ps.rank == 0:
        samples.append((time.monotonic() - start, _server_bytes(ps)))
        moves = sum(s["stats"].get("slices_handed", 0) for s in ps.server_stats() if "stats" in s)
        with open(out, "w") as fh:
            series = [[t, {str(k): v for k, v in b.items()}] for t, b in samples]
            json.dump({"iterations": iterations, "samples": series, "moves": moves}, fh)
    ps.shutdown()


# ----------------------------------------------------------------- driver side

def _bytes_ratio(samples: list, t0: float, t1: float) -> float:
    """Max over mean of per-server bytes moved between the samples nearest t0 and t1."""
    times = np.array([t for t, _ in samples])
    a = samples[int(np.argmin(np.abs(times - t0)))][1]
    b = samples[int(np.argmin(np.abs(times - t1)))][1]
    per = np.array([b[k] - a.get(k, 0.0) for k in b])
    return float(per.max() / per.mean()) if per.mean() > 0 else 1.0


def _median_time(iterations: list, t0: float, t1: float) -> float:
    sel = [d for t, d in iterations if t0 <= t <= t1]
    return float(np.median(sel)) if sel else float("nan")


def run(workload: str, placement: str, seconds: float, work: Path, rate: str | None) -> dict:
    out = work / f"{workload}-{placement}.json"
    worker_cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", workload, placement, str(out),
                  str(seconds)]
    if rate is None:
        cmd = [sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", str(NODES), "--classic", "--no-prefix"]
        if placement == "rebalanced":
            cmd += ["--rebalance", "1.2"]
        done = subprocess.run([*cmd, "--", *worker_cmd], capture_output=True, text=True, timeout=seconds * 4 + 120)
        if done.returncode != 0:
            raise SystemExit(f"{workload}/{placement} failed:\n{done.stdout}\n{done.stderr}")
    else:
        secret = work / "secret"
        secret.write_text(os.urandom(32).hex())
        extra = {"SHOAL_LOCAL_ACCESS": "0", "PYTHONUNBUFFERED": "1"}
        if placement == "rebalanced":
            extra["SHOAL_REBALANCE"] = "1.2"
        with EmulatedHosts(NODES, rate=rate) as hosts:
            run_cluster(hosts, worker_cmd, str(secret), timeout=seconds * 4 + 120, extra_env=extra)
    data = json.loads(out.read_text())
    warm = 2.0
    if placement == "rebalanced":
        before = (warm, min(seconds / 3, 5.0))
        after = (seconds * 2 / 3, seconds)
    else:
        before = after = (warm, seconds)
    data.update({
        "bytes_max_over_mean_before": _bytes_ratio(data["samples"], *before),
        "bytes_max_over_mean": _bytes_ratio(data["samples"], *after),
        "iteration_s_before": _median_time(data["iterations"], *before),
        "iteration_s": _median_time(data["iterations"], *after),
    })
    return data


def plot(results: dict, path: Path, link: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, workload in zip(axes, ("vgg", "zipf"), strict=True):
        for placement, style in (("unsliced", "-"), ("static", "--"), ("rebalanced", "-")):
            its = np.array(results[workload][placement]["iterations"])
            if its.size == 0:
                continue
            window = max(1, len(its) // 60)
            smooth = np.convolve(its[:, 1], np.ones(window) / window, mode="valid")
            ax.plot(its[window - 1:, 0], smooth * 1e3, style, label=placement)
        ax.set_title(f"{workload}: iteration time ({NODES} hosts, {link})")
        ax.set_xlabel("seconds")
        ax.set_ylabel("ms per iteration")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--rate", default="1gbit", help="egress cap of each emulated host (tc tbf rate)")
    parser.add_argument("--worker", nargs=4, metavar=("WORKLOAD", "PLACEMENT", "OUT", "SECONDS"))
    args = parser.parse_args()
    if args.worker:
        workload, placement, out, seconds = args.worker
        worker(workload, placement, out, float(seconds))
        return
    work = RESULTS / ".slicing-work"
    work.mkdir(parents=True, exist_ok=True)
    reason = unavailable_reason()
    rate = None if reason else args.rate
    link = f"emulated hosts, {rate} each" if rate else "loopback"
    print(f"link: {link}" + (f" ({reason})" if reason else ""), flush=True)
    results: dict[str, dict[str, dict]] = {}
    for workload in ("vgg", "zipf"):
        results[workload] = {}
        for placement in ("unsliced", "static", "rebalanced"):
            results[workload][placement] = run(workload, placement, args.seconds, work, rate)
            r = results[workload][placement]
            print(f"{workload:5s} {placement:10s} bytes max/mean {r['bytes_max_over_mean']:.2f} "
                  f"iteration {r['iteration_s'] * 1e3:.1f} ms  moves {r['moves']}", flush=True)
    lines = ["| workload | placement | bytes max/mean | iteration ms | vs unsliced | slices moved |",
             "|---|---|---:|---:|---:|---:|"]
    for workload, per in results.items():
        base = per["unsliced"]["iteration_s"]
        for placement, r in per.items():
            if placement == "rebalanced":
                lines.append(f"| {workload} | rebalanced, before the first moves | "
                             f"{r['bytes_max_over_mean_before']:.2f} | {r['iteration_s_before'] * 1e3:.1f} | "
                             f"{base / r['iteration_s_before']:.2f}x | |")
                label = "rebalanced, last third of the run"
            else:
                label = placement
            lines.append(f"| {workload} | {label} | {r['bytes_max_over_mean']:.2f} | {r['iteration_s'] * 1e3:.1f} | "
                         f"{base / r['iteration_s']:.2f}x | {r['moves']} |")
    table = f"{NODES} servers and {NODES} workers, classic mode, link: {link}\n\n" + "\n".join(lines)
    print(table)
    plot(results, RESULTS / "slicing.png", link)
    summary = {w: {p: {k: v for k, v in r.items() if k not in ("iterations", "samples")} for p, r in per.items()}
               for w, per in results.items()}
    write_results("slicing", {"nodes": NODES, "seconds": args.seconds, "link": link, "results": summary}, table)
    for f in work.iterdir():
        f.unlink()
    work.rmdir()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
