"""Soak run: a local cluster under sustained load for a bounded time, memory and descriptors watched.

    python benchmarks/soak.py [--minutes 10] [--interval 10]
    python benchmarks/soak.py --minutes 0.5 --interval 2      # a quick smoke check

Starts ``shoal run --nodes 2 --workers-per-node 2`` in a subprocess running
``benchmarks/soak_worker.py`` (a static SSP table read locally and remotely, a
table on two replicas, a dense parameter, clock ticks, a collective checkpoint
about every minute (four in a shorter run), ``ps.log``), and watches it from outside. Every
``--interval`` seconds it records, for each process of the job (the launcher,
which also hosts the rendezvous, both servers and the four workers, found by
walking the launcher's process tree), its resident memory (``VmRSS``), open
file descriptors and threads; the number of ``/dev/shm/shoal-*`` entries; and
each server's message and byte counters (STATS, as ``shoal status`` asks).

The workers stop themselves after ``--minutes``; the job is killed if it is
still running ``--margin`` seconds later. Judgement, per process: after a
warm-up (the first minute, or 20% of the run if that is shorter), the median of
the first third of the remaining samples against the median of the last third.
Flat means RSS grew by less than max(10%, 20 MB), descriptors and threads by at
most 2, and ``/dev/shm`` entries not at all; the job must also end with status
0 and leave no process behind. Prints a table, writes ``results/soak.{json,md}``
(settings, every sample, verdicts, rounds and messages) and ``results/soak.png``
(RSS and descriptors over time); exits 1 if anything is not flat.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]

from common import RESULTS, write_results  # noqa: E402

NODES, WORKERS_PER_NODE = 2, 2
RSS_GROWTH_FRACTION, RSS_GROWTH_MB = 0.10, 20.0  # allowed: whichever is larger
FD_GROWTH, THREAD_GROWTH = 2, 2
WARMUP_S, WARMUP_FRACTION = 60.0, 0.2
CHECKPOINT_S = 60.0  # a collective checkpoint this often (four times in a shorter run)
SHM_PREFIX = "shoal-"
ALERT_WORDS = ("Traceback", "Error", "WARNING", "exited with status")


# ------------------------------------------------------------------ /proc

@dataclass(frozen=True)
class Proc:
    """One process, named by pid and start time so that a reused pid is never mistaken for it."""

    pid: int
    start: int


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time in ticks) from /proc/<pid>/stat."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    return fields[0], int(fields[1]), int(fields[19])


def process_tree(root: int) -> list[Proc]:
    """``root`` and every live descendant, from the parent pids of all processes."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _stat(int(entry))
        if stat is None or stat[0] == "Z":
            continue
        children.setdefault(stat[1], []).append(int(entry))
        starts[int(entry)] = stat[2]
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in starts:
            found.append(Proc(pid, starts[pid]))
            todo.extend(children.get(pid, []))
    return found


def alive(proc: Proc) -> bool:
    stat = _stat(proc.pid)
    return stat is not None and stat[0] != "Z" and stat[2] == proc.start


def label(proc: Proc, launcher: int) -> str:
    """``launcher``, ``s<node>``, ``w<rank>``, or ``other-<pid>``: the launcher forks its servers and
    workers, and names each (``shoal-s0``, ``shoal-w1``)."""
    if proc.pid == launcher:
        return "launcher"
    try:
        name = Path(f"/proc/{proc.pid}/comm").read_text().strip()
    except OSError:
        return f"other-{proc.pid}"
    role = name.removeprefix("shoal-")
    if role != name and role[:1] in ("s", "w") and role[1:].isdigit():
        return role
    return f"other-{proc.pid}"


def measure(pid: int) -> dict[str, float] | None:
    """RSS in MB, open descriptors and threads of ``pid``; None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss_kb = int(fields.get("VmRSS", "0 kB").split()[0])
    return {"rss_mb": rss_kb / 1024, "fds": fds, "threads": int(fields["Threads"])}


def shm_entries() -> int:
    try:
        return sum(1 for name in os.listdir("/dev/shm") if name.startswith(SHM_PREFIX))
    except OSError:
        return 0


# ----------------------------------------------------------------- servers

class ServerStats:
    """Each server's message and byte counters, asked the way ``shoal status`` asks."""

    def __init__(self, launcher: int) -> None:
        self.launcher = launcher
        self.client: Any = None

    def sample(self) -> dict[str, dict[str, int]]:
        from shoal.api.errors import ShoalError
        from shoal.launch.env import read_secret
        from shoal.launch.status import StatusClient, running_jobs

        try:
            if self.client is None:
                job = next((j for j in running_jobs() if int(j.get("pid", 0)) == self.launcher), None)
                if job is None:
                    return {}  # the launcher has not recorded its rendezvous yet
                secret = read_secret({"SHOAL_SECRET_FILE": job.get("secret_file") or ""})
                self.client = StatusClient(job["rendezvous"], secret, timeout=2.0)
            snapshot = self.client.snapshot()
        except ShoalError:
            return {}
        return {f"s{node}": {"pid": int(info.get("pid", 0)),
                             **{k: int(info.get("stats", {}).get(k, 0)) for k in ("messages", "bytes_in", "bytes_out")}}
                for node, info in snapshot.servers.items()}

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


# --------------------------------------------------------------- judgement

def windows(duration: float, warmup: float) -> tuple[tuple[float, float], tuple[float, float]]:
    """The first and the last third of the loaded time after the warm-up (seconds since the load began)."""
    third = (duration - warmup) / 3
    return (warmup, warmup + third), (duration - third, duration)


def judge(samples: list[dict[str, Any]], first: tuple[float, float], last: tuple[float, float]
          ) -> dict[str, dict[str, Any]]:
    """Per process: medians of the two windows and whether RSS, descriptors and threads stayed flat."""
    names = sorted({name for s in samples for name in s["procs"]}, key=_order)
    verdicts = {}
    for name in names:
        if all(s["t"] < first[0] for s in samples if name in s["procs"]):
            continue  # gone before the load settled: a child seen between fork and exec, or setup only
        def window(bounds: tuple[float, float], key: str, name: str = name) -> float | None:
            values = [s["procs"][name][key] for s in samples if bounds[0] <= s["t"] <= bounds[1] and name in s["procs"]]
            return statistics.median(values) if values else None

        v: dict[str, Any] = {"pid": next(s["procs"][name]["pid"] for s in samples if name in s["procs"])}
        for key in ("rss_mb", "fds", "threads"):
            v[key] = [window(first, key), window(last, key)]
        if None in v["rss_mb"]:
            v.update(flat=False, why="no samples in one of the windows")
            verdicts[name] = v
            continue
        (rss0, rss1), (fd0, fd1), (th0, th1) = v["rss_mb"], v["fds"], v["threads"]
        v["rss_limit_mb"] = max(RSS_GROWTH_FRACTION * rss0, RSS_GROWTH_MB)
        why = []
        if rss1 - rss0 >= v["rss_limit_mb"]:
            why.append(f"RSS grew {rss1 - rss0:.1f} MB")
        if fd1 - fd0 > FD_GROWTH:
            why.append(f"descriptors grew by {fd1 - fd0:g}")
        if th1 - th0 > THREAD_GROWTH:
            why.append(f"threads grew by {th1 - th0:g}")
        v.update(flat=not why, why="; ".join(why))
        verdicts[name] = v
    return verdicts


def _order(name: str) -> tuple[int, str]:
    return ({"l": 0, "s": 1, "w": 2}.get(name[0], 3), name)


def _median_in(samples: list[dict[str, Any]], bounds: tuple[float, float], key: str) -> float | None:
    values = [s[key] for s in samples if bounds[0] <= s["t"] <= bounds[1]]
    return statistics.median(values) if values else None


def render(verdicts: dict[str, dict[str, Any]]) -> str:
    lines = ["| process | pid | RSS MB first third | RSS MB last third | last/first | growth limit MB | "
             "fds first → last | threads first → last | verdict |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, v in verdicts.items():
        if "rss_limit_mb" not in v:
            lines.append(f"| {name} | {v['pid']} | | | | | | | NOT FLAT: {v['why']} |")
            continue
        (rss0, rss1), (fd0, fd1), (th0, th1) = v["rss_mb"], v["fds"], v["threads"]
        lines.append(f"| {name} | {v['pid']} | {rss0:.1f} | {rss1:.1f} | {rss1 / rss0:.3f} | {v['rss_limit_mb']:.0f} | "
                     f"{fd0:g} → {fd1:g} | {th0:g} → {th1:g} | {'flat' if v['flat'] else 'NOT FLAT: ' + v['why']} |")
    return "\n".join(lines)


def plot(samples: list[dict[str, Any]], first: tuple[float, float], last: tuple[float, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({name for s in samples for name in s["procs"]}, key=_order)
    fig, axes = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for ax, key, title in ((axes[0], "rss_mb", "resident memory (MB)"), (axes[1], "fds", "open file descriptors")):
        for name in names:
            points = [(s["t"], s["procs"][name][key]) for s in samples if name in s["procs"]]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=name)
        for lo, hi in (first, last):
            ax.axvspan(lo, hi, color="0.9", zorder=0)
        ax.set_ylabel(title)
    axes[0].legend(ncol=4, fontsize="small")
    axes[0].set_title(f"soak: {NODES} nodes x {WORKERS_PER_NODE} workers (shaded: the windows compared)")
    axes[1].set_xlabel("seconds since the load began")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ------------------------------------------------------------------- run

def _stop(launcher: subprocess.Popen[bytes], seen: set[Proc]) -> list[Proc]:
    """Stop the job: SIGTERM the launcher's group, then SIGKILL every process of the job still alive;
    returns what was still alive when the launcher had gone."""
    if launcher.poll() is None:
        _signal_group(launcher.pid, signal.SIGTERM)
        try:
            launcher.wait(timeout=15)
        except subprocess.TimeoutExpired:
            _signal_group(launcher.pid, signal.SIGKILL)
            launcher.wait()
    time.sleep(1.0)  # children die with the launcher (PR_SET_PDEATHSIG); give them a moment
    left = [p for p in seen if p.pid != launcher.pid and alive(p)]
    for proc in left:
        _signal_group(proc.pid, signal.SIGKILL)  # every child of the launcher leads its own group
        if alive(proc):
            os.kill(proc.pid, signal.SIGKILL)
    return left


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _alerts(log_path: Path) -> list[str]:
    lines = log_path.read_text(errors="replace").splitlines() if log_path.exists() else []
    return [line for line in lines if any(word in line for word in ALERT_WORDS)]


def soak(minutes: float, interval: float, margin: float, work: Path) -> dict[str, Any]:
    duration = minutes * 60
    log_path = work / "launcher.log"
    command = [sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", str(NODES),
               "--workers-per-node", str(WORKERS_PER_NODE), "--",
               sys.executable, str(HERE / "soak_worker.py"), str(work), str(duration),
               "--checkpoint-s", str(min(CHECKPOINT_S, duration / 4))]
    launched = time.time()
    deadline = time.monotonic() + duration + margin
    seen: set[Proc] = set()
    samples: list[dict[str, Any]] = []
    servers = None
    shm_before = shm_entries()
    with log_path.open("wb") as log_file:
        launcher = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    try:
        servers = ServerStats(launcher.pid)
        next_at = time.monotonic()
        while launcher.poll() is None and time.monotonic() < deadline:
            tree = process_tree(launcher.pid)
            seen.update(tree)
            procs = {}
            for proc in tree:
                figures = measure(proc.pid)
                if figures is not None:
                    procs[label(proc, launcher.pid)] = {"pid": proc.pid, **figures}
            sample = {"wall": time.time(), "procs": procs, "shm": shm_entries(), "servers": servers.sample()}
            samples.append(sample)
            _progress(sample, launched)
            next_at += interval
            time.sleep(max(0.0, next_at - time.monotonic()))
        timed_out = launcher.poll() is None
    finally:
        if servers is not None:
            servers.close()
        left = _stop(launcher, seen)
    started = work / "started"
    load_began = float(started.read_text()) if started.exists() else launched
    for s in samples:
        s["t"] = round(s.pop("wall") - load_began, 3)
    ranks = [json.loads(p.read_text()) for p in sorted(work.glob("rank-*.json"))]
    return {"samples": samples, "exit_status": launcher.returncode, "timed_out": timed_out,
            "left_behind": [p.pid for p in left], "ranks": ranks, "alerts": _alerts(log_path),
            "shm_before": shm_before, "shm_after": shm_entries(),
            "log_tail": log_path.read_text(errors="replace").splitlines()[-40:]}


def _progress(sample: dict[str, Any], launched: float) -> None:
    procs = sample["procs"]
    rss = " ".join(f"{name} {p['rss_mb']:.0f}" for name, p in sorted(procs.items(), key=lambda kv: _order(kv[0])))
    messages = sum(s["messages"] for s in sample["servers"].values())
    print(f"{sample['wall'] - launched:7.1f}s  RSS MB: {rss}  fds {sum(p['fds'] for p in procs.values())}  "
          f"threads {sum(p['threads'] for p in procs.values())}  shm {sample['shm']}  server messages {messages}",
          flush=True)


def problems_of(run: dict[str, Any], verdicts: dict[str, dict[str, Any]], shm: list[float | None],
                margin: float) -> list[str]:
    """Everything that makes the run not flat, or not a clean run at all."""
    problems = [f"{name}: {v['why']}" for name, v in verdicts.items() if not v["flat"]]
    if not verdicts:
        problems.append("no process was sampled")
    if shm[0] is None or shm[1] is None or shm[1] > shm[0]:
        problems.append(f"/dev/shm/{SHM_PREFIX}* entries {shm[0]} -> {shm[1]} (median of each window)")
    if run["shm_after"] > run["shm_before"]:
        problems.append(f"/dev/shm/{SHM_PREFIX}* entries {run['shm_before']} before the job, "
                        f"{run['shm_after']} after it")
    if run["timed_out"]:
        problems.append(f"the job was still running {margin:.0f} s after its load should have ended; killed")
    elif run["exit_status"] != 0:
        problems.append(f"the job ended with status {run['exit_status']}")
    if len(run["ranks"]) != NODES * WORKERS_PER_NODE:
        problems.append(f"{len(run['ranks'])} of {NODES * WORKERS_PER_NODE} workers finished their loop")
    if run["left_behind"]:
        problems.append(f"processes left behind after the launcher ended: {run['left_behind']}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the workers keep the load on")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--margin", type=float, default=None,
                        help="seconds past --minutes before the job is killed (default max(60, 25%% of the run))")
    parser.add_argument("--keep-work", action="store_true", help="keep the work directory (log, checkpoints)")
    args = parser.parse_args()
    duration = args.minutes * 60
    margin = args.margin if args.margin is not None else max(60.0, 0.25 * duration)
    warmup = min(WARMUP_S, WARMUP_FRACTION * duration)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # run the finally blocks
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    try:
        run = soak(args.minutes, args.interval, margin, work)
    finally:
        if args.keep_work:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    samples = run["samples"]
    first, last = windows(duration, warmup)
    verdicts = judge(samples, first, last)
    shm = [_median_in(samples, first, "shm"), _median_in(samples, last, "shm")]
    problems = problems_of(run, verdicts, shm, margin)
    final: dict[str, dict[str, int]] = next((s["servers"] for s in reversed(samples) if s["servers"]), {})
    messages = sum(s["messages"] for s in final.values())
    rounds = sum(r["rounds"] for r in run["ranks"])
    loaded = max((r["seconds"] for r in run["ranks"]), default=0.0)
    table = (f"{NODES} nodes x {WORKERS_PER_NODE} workers, {args.minutes:g} min under load, a sample every "
             f"{args.interval:g} s ({len(samples)} samples); windows compared: {first[0]:.0f}-{first[1]:.0f} s and "
             f"{last[0]:.0f}-{last[1]:.0f} s after the load began\n\n{render(verdicts)}\n\n"
             f"/dev/shm/{SHM_PREFIX}* entries: {' → '.join('-' if n is None else f'{n:g}' for n in shm)} "
             "(median of each window)\n"
             f"rounds: {rounds} over {len(run['ranks'])} workers ({rounds / loaded if loaded else 0:.0f}/s), "
             f"checkpoints: {max((r['checkpoints'] for r in run['ranks']), default=0)}, server messages: {messages} "
             f"({messages / loaded if loaded else 0:.0f}/s)\n"
             f"verdict: {'FLAT' if not problems else 'NOT FLAT'}" + "".join(f"\n- {p}" for p in problems))
    print()
    print(table)
    if run["alerts"]:
        print(f"\n{len(run['alerts'])} alarming line(s) in the job's output, the first ones:")
        print("\n".join(run["alerts"][:20]))
    if run["exit_status"] != 0:
        print("\nthe job's last output lines:\n" + "\n".join(run["log_tail"]))
    write_results("soak", {
        "settings": {"nodes": NODES, "workers_per_node": WORKERS_PER_NODE, "minutes": args.minutes,
                     "interval_s": args.interval, "margin_s": margin, "warmup_s": warmup,
                     "windows_s": [first, last], "rss_growth_limit": [RSS_GROWTH_FRACTION, RSS_GROWTH_MB],
                     "fd_growth_limit": FD_GROWTH, "thread_growth_limit": THREAD_GROWTH},
        "flat": not problems, "problems": problems, "verdicts": verdicts, "shm": shm,
        "shm_before_after": [run["shm_before"], run["shm_after"]], "exit_status": run["exit_status"],
        "left_behind": run["left_behind"], "ranks": run["ranks"], "rounds": rounds, "server_messages": messages,
        "final_server_stats": final, "alerts": run["alerts"][:50], "samples": samples,
    }, table)
    plot(samples, first, last, RESULTS / "soak.png")
    print(f"wrote {RESULTS / 'soak.png'}")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
