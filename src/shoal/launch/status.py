"""``shoal status``: a live table of a running cluster, from its rendezvous and its servers.

``shoal run`` leaves a small run file (rendezvous address, cluster id, launcher
pid, command, and the path of the job's secret file -- never the secret) in a
per-user directory only its owner may enter, while the job runs, so that
``shoal status`` finds a running job by its cluster id, or by itself when only
one runs; with several and none named it lists them. For a cluster started any
other way, pass ``--rendezvous`` and ``--secret-file``.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from shoal.api.config import Limits
from shoal.api.errors import ClusterError, RequestTimeoutError
from shoal.api.ids import OBSERVER, RENDEZVOUS
from shoal.cluster import membership
from shoal.cluster.requests import RequestTracker
from shoal.launch.user_dir import private_runs_dir, runs_dir
from shoal.transport.zmq_transport import ZmqTransport
from shoal.wire.codec import Codec
from shoal.wire.message import Message
from shoal.wire.ops import Op


def keep_secret(name: str, secret: bytes) -> Path:
    """Write a job's secret (hex) into a file only this user may read; its path is what children and
    ``shoal status`` are given, so the secret is on no command line and in no environment."""
    path = private_runs_dir() / f"{name}.secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secret.hex())
    return path


def shared_secret(name: str) -> Path:
    """The file of the secret every process of job ``name`` on this machine shares: the first process
    to ask makes it (linked into place whole, so no one reads half a secret), the others read it."""
    path = private_runs_dir() / f"{name}.secret"
    if not path.exists():
        draft = keep_secret(f"{name}.{os.getpid()}.draft", secrets.token_bytes(32))
        try:
            os.link(draft, path)
        except FileExistsError:
            pass  # another process of the job was first
        finally:
            draft.unlink()
    return path


def record_run(cluster_id: str, rendezvous: str, secret_file: Path | None, shape: str = "",
               command: str = "") -> Path:
    """Leave the run file of a job this process launched; ``shape`` is e.g. ``2 x 1``."""
    path = private_runs_dir() / f"{cluster_id}.json"
    path.write_text(json.dumps({"cluster_id": cluster_id, "rendezvous": rendezvous, "pid": os.getpid(),
                                "secret_file": None if secret_file is None else str(secret_file),
                                "started": time.time(), "shape": shape, "command": command}))
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running_jobs() -> list[dict[str, Any]]:
    """Jobs whose launcher is still alive, newest first (files of dead ones are removed)."""
    jobs = []
    for path in runs_dir().glob("*.json") if runs_dir().is_dir() else []:
        try:
            info = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if _alive(int(info.get("pid", 0))):
            jobs.append(info)
        else:  # its launcher was killed: what it left goes now
            path.unlink(missing_ok=True)
            if info.get("secret_file"):
                Path(info["secret_file"]).unlink(missing_ok=True)
    return sorted(jobs, key=lambda j: -float(j.get("started", 0)))


def find_job(cluster_id: str | None) -> dict[str, Any]:
    """The running job named by ``cluster_id`` (a unique prefix will do), or the only one running.

    Raises ``ClusterError`` naming the running jobs when there are several and none was named:
    the newest is not necessarily the one meant.
    """
    jobs = running_jobs()
    if cluster_id is not None:
        matches = [j for j in jobs if str(j["cluster_id"]).startswith(cluster_id)]
        if len(matches) == 1:
            return matches[0]
        what = "no running job has" if not matches else f"{len(matches)} running jobs have"
        raise ClusterError(f"{what} a cluster id starting with {cluster_id!r}\n{describe_jobs(jobs)}")
    if not jobs:
        raise ClusterError("no running job found (give a cluster id or --rendezvous ADDRESS)")
    if len(jobs) > 1:
        raise ClusterError(f"{len(jobs)} jobs are running; name one: shoal status CLUSTER_ID\n{describe_jobs(jobs)}")
    return jobs[0]


def describe_jobs(jobs: list[dict[str, Any]]) -> str:
    """One line per job: id, age, shape, launcher pid, rendezvous, command."""
    if not jobs:
        return "(no running jobs)"
    lines = [f"{'cluster id':<12}  {'running':>8}  {'nodes x workers':>15}  {'pid':>7}  {'rendezvous':<26}  command"]
    for job in jobs:
        age = time.time() - float(job.get("started", time.time()))
        lines.append(f"{job['cluster_id']:<12}  {age:>7.0f}s  {job.get('shape') or '?':>15}  {job.get('pid', '?'):>7}  "
                     f"{job['rendezvous']:<26}  {job.get('command') or ''}")
    return "\n".join(lines)


@dataclass
class Snapshot:
    at: float
    status: dict[str, Any]
    servers: dict[int, dict[str, Any]]


class StatusClient:
    """Asks the rendezvous and every live server how they are."""

    def __init__(self, rendezvous: str, secret: bytes | None, timeout: float = 5.0) -> None:
        self.timeout = timeout
        self.transport = ZmqTransport()
        self.tracker = RequestTracker(self.transport, Codec(Limits(), secret), sender=OBSERVER)
        self.tracker.connect(RENDEZVOUS, rendezvous)
        self._connected: dict[int, str] = {}

    def snapshot(self) -> Snapshot:
        status = membership.status(self.tracker, self.timeout)
        nodes = []
        for node, address in enumerate(status.get("servers") or []):
            if address is None:
                continue
            if self._connected.get(node) != address:
                if node in self._connected:
                    self.tracker.disconnect(node)
                self.tracker.connect(node, address)
                self._connected[node] = address
            nodes.append(node)
        # A server that does not answer shows as unreachable.
        replies = self.tracker.gather(nodes, lambda n: Message(Op.STATS), "STATS", self.timeout, partial=True)
        return Snapshot(time.monotonic(), status, replies)

    def close(self) -> None:
        self.tracker.close()
        self.transport.close()


def _rate(now: Snapshot, before: Snapshot | None, node: int, key: str) -> float | None:
    if before is None or node not in before.servers or node not in now.servers:
        return None
    dt = now.at - before.at
    return (now.servers[node]["stats"].get(key, 0) - before.servers[node]["stats"].get(key, 0)) / dt if dt else None


def render_table(now: Snapshot, before: Snapshot | None = None) -> str:
    st = now.status
    workers, left = st.get("workers") or [], st.get("left") or []
    state = "finished" if st.get("finished") else "ready" if st.get("ready") else "starting"
    lines = [f"cluster {st.get('cluster_id')} · {state} · {sum(1 for a in st['servers'] if a)} server(s) · "
             f"{len(workers)} worker(s) registered, {len(left)} done, of {st.get('num_workers')}"]
    header = f"{'node':>4}  {'pid':>7}  {'slices':>6}  {'rows':>10}  {'msg/s':>8}  {'MB/s in':>8}  {'MB/s out':>8}  " \
             f"{'queue':>5}  {'held':>4}  {'clocks':>9}  {'errors':>6}  metrics"
    lines.append(header)
    for node, address in enumerate(st.get("servers") or []):
        if address is None:
            lines.append(f"{node:>4}  (departed)")
            continue
        info = now.servers.get(node)
        if info is None:
            lines.append(f"{node:>4}  unreachable at {address}")
            continue
        stats = info.get("stats", {})
        slices = sum(len(t["shards"]) for t in info.get("tables", {}).values())
        rows = sum(int(t["rows"]) for t in info.get("tables", {}).values())
        msgs = _rate(now, before, node, "messages")
        mb_in, mb_out = _rate(now, before, node, "bytes_in"), _rate(now, before, node, "bytes_out")
        clocks = [c for c in info.get("clocks", []) if c < 1 << 60]
        clock_text = f"{min(clocks)}/{max(clocks)}" if clocks else "-"
        errors = sum(v for k, v in stats.items() if k.startswith("error_"))
        held = int(info.get("held", 0))

        def num(x: float | None, scale: float = 1.0) -> str:
            return "-" if x is None else f"{x / scale:.1f}"

        lines.append(f"{node:>4}  {info.get('pid', '-'):>7}  {slices:>6}  {rows:>10}  {num(msgs):>8}  "
                     f"{num(mb_in, 1e6):>8}  {num(mb_out, 1e6):>8}  {info.get('queue', 0):>5}  {held:>4}  "
                     f"{clock_text:>9}  {errors:>6}  {info.get('metrics') or '-'}")
    metrics = st.get("metrics") or {}
    for rank in workers:
        url = metrics.get(f"worker {rank}")
        lines.append(f"worker {rank}: pid {st.get('pids', {}).get(f'worker {rank}', '-')}"
                     f"{' (done)' if rank in left else ''}  metrics {url or '-'}")
    return "\n".join(lines)


def watch(rendezvous: str, secret: bytes | None, interval: float, count: int, out: IO[str]) -> None:
    """Print the table ``count`` times, ``interval`` seconds apart (rates need two samples); on a
    terminal each table replaces the last."""
    client = StatusClient(rendezvous, secret)
    live = out.isatty()
    try:
        before = None
        for i in range(count):
            try:
                now = client.snapshot()
            except (ClusterError, RequestTimeoutError) as exc:
                raise ClusterError(f"no answer from the rendezvous at {rendezvous}: {exc}") from None
            if i:
                out.write("\x1b[H\x1b[2J" if live else "\n")
            out.write(render_table(now, before) + "\n")
            out.flush()
            before = now
            if i + 1 < count:
                time.sleep(interval)
    finally:
        client.close()
