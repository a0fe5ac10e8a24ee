"""This tree against an earlier commit, side by side in one run: did a change make anything slower?

    python benchmarks/bench_versions.py [--against REV] [--rounds 3] [--seconds 15]

A restructuring is meant to keep speed; absolute figures move with the machine
(and a shared virtual machine moves a lot from day to day), so the check runs
both versions in the same run, alternating (each round starts with the version
the round before ran second). ``REV`` is checked
out into a temporary git worktree; each contender runs with ``PYTHONPATH``
pointing at its own ``src``. Measured per contender:

* start-up: ``shoal run --nodes 2 --workers-per-node 1`` of a script that
  calls ``shoal.init()``, one barrier and ``shutdown()``, launcher start to
  exit (the median of 3 per round);
* remote pulls through ``shoal run --nodes 1 --classic`` (every key to the
  server over loopback tcp, authenticated): microseconds per pull of 1 key and
  of 10,000 keys of 64 float32, one request at a time, and of 100 and 10,000 keys
  of a table in 8 slices (the server reads each slice's share); a training step's
  traffic on 2 nodes (100 keys over both nodes' slices pulled, then pushed without
  waiting, one push in flight, as the apps' steps through messages go); and the pulls of
  1, 10,000 and 100 sliced keys again with both contenders' jobs running at once,
  taking turns of ``TURN_CALLS`` pulls (a turn of one against the next turn of the other sees the machine in
  the same state: on a shared machine a round of jobs one after the other can
  land in a faster or slower minute than the next);
* KGE (synthetic Zipf graph, ComplEx) with ``--mode auto`` on 2 nodes: triples/s, and the cores
  both servers used; and triples/s again with 5% of all messages lost (``shoal run --faults``,
  seeded by the round, so both contenders lose the same draws of the dice);
* a replica sync round in one process (MF's: 1,400 replica rows of 65 float32 that all changed):
  the two nodes' placement machines' work, from the replica's tick to its taking the owner's
  answer (the codec runs between them, untimed); what a server spends on it in a job is several
  times this (its caches cold there), but the ratio shows a change to it where a job's noise
  hides it;
* a round of intents as KGE's on the Zipf graph makes them, in one process: each node's next 8
  clocks' rows (about 760 keys, 60 wanted by both nodes) announced, moved or copied, and the
  replicas synced, both nodes' machines timed the same way (target 3's work per round);
* a server's update of 10,000 distinct rows of 64 float32 of a 200,000-row table, by each update
  rule (SGD, Adagrad, Adam), in one process: the rule's compiled kernel and the table's own steps.

Ratios above 1 mean this tree is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TextIO

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from common import checked_out, write_results  # noqa: E402

PULLS = r"""
import json, sys, time
import numpy as np
import shoal

ps = shoal.init()
table = ps.table("versions", 200_000, 64)
sliced = ps.table("versions.sliced", 200_000, 64, slices=8)  # every slice on the one server
out = {}
for name, t, n, calls, every in (("1", table, 1, 3000, 20), ("10000", table, 10_000, 300, 20),
                                 ("sliced 100", sliced, 100, 1000, 2000), ("sliced 10000", sliced, 10_000, 300, 20)):
    keys = np.arange(0, 200_000, every)[:n]  # the sliced table's: spread over its 8 slices
    for _ in range(calls // 10):
        t.pull(keys)
    start = time.perf_counter()
    for _ in range(calls):
        t.pull(keys)
    out[name] = (time.perf_counter() - start) / calls * 1e6
ps.shutdown()
open(sys.argv[1], "w").write(json.dumps(out))
"""


# A training step's remote traffic on 2 nodes, as the apps' steps through messages go: 100 keys of a
# table spread over both nodes' slices pulled (the worker's own node's read where they lie), then
# their changes pushed without waiting (the step before's push waited for first: one in flight).
STEPS = r"""
import json, sys, time
import numpy as np
import shoal

ps = shoal.init()
table = ps.table("versions.steps", 200_000, 64, optimizer=shoal.optim.SGD(lr=1e-6))
rng = np.random.default_rng(0)
batches = [np.sort(rng.choice(200_000, 100, replace=False)) for _ in range(64)]
grads = np.full((100, 64), 1e-3, np.float32)
ps.barrier()
if ps.rank == 0:
    pushed = None
    for step in range(2_300):
        if step == 300:
            start = time.perf_counter()
        keys = batches[step % 64]
        table.pull(keys)
        if pushed is not None:
            pushed.wait()
        pushed = table.push_async(keys, grads)
    pushed.wait()
    open(sys.argv[1], "w").write(json.dumps({"step_us": (time.perf_counter() - start) / 2_000 * 1e6}))
ps.barrier()
ps.shutdown()
"""


# A worker that pulls a turn of calls when its driver asks (a line on one FIFO) and tells the time per
# call (a line on the other); the job's stdin is not the driver's.
TURNS = r"""
import sys, time
import numpy as np
import shoal

ps = shoal.init()
table = ps.table("versions", 200_000, 64)
sliced = ps.table("versions.sliced", 200_000, 64, slices=8)
pulls = {"1": (table, np.arange(0, 200_000, 20)[:1]), "10000": (table, np.arange(0, 200_000, 20)),
         "sliced-100": (sliced, np.arange(0, 200_000, 2_000))}
for t, keys in pulls.values():
    for _ in range(100):
        t.pull(keys)
with open(sys.argv[2], "w") as answers:
    answers.write("ready\n")
    answers.flush()
    for line in open(sys.argv[1]):
        name, calls = line.split()
        if name == "end":
            break
        t, keys = pulls[name]
        start = time.perf_counter()
        for _ in range(int(calls)):
            t.pull(keys)
        answers.write(f"{(time.perf_counter() - start) / int(calls) * 1e6}\n")
        answers.flush()
ps.shutdown()
"""
# Per pull taken in turns: the keys (as the table shows them) and the calls a turn.
TURN_CALLS = {"1": ("1", 1500), "10000": ("10,000", 100), "sliced-100": ("100 across 8 slices", 500)}
TURNS_EACH = 12


# Two nodes' placement machines in one process (each script makes ``machines``): ``deliver`` carries
# their messages through the codec (untimed) and adds the machines' time handling them to ``spent``.
_MACHINES = r"""
import json, statistics, sys, time, uuid
import numpy as np
import shoal
from shoal.api.config import TableSpec
from shoal.placement.adaptive_table import AdaptiveTable
from shoal.placement.machine import PlacementMachine
from shoal.placement.messages import from_parts, to_parts
from shoal.wire.codec import Codec
from shoal.wire.message import Message
from shoal.wire.ops import Op

codec = Codec(secret=b"s" * 32, local=True)
spent = [0.0]

def deliver(effects, now, clock):
    pending = list(effects.sends)
    while pending:
        send = pending.pop(0)
        body, arrays = to_parts([send.message], [send.table])
        body.update(channel=1, seq=1, base=1, acks=0, acked=0)  # the channel's header, as a server's link adds it
        frames = codec.encode(Message(Op.PLACEMENT, table=send.table, body=body, arrays=arrays))
        msg = codec.decode(frames)
        for part in from_parts(msg.body, msg.arrays):
            started = time.perf_counter()
            answer = machines[send.node].receive(1 - send.node, part, now, clock)
            spent[0] += time.perf_counter() - started
            pending += answer.sends
"""

# A replica sync round of MF's size in one process: 1,400 replica rows of 65 float32 that all changed, from the
# replica's tick to its taking the owner's answer.
SYNC_ROUND = _MACHINES + r"""
NUM_KEYS, DIM, REPLICAS = 3364, 65, 1400
spec = TableSpec("sync", num_keys=NUM_KEYS, dim=DIM, techniques="replication", init=shoal.Constant(0.0))
cluster = uuid.uuid4().hex[:12]
machines = [PlacementMachine(AdaptiveTable(spec, node, 2, cluster)) for node in range(2)]

keys = np.arange(REPLICAS, dtype=np.int64) * 2  # homed on node 0, replicas on node 1
machines[1].intend(keys, 0, 10**9)
deliver(machines[1].tick(0.0, 0, 0.001), 0.0, 0)
change = np.full((REPLICAS, DIM), 1e-3, np.float32)
rounds = []
now = 0.0
for clock in range(1, 601):
    machines[1].table.store.update_present(keys, change, machines[1].table.scale)
    now += 0.011
    spent[0] = 0.0
    started = time.perf_counter()
    effects = machines[1].tick(now, clock, 0.001)
    spent[0] += time.perf_counter() - started
    deliver(effects, now, clock)
    rounds.append(spent[0])
open(sys.argv[1], "w").write(json.dumps({"round_us": statistics.median(rounds[100:]) * 1e6}))
"""


# A round of intents as KGE's on the Zipf graph makes them, in one process: each node declares its next 8
# clocks' rows (about 760 keys, 60 of them wanted by both nodes), rows of 400 float32, both nodes act every
# 200 ms and their replicas sync as often; both nodes' machines from their ticks to the last answer (the
# codec runs between them, untimed). What target 3's servers do per round, without the loop, the sockets
# and the cold caches of a busy job.
PLACEMENT_ROUND = _MACHINES + r"""
NUM_KEYS, DIM, CLOCKS = 40_000, 400, 8
spec = TableSpec("kge", num_keys=NUM_KEYS, dim=DIM, techniques="auto", init=shoal.Constant(0.0), act_ms=200.0,
                 sync_ms=200.0)
cluster = uuid.uuid4().hex[:12]
machines = [PlacementMachine(AdaptiveTable(spec, node, 2, cluster)) for node in range(2)]

rng = np.random.default_rng(0)
rounds = []
now = 0.0
for r in range(300):
    clock = r * CLOCKS
    hot = rng.choice(200, 60, replace=False)
    for machine in machines:
        keys = np.unique(np.concatenate([hot, rng.choice(NUM_KEYS, 700)])).astype(np.int64)
        for c in range(CLOCKS):
            machine.intend(keys[c::CLOCKS], clock + CLOCKS + c, clock + CLOCKS + c + 1)
    now += 0.2
    spent[0] = 0.0
    for machine in machines:
        started = time.perf_counter()
        effects = machine.tick(now, clock, 0.025)
        spent[0] += time.perf_counter() - started
        deliver(effects, now, clock)
    rounds.append(spent[0])
open(sys.argv[1], "w").write(json.dumps({"round_us": statistics.median(rounds[100:]) * 1e6}))
"""

# A server's update of 10,000 distinct rows of 64 float32 by each update rule, in one process: the
# compiled kernel and the table's own steps (keys checked, slice found, row locks), median of rounds.
UPDATES = r"""
import json, statistics, sys, time, uuid
import numpy as np
import shoal
from shoal.consistency.clocks import ClockTable
from shoal.placement.layout import TableLayout
from shoal.server.tables import ServedTable

rng = np.random.default_rng(0)
keys = np.sort(rng.choice(200_000, 10_000, replace=False)).astype(np.int64)
grads = (rng.standard_normal((10_000, 64)) * 1e-3).astype(np.float32)
out = {}
for name, opt in (("sgd", shoal.optim.SGD(lr=0.01)), ("adagrad", shoal.optim.Adagrad(lr=0.1)),
                  ("adam", shoal.optim.Adam(lr=0.01))):
    spec = shoal.TableSpec("updates", 200_000, 64, init=shoal.Normal(std=0.1), optimizer=opt)
    table = ServedTable(spec, TableLayout.initial(spec, 1), 0, uuid.uuid4().hex[:12], ClockTable.fresh(1))
    times = []
    for _ in range(120):
        started = time.perf_counter()
        table.push(keys, grads)
        times.append(time.perf_counter() - started)
    table.close()
    out[name] = statistics.median(times[20:]) * 1e6
open(sys.argv[1], "w").write(json.dumps(out))
"""


TRIVIAL = r"""
import shoal
ps = shoal.init()
ps.barrier()
ps.shutdown()
"""


def trivial_job(src: Path, script: Path) -> float:
    """Seconds ``shoal run`` of the trivial 2-node job takes, launcher start to exit."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", "2", "--workers-per-node", "1", "--",
                    sys.executable, str(script)], env={**os.environ, "PYTHONPATH": str(src)}, capture_output=True,
                   check=True, timeout=120, cwd=ROOT)
    return time.perf_counter() - started


def shoal_run(src: Path, nodes: int, args: list[str], classic: bool = False, faults: str = "") -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", str(nodes),
               *(["--classic"] if classic else []), *(["--faults", faults] if faults else []),
               "--", sys.executable, *args]
        cmd = [c.replace("{out}", str(out)) for c in cmd]
        done = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(src)}, capture_output=True, text=True,
                              timeout=600, cwd=ROOT)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} with {src} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())  # type: ignore[no-any-return]


def _answer(process: subprocess.Popen[bytes], answers: TextIO, timeout_s: float = 300.0) -> str:
    """The job's next line, once it comes; raises if the job ends or stays silent first."""
    deadline = time.monotonic() + timeout_s
    while not select.select([answers], [], [], 1.0)[0]:
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("a pulling job ended, or fell silent, before it answered")
    return answers.readline()


def pulls_in_turns(contenders: dict[str, Path], script: Path, tmp: Path) -> dict[str, dict[str, list[float]]]:
    """Microseconds per remote pull of each contender, turn by turn, both jobs running at once."""
    jobs: dict[str, tuple[subprocess.Popen[bytes], TextIO, TextIO]] = {}
    for i, (name, src) in enumerate(contenders.items()):
        asks_at, answers_at = tmp / f"asks{i}", tmp / f"answers{i}"
        os.mkfifo(asks_at)
        os.mkfifo(answers_at)
        cmd = [sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", "1", "--classic", "--", sys.executable,
               str(script), str(asks_at), str(answers_at)]
        process = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(src)}, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, cwd=ROOT)
        # Read-write: opening a FIFO so never waits for its other end (a job that fails to start would
        # never open its end); ``_answer`` waits for the job's lines, a bounded time.
        jobs[name] = (process, open(os.open(asks_at, os.O_RDWR), "w"),  # noqa: SIM115 - held for every turn
                      open(os.open(answers_at, os.O_RDWR)))  # noqa: SIM115
    try:
        for process, _, answers in jobs.values():
            if _answer(process, answers).strip() != "ready":
                raise SystemExit("a pulling job said something else than that it was ready")
        times: dict[str, dict[str, list[float]]] = {name: {pull: [] for pull in TURN_CALLS} for name in jobs}
        for turn in range(TURNS_EACH):
            order = list(jobs) if turn % 2 == 0 else list(reversed(jobs))
            for pull, (_, calls) in TURN_CALLS.items():
                for name in order:
                    process, asks, answers = jobs[name]
                    asks.write(f"{pull} {calls}\n")
                    asks.flush()
                    times[name][pull].append(float(_answer(process, answers)))
        return times
    finally:
        for process, asks, answers in jobs.values():
            asks.write("end 0\n")
            asks.close()
            answers.close()
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def in_process(src: Path, script: Path) -> dict[str, float]:
    """What ``script`` measured in one process of ``src`` (``SYNC_ROUND``, ``PLACEMENT_ROUND``, ``UPDATES``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        subprocess.run([sys.executable, str(script), str(out)], env={**os.environ, "PYTHONPATH": str(src)},
                       capture_output=True, check=True, timeout=300, cwd=ROOT)
        return {k: float(v) for k, v in json.loads(out.read_text()).items()}


def measure(src: Path, seconds: float, pulls_script: Path, steps_script: Path, trivial_script: Path,
            sync_script: Path, round_script: Path, updates_script: Path, seed: int) -> dict[str, float]:
    startup = statistics.median(trivial_job(src, trivial_script) for _ in range(3))
    pulls = shoal_run(src, 1, [str(pulls_script), "{out}"], classic=True)
    steps = shoal_run(src, 2, [str(steps_script), "{out}"])
    kge_args = [str(ROOT / "examples" / "kge" / "train.py"), "--mode", "auto", "--data", "zipf",
                "--seconds", str(seconds), "--out", "{out}"]
    kge = shoal_run(src, 2, kge_args)
    lossy = shoal_run(src, 2, kge_args, faults=f"loss=0.05,seed={seed}")
    return {"startup_s": startup, "pull_1_us": pulls["1"], "pull_10000_us": pulls["10000"],
            "pull_sliced_100_us": pulls["sliced 100"], "pull_sliced_10000_us": pulls["sliced 10000"],
            "step_2_nodes_us": steps["step_us"],
            "kge_auto_triples_per_s": kge["triples_per_s"],
            "kge_auto_server_cores": kge["server_cores"],
            "kge_auto_loss_triples_per_s": lossy["triples_per_s"],
            "sync_round_us": in_process(src, sync_script)["round_us"],
            "placement_round_us": in_process(src, round_script)["round_us"],
            **{f"update_{rule}_us": us for rule, us in in_process(src, updates_script).items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="HEAD", help="the commit to compare this working tree with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=15.0, help="KGE training time per contender")
    args = parser.parse_args()
    with checked_out(args.against) as (rev, old_src), tempfile.TemporaryDirectory() as tmp:
        scripts = {"pulls": PULLS, "steps": STEPS, "trivial": TRIVIAL, "turns": TURNS, "sync_round": SYNC_ROUND,
                   "placement_round": PLACEMENT_ROUND, "updates": UPDATES}
        for name, text in scripts.items():
            (Path(tmp) / f"{name}.py").write_text(text)
        pulls_script, steps_script, trivial_script, turns_script, sync_script, round_script, updates_script = (
            Path(tmp) / f"{name}.py" for name in scripts)
        contenders = {"this tree": ROOT / "src", rev: old_src}
        turns = pulls_in_turns(contenders, turns_script, Path(tmp))
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in contenders}
        order = list(contenders.items())
        for round_ in range(args.rounds):
            # Each round starts with the other tree: the machine's speed drifts within a round.
            for name, src in order[round_ % 2:] + order[:round_ % 2]:
                runs[name].append(measure(src, args.seconds, pulls_script, steps_script, trivial_script,
                                          sync_script, round_script, updates_script, round_ + 1))
                print(f"round {round_ + 1} {name}: {runs[name][-1]}", flush=True)
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    new, base = medians["this tree"], medians[rev]
    rows = [("trivial 2-node job, start to exit (s)", "startup_s", True),
            ("remote pull, 1 key (µs)", "pull_1_us", True), ("remote pull, 10,000 keys (µs)", "pull_10000_us", True),
            ("remote pull, 100 keys across 8 slices of one server (µs)", "pull_sliced_100_us", True),
            ("remote pull, 10,000 keys across 8 slices of one server (µs)", "pull_sliced_10000_us", True),
            ("a step on 2 nodes: 100 keys over both pulled, then pushed, one push in flight (µs)", "step_2_nodes_us",
             True),
            ("KGE auto, 2 nodes (triples/s)", "kge_auto_triples_per_s", False),
            ("KGE auto, 2 nodes: both servers' cores", "kge_auto_server_cores", True),
            ("KGE auto, 2 nodes, 5% of messages lost (triples/s)", "kge_auto_loss_triples_per_s", False),
            ("a replica sync round of 1,400 rows, the machines' work in one process (µs)", "sync_round_us", True),
            ("a KGE-like round of intents on 2 nodes, the machines' work in one process (µs)", "placement_round_us",
             True),
            *((f"a server's {rule} update of 10,000 rows of 64, in one process (µs)", f"update_{key}_us", True)
              for rule, key in (("SGD", "sgd"), ("Adagrad", "adagrad"), ("Adam", "adam")))]
    lines = [f"This tree against {rev}, alternating, {args.rounds} rounds; medians. Ratio > 1: this tree is faster.",
             "", f"| measure | this tree | {rev} | ratio |", "|---|---:|---:|---:|"]
    for label, key, lower_is_better in rows:
        ratio = base[key] / new[key] if lower_is_better else new[key] / base[key]
        lines.append(f"| {label} | {new[key]:,.2f} | {base[key]:,.2f} | {ratio:.2f} |")
    lines += ["", f"Remote pulls with both jobs running at once, taking turns ({TURNS_EACH} turns each, the first "
              "turn alternating); median µs per pull, and the turns where this tree was faster than the other's "
              "turn next to it.", "", f"| keys | this tree | {rev} | ratio | this tree faster |",
              "|---:|---:|---:|---:|---:|"]
    for pull, (keys, _) in TURN_CALLS.items():
        ours, theirs = turns["this tree"][pull], turns[rev][pull]
        faster = sum(a < b for a, b in zip(ours, theirs, strict=True))
        lines.append(f"| {keys} | {statistics.median(ours):,.1f} | {statistics.median(theirs):,.1f} | "
                     f"{statistics.median(theirs) / statistics.median(ours):.2f} | {faster} of {len(ours)} |")
    table = "\n".join(lines)
    print("\n" + table)
    write_results("versions", {"against": rev, "rounds": args.rounds, "runs": runs, "medians": medians,
                               "pull_turns_us": turns}, table)


if __name__ == "__main__":
    main()
