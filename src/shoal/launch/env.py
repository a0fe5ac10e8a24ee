"""The environment contract between a launcher and the processes it starts.

This is the only module that reads ``SHOAL_*`` variables. A missing or bad
variable fails at once with a message that names it.

| variable | meaning |
|---|---|
| ``SHOAL_RENDEZVOUS`` | address of the rendezvous, e.g. ``tcp://127.0.0.1:5555`` |
| ``SHOAL_CLUSTER_ID`` | names the cluster (and its shared memory) |
| ``SHOAL_NUM_NODES`` | number of nodes (one server each) |
| ``SHOAL_WORKERS_PER_NODE`` | workers on each node |
| ``SHOAL_NODE`` | this process's node |
| ``SHOAL_RANK`` | this worker's global rank (workers only) |
| ``SHOAL_SECRET`` / ``SHOAL_SECRET_FILE`` | the job's secret (hex), or a file holding it; launchers make one |
| ``SHOAL_BIND`` | server bind address, default ``tcp://127.0.0.1:0`` |
| ``SHOAL_LOCAL_ACCESS`` | ``0`` sends every key through a server (classic PS mode) |
| ``SHOAL_MAX_MESSAGE_BYTES`` | largest message accepted |
| ``SHOAL_OWNS_SECRET_FILE`` | ``1``: the server removes ``SHOAL_SECRET_FILE`` when it ends (torchrun's own) |
| ``SHOAL_SERVER_MEMORY`` | bytes each server may give its tables (default: half the machine's memory) |
| ``SHOAL_CONNECT_TIMEOUT`` / ``SHOAL_REQUEST_TIMEOUT`` | seconds |
| ``SHOAL_BARRIER_TIMEOUT`` / ``SHOAL_REPLICA_TIMEOUT`` | seconds |
| ``SHOAL_RESEND_TIMEOUT`` | most seconds before an unanswered request is sent again (default 1; less once timed) |
| ``SHOAL_LAUNCHER_PID`` | pid of the launcher; its death ends the process |
| ``SHOAL_WATCH_PID`` | a detached server ends when this process is gone (torchrun agent) |
| ``SHOAL_HOST_RENDEZVOUS`` | ``1``: this server also hosts the rendezvous (torchrun, node 0) |
| ``SHOAL_JOIN`` | ``1``: this server joins a running cluster as node ``SHOAL_NODE`` (the next free one) |
| ``SHOAL_REBALANCE`` | where a server hosts the rendezvous: max/mean load that triggers moving slices |
| ``SHOAL_LOG_LEVEL`` | logging level of server processes |
| ``SHOAL_FAULTS`` | inject faults on arrival: ``delay_ms=2,jitter_ms=1,loss=0.01,duplicate=0.01,seed=3`` |
| ``SHOAL_RUN_DIR`` | workers write their run records here at shutdown, for the run report |
| ``SHOAL_METRICS`` | ``0`` turns off the Prometheus endpoint every process serves |
| ``SHOAL_METRICS_PORT`` | fixed ports: servers serve on this plus their node, workers on this plus nodes plus rank |
| ``SHOAL_METRICS_HOST`` | the address metrics bind, default ``127.0.0.1`` |
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from shoal.api.config import ClusterSpec, Limits, RebalancePolicy, Timeouts
from shoal.api.errors import ConfigError
from shoal.transport.base import Transport
from shoal.transport.faulty import Faults, FaultyTransport
from shoal.transport.zmq_transport import ZmqTransport

PREFIX = "SHOAL_"
_HINT = "start the script with `shoal run ...`, or set the SHOAL_* variables (see shoal.launch.env)"


@dataclass(frozen=True)
class ProcessRole:
    """Who this process is in the cluster."""

    cluster: ClusterSpec
    node: int
    rank: int  # -1 for a server
    local_access: bool
    bind: str


def _get(env: Mapping[str, str], name: str) -> str:
    value = env.get(PREFIX + name)
    if value is None or value == "":
        raise ConfigError(f"{PREFIX}{name} is not set: {_HINT}")
    return value


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(PREFIX + name)
    if raw in (None, "") and default is not None:
        return default
    raw = _get(env, name)
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{PREFIX}{name} must be an integer, got {raw!r}") from None


def seconds(env: Mapping[str, str], name: str, default: float) -> float:
    """``SHOAL_<name>`` as seconds (``default`` when unset); ``ConfigError`` naming it when it is no number."""
    raw = env.get(PREFIX + name)
    if raw in (None, ""):
        return default
    try:
        return float(raw)  # type: ignore[arg-type]
    except ValueError:
        raise ConfigError(f"{PREFIX}{name} must be a number of seconds, got {raw!r}") from None


def read_secret(env: Mapping[str, str]) -> bytes | None:
    raw = env.get(PREFIX + "SECRET")
    path = env.get(PREFIX + "SECRET_FILE")
    if path:
        try:
            with open(path) as fh:
                raw = fh.read().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read {PREFIX}SECRET_FILE {path!r}: {exc}") from exc
    if not raw:
        return None
    try:
        return bytes.fromhex(raw)
    except ValueError:
        raise ConfigError(f"the shared secret must be hex (from {PREFIX}SECRET or {PREFIX}SECRET_FILE)") from None


def cluster_from_env(env: Mapping[str, str] | None = None) -> ClusterSpec:
    env = os.environ if env is None else env
    defaults = Timeouts()
    try:
        return _cluster(env, defaults)
    except ConfigError as exc:  # a value out of range: name the variables it came from
        raise ConfigError(f"{exc} (from the {PREFIX}* variables: {_SETTINGS})") from None


#: the variables ``cluster_from_env`` reads, by the setting they give
_SETTINGS = ", ".join(f"{field} = {PREFIX}{name}" for field, name in (
    ("num_nodes", "NUM_NODES"), ("workers_per_node", "WORKERS_PER_NODE"), ("max_message_bytes", "MAX_MESSAGE_BYTES"),
    ("server_memory_bytes", "SERVER_MEMORY"), ("connect_s", "CONNECT_TIMEOUT"), ("request_s", "REQUEST_TIMEOUT"),
    ("barrier_s", "BARRIER_TIMEOUT"), ("replica_s", "REPLICA_TIMEOUT"), ("resend_s", "RESEND_TIMEOUT")))


def _cluster(env: Mapping[str, str], defaults: Timeouts) -> ClusterSpec:
    return ClusterSpec(
        cluster_id=_get(env, "CLUSTER_ID"),
        num_nodes=_int(env, "NUM_NODES"),
        workers_per_node=_int(env, "WORKERS_PER_NODE"),
        rendezvous=_get(env, "RENDEZVOUS"),
        secret=read_secret(env),
        limits=Limits(max_message_bytes=_int(env, "MAX_MESSAGE_BYTES", Limits().max_message_bytes),
                      server_memory_bytes=_int(env, "SERVER_MEMORY", 0)),
        timeouts=Timeouts(
            connect_s=seconds(env, "CONNECT_TIMEOUT", defaults.connect_s),
            request_s=seconds(env, "REQUEST_TIMEOUT", defaults.request_s),
            barrier_s=seconds(env, "BARRIER_TIMEOUT", defaults.barrier_s),
            replica_s=seconds(env, "REPLICA_TIMEOUT", defaults.replica_s),
            resend_s=seconds(env, "RESEND_TIMEOUT", defaults.resend_s),
        ),
    )


def role_from_env(server: bool, env: Mapping[str, str] | None = None) -> ProcessRole:
    env = os.environ if env is None else env
    cluster = cluster_from_env(env)
    node = _int(env, "NODE")
    joining = server and env.get(PREFIX + "JOIN") == "1"
    if not 0 <= node < cluster.num_nodes and not (joining and node >= cluster.num_nodes):
        hint = f"; a server joining a running cluster sets {PREFIX}JOIN=1" if server else ""
        raise ConfigError(f"{PREFIX}NODE={node} is outside [0, {cluster.num_nodes}){hint}")
    rank = -1
    if not server:
        rank = _int(env, "RANK")
        if not 0 <= rank < cluster.num_workers:
            raise ConfigError(f"{PREFIX}RANK={rank} is outside [0, {cluster.num_workers})")
    return ProcessRole(
        cluster=cluster,
        node=node,
        rank=rank,
        local_access=_switch(env, "LOCAL_ACCESS"),
        bind=env.get(PREFIX + "BIND") or "tcp://127.0.0.1:0",
    )


def configured(env: Mapping[str, str] | None = None) -> bool:
    """True when a launcher or scheduler set this process's ``SHOAL_*`` variables."""
    env = os.environ if env is None else env
    return PREFIX + "CLUSTER_ID" in env


def _switch(env: Mapping[str, str], name: str, default: bool = True) -> bool:
    """``SHOAL_<name>`` as on or off (``1/true/yes/on``, ``0/false/no/off``; unset: ``default``)."""
    raw = env.get(PREFIX + name, "").lower()
    if not raw:
        return default
    if raw not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise ConfigError(f"{PREFIX}{name} must be 1/true/yes/on or 0/false/no/off, got {env[PREFIX + name]!r}")
    return raw in ("1", "true", "yes", "on")


def _pid(env: Mapping[str, str] | None, name: str) -> int | None:
    env = os.environ if env is None else env
    raw = env.get(PREFIX + name)
    if not raw:
        return None
    if not raw.isdigit():
        raise ConfigError(f"{PREFIX}{name} must be a process id, got {raw!r}")
    return int(raw)


def launcher_pid(env: Mapping[str, str] | None = None) -> int | None:
    return _pid(env, "LAUNCHER_PID")


def transport(env: Mapping[str, str] | None = None) -> Transport:
    """ZeroMQ, wrapped in the fault injector when ``SHOAL_FAULTS`` is set (tests, fault scenarios)."""
    env = os.environ if env is None else env
    zmq_transport: Transport = ZmqTransport()
    spec = env.get(PREFIX + "FAULTS")
    if not spec:
        return zmq_transport
    try:
        faults = Faults.parse(spec)
    except ConfigError as exc:
        zmq_transport.close()
        raise ConfigError(f"{PREFIX}FAULTS: {exc}") from None
    return FaultyTransport(zmq_transport, faults)


def metrics_port(node: int, rank: int | None, env: Mapping[str, str] | None = None) -> int | None:
    """Where this process serves Prometheus metrics (0: any free port), or None when turned off."""
    env = os.environ if env is None else env
    if not _switch(env, "METRICS"):
        return None
    if not env.get(PREFIX + "METRICS_PORT"):
        return 0
    base = _int(env, "METRICS_PORT")
    port = base + node if rank is None else base + _int(env, "NUM_NODES") + rank
    if not (0 <= base and port <= 65535):
        raise ConfigError(f"{PREFIX}METRICS_PORT={base} gives this process port {port}, outside 0..65535")
    return port


def metrics_host(env: Mapping[str, str] | None = None) -> str:
    """The address metrics bind (``SHOAL_METRICS_HOST``): loopback unless the job has a shared secret."""
    env = os.environ if env is None else env
    return env.get(PREFIX + "METRICS_HOST") or "127.0.0.1"


def run_dir(env: Mapping[str, str] | None = None) -> str | None:
    """Where workers write their run records (``SHOAL_RUN_DIR``), if a report was asked for."""
    env = os.environ if env is None else env
    return env.get(PREFIX + "RUN_DIR") or None


def owned_secret_file(env: Mapping[str, str] | None = None) -> Path | None:
    """The secret file this server removes when it ends (``SHOAL_OWNS_SECRET_FILE``: torchrun's
    per-invocation secret, which no one needs once the node's server is gone)."""
    env = os.environ if env is None else env
    path = env.get(PREFIX + "SECRET_FILE")
    return Path(path) if path and env.get(PREFIX + "OWNS_SECRET_FILE") == "1" else None


def watch_pid(env: Mapping[str, str] | None = None) -> int | None:
    """A process whose end ends a detached server (``SHOAL_WATCH_PID``)."""
    return _pid(env, "WATCH_PID")


def hosts_rendezvous(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return env.get(PREFIX + "HOST_RENDEZVOUS") == "1"


def rebalance(env: Mapping[str, str] | None = None) -> RebalancePolicy | None:
    """The rebalancing policy of a rendezvous hosted by a server (``SHOAL_REBALANCE=1.25``), if any."""
    env = os.environ if env is None else env
    raw = env.get(PREFIX + "REBALANCE")
    if not raw:
        return None
    try:
        return RebalancePolicy(threshold=float(raw))
    except ValueError:
        raise ConfigError(f"{PREFIX}REBALANCE must be a number above 1 (max/mean load), got {raw!r}") from None


def log_level(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    level = env.get(PREFIX + "LOG_LEVEL", "WARNING").upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ConfigError(f"{PREFIX}LOG_LEVEL must be DEBUG, INFO, WARNING, ERROR or CRITICAL, got {level!r}")
    return level


def child_env(cluster: ClusterSpec, node: int, rank: int | None, local_access: bool, bind: str | None,
              launcher: int, secret_file: Path | None = None) -> dict[str, str]:
    """The variables a launcher sets for one child process: the secret by the path of a file only
    this user may read, or (no file shared with the child: Ray) in its own variable."""
    env = {
        PREFIX + "CLUSTER_ID": cluster.cluster_id,
        PREFIX + "NUM_NODES": str(cluster.num_nodes),
        PREFIX + "WORKERS_PER_NODE": str(cluster.workers_per_node),
        PREFIX + "RENDEZVOUS": cluster.rendezvous,
        PREFIX + "NODE": str(node),
        PREFIX + "MAX_MESSAGE_BYTES": str(cluster.limits.max_message_bytes),
        PREFIX + "SERVER_MEMORY": str(cluster.limits.server_memory_bytes),
        PREFIX + "CONNECT_TIMEOUT": str(cluster.timeouts.connect_s),
        PREFIX + "REQUEST_TIMEOUT": str(cluster.timeouts.request_s),
        PREFIX + "BARRIER_TIMEOUT": str(cluster.timeouts.barrier_s),
        PREFIX + "REPLICA_TIMEOUT": str(cluster.timeouts.replica_s),
        PREFIX + "RESEND_TIMEOUT": str(cluster.timeouts.resend_s),
        PREFIX + "LOCAL_ACCESS": "1" if local_access else "0",
        PREFIX + "LAUNCHER_PID": str(launcher),
    }
    if rank is not None:
        env[PREFIX + "RANK"] = str(rank)
        env[PREFIX + "LOCAL_RANK"] = str(rank % max(cluster.workers_per_node, 1))
    if bind:
        env[PREFIX + "BIND"] = bind
    if secret_file is not None:
        env[PREFIX + "SECRET_FILE"] = str(secret_file)
    elif cluster.secret:
        env[PREFIX + "SECRET"] = cluster.secret.hex()
    return env
