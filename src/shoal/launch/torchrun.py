"""Running under ``torchrun``: the same training script, no Shoal launcher.

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr 10.0.0.1 --master-port 29500 train.py

Shoal reads torchrun's environment: ``RANK`` is the worker rank, ``GROUP_RANK``
the node, ``GROUP_WORLD_SIZE`` the number of nodes, ``LOCAL_WORLD_SIZE`` the
workers per node. Roles (``SHOAL_TORCHRUN_ROLE``, default ``colocated``): every
process is a worker, and the process with ``LOCAL_RANK`` 0 on each node starts
that node's server as a detached process; node 0's server also hosts the
rendezvous, at ``MASTER_ADDR`` and ``SHOAL_RENDEZVOUS_PORT`` (default
``MASTER_PORT + 1``). A server leaves when every worker has finished or when
the torchrun agent that started its node is gone. Workers restarted by the
elastic agent find their node's server still running and rejoin.

Every message is authenticated. On one host without ``SHOAL_SECRET`` or
``SHOAL_SECRET_FILE``, the job's processes share a secret made by the first of
them, in a file of the user's private run directory named by the torchrun run id
and port. Across hosts the secret must be given, and servers bind
``SHOAL_BIND_HOST`` (default: the address this host uses to reach ``MASTER_ADDR``).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from shoal.api.config import ClusterSpec, Limits, Timeouts
from shoal.api.errors import ClusterError, ConfigError
from shoal.cluster.fdshare import socket_name
from shoal.launch import env as shoal_env
from shoal.launch.env import ProcessRole
from shoal.launch.status import shared_secret

_LOOPBACK = ("127.", "localhost", "::1")


def detected(environ: Mapping[str, str] | None = None) -> bool:
    environ = os.environ if environ is None else environ
    return "TORCHELASTIC_RUN_ID" in environ and "GROUP_RANK" in environ


def _need(environ: Mapping[str, str], name: str) -> str:
    value = environ.get(name)
    if not value:
        raise ConfigError(f"{name} is not set: is this process started by torchrun?")
    return value


def _int(environ: Mapping[str, str], name: str) -> int:
    raw = _need(environ, name)
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from None


def _local_address(master: str) -> str:
    """The address of this host on the route to ``master`` (no packet is sent)."""
    if master.startswith(_LOOPBACK):
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((master, 9))
        return str(probe.getsockname()[0])
    except OSError as exc:  # no IPv4 route to it (an IPv6 master), or a name that does not resolve
        raise ConfigError(f"MASTER_ADDR {master!r} is no IPv4 host this machine can route to: {exc} (Shoal's "
                          "addresses are IPv4; set SHOAL_BIND_HOST to this host's address)") from None
    finally:
        probe.close()


def role(environ: Mapping[str, str] | None = None) -> ProcessRole:
    environ = os.environ if environ is None else environ
    master = _need(environ, "MASTER_ADDR")
    port = _int(environ, "SHOAL_RENDEZVOUS_PORT") if environ.get("SHOAL_RENDEZVOUS_PORT") else (
        _int(environ, "MASTER_PORT") + 1)
    run_id = re.sub(r"[^A-Za-z0-9_-]", "-", _need(environ, "TORCHELASTIC_RUN_ID"))[:40]
    nodes = _int(environ, "GROUP_WORLD_SIZE") if "GROUP_WORLD_SIZE" in environ else (
        _int(environ, "WORLD_SIZE") // _int(environ, "LOCAL_WORLD_SIZE"))
    cluster_id = f"{run_id}-{port}"
    per_node, node, rank = _int(environ, "LOCAL_WORLD_SIZE"), _int(environ, "GROUP_RANK"), _int(environ, "RANK")
    world = _int(environ, "WORLD_SIZE") if "WORLD_SIZE" in environ else nodes * per_node
    # Every node runs LOCAL_WORLD_SIZE workers here: torchrun allows a different --nproc-per-node on
    # each node, which would make ranks that no server knows (they failed only at their first call).
    if per_node < 1 or nodes < 1 or world != nodes * per_node or not 0 <= node < nodes or not 0 <= rank < world:
        raise ConfigError(f"torchrun's world does not fit one job of equal nodes: WORLD_SIZE {world}, GROUP_WORLD_SIZE "
                          f"{nodes}, LOCAL_WORLD_SIZE {per_node}, GROUP_RANK {node}, RANK {rank} (every node must "
                          "run the same --nproc-per-node)")
    secret = shoal_env.read_secret(environ)
    if secret is None:
        if not master.startswith(_LOOPBACK):
            raise ConfigError("torchrun across hosts needs a shared secret: set SHOAL_SECRET or SHOAL_SECRET_FILE")
        secret = shoal_env.read_secret({"SHOAL_SECRET_FILE": str(_job_secret_file(cluster_id))})
    host = environ.get("SHOAL_BIND_HOST") or _local_address(master)
    defaults = Timeouts()
    cluster = ClusterSpec(
        cluster_id=cluster_id, num_nodes=nodes, workers_per_node=per_node,
        rendezvous=f"tcp://{master}:{port}", secret=secret, limits=Limits(),
        timeouts=Timeouts(connect_s=shoal_env.seconds(environ, "CONNECT_TIMEOUT", defaults.connect_s)),
    )
    return ProcessRole(cluster=cluster, node=node, rank=rank,
                       local_access=environ.get("SHOAL_LOCAL_ACCESS", "1") not in ("0", "false", "no"),
                       bind=f"tcp://{host}:0")


def _job_secret_file(cluster_id: str) -> Path:
    """The secret every process of the job on this host shares (several torchrun invocations may
    make one job here, as nodes of it); node 0's server removes it when it ends."""
    return shared_secret(f"torchrun-{cluster_id}")


def _server_running(cluster: ClusterSpec, node: int) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(socket_name(cluster.cluster_id, node))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def start_node_services(r: ProcessRole, environ: Mapping[str, str] | None = None) -> None:
    """On each node's ``LOCAL_RANK`` 0: start the node's server (detached), unless one already runs."""
    environ = os.environ if environ is None else environ
    role_name = environ.get("SHOAL_TORCHRUN_ROLE", "colocated")
    if role_name != "colocated":
        raise ConfigError(f"SHOAL_TORCHRUN_ROLE must be 'colocated', got {role_name!r}")
    if environ.get("LOCAL_RANK", "0") != "0" or _server_running(r.cluster, r.node):
        return
    given = shoal_env.read_secret(environ) is not None  # else the job's shared secret file (``role``)
    secret_file = None if given else _job_secret_file(r.cluster.cluster_id)
    child = shoal_env.child_env(r.cluster, r.node, None, r.local_access, r.bind, launcher=os.getppid(),
                                secret_file=secret_file)
    if secret_file is not None and r.node == 0:
        child["SHOAL_OWNS_SECRET_FILE"] = "1"  # it hosts the rendezvous, and leaves last
    child.pop("SHOAL_LAUNCHER_PID")  # detached: it watches the torchrun agent instead
    child["SHOAL_WATCH_PID"] = str(os.getppid())
    if r.node == 0:
        child["SHOAL_HOST_RENDEZVOUS"] = "1"
    subprocess.Popen([sys.executable, "-m", "shoal.launch.server_main"], env={**os.environ, **child},
                     stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + r.cluster.timeouts.connect_s
    while not _server_running(r.cluster, r.node):
        if time.monotonic() > deadline:
            raise ClusterError(f"the server of node {r.node} did not start within {r.cluster.timeouts.connect_s}s")
        time.sleep(0.05)
