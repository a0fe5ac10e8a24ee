"""Python work per remote request: function calls and profiled time, worker and server side.

    python benchmarks/bench_request_cost.py [--requests 3000]

A rendezvous, one server and one worker run in this process over real ZeroMQ
sockets on loopback tcp, authenticated as every job is. The worker pulls (then
pushes) one 64-float row at a time with ``local_access=False``, so each call is
one request to the server and one reply. ``cProfile`` runs in the server's
thread and in the worker's, counting every Python function call each side makes
per request. Unlike wall time on a shared machine, the count does not change
from run to run: it is the measure of the Python work per message that the
per-message target is about. Profiled times are inflated by the profiler and by
the two sides sharing one interpreter; read them as shares, not as latency
(``bench_pull_push.py`` measures that, against raw pyzmq).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import threading
import uuid

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import shoal  # noqa: E402
from common import write_results  # noqa: E402
from shoal.api.config import ClusterSpec, Limits  # noqa: E402
from shoal.client.worker import Worker  # noqa: E402
from shoal.cluster.rendezvous import Rendezvous  # noqa: E402
from shoal.server.server import ParameterServer  # noqa: E402
from shoal.transport.zmq_transport import ZmqTransport  # noqa: E402
from shoal.wire.codec import Codec  # noqa: E402

DIM = 64
TOP = 12


def per_request(profile: cProfile.Profile, requests: int) -> dict[str, object]:
    """Calls and profiled microseconds per request, and the functions costing most."""
    stats = pstats.Stats(profile)
    table = stats.stats  # type: ignore[attr-defined]
    calls = sum(nc for (_, _, _), (_, nc, _, _, _) in table.items()) / requests
    own = sorted(((tt, nc, f"{os.path.basename(f)}:{line} {name}") for (f, line, name), (_, nc, tt, _, _)
                  in table.items()), reverse=True)
    waiting = {"poll", "acquire"}  # blocked in the poller or on the GIL, not working
    busy = sum(tt for tt, _, where in own if where.rsplit(" ", 1)[-1] not in waiting)
    return {"calls": round(calls, 1), "busy_us": round(busy / requests * 1e6, 1),
            "top": [{"where": where, "calls": round(nc / requests, 2), "us": round(tt / requests * 1e6, 1)}
                    for tt, nc, where in own if where.rsplit(" ", 1)[-1] not in waiting][:TOP]}


def measure(op: str, requests: int) -> dict[str, object]:
    transport = ZmqTransport()
    secret = os.urandom(32)
    limits = Limits()
    cluster_id = "b" + uuid.uuid4().hex[:10]
    rendezvous = Rendezvous(transport, Codec(limits, secret), "tcp://127.0.0.1:0", cluster_id, 1, 1,
                            end_when_workers_leave=False).start()
    spec = ClusterSpec(cluster_id, 1, 1, rendezvous.address, secret, limits)
    server = ParameterServer(0, spec, transport, share_memory=False)
    server_profile = cProfile.Profile()
    serving = threading.Event()

    def serve() -> None:
        server_profile.enable()
        serving.set()
        try:
            server.run()
        finally:
            server_profile.disable()

    thread = threading.Thread(target=serve, name="server-0", daemon=True)
    thread.start()
    serving.wait()
    worker = Worker(spec, 0, 0, transport, local_access=False)
    try:
        table = worker.table("cost", 100_000, DIM, init=shoal.Normal(std=0.1), optimizer=shoal.optim.SGD(lr=1e-6))
        keys = np.array([12_345], dtype=np.int64)
        values = np.ones((1, DIM), np.float32)

        def call() -> None:
            if op == "pull":
                table.pull(keys)
            else:
                table.push(keys, values)

        for _ in range(500):  # warm: compiled kernels, connections, round-trip estimates
            call()
        server_profile.clear()  # type: ignore[attr-defined]
        worker_profile = cProfile.Profile()
        worker_profile.enable()
        for _ in range(requests):
            call()
        worker_profile.disable()
        server_profile.disable()  # the server thread keeps the profile it has: stop counting now
        return {"op": op, "requests": requests, "worker": per_request(worker_profile, requests),
                "server": per_request(server_profile, requests)}
    finally:
        worker.shutdown()
        server.stop()
        thread.join(timeout=10)
        rendezvous.stop()
        transport.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args()
    results = [measure(op, args.requests) for op in ("pull", "push")]
    lines = ["Python work per remote request of one 64-float row (authenticated, loopback tcp).", "",
             "| op | worker calls | server calls | worker µs (profiled) | server µs (profiled) |",
             "|---|---:|---:|---:|---:|"]
    for r in results:
        w, s = r["worker"], r["server"]
        lines.append(f"| {r['op']} | {w['calls']} | {s['calls']} | {w['busy_us']} | {s['busy_us']} |")  # type: ignore[index]
    for r in results:
        for side in ("worker", "server"):
            lines += ["", f"{r['op']}, {side}: most costly functions (own time per request, profiled)", "",
                      "| function | calls | µs |", "|---|---:|---:|"]
            lines += [f"| {t['where']} | {t['calls']} | {t['us']} |" for t in r[side]["top"]]  # type: ignore[index]
    text = "\n".join(lines)
    print(text)
    write_results("request_cost", {"dim": DIM, "results": results}, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
