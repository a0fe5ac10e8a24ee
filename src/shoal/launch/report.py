"""Run reports: what a finished job did, as PNG plots and one small HTML page.

Inputs, all in the run directory:

* ``worker-<rank>.json``: written by each worker at shutdown: the scalars it
  logged with ``ps.log(...)`` (loss, RMSE, ...), its read-staleness histogram
  and counters per table;
* ``servers.json``: written by the launcher, which samples every server's
  counters four times a second while the job runs.

Plots need matplotlib (the ``bench`` extra); without it the page still lists
the figures as tables.
"""

from __future__ import annotations

import html
import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from shoal.api.errors import ShoalError
from shoal.launch.status import StatusClient

SAMPLE_S = 0.25
# The first second is sampled faster: a job that short (a small model on a warm machine) would
# otherwise end with one sample or none, and its report with no throughput curve.
FIRST_SAMPLE_S, FIRST_SECOND_S = 0.05, 1.0
# A sample asks every server; one that has just exited at the job's end is waited for this long
# (a sample is dropped, not the job held: 2 s held every short job's exit by 2-4 s).
SAMPLE_TIMEOUT_S = 0.5
# Samples the launcher keeps at most (2.5 minutes' at ``SAMPLE_S``; the report's curves need no more
# points): past that every other one goes and the period doubles, so a job of any length keeps its
# whole course at a coarser step. Kept all, a 2-node job's took about 4 MB of the launcher's memory
# every 10 minutes, and a long job's as much again every 10 minutes.
MAX_SAMPLES = 600


class LoadSampler:
    """Samples every server's counters every ``SAMPLE_S`` seconds (``FIRST_SAMPLE_S`` in the first
    second; less often past ``MAX_SAMPLES``) in a thread, until stopped."""

    def __init__(self, rendezvous: str, secret: bytes | None, run_dir: Path) -> None:
        self.rendezvous, self.secret, self.run_dir = rendezvous, secret, run_dir
        self.samples: list[dict[str, Any]] = []
        self.period_s = SAMPLE_S
        self.started = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shoal-report-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        client = StatusClient(self.rendezvous, self.secret, timeout=SAMPLE_TIMEOUT_S)
        self.started = time.time()  # workers log wall-clock times: plots count both from here
        start = time.monotonic()
        try:
            while not self._stop.wait(FIRST_SAMPLE_S if time.monotonic() - start < FIRST_SECOND_S else self.period_s):
                try:
                    snap = client.snapshot()
                except ShoalError:
                    continue  # the job is starting or ending
                self.samples.append({"t": snap.at - start,
                                     "servers": {str(n): _sample(info) for n, info in snap.servers.items()}})
                if len(self.samples) > MAX_SAMPLES:
                    self.samples = self.samples[::2]
                    self.period_s *= 2
                if snap.status.get("finished"):  # the servers are leaving: nothing more to see
                    break
        finally:
            client.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        (self.run_dir / "servers.json").write_text(json.dumps({"interval_s": self.period_s, "started": self.started,
                                                               "samples": self.samples}))


def _sample(info: dict[str, Any]) -> dict[str, Any]:
    return {"stats": {k: info["stats"].get(k, 0) for k in ("messages", "bytes_in", "bytes_out")},
            "clocks": [c for c in info.get("clocks", []) if c < 1 << 60], "queue": info.get("queue", 0)}


def _load(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Workers' records and the servers' samples, every time in seconds since the job started (or,
    without the servers' samples, since the first value any worker logged)."""
    workers = []
    for path in sorted(run_dir.glob("worker-*.json")):
        try:
            workers.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    try:
        servers = json.loads((run_dir / "servers.json").read_text())
        samples, started = servers["samples"], servers.get("started")
    except (OSError, ValueError, KeyError):
        samples, started = [], None
    logged = [e["t"] for w in workers for e in w.get("log", [])]
    origin = started if started is not None else min(logged, default=0.0)
    for w in workers:
        for e in w.get("log", []):
            e["t"] -= origin
    return workers, samples


def _server_rates(samples: list[dict[str, Any]]) -> tuple[np.ndarray, dict[str, dict[str, np.ndarray]]]:
    """Per server: messages/s and bytes/s (in + out) between consecutive samples."""
    times = np.array([s["t"] for s in samples])
    nodes = sorted({n for s in samples for n in s["servers"]}, key=int)
    rates: dict[str, dict[str, np.ndarray]] = {}
    for n in nodes:
        def series(key: str, node: str = n) -> np.ndarray:
            return np.array([s["servers"].get(node, {}).get("stats", {}).get(key, np.nan) for s in samples], float)

        dt = np.diff(times)
        rates[n] = {"messages": np.diff(series("messages")) / dt,
                    "bytes": (np.diff(series("bytes_in")) + np.diff(series("bytes_out"))) / dt}
    return times[1:], rates


def _staleness(workers: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    merged: dict[str, np.ndarray] = {}
    for w in workers:
        for table, info in w.get("tables", {}).items():
            counts = info.get("staleness", {}).get("counts", {})
            if not counts:
                continue
            hist = np.zeros(max(int(k) for k in counts) + 1)
            for k, v in counts.items():
                hist[int(k)] += v
            old = merged.get(table, np.zeros(0))
            size = max(old.size, hist.size)
            merged[table] = np.pad(old, (0, size - old.size)) + np.pad(hist, (0, size - hist.size))
    return merged


def _plots(run_dir: Path, workers: list[dict[str, Any]], samples: list[dict[str, Any]]) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    logged = sorted({k for w in workers for entry in w.get("log", []) for k in entry["values"]})
    if logged:
        fig, axes = plt.subplots(1, len(logged), figsize=(5 * len(logged), 3.5), squeeze=False)
        for ax, name in zip(axes[0], logged, strict=True):
            plot_logged(ax, workers, name)
        made.append(_save(plt, fig, run_dir, "metrics.png"))
    if len(samples) > 1:
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.5))
        plot_throughput(left, right, samples)
        made.append(_save(plt, fig, run_dir, "throughput.png"))
    staleness = _staleness(workers)
    if staleness:
        fig, ax = plt.subplots(figsize=(5.5, 3.5))
        plot_staleness(ax, staleness)
        made.append(_save(plt, fig, run_dir, "staleness.png"))
    return made


def _save(plt: Any, fig: Any, run_dir: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(run_dir / name, dpi=90)
    plt.close(fig)
    return name


def plot_logged(ax: Any, workers: list[dict[str, Any]], name: str) -> None:
    """One logged scalar of every worker against job seconds."""
    for w in workers:
        points = [(e["t"], e["values"][name]) for e in w.get("log", []) if name in e["values"]]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=f"rank {w['rank']}")
    ax.set(title=name, xlabel="seconds since the job started")
    ax.legend(fontsize=7)


def plot_throughput(left: Any, right: Any, samples: list[dict[str, Any]]) -> None:
    """Messages and iterations per second (left) and each server's bytes per second (right)."""
    times, rates = _server_rates(samples)
    left.plot(times, sum(r["messages"] for r in rates.values()), marker=".", label="messages/s, all servers")
    slowest = [min((min(s["clocks"]) for s in smp["servers"].values() if s["clocks"]), default=np.nan)
               for smp in samples]
    left.plot(times, np.diff(np.array(slowest, float)) / np.diff([s["t"] for s in samples]),
              marker=".", label="slowest clock, iterations/s")
    left.set(title="throughput", xlabel="seconds since the job started", yscale="log")
    left.legend(fontsize=7)
    for n, r in rates.items():
        right.plot(times, r["bytes"] / 1e6, marker=".", label=f"server {n}")
    right.set(title="per-server load (MB/s in + out)", xlabel="seconds since the job started")
    right.legend(fontsize=7)


def plot_staleness(ax: Any, staleness: dict[str, np.ndarray]) -> None:
    """Share of reads by clocks behind, one bar per table centred on each whole clock."""
    from matplotlib.ticker import MaxNLocator

    width = 0.8 / len(staleness)
    for i, (table, hist) in enumerate(sorted(staleness.items())):
        offset = (i - (len(staleness) - 1) / 2) * width
        ax.bar(np.arange(hist.size) + offset, hist / hist.sum(), width, label=table)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # staleness is a whole number of clocks
    ax.set(title="read staleness", xlabel="clocks behind the reader", ylabel="share of reads")
    ax.legend(fontsize=7)


def summarize(run_dir: Path) -> dict[str, Any]:
    """The figures the page shows, also written to ``summary.json``."""
    workers, samples = _load(run_dir)
    summary: dict[str, Any] = {"workers": len(workers)}
    if samples:
        summary["job_seconds"] = round(samples[-1]["t"], 1)
        last: dict[str, Any] = {}
        for sample in samples:  # each server's latest figures (one may have stopped answering first)
            last.update(sample["servers"])
        moved = {n: s["stats"]["bytes_in"] + s["stats"]["bytes_out"] for n, s in last.items()}
        summary["server_bytes"] = moved
        if moved and np.mean(list(moved.values())) > 0:
            summary["server_bytes_max_over_mean"] = round(float(max(moved.values()) / np.mean(list(moved.values()))), 3)
        summary["server_messages"] = {n: s["stats"]["messages"] for n, s in last.items()}
    finals: dict[str, float] = {}
    for w in workers:
        for entry in w.get("log", []):
            finals.update({f"{k} (rank {w['rank']})": float(v) for k, v in entry["values"].items()})
    summary["last_logged"] = finals
    staleness = _staleness(workers)
    summary["staleness_mean"] = {t: round(float((h * np.arange(h.size)).sum() / h.sum()), 3)
                                 for t, h in staleness.items()}
    summary["clocks"] = {str(w["rank"]): w.get("clock") for w in workers}
    return summary


def write_report(run_dir: str | Path) -> Path:
    """Write ``report.html`` (with its PNGs and ``summary.json``) into ``run_dir``; returns the page."""
    run_dir = Path(run_dir)
    workers, samples = _load(run_dir)
    images = _plots(run_dir, workers, samples)
    summary = summarize(run_dir)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    rows = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(json.dumps(v))}</td></tr>"
                   for k, v in summary.items())
    figures = "".join(f'<figure><img src="{name}" alt="{name}"></figure>' for name in images) or \
        "<p>(no plots: matplotlib is not installed; install the <code>bench</code> extra)</p>"
    page = run_dir / "report.html"
    page.write_text(f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Shoal run report</title>
<style>body{{font-family:sans-serif;margin:2em}} th{{text-align:left;padding-right:1em}}
td{{font-family:monospace}} img{{max-width:100%}}</style></head>
<body><h1>Shoal run report</h1><p>{html.escape(str(run_dir.resolve()))}</p>
<table>{rows}</table>{figures}</body></html>
""")
    return page
