"""Emulated hosts: network namespaces joined by veth pairs to a bridge, rates capped with ``tc tbf``.

Each "host" is a namespace with one address in 198.18.0.0/24 (a range set aside
for benchmarking). The bridge lives in a namespace of its own, so nothing touches
the machine's own interfaces, and everything is deleted on exit. The kernel here
has no ``netem``: delay and loss come from Shoal's fault-injecting transport
(``SHOAL_FAULTS``), not from ``tc``.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Mapping, Sequence

SUBNET = "198.18.0"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"shoalprobe{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
    except FileNotFoundError:
        return "the `ip` command (iproute2) is not installed"
    except subprocess.CalledProcessError as exc:
        return f"network namespaces are not permitted here: {exc.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return None


class EmulatedHosts:
    """``count`` namespaces on one bridge; ``rate`` (e.g. ``"1gbit"``) caps each host's egress."""

    def __init__(self, count: int, rate: str | None = "1gbit") -> None:
        self.tag = secrets.token_hex(3)
        self.count = count
        self.rate = rate
        self.hub = f"shoal{self.tag}hub"
        self.names = [f"shoal{self.tag}h{i}" for i in range(count)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(count)]

    def __enter__(self) -> EmulatedHosts:
        try:
            _ip("netns", "add", self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for i, name in enumerate(self.names):
                _ip("netns", "add", name)
                _ip("link", "add", "eth0", "netns", name, "type", "veth", "peer", "name", f"port{i}", "netns",
                    self.hub)
                _ip("-n", name, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "lo", "up")
                _ip("-n", name, "link", "set", "eth0", "up")
                _ip("-n", self.hub, "link", "set", f"port{i}", "master", "br0")
                _ip("-n", self.hub, "link", "set", f"port{i}", "up")
                if self.rate:
                    subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
                                    "rate", self.rate, "burst", "256kb", "latency", "50ms"],
                                   check=True, capture_output=True, timeout=10)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for name in [*self.names, self.hub]:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)

    def popen(self, host: int, command: Sequence[str], env: Mapping[str, str] | None = None,
              **kwargs: object) -> subprocess.Popen[str]:
        """Start ``command`` inside host ``host``'s namespace."""
        return subprocess.Popen(["ip", "netns", "exec", self.names[host], *command],
                                env={**os.environ, **(env or {})}, text=True, **kwargs)  # type: ignore[call-overload]

    def run(self, host: int, command: Sequence[str], timeout: float, **kwargs: object) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.names[host], *command], text=True, timeout=timeout,
                              **kwargs)  # type: ignore[call-overload]

    def link(self, host: int, up: bool) -> None:
        """Take host ``host``'s link down (a partition) or up again."""
        _ip("-n", self.names[host], "link", "set", "eth0", "up" if up else "down")


def run_cluster(hosts: EmulatedHosts, worker_command: Sequence[str], secret_file: str, faults: str = "",
                timeout: float = 300.0, extra_env: Mapping[str, str] | None = None) -> list[str]:
    """A server and a worker on every host, started as any scheduler would: ``shoal.launch.server_main``
    and the worker command, each given only the documented ``SHOAL_*`` variables. Node 0's server
    hosts the rendezvous. Returns each worker's output; raises if a process fails or overruns."""
    common = {
        "SHOAL_CLUSTER_ID": f"emulated-{hosts.tag}", "SHOAL_NUM_NODES": str(hosts.count),
        "SHOAL_WORKERS_PER_NODE": "1", "SHOAL_RENDEZVOUS": f"tcp://{hosts.addresses[0]}:29400",
        "SHOAL_SECRET_FILE": secret_file, "SHOAL_CONNECT_TIMEOUT": "30", **(extra_env or {}),
    }
    if faults:
        common["SHOAL_FAULTS"] = faults
    servers: list[subprocess.Popen[str]] = []
    workers: list[subprocess.Popen[str]] = []
    try:
        for host in range(hosts.count):
            env = {**common, "SHOAL_NODE": str(host), "SHOAL_BIND": f"tcp://{hosts.addresses[host]}:0"}
            if host == 0:
                env["SHOAL_HOST_RENDEZVOUS"] = "1"
            servers.append(hosts.popen(host, [sys.executable, "-m", "shoal.launch.server_main"], env))
        for host in range(hosts.count):
            env = {**common, "SHOAL_NODE": str(host), "SHOAL_RANK": str(host)}
            workers.append(hosts.popen(host, worker_command, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        outputs = [w.communicate(timeout=timeout)[0] for w in workers]
        failed = [i for i, w in enumerate(workers) if w.returncode != 0]
        if failed:
            raise RuntimeError(f"workers {failed} failed:\n" + "\n".join(outputs[i] for i in failed))
        codes = [s.wait(timeout=15) for s in servers]  # servers leave once every worker has left
        if any(codes):
            raise RuntimeError(f"servers exited with {codes}")
        return outputs
    finally:
        for p in servers + workers:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
