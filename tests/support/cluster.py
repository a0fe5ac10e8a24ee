"""A whole cluster inside the test process: rendezvous, servers and workers in threads.

Server and client logic run for real (codec, request tracking, shared-memory
shards, fd passing); only the sockets are replaced by the in-process transport,
unless a ZeroMQ transport is asked for.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from shoal.api.config import ClusterSpec, Limits, RebalancePolicy, Timeouts
from shoal.api.errors import TableError
from shoal.client.worker import Worker
from shoal.cluster.rendezvous import Rendezvous
from shoal.server.server import ParameterServer
from shoal.transport.base import Transport
from shoal.transport.inproc import InProcTransport
from shoal.wire.codec import Codec

FAST = Timeouts(connect_s=10.0, request_s=10.0, barrier_s=20.0)


class ThreadCluster:
    def __init__(self, nodes: int = 2, workers_per_node: int = 1, transport: Transport | None = None,
                 secret: bytes | None = None, limits: Limits | None = None, timeouts: Timeouts = FAST,
                 rebalance: RebalancePolicy | None = None, metrics: bool = False, lane: bool = False,
                 now: Callable[[], float] = time.monotonic) -> None:
        """``now``: the clock the servers' timers read (a ``ManualClock`` to move it by hand); ``lane``:
        servers with a lane (``server.lane``: it needs a secret and a transport of native sockets on
        loopback tcp)."""
        self.transport = transport or InProcTransport()
        self.inproc = isinstance(self.transport, InProcTransport)
        cluster_id = "t" + uuid.uuid4().hex[:10]
        limits = limits or Limits()
        address = "inproc://rendezvous" if self.inproc else "tcp://127.0.0.1:0"
        self.rendezvous = Rendezvous(self.transport, Codec(limits, secret), address, cluster_id, nodes,
                                     nodes * workers_per_node, rebalance=rebalance,
                                     end_when_workers_leave=False).start()
        self.spec = ClusterSpec(cluster_id, nodes, workers_per_node, self.rendezvous.address, secret, limits,
                                timeouts)
        bind = "inproc://*" if self.inproc else "tcp://127.0.0.1:0"
        self.servers = [ParameterServer(n, self.spec, self.transport, bind=bind, metrics_port=0 if metrics else None,
                                        now=now, lane=lane)
                        for n in range(nodes)]
        self.threads = [threading.Thread(target=s.run, daemon=True, name=f"server-{n}")
                        for n, s in enumerate(self.servers)]
        for t in self.threads:
            t.start()
        self.workers: list[Worker] = []

    def worker(self, rank: int, local_access: bool = True, now: Callable[[], float] = time.monotonic) -> Worker:
        """``now``: the clock the worker's timers read (a ``ManualClock`` to move it by hand)."""
        w = Worker(self.spec, rank, rank // self.spec.workers_per_node, self.transport, local_access=local_access,
                   now=now)
        self.workers.append(w)
        return w

    def all_workers(self, local_access: bool = True) -> list[Worker]:
        return [self.worker(r, local_access) for r in range(self.spec.num_workers)]

    def run_workers(self, body: Callable[[Worker], Any], local_access: bool = True) -> list[Any]:
        """Run ``body(worker)`` for every rank in its own thread; re-raise the first failure."""
        results: list[Any] = [None] * self.spec.num_workers
        errors: list[BaseException] = []

        def run(rank: int) -> None:
            try:
                w = self.worker(rank, local_access)
                results[rank] = body(w)
                w.shutdown()
            except BaseException as exc:  # noqa: BLE001 - handed to the test thread
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(r,)) for r in range(self.spec.num_workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        if errors:
            raise errors[0]
        return results

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()
        for s in self.servers:
            s.stop()
        for t in self.threads:
            t.join(timeout=10)
        self.rendezvous.stop()
        if not self.inproc:
            self.transport.close()

    def __enter__(self) -> ThreadCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fail_first_static_push(cluster: ThreadCluster, node: int) -> None:
    """Server ``node`` answers the first static push it handles with a typed error (one request
    failing at a server that goes on serving: no valid push fails there by itself)."""
    service = cluster.servers[node].static
    original = service._push
    calls = {"n": 0}

    def failing(table, msg):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 1:
            raise TableError("injected server-side failure of one push")
        return original(table, msg)

    service._push = failing


def table_on_every_worker(workers: list[Worker], name: str, *args: Any, **options: Any) -> list[Any]:
    """One table made on every worker at once, from threads (making a table waits for every worker)."""
    out: list[Any] = [None] * len(workers)

    def make(i: int) -> None:
        out[i] = workers[i].table(name, *args, **options)

    threads = [threading.Thread(target=make, args=(i,)) for i in range(len(workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(t is not None for t in out), "table creation did not finish"
    return out

