"""Dynamic read quorums while propagation delays change: MF on 3 replicas, and the model out of sample.

    python benchmarks/bench_dynamic_quorum.py

MF on MovieLens 100k, 3 nodes x 1 worker, both tables on 3 replicas (W = 1,
gossip every 50 ms). The training run with ``read_quorum=shoal.Dynamic(P, K)``
goes through four phases of four epochs: steady, gossip every 200 ms, gossip
every 50 ms with one replica paused by SIGSTOP for 150 ms every 400 ms, and
that replica killed. The same run with
R = 3 throughout is the baseline. Every read is checked by counting: the pushes
to its shard acknowledged before it was issued that its merged version vector
does not cover. Reported per phase: the quorum sizes chosen, the measured
P(missing <= K) of the dynamic reads against the promised P, read latency, and
test RMSE per epoch of both runs.

Out of sample: the model is fitted from the measurements of one steady run
(seed 0, R = 1) and its P(missing <= k) for R = 1 and 2 is set beside the
fractions measured in two other steady runs (seed 1, R = 1 and R = 2).

Writes ``results/dynamic_quorum.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
TRAIN = HERE.parent / "examples" / "mf" / "train.py"
sys.path.insert(0, str(HERE))

from bench_replication import missing_counts  # noqa: E402
from common import RESULTS, write_results  # noqa: E402

P, K, LATENCY_MS = 0.8, 2, 1000.0  # the latency bound left wide: the choice is by consistency alone
KS = (0, 1, 2, 3, 4)
GOSSIP_MS, SLOW_GOSSIP_MS = 50.0, 200.0
PAUSE_S, EVERY_S = 0.15, 0.4
EPOCHS, PAUSED_FROM, KILLED_FROM = 16, 9, 13
PHASES = {1: f"steady, gossip {GOSSIP_MS:.0f} ms", 5: f"gossip {SLOW_GOSSIP_MS:.0f} ms",
          PAUSED_FROM: f"gossip {GOSSIP_MS:.0f} ms, a replica paused {PAUSE_S * 1000:.0f} ms in {EVERY_S * 1000:.0f}",
          KILLED_FROM: "a replica killed"}
TABLES = ("mf.users", "mf.items")


def train(out: Path, epochs: int, quorum: str, seed: int, disturb: bool) -> dict[str, Any]:
    """One MF job; with ``disturb``, the gossip period and a replica change by epoch (see above)."""
    out.mkdir(parents=True, exist_ok=True)
    gossip = ["--gossip-at", f"5:{SLOW_GOSSIP_MS}", "--gossip-at", f"{PAUSED_FROM}:{GOSSIP_MS}"] if disturb else []
    command = [sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", "3", "--workers-per-node", "1",
               "--on-server-failure", "continue", "--replica-timeout", "0.5", "--",
               sys.executable, str(TRAIN), "--epochs", str(epochs), "--replicas", "3", "--gossip-ms", str(GOSSIP_MS),
               "--read-quorum", quorum, "--dynamic", f"{P},{K},{LATENCY_MS}", "--seed", str(seed), *gossip,
               "--record", str(out), "--info", str(out / "info.json"), "--out", str(out / "out.json"), "--quiet"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    events: list[dict[str, Any]] = []
    watcher = threading.Thread(target=_disturb, args=(out, proc, events), daemon=True) if disturb else None
    if watcher is not None:
        watcher.start()
    _, err = proc.communicate(timeout=1800)
    if watcher is not None:
        watcher.join(5)
    if proc.returncode != 0:
        raise SystemExit(f"MF run failed ({proc.returncode}): {err[-3000:]}")
    ranks = [json.loads((out / f"record{r}.json").read_text()) for r in range(3) if (out / f"record{r}.json").exists()]
    epochs_at = [json.loads(line) for line in (out / "epochs.jsonl").read_text().splitlines()]
    return {"result": json.loads((out / "out.json").read_text()), "ranks": ranks, "epochs": epochs_at,
            "events": events}


def _disturb(out: Path, proc: subprocess.Popen[str], events: list[dict[str, Any]]) -> None:
    """Pause server 2 in pulses from epoch PAUSED_FROM on, kill it when epoch KILLED_FROM starts."""
    pids = None
    while proc.poll() is None:
        epoch = _current_epoch(out)
        if pids is None and (out / "info.json").exists():
            try:
                pids = json.loads((out / "info.json").read_text())["server_pids"]
            except (json.JSONDecodeError, KeyError):
                pass
        if pids is None or epoch < PAUSED_FROM:
            time.sleep(0.05)
            continue
        if epoch >= KILLED_FROM:
            os.kill(pids[2], signal.SIGKILL)
            events.append({"t": time.time(), "event": "killed server 2"})
            return
        os.kill(pids[2], signal.SIGSTOP)
        events.append({"t": time.time(), "event": "paused"})
        time.sleep(PAUSE_S)
        os.kill(pids[2], signal.SIGCONT)
        time.sleep(EVERY_S - PAUSE_S)


def _current_epoch(out: Path) -> int:
    path = out / "epochs.jsonl"
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    try:
        return int(json.loads(lines[-1])["epoch"]) if lines else 0
    except (json.JSONDecodeError, KeyError):
        return 0


def reads_of(run: dict[str, Any], table: str) -> tuple[list[tuple], np.ndarray]:
    """Every read of ``table`` in the run, and how many acknowledged pushes each missed."""
    acks = [tuple(a) for rank in run["ranks"] for a in rank[table]["acks"]]
    reads = [(r[0], r[1], r[2], r[3], {int(o): s for o, s in r[4].items()})
             for rank in run["ranks"] for r in rank[table]["reads"]]
    return reads, missing_counts(reads, acks)


def phase_of(t: float, epochs: list[dict[str, Any]]) -> int:
    """The phase (first epoch of it) a moment falls in."""
    started = [e["epoch"] for e in epochs if e["t"] <= t]
    epoch = started[-1] if started else 1
    return max(p for p in PHASES if p <= epoch)


def fitted(run: dict[str, Any], table: str, shard: int) -> Any:
    from shoal.replication.delays import DelaySamples
    from shoal.replication.pbs import ShardModel

    data = run["ranks"][0][table]["models"][str(shard)]
    model = ShardModel(replicas=[int(n) for n in data["replicas"]])
    model.rates = {int(o): float(r) for o, r in data["rates"].items()}
    for pair, samples in data["delays"].items():
        o, j = (int(x) for x in pair.split(">"))
        model.delays[(o, j)] = DelaySamples()
        model.delays[(o, j)].extend(samples)
    for j, samples in data["read_latency"].items():
        model.read_latency[int(j)] = DelaySamples()
        model.read_latency[int(j)].extend(samples)
    return model


def summarise(dynamic: dict[str, Any], fixed: dict[str, Any], fit: dict[str, Any],
              measured: dict[int, dict[str, Any]], epochs: int) -> dict[str, Any]:
    from shoal.replication.pbs import predict

    phases: dict[str, Any] = {}
    for name, run in (("dynamic", dynamic), ("R=3", fixed)):
        rows: dict[int, dict[str, list]] = {p: {"missing": [], "size": [], "latency": []} for p in PHASES}
        for table in TABLES:
            reads, missing = reads_of(run, table)
            for read, miss in zip(reads, missing, strict=True):
                row = rows[phase_of(read[2], run["epochs"])]
                row["missing"].append(int(miss))
                row["size"].append(read[1])
                row["latency"].append(read[3] * 1000)
        phases[name] = {
            str(p): {"reads": len(r["missing"]),
                     "quorum_sizes": {str(s): int(c) for s, c in zip(*np.unique(r["size"], return_counts=True),
                                                                      strict=True)},
                     "p_missing_at_most_k": float(np.mean(np.array(r["missing"]) <= K)) if r["missing"] else None,
                     "mean_missing": float(np.mean(r["missing"])) if r["missing"] else None,
                     "latency_p50_ms": float(np.percentile(r["latency"], 50)) if r["latency"] else None,
                     "latency_p99_ms": float(np.percentile(r["latency"], 99)) if r["latency"] else None}
            for p, r in rows.items()}
    choices = [{"t": c[0], "table": table, "shard": c[1], "r": c[2], "predicted": c[3]}
               for table in TABLES for c in dynamic["ranks"][0][table]["choices"]]
    timeline = []  # every dynamic read: when it was issued, its quorum, what it missed
    for table in TABLES:
        reads, missing = reads_of(dynamic, table)
        timeline += [[read[2], read[1], int(miss)] for read, miss in zip(reads, missing, strict=True)]
    timeline.sort()
    # Out of sample: the model fitted from the steady R=1 run of seed 0 against the steady runs of seed 1.
    sample: dict[str, Any] = {}
    for r, run in measured.items():
        predicted_all, measured_all = [], []
        for table in TABLES:
            reads, missing = reads_of(run, table)
            for shard in range(3):
                model = fitted(fit, table, shard)
                mine = np.array([m for read, m in zip(reads, missing, strict=True) if read[0] == shard])
                predicted_all.append([predict(model, model.replicas, r, k) for k in KS])
                measured_all.append([float(np.mean(mine <= k)) if mine.size else np.nan for k in KS])
        sample[str(r)] = {"predicted": np.mean(predicted_all, axis=0).tolist(),
                          "measured": np.nanmean(measured_all, axis=0).tolist()}
    return {"p": P, "k": K, "phases": phases, "choices": choices, "timeline": timeline,
            "rmse": {"dynamic": dynamic["result"]["rmse"], "R=3": fixed["result"]["rmse"]},
            "seconds": {"dynamic": dynamic["result"]["train_seconds"], "R=3": fixed["result"]["train_seconds"]},
            "epochs_at": {"dynamic": dynamic["epochs"], "R=3": fixed["epochs"]},
            "events": {"dynamic": dynamic["events"], "R=3": fixed["events"]},
            "out_of_sample": sample, "epochs": epochs}


def report(summary: dict[str, Any]) -> str:
    lines = [f"MF on MovieLens 100k, 3 nodes x 1 worker, both tables on 3 replicas, W=1, gossip every "
             f"{GOSSIP_MS:.0f} ms unless said; `Dynamic(p={P}, k={K})` against R=3. Missing = pushes to a "
             "read's shard acknowledged before it was issued that its merged version does not cover, counted per "
             "read.", "",
             f"| phase (from epoch) | quorum | reads | R chosen (reads) | measured P(missing <= {K}) | mean missing "
             "| latency p50 / p99 ms |", "|---|---|---:|---|---:|---:|---|"]
    for p, label in PHASES.items():
        for name in ("dynamic", "R=3"):
            row = summary["phases"][name][str(p)]
            if not row["reads"]:
                continue
            lines.append(f"| {p}: {label} | {name} | {row['reads']} | {row['quorum_sizes']} | "
                         f"{row['p_missing_at_most_k']:.3f} | {row['mean_missing']:.2f} | "
                         f"{row['latency_p50_ms']:.1f} / {row['latency_p99_ms']:.1f} |")
    rmse = summary["rmse"]
    lines += ["", "| epoch | " + " | ".join(str(e + 1) for e in range(len(rmse["dynamic"]))) + " |",
              "|---|" + "---:|" * len(rmse["dynamic"]),
              "| RMSE dynamic | " + " | ".join(f"{v:.4f}" for v in rmse["dynamic"]) + " |",
              "| RMSE R=3 | " + " | ".join(f"{v:.4f}" for v in rmse["R=3"]) + " |", "",
              f"Training took {summary['seconds']['dynamic']:.1f} s with the dynamic quorum and "
              f"{summary['seconds']['R=3']:.1f} s with R=3.", "",
              "Out of sample (model fitted on the steady R=1 run of seed 0; reads of the steady runs of seed 1):", "",
              "| R | " + " | ".join(f"P(<= {k}) predicted / measured" for k in KS) + " |",
              "|---|" + "---|" * len(KS)]
    worst = 0.0
    for r, row in summary["out_of_sample"].items():
        cells = []
        for pr, me in zip(row["predicted"], row["measured"], strict=True):
            cells.append(f"{pr:.3f} / {me:.3f}")
            worst = max(worst, abs(pr - me))
        lines.append(f"| {r} | " + " | ".join(cells) + " |")
    lines += ["", f"Largest |predicted - measured| out of sample: {worst:.3f}."]
    return "\n".join(lines)


def plot(summary: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = summary["epochs_at"]["dynamic"]
    t0 = epochs[0]["t"]
    fig, (ax, below) = plt.subplots(2, 1, figsize=(10, 6.4), sharex=True)
    for i, table in enumerate(TABLES):
        for shard in range(3):
            mine = [c for c in summary["choices"] if c["table"] == table and c["shard"] == shard]
            ax.step([c["t"] - t0 for c in mine], [c["r"] + (i * 3 + shard - 2.5) * 0.03 for c in mine], where="post",
                    alpha=0.7, label=f"{table} shard {shard}")
    for p, label in PHASES.items():
        start = next((e["t"] for e in epochs if e["epoch"] == p), None)
        if start is not None:
            ax.axvline(start - t0, color="grey", ls=":", lw=0.8)
            ax.text(start - t0, 3.15, label, fontsize=7, rotation=0)
    ax.set_yticks([1, 2, 3])
    ax.set_ylim(0.7, 3.4)
    ax.set_ylabel("read quorum chosen")
    ax.legend(fontsize=6, ncol=3, loc="lower right")
    timeline = np.array(summary["timeline"], dtype=np.float64)
    window = 200
    within = np.convolve(timeline[:, 2] <= K, np.ones(window) / window, mode="valid")
    below.plot(timeline[window - 1 :, 0] - t0, within, lw=1, label=f"measured P(missing <= {K}), last {window} reads")
    below.axhline(P, color="red", ls="--", lw=0.8, label=f"promised p = {P}")
    for p in PHASES:
        start = next((e["t"] for e in epochs if e["epoch"] == p), None)
        if start is not None:
            below.axvline(start - t0, color="grey", ls=":", lw=0.8)
    below.set_ylim(0, 1.05)
    below.set_xlabel("seconds since epoch 1 began")
    below.set_ylabel("fraction of reads")
    below.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(RESULTS / "dynamic_quorum.png", dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=EPOCHS)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        dynamic = train(root / "dynamic", args.epochs, "dynamic", 0, disturb=True)
        print("dynamic run done", flush=True)
        fixed = train(root / "r3", args.epochs, "3", 0, disturb=True)
        print("R=3 run done", flush=True)
        fit = train(root / "fit", 3, "1", 0, disturb=False)
        measured = {r: train(root / f"steady{r}", 3, str(r), 1, disturb=False) for r in (1, 2)}
        print("steady runs done", flush=True)
        summary = summarise(dynamic, fixed, fit, measured, args.epochs)
    text = report(summary)
    print("\n" + text)
    write_results("dynamic_quorum", summary, text)
    plot(summary)


if __name__ == "__main__":
    main()
