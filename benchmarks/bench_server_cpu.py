"""Where the servers' CPU goes on KGE auto with 2 nodes: per op, per timer, per kind of placement message.

    python benchmarks/bench_server_cpu.py [--seconds 15] [--runs 2] [--sync-ms 50,200] [--act-ms 200,800]
        [--variant="--dim 25" ...] [--against REV]

Runs the KGE app on the synthetic Zipf graph (``bench_kge.py``'s job) on a local
cluster of 2 nodes x 1 worker and reads each server's CPU account
(``ParameterServer.cpu_use``: thread CPU time, charged per activity) before and
after training. Prints, summed over both servers and per second of training:
how often each activity ran, its CPU per run and the cores it kept busy (for
each kind of placement message also the keys one carried and the CPU per key);
the part of the loop thread no activity was charged (waiting for and reading messages)
and the process's other threads (ZeroMQ's I/O thread). Thread CPU, not wall
time: on 2 cores shared by four busy processes a handler is often preempted, and
wall time would charge it for the processes that ran meanwhile. Writes
``results/server_cpu.{json,md}``.

It also prices the rows the servers moved (each kind's bytes, from the servers'
stats) at the least CPU a MB of each kind costs on this machine (``rows_floor.py``,
measured before the runs): what no Python around the kernels, codec and sockets
could save; beside it, what copying them cost the live servers (their stores held
meanwhile, ``rows_cpu_us``). The rest of the servers' CPU is shared out over the
events they handled (messages and timer passes).

With ``--sync-ms`` (replica sync periods) or ``--act-ms`` (how often the servers
act on intents), each run is made once per period (the app's options of those
names; with both, per pair; the settings take turns run by run, each round
starting one setting further on) and a first table compares them: servers'
cores, triples/s, and the time to the training loss ``bench_kge.py`` times (what
a staler replica would cost shows there).

With ``--variant ARGS`` (repeated) each run is made once per variant, the app given ``ARGS``
besides: e.g. ``--variant="--dim 100" --variant="--dim 25"`` (rows a quarter as large move a
quarter of the bytes while the app takes more steps a second: the servers' CPU per byte and per
step told apart), or the app's ``--lookahead``.

With ``--against REV`` the runs are made once with this tree and once with commit ``REV``
(checked out into a temporary git worktree, each job with ``PYTHONPATH`` at its own
``src``), taking turns, and the first table compares the two the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_kge import LOSS_TARGET, time_to  # noqa: E402
from common import ROOT, checked_out, run_example_of, write_results  # noqa: E402
from rows_floor import STEPS_OF_KIND, cpu_per_mb, per_kind  # noqa: E402

KGE = HERE.parent / "examples" / "kge" / "train.py"

Split = dict[str, list[float]]  # activity -> [times run, CPU seconds]


def _delta(after: Split, before: Split) -> Split:
    return {name: [count - before.get(name, [0, 0.0])[0], seconds - before.get(name, [0, 0.0])[1]]
            for name, (count, seconds) in after.items()}


def _add(into: Split, part: Split) -> None:
    for name, (count, seconds) in part.items():
        total = into.setdefault(name, [0, 0.0])
        total[0] += count
        total[1] += seconds


def _sentence_start(label: str) -> str:
    """``label`` opening a sentence: a word capitalised, a commit's name as it is."""
    return label if all(c in "0123456789abcdef" for c in label) else label[0].upper() + label[1:]


def servers_cpu(result: dict[str, Any]) -> dict[str, Any]:
    """The servers' CPU during training, summed over servers, from the app's stats before and after."""
    activities: Split = {}
    placement: Split = {}
    passes: Split = {}
    loop_s = process_s = 0.0
    sent: dict[str, dict[str, float]] = {"keys": {}, "bytes": {}}  # per kind of placement message
    rows_cpu_s = 0.0
    for after, before in zip(result["servers"], result["servers_before"], strict=True):
        rows_cpu_s += (after["stats"].get("rows_cpu_us", 0) - before["stats"].get("rows_cpu_us", 0)) / 1e6
        for name, count in after["stats"].items():
            for what, by_kind in sent.items():
                if name.startswith("placement_") and name.endswith(f"_{what}_sent"):
                    kind = name.removeprefix("placement_").removesuffix(f"_{what}_sent")
                    by_kind[kind] = by_kind.get(kind, 0) + count - before["stats"].get(name, 0)
        _add(activities, _delta(after["cpu"]["activities"], before["cpu"]["activities"]))
        _add(placement, _delta(after["cpu"]["placement"], before["cpu"]["placement"]))
        _add(passes, _delta(after["cpu"]["adaptive_passes"], before["cpu"]["adaptive_passes"]))
        loop_s += after["cpu"]["loop_s"] - before["cpu"]["loop_s"]
        process_s += after["cpu_s"] - before["cpu_s"]
    return {"seconds": result["seconds"], "triples_per_s": result["triples_per_s"], "activities": activities,
            "placement": placement, "adaptive_passes": passes, "loop_s": loop_s, "process_s": process_s,
            "keys_sent": sent["keys"], "bytes_sent": sent["bytes"], "rows_cpu_s": rows_cpu_s,
            "time_to_loss_s": time_to(result["losses"], LOSS_TARGET)}


def compare_periods(by_period: dict[str, list[dict[str, Any]]]) -> str:
    """One line per setting (a tree, a variant, the app's periods): medians over its runs."""
    lines = [f"The settings side by side (medians of {len(next(iter(by_period.values())))} run(s) each, "
             "taking turns):", "",
             f"| setting | servers' cores | triples/s | servers' CPU per 1,000 triples (ms) | events/s | rows MB/s "
             f"| time to loss {LOSS_TARGET} s |", "|---|---:|---:|---:|---:|---:|---:|"]
    for period, runs in by_period.items():
        cores = statistics.median(r["process_s"] / r["seconds"] for r in runs)
        rate = statistics.median(r["triples_per_s"] for r in runs)
        per_1k = statistics.median(r["process_s"] / (r["seconds"] * r["triples_per_s"]) * 1e6 for r in runs)
        events = statistics.median(_events(r) / r["seconds"] for r in runs)
        moved = statistics.median(sum(r["bytes_sent"].values()) / r["seconds"] / 1e6 for r in runs)
        reached = [r["time_to_loss_s"] for r in runs if r.get("time_to_loss_s") is not None]
        when = (f"{statistics.median(reached):.1f}" if len(reached) == len(runs)
                else f"{len(reached)} of {len(runs)} reached")
        lines.append(f"| {period} | {cores:.3f} | {rate:,.0f} | {per_1k:.2f} | {events:,.0f} | {moved:.1f} | {when} |")
    return "\n".join(lines)


def _events(run: dict[str, Any]) -> float:
    """The messages a run's servers handled and their adaptive timer's passes."""
    return sum(count for name, (count, _) in run["activities"].items()
               if not name.startswith("timer ") or name == "timer adaptive")


def floor_of(rate: float, price: float) -> float:
    """Cores for ``rate`` MB/s at ``price`` ms of CPU per MB."""
    return rate * price / 1e3


def rows_at_the_least(runs: list[dict[str, Any]], prices: dict[str, float]) -> str:
    """The rows each kind moved, priced at the least CPU a MB of it costs; the rest of the servers' CPU
    per event they handled."""
    seconds = sum(r["seconds"] for r in runs)
    moved: dict[str, float] = {}
    for r in runs:
        for kind, count in r["bytes_sent"].items():
            moved[kind] = moved.get(kind, 0) + count
    by_kind = per_kind(prices)
    lines = ["The rows the servers moved, priced at the least CPU a MB of each kind costs here (``rows_floor.py``: "
             "its steps timed alone in a quiet process, on rows far beyond the caches; "
             + "; ".join(f"{step} {ms:.2f}" for step, ms in prices.items()) + " ms per MB):", "",
             "| placement message | MB/s sent | ms of CPU per MB, at the least | cores, at the least |",
             "|---|---:|---:|---:|"]
    floor = 0.0
    for kind, count in sorted(moved.items(), key=lambda kv: -kv[1]):
        rate = count / seconds / 1e6
        price = by_kind.get(kind, prices["hop"])  # keys and numbers alone: the hop
        floor += floor_of(rate, price)
        lines.append(f"| {kind} | {rate:.2f} | {price:.2f} | {floor_of(rate, price):.4f} |")
    live = sum(r["rows_cpu_s"] for r in runs) / seconds
    lines += ["", f"Live, the servers' stores held while rows were copied in or out: {live:.3f} cores, "
              f"{live * 1e3 / max(sum(moved.values()) / seconds / 1e6, 1e-9):.2f} ms per MB sent (both sides; "
              "the hop's share is in ZeroMQ's I/O threads and the loop's sends and receives)."]
    process_s = sum(r["process_s"] for r in runs) / seconds
    events = sum(_events(r) for r in runs) / seconds
    rest = process_s - floor
    lines += ["", f"Rows: {sum(moved.values()) / seconds / 1e6:.1f} MB/s, at least {floor:.3f} cores of the servers' "
              f"{process_s:.3f}. The rest, {rest:.3f} cores, over {events:,.0f} events a second (messages handled "
              f"and timer passes): {rest / events * 1e6:,.0f} µs of CPU an event."]
    return "\n".join(lines)


def report(runs: list[dict[str, Any]]) -> str:
    seconds = sum(r["seconds"] for r in runs)
    activities: Split = {}
    placement: Split = {}
    passes: Split = {}
    for r in runs:
        _add(activities, r["activities"])
        _add(placement, r["placement"])
        _add(passes, r["adaptive_passes"])
    loop_s = sum(r["loop_s"] for r in runs)
    process_s = sum(r["process_s"] for r in runs)
    charged = sum(s for _, s in activities.values())

    keys: dict[str, float] = {}
    for r in runs:
        for kind, count in r["keys_sent"].items():
            keys[kind] = keys.get(kind, 0) + count

    def rows(split: Split, per_key: bool = False) -> list[str]:
        out = []
        for name, (count, cpu) in sorted(split.items(), key=lambda kv: -kv[1][1]):
            if count > 0:
                row = f"| {name} | {count / seconds:,.1f} | {cpu / count * 1e6:,.0f} | {cpu / seconds:.4f} |"
                if per_key:  # what every server sent, every other one received
                    row += f" {keys.get(name, 0) / count:,.0f} | {cpu / max(keys.get(name, 0), 1) * 1e6:.2f} |"
                out.append(row)
        return out

    rates = ", ".join(f"{r['triples_per_s']:,.0f}" for r in runs)
    lines = [f"KGE on the Zipf graph, auto, 2 nodes x 1 worker, {len(runs)} run(s) of "
             f"{seconds / len(runs):.0f} s of training ({rates} triples/s); both servers together, thread CPU "
             "per second of training.", "",
             f"Servers' processes: {process_s / seconds:.3f} cores; their request loops {loop_s / seconds:.3f} "
             f"(charged to an activity {charged / seconds:.3f}, waiting for and reading messages "
             f"{(loop_s - charged) / seconds:.3f}); other threads (ZeroMQ's I/O) "
             f"{(process_s - loop_s) / seconds:.3f}.", "",
             "| activity (a message's op: decoded, served, answered; or a timer pass) | per s | µs CPU each | cores |",
             "|---|---:|---:|---:|", *rows(activities), "",
             "The PLACEMENT messages' share by kind (each message carries one or more):", "",
             "| placement message | per s | µs CPU each | cores | keys each | µs CPU per key |",
             "|---|---:|---:|---:|---:|---:|", *rows(placement, per_key=True), "",
             "The adaptive timer's passes, by whether they sent placement messages (a sync of the replicas, "
             "intents acted on) or found nothing due:", "",
             "| timer adaptive: pass | per s | µs CPU each | cores |", "|---|---:|---:|---:|", *rows(passes)]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--sync-ms", default="",
                   help="replica sync periods to compare, comma-separated (ms; default: the app's own)")
    p.add_argument("--against", default="", help="a commit to compare this tree with, run by run")
    p.add_argument("--variant", action="append", default=[],
                   help="the app's arguments of a variant to compare (repeat the option for each)")
    p.add_argument("--act-ms", default="",
                   help="how often servers act on intents, to compare, comma-separated (ms; default: the app's own)")
    args = p.parse_args()
    prices = cpu_per_mb()  # on a quiet machine, before the job starts
    print("ms of CPU per MB, at the least: " + ", ".join(f"{step} {ms:.2f}" for step, ms in prices.items()), flush=True)
    with contextlib.ExitStack() as stack:
        trees = {"": ROOT / "src"}
        if args.against:
            rev, old_src = stack.enter_context(checked_out(args.against))
            trees = {"this tree": ROOT / "src", rev: old_src}
        variants: list[str] = args.variant or [""]
        settings = [(tree, variant, sync, act) for tree in trees for variant in variants
                    for sync in _periods(args.sync_ms) for act in _periods(args.act_ms)]
        by_period: dict[str, list[dict[str, Any]]] = {}
        for r in range(args.runs):
            # Each round starts one setting further on: in a fixed order the setting run first in
            # each round ran first in all of them, and the machine's speed drifts within a round.
            for tree, variant, sync, act in settings[r % len(settings):] + settings[:r % len(settings)]:
                label = ", ".join([*([tree] if tree else []), *([variant] if variant else []),
                                   *(f"{name} {ms} ms" for name, ms in (("sync", sync), ("act", act)) if ms)]
                                  ) or "the app's"
                extra = [*variant.split(), *(["--sync-ms", sync] if sync else []),
                         *(["--act-ms", act] if act else [])]
                result = run_example_of(trees[tree], KGE, ["--data", "zipf", "--mode", "auto", "--seconds",
                                                           str(args.seconds), *extra], nodes=2)
                runs = by_period.setdefault(label, [])
                runs.append(servers_cpu(result))
                print(f"run, {label}: {result['triples_per_s']:,.0f} triples/s, servers "
                      f"{runs[-1]['process_s'] / result['seconds']:.3f} cores", flush=True)
    tables = [compare_periods(by_period)] if len(settings) > 1 else []
    for label, runs in by_period.items():
        tables.append((f"{_sentence_start(label)}: " if len(settings) > 1 else "") + report(runs))
        tables.append(rows_at_the_least(runs, prices))
    table = "\n\n".join(tables)
    print("\n" + table)
    write_results("server_cpu", {"seconds": args.seconds, "runs": by_period, "ms_per_mb": prices,
                                 "steps_of_kind": STEPS_OF_KIND}, table)


def _periods(option: str) -> list[str | None]:
    """The periods an option lists, in ms; [None] (the app's own) when it lists none."""
    return [f"{float(ms):g}" for ms in option.split(",") if ms] or [None]


if __name__ == "__main__":
    main()
