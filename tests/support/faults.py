"""Fault-injection scenarios: real jobs, real processes, faults at seeded random moments.

Each scenario states what it does and what must hold, runs a job (``shoal run``
on this machine, or servers and workers on emulated hosts for partitions),
injects its fault, and checks its invariants:

* **no hang**: the job ends within its time bound, by finishing or by failing
  with an error that names what it waited for;
* **no lost acknowledged update**: every push a worker saw acknowledged is in
  the final values, exactly once;
* **bounded staleness**: no read was staler than the consistency model allows.

Faults: SIGKILL and SIGSTOP of servers and workers, links taken down inside
network namespaces, and delay, loss, duplication and reordering through the
fault-injecting transport (``SHOAL_FAULTS``; the kernel here has no netem).
``benchmarks/faults.py`` runs them all and writes the report; ``make test``
runs a quick few (tests/test_faults.py).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
FAULT_WORKER = ROOT / "tests" / "scripts" / "fault_worker.py"
REPLICA_WORKER = ROOT / "tests" / "scripts" / "replica_worker.py"
BOUND_S = 120.0  # a scenario's job must end within this: anything longer is a hang


@dataclass
class Outcome:
    scenario: str
    seed: int
    fault: str
    must_hold: str
    checks: dict[str, bool] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    skipped: str | None = None

    @property
    def holds(self) -> bool:
        return self.skipped is None and bool(self.checks) and all(self.checks.values())


@dataclass(frozen=True)
class Scenario:
    name: str
    seed: int
    fault: str
    must_hold: str
    body: Callable[[random.Random, Path, Outcome], None]
    quick: bool = False

    def run(self, tmp: Path) -> Outcome:
        outcome = Outcome(self.name, self.seed, self.fault, self.must_hold)
        tmp.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        try:
            self.body(random.Random(self.seed), tmp, outcome)
        except Skip as exc:
            outcome.skipped = str(exc)
        outcome.seconds = round(time.monotonic() - start, 2)
        return outcome


class Skip(Exception):
    """The scenario cannot run here (no network namespaces, say)."""


# --------------------------------------------------------------------- jobs


def launch(tmp: Path, script: Path, script_args: list[str], nodes: int = 2, workers_per_node: int = 2,
           faults: str | None = None, policy: str = "fail", options: list[str] | None = None
           ) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", str(nodes), "--workers-per-node",
           str(workers_per_node), "--on-server-failure", policy, "--connect-timeout", "30", "--request-timeout",
           "30", "--barrier-timeout", "60", "--resend-timeout", "0.2", *(options or [])]
    if faults:
        cmd += ["--faults", faults]
    cmd += ["--", sys.executable, str(script), str(tmp), *script_args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def finish(proc: subprocess.Popen[str], outcome: Outcome, bound: float = BOUND_S) -> tuple[int | None, str]:
    """Wait for the job within ``bound``; a job still running then is a hang (killed, recorded)."""
    start = time.monotonic()
    try:
        output, _ = proc.communicate(timeout=bound)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate(timeout=30)
        outcome.checks["no hang"] = False
        outcome.facts["output_tail"] = output[-3000:]
        return None, output
    outcome.checks["no hang"] = True
    outcome.facts["job_seconds"] = round(time.monotonic() - start, 2)
    if proc.returncode != 0:
        outcome.facts["output_tail"] = output[-3000:]
    return proc.returncode, output


def read_json(path: Path, timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return json.loads(path.read_text())  # type: ignore[no-any-return]
        except (OSError, ValueError):
            time.sleep(0.05)
    raise AssertionError(f"{path} did not appear within {timeout}s")


def later(delay: float, action: Callable[[], None]) -> threading.Thread:
    """Run ``action`` after ``delay`` seconds in a thread (a fault at a chosen moment)."""
    def run() -> None:
        time.sleep(delay)
        try:
            action()
        except ProcessLookupError:
            pass  # the process ended first
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def counting_checks(tmp: Path, outcome: Outcome, code: int | None, workers: int, bound: int | None) -> None:
    """The invariants of a job of fault_worker.py that must finish."""
    outcome.checks["job finished"] = code == 0
    if code != 0:
        return
    result = read_json(tmp / "result.json", 5)
    outcome.facts.update(lost=result["lost"], extra=result["extra"])
    outcome.checks["no lost acknowledged update"] = result["exact"]
    per_worker = [read_json(tmp / f"w{r}.json", 5) for r in range(workers)]
    outcome.facts["staleness_max"] = max(w["staleness_max"] for w in per_worker)
    outcome.facts["requests_resent"] = sum(w["resent"] for w in per_worker)
    if bound is not None:
        outcome.checks[f"staleness <= {bound}"] = outcome.facts["staleness_max"] <= bound


# ---------------------------------------------------------------- scenarios


def network(faults: str, model: str = "ssp", staleness: int = 1, resent: bool = False, rounds: int = 150,
            slices: int = 0, options: list[str] | None = None, techniques: str | None = None
            ) -> Callable[[random.Random, Path, Outcome], None]:
    """Every process suffers ``faults`` (seeded per scenario) on everything it receives."""
    def body(rng: random.Random, tmp: Path, outcome: Outcome) -> None:
        spec = f"{faults},seed={rng.randrange(1 << 30)}"
        args = ["--model", model, "--staleness", str(staleness), "--rounds", str(rounds), "--slices", str(slices)]
        args += ["--techniques", techniques] if techniques else []
        code, _ = finish(launch(tmp, FAULT_WORKER, args, faults=spec, options=options), outcome)
        bound = {"bsp": 0, "ssp": staleness, "essp": staleness}.get(model)
        counting_checks(tmp, outcome, code, 4, bound)
        if resent and code == 0:
            outcome.checks["lost requests were sent again"] = outcome.facts["requests_resent"] > 0
    return body


def pause(target: str, seconds: float, model: str = "ssp") -> Callable[[random.Random, Path, Outcome], None]:
    """SIGSTOP a server or worker at a random moment, SIGCONT it ``seconds`` later."""
    def body(rng: random.Random, tmp: Path, outcome: Outcome) -> None:
        proc = launch(tmp, FAULT_WORKER, ["--model", model, "--rounds", "200"])
        pid = _pick(rng, tmp, target, outcome)
        delay = rng.uniform(0.2, 1.0)
        outcome.facts["stopped_after_s"] = round(delay, 2)
        later(delay, lambda: os.kill(pid, signal.SIGSTOP))
        later(delay + seconds, lambda: os.kill(pid, signal.SIGCONT))
        code, _ = finish(proc, outcome)
        counting_checks(tmp, outcome, code, 4, {"bsp": 0, "ssp": 1}.get(model))
    return body


def kill(target: str, policy: str = "fail") -> Callable[[random.Random, Path, Outcome], None]:
    """SIGKILL a server or worker at a random moment: the job must end, naming the process that died."""
    def body(rng: random.Random, tmp: Path, outcome: Outcome) -> None:
        proc = launch(tmp, FAULT_WORKER, ["--rounds", "400"], policy=policy)
        pid = _pick(rng, tmp, target, outcome)
        delay = rng.uniform(0.2, 1.0)
        outcome.facts["killed_after_s"] = round(delay, 2)
        later(delay, lambda: os.kill(pid, signal.SIGKILL)).join()
        code, output = finish(proc, outcome)
        outcome.checks["job failed"] = code not in (0, None)
        name = outcome.facts["target"]
        outcome.checks["failure names the process"] = f"{name} exited with status -9" in output
    return body


def stalled_server(rng: random.Random, tmp: Path, outcome: Outcome) -> None:
    """A server stopped for longer than the request timeout: workers fail with an error naming it."""
    proc = launch(tmp, FAULT_WORKER, ["--rounds", "400"], options=["--request-timeout", "3"])
    pid = _pick(rng, tmp, "server", outcome)
    later(rng.uniform(0.2, 0.6), lambda: os.kill(pid, signal.SIGSTOP)).join()
    try:
        code, output = finish(proc, outcome, bound=60)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass  # the launcher already ended it
    outcome.checks["job failed"] = code not in (0, None)
    outcome.checks["error names what it waited for"] = "no reply within 3.0s" in output and "to peer" in output


def replica(policy: str, disturbance: str, write_quorum: int = 2) -> Callable[[random.Random, Path, Outcome], None]:
    """A replicated table (3 replicas): a replica is killed, paused or killed and restarted."""
    def body(rng: random.Random, tmp: Path, outcome: Outcome) -> None:
        proc = launch(tmp, REPLICA_WORKER, [str(write_quorum), "200"], nodes=3, workers_per_node=1, policy=policy,
                      options=["--replica-timeout", "0.5"])
        pids = read_json(tmp / "servers.json")["pids"]
        victim = rng.randrange(3)
        delay = rng.uniform(0.2, 0.8)
        outcome.facts.update(target=f"server s{victim}", after_s=round(delay, 2))
        if disturbance == "kill":
            later(delay, lambda: os.kill(pids[victim], signal.SIGKILL))
        else:
            later(delay, lambda: os.kill(pids[victim], signal.SIGSTOP))
            later(delay + 1.5, lambda: os.kill(pids[victim], signal.SIGCONT))
        code, _ = finish(proc, outcome)
        outcome.checks["job finished"] = code == 0
        if code != 0:
            return
        result = read_json(tmp / "result.json", 5)
        acked = sum(read_json(tmp / f"acked{r}.json", 5)["acked"] for r in range(3))
        outcome.facts.update(acked=acked, live_replicas=result["live"])
        outcome.checks["live replicas identical"] = result["identical"]
        counts = [c for counts in result["counts"].values() for c in counts]
        outcome.facts["counted"] = [min(counts), max(counts)] if counts else []
        if write_quorum > 1:
            outcome.checks["no lost acknowledged update"] = all(c == float(acked) for c in counts)
        else:  # W=1: the pushes only the dead replica had are lost, never doubled
            outcome.checks["no push counted twice"] = all(c <= acked for c in counts)
            outcome.checks["lost at most what one replica had not gossiped"] = all(c >= 0.9 * acked for c in counts)
    return body


def oversubscribed(body: Callable[[random.Random, Path, Outcome], None], loops: int = 3
                   ) -> Callable[[random.Random, Path, Outcome], None]:
    """``body`` with ``loops`` busy-loop processes competing for the CPU the whole time."""
    def run(rng: random.Random, tmp: Path, outcome: Outcome) -> None:
        from tests.support.load import BusyCPUs

        outcome.facts["busy_loops"] = loops
        with BusyCPUs(loops, limit_s=BOUND_S + 60):
            body(rng, tmp, outcome)
    return run


def checkpoint_kill(rng: random.Random, tmp: Path, outcome: Outcome) -> None:
    """Checkpoints every 20 rounds; a server is SIGKILLed at a random moment (mid-write or not)."""
    from shoal.storage import checkpoint

    proc = launch(tmp, FAULT_WORKER, ["--rounds", "400", "--checkpoint-every", "20", "--sleep-ms", "1"])
    pid = _pick(rng, tmp, "server", outcome)
    root = tmp / "ckpt"
    deadline = time.monotonic() + 60
    while not (root / checkpoint.LATEST).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    later(rng.uniform(0.05, 0.6), lambda: os.kill(pid, signal.SIGKILL)).join()
    code, _ = finish(proc, outcome)
    outcome.checks["job failed"] = code not in (0, None)
    try:
        path = checkpoint.latest(root)
        manifest = checkpoint.read_manifest(path)
        entry = manifest["tables"]["faults"]
        rows = sum(keys.shape[0] for keys, _ in checkpoint.read_parts(path, entry))
        outcome.facts.update(checkpoint_clock=manifest["clock"], rows=rows)
        outcome.checks["last checkpoint complete and intact"] = rows == entry["spec"]["num_keys"]
    except Exception as exc:  # noqa: BLE001 - any failure to read it breaks the invariant
        outcome.facts["checkpoint_error"] = repr(exc)
        outcome.checks["last checkpoint complete and intact"] = False


def partition(seconds: float) -> Callable[[random.Random, Path, Outcome], None]:
    """Three emulated hosts; one host's link goes down at a random moment and comes back."""
    def body(rng: random.Random, tmp: Path, outcome: Outcome) -> None:
        from tests.support.netns import EmulatedHosts, run_cluster, unavailable_reason

        reason = unavailable_reason()
        if reason:
            raise Skip(reason)
        secret = tmp / "secret"
        secret.write_text("5e" * 32)
        victim = rng.randrange(1, 3)
        delay = rng.uniform(0.5, 1.5)
        outcome.facts.update(target=f"host {victim}", down_after_s=round(delay, 2), down_s=seconds)
        with EmulatedHosts(3, rate="1gbit") as hosts:
            later(delay, lambda: hosts.link(victim, False))
            later(delay + seconds, lambda: hosts.link(victim, True))
            start = time.monotonic()
            try:
                run_cluster(hosts, [sys.executable, str(FAULT_WORKER), str(tmp), "--rounds", "300"], str(secret),
                            timeout=BOUND_S, extra_env={"SHOAL_RESEND_TIMEOUT": "0.2", "SHOAL_REQUEST_TIMEOUT": "30"})
                code = 0
            except subprocess.TimeoutExpired:
                outcome.checks["no hang"] = False
                return
            except RuntimeError as exc:
                outcome.facts["output_tail"] = str(exc)[-3000:]
                code = 1
            outcome.checks["no hang"] = True
            outcome.facts["job_seconds"] = round(time.monotonic() - start, 2)
        counting_checks(tmp, outcome, code, 3, 1)
    return body


def _pick(rng: random.Random, tmp: Path, target: str, outcome: Outcome) -> int:
    """A seeded choice among the job's servers (other than node 0's, whose loss ends any job) or workers."""
    servers = read_json(tmp / "pids.json")["servers"]
    if target == "server":
        index = rng.randrange(len(servers))
        outcome.facts["target"] = f"server s{index}"
        return int(servers[index])
    rank = rng.randrange(1, 4)  # rank 0 coordinates the final check
    outcome.facts["target"] = f"worker w{rank}"
    return int(read_json(tmp / f"pid{rank}.json")["pid"])


NO_HANG = "no hang"
EXACT = "no hang; every acknowledged push applied exactly once"
SCENARIOS = [
    Scenario("delay", 1, "every message delayed 2 ms", f"{EXACT}; staleness <= 1",
             network("delay_ms=2"), quick=True),
    Scenario("reorder", 2, "delay 0-5 ms jitter, so messages reorder", f"{EXACT}; staleness <= 1",
             network("jitter_ms=5")),
    Scenario("loss-2%", 3, "2% of all messages lost", f"{EXACT}; lost requests sent again",
             network("loss=0.02", resent=True)),
    Scenario("loss-10%", 4, "10% of all messages lost", f"{EXACT}; lost requests sent again",
             network("loss=0.1", resent=True, rounds=80)),
    Scenario("duplicate-10%", 5, "10% of all messages delivered twice", EXACT,
             network("duplicate=0.1")),
    Scenario("loss-dup-reorder", 6, "5% lost, 5% twice, 2 ms jitter", EXACT,
             network("loss=0.05,duplicate=0.05,jitter_ms=2", rounds=100)),
    Scenario("bsp-under-loss", 7, "BSP with 5% loss", f"{EXACT}; staleness 0",
             network("loss=0.05", model="bsp", rounds=80)),
    Scenario("ssp2-under-jitter", 8, "SSP(2) with 1 ms delay and 3 ms jitter", f"{EXACT}; staleness <= 2",
             network("delay_ms=1,jitter_ms=3", staleness=2)),
    Scenario("essp-under-jitter", 9, "ESSP(1) with 3 ms jitter", f"{EXACT}; staleness <= 1",
             network("jitter_ms=3", model="essp")),
    Scenario("slices-moving-under-loss", 10, "8 slices rebalanced live (threshold 1.05) with 2% loss", EXACT,
             network("loss=0.02", slices=8, options=["--rebalance", "1.05"], rounds=200)),
    Scenario("pause-server", 11, "a server SIGSTOPped for 1.5 s", f"{EXACT}; staleness <= 1",
             pause("server", 1.5)),
    Scenario("pause-worker", 12, "a worker SIGSTOPped for 1.5 s", f"{EXACT}; staleness <= 1",
             pause("worker", 1.5), quick=True),
    Scenario("pause-server-bsp", 13, "a server SIGSTOPped for 1 s under BSP", f"{EXACT}; staleness 0",
             pause("server", 1.0, model="bsp")),
    Scenario("kill-worker", 14, "a worker SIGKILLed", "no hang; the job ends naming the dead worker",
             kill("worker")),
    Scenario("kill-server", 15, "a server SIGKILLed (policy fail)", "no hang; the job ends naming the dead server",
             kill("server")),
    Scenario("stalled-server", 16, "a server SIGSTOPped past the 3 s request timeout",
             "no hang; workers fail with an error naming the server they waited for", stalled_server),
    Scenario("kill-replica", 17, "a replica of a 3-way replicated table SIGKILLed (write quorum 2)",
             "no hang; no acknowledged push lost; live replicas identical", replica("continue", "kill")),
    Scenario("restart-replica", 18, "a replica SIGKILLed and restarted (policy restart)",
             "no hang; no acknowledged push lost; all replicas identical", replica("restart", "kill")),
    Scenario("pause-replica", 19, "a replica SIGSTOPped 1.5 s (replica timeout 0.5 s)",
             "no hang; no acknowledged push lost; replicas identical after", replica("continue", "pause")),
    Scenario("kill-during-checkpoints", 20, "a server SIGKILLed while checkpoints are taken every 20 rounds",
             "no hang; the newest checkpoint is complete and intact", checkpoint_kill),
    Scenario("partition-1s", 21, "an emulated host's link down for 1 s", f"{EXACT}; staleness <= 1",
             partition(1.0)),
    Scenario("partition-3s", 22, "an emulated host's link down for 3 s", f"{EXACT}; staleness <= 1",
             partition(3.0)),
    Scenario("counting-oversubscribed", 23, "no network fault; three busy loops compete for the 2 cores",
             f"{EXACT}; staleness <= 1", oversubscribed(network("delay_ms=0"))),
    Scenario("kill-replica-oversubscribed", 24,
             "a replica SIGKILLed (write quorum 2) while three busy loops compete for the 2 cores",
             "no hang; no acknowledged push lost; live replicas identical",
             oversubscribed(replica("continue", "kill"))),
    Scenario("kill-replica-w1-oversubscribed", 25,
             "a replica SIGKILLed (write quorum 1) while three busy loops compete for the 2 cores",
             "no hang; no push counted twice; live replicas identical",
             oversubscribed(replica("continue", "kill", write_quorum=1))),
    Scenario("adaptive-under-loss", 26, "an adaptive table (auto) whose keys move and are copied, 5% lost, "
             "2% twice, 2 ms jitter", EXACT, network("loss=0.05,duplicate=0.02,jitter_ms=2", model="asp",
                                                     techniques="auto", rounds=150)),
]
