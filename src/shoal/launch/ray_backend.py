"""Running a Shoal job on a Ray cluster (the ``ray`` extra; use it through ``shoal.ray``).

Each Shoal node becomes one Ray placement group packed onto one machine
(``STRICT_PACK``): a bundle for the server and one per worker, so a node's
workers share its memory segments. The server runs as a child process of a
small server actor (it dies with the actor); node 0's actor also hosts the
rendezvous. Workers are actors that run the training function with the
``SHOAL_*`` variables set, so ``shoal.init()`` inside it joins the cluster.
Ray carries only the function and its return value; parameters travel over
Shoal's own transport, signed with a secret made for the job.
"""

from __future__ import annotations

import os
import runpy
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shoal.api.config import ClusterSpec, Limits, Timeouts
from shoal.api.errors import ClusterError, ConfigError
from shoal.cluster.rendezvous import Rendezvous
from shoal.launch.env import child_env
from shoal.transport.zmq_transport import ZmqTransport
from shoal.wire.codec import Codec

try:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError:  # pragma: no cover - exercised only without the extra
    ray = None  # type: ignore[assignment]


@dataclass(frozen=True)
class RayJobOptions:
    """The shape of a job on Ray and what each role asks of the cluster."""

    nodes: int = 1
    workers_per_node: int = 1
    #: Ray resources of each server and each worker, e.g. ``{"CPU": 2, "GPU": 1}``
    server_resources: Mapping[str, float] = field(default_factory=lambda: {"CPU": 1})
    worker_resources: Mapping[str, float] = field(default_factory=lambda: {"CPU": 1})
    local_access: bool = True
    limits: Limits = field(default_factory=Limits)
    timeouts: Timeouts = field(default_factory=Timeouts)
    #: seconds the whole job may take; ``None``: no limit
    job_timeout_s: float | None = None
    extra_env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.workers_per_node < 1:
            raise ConfigError(f"need at least 1 node and 1 worker per node, got {self.nodes} x {self.workers_per_node}")
        for role, res in (("server", self.server_resources), ("worker", self.worker_resources)):
            if not res or any(v <= 0 for v in res.values()):
                raise ConfigError(f"{role}_resources must ask for something positive (Ray bundles cannot be "
                                  f"empty), got {dict(res)}")


def _actor_options(resources: Mapping[str, float]) -> dict[str, Any]:
    rest = {k: float(v) for k, v in resources.items() if k not in ("CPU", "GPU", "memory")}
    options: dict[str, Any] = {"num_cpus": float(resources.get("CPU", 0)), "num_gpus": float(resources.get("GPU", 0))}
    if "memory" in resources:
        options["memory"] = resources["memory"]
    if rest:
        options["resources"] = rest
    return options


class ServerHost:
    """A Ray actor holding one node's server process (and, on node 0, the rendezvous)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.rendezvous: Rendezvous | None = None
        self.transport: ZmqTransport | None = None

    def address(self) -> str:
        return str(ray.util.get_node_ip_address())

    def host_rendezvous(self, cluster_id: str, nodes: int, workers: int, limits: Limits, secret: bytes) -> str:
        self.transport = ZmqTransport()
        self.rendezvous = Rendezvous(self.transport, Codec(limits, secret), f"tcp://{self.address()}:0",
                                     cluster_id, nodes, workers).start()
        return self.rendezvous.address

    def start(self, env: dict[str, str]) -> int:
        from shoal.launch.lifecycle import die_with_parent

        self.proc = subprocess.Popen([sys.executable, "-m", "shoal.launch.server_main"], env={**os.environ, **env},
                                     stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        return self.proc.pid

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def finished(self) -> bool:
        return self.rendezvous is not None and self.rendezvous.finished

    def stop(self, grace_s: float = 5.0) -> int | None:
        """Wait for the server to leave (it does once every worker left), else end it; reap it."""
        if self.rendezvous is not None:
            self.rendezvous.shutdown_requested = True
        code = None
        if self.proc is not None:
            try:
                code = self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    code = self.proc.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    code = self.proc.wait()
        if self.rendezvous is not None:
            self.rendezvous.stop()
        if self.transport is not None:
            self.transport.close()
        return code


class WorkerHost:
    """A Ray actor running the training function as one Shoal worker."""

    def run(self, env: dict[str, str], fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        os.environ.update(env)
        return fn(*args, **kwargs)


def run_script(path: str, argv: Sequence[str] = ()) -> int:
    """Run a Python script as ``__main__`` with ``argv``, as ``python path argv...`` would; its exit status."""
    path = os.path.abspath(path)
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(path))
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


def _require_ray() -> None:
    if ray is None:
        raise ConfigError("the Ray backend needs Ray: pip install 'shoal[ray]'")
    if not ray.is_initialized():
        ray.init()


def run(fn: Callable[..., Any], options: RayJobOptions, args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on every worker of a Shoal cluster placed on Ray; the results by rank."""
    _require_ray()
    kwargs = dict(kwargs or {})
    cluster_id = secrets.token_hex(6)
    secret = secrets.token_bytes(32)
    workers = options.nodes * options.workers_per_node
    groups = [placement_group([dict(options.server_resources)]
                              + [dict(options.worker_resources)] * options.workers_per_node, strategy="STRICT_PACK")
              for _ in range(options.nodes)]
    servers: list[Any] = []
    hosts: list[Any] = []
    try:
        for node, group in enumerate(groups):
            if not _ready(group, options.timeouts.connect_s):
                raise ClusterError(f"Ray could not place node {node} (server {dict(options.server_resources)} + "
                                   f"{options.workers_per_node} x worker {dict(options.worker_resources)} on one "
                                   f"machine) within {options.timeouts.connect_s}s")
        server_cls: Any = ray.remote(ServerHost)
        for group in groups:
            strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=0)
            servers.append(server_cls.options(scheduling_strategy=strategy,
                                              **_actor_options(options.server_resources)).remote())
        rendezvous = ray.get(servers[0].host_rendezvous.remote(cluster_id, options.nodes, workers, options.limits,
                                                              secret), timeout=options.timeouts.connect_s)
        cluster = ClusterSpec(cluster_id, options.nodes, options.workers_per_node, rendezvous, secret,
                              options.limits, options.timeouts)
        addresses = ray.get([s.address.remote() for s in servers], timeout=options.timeouts.connect_s)
        for node, server in enumerate(servers):
            env = {**options.extra_env, **child_env(cluster, node, None, options.local_access,
                                                    f"tcp://{addresses[node]}:0", launcher=0)}
            env.pop("SHOAL_LAUNCHER_PID")  # the actor is the parent: the server dies with it
            ray.get(server.start.remote(env), timeout=options.timeouts.connect_s)
        worker_cls: Any = ray.remote(WorkerHost)
        calls = []
        for rank in range(workers):
            node, local = divmod(rank, options.workers_per_node)
            strategy = PlacementGroupSchedulingStrategy(placement_group=groups[node],
                                                        placement_group_bundle_index=1 + local)
            host = worker_cls.options(scheduling_strategy=strategy, **_actor_options(options.worker_resources)).remote()
            hosts.append(host)
            env = {**options.extra_env, **child_env(cluster, node, rank, options.local_access, None, launcher=0)}
            env.pop("SHOAL_LAUNCHER_PID")
            calls.append(host.run.remote(env, fn, list(args), kwargs))
        return _collect(calls, servers, options.job_timeout_s)
    finally:
        for server in servers:
            try:
                ray.get(server.stop.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - a dead actor has nothing left to stop
                pass
        for actor in servers + hosts:
            ray.kill(actor)
        for group in groups:
            remove_placement_group(group)


def _ready(group: Any, timeout_s: float) -> bool:
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    return bool(ready)


def _collect(calls: list[Any], servers: list[Any], timeout_s: float | None) -> list[Any]:
    """Wait for every worker; a failed worker or server ends the job with its error."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending = list(calls)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=1.0)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayError as exc:
                raise ClusterError(f"worker {calls.index(ref)} failed: {exc}") from exc
        codes = ray.get([s.poll.remote() for s in servers], timeout=30)
        for node, code in enumerate(codes):
            # A server leaves with 0 once every worker has said goodbye, which can come before the
            # workers' functions return (they may go on after ps.shutdown()): only other codes fail.
            if code not in (None, 0) and pending:
                raise ClusterError(f"the server of node {node} exited with status {code} before the workers finished")
        if deadline is not None and time.monotonic() > deadline:
            raise ClusterError(f"the job did not finish within {timeout_s}s ({len(pending)} worker(s) still running)")
    return [ray.get(ref) for ref in calls]
