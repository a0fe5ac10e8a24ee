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

It also times, unprofiled and in a tight loop, the steps no authenticated request
can skip on either side (``floor``): what pyzmq costs to send and receive the
frames of a request and of its reply, and what the codec costs to encode and
decode them. Raw pyzmq (``bench_pull_push.py``'s contender) sends and receives
frames too, so what a request must cost beyond raw pyzmq's round trip is the
codec's steps and what Shoal's frames cost more than raw pyzmq's (timed side by
side): raw pyzmq's round trip plus that is the lower bound for a 1-key pull.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import threading
import time
import uuid
from collections.abc import Callable

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import critical_path  # noqa: E402
import shoal  # noqa: E402
from common import write_results  # noqa: E402
from shoal.api.config import ClusterSpec, Limits  # noqa: E402
from shoal.client.worker import Worker  # noqa: E402
from shoal.cluster.rendezvous import Rendezvous  # noqa: E402
from shoal.server.server import ParameterServer  # noqa: E402
from shoal.transport.zmq_transport import ZmqTransport  # noqa: E402
from shoal.wire.codec import Codec  # noqa: E402
from shoal.wire.message import Message  # noqa: E402
from shoal.wire.ops import Op  # noqa: E402

DIM = 64
TOP = 12
#: raw pyzmq's own frames: part of its round trip already, so not of what Shoal adds to it
RAW_ROWS = ("raw pyzmq: send and receive its request's frames", "raw pyzmq: send and receive its reply's frames")


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


def _cpu_us(fn: Callable[[], object], calls: int = 20_000) -> float:
    """CPU microseconds per call of ``fn`` in a tight loop (the best of three runs)."""
    best = float("inf")
    for _ in range(3):
        start = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - start) / calls * 1e6)
    return best


def floor() -> list[tuple[str, float]]:
    """The unavoidable steps of one authenticated 1-row pull, per side, hot (CPU µs per message)."""
    import zmq

    codec = Codec(Limits(), os.urandom(32), local=True)
    request = Message(Op.PULL, req=7, table="cost", epoch=1, clock=3, sender=0, incarnation=123_456_789,
                      body={"stream": [123_456_789, 7, 6, 2]}, arrays=[np.array([12_345], np.int64)])
    reply = request.reply(Op.VALUES, {"seen": 7}, arrays=[np.ones((1, DIM), np.float32)])
    request_frames, reply_frames = codec.encode(request), codec.encode(reply)
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    more = int(zmq.SNDMORE)

    def send_receive(frames: list[object], sender: zmq.Socket[bytes], receiver: zmq.Socket[bytes]) -> None:
        for frame in frames[:-1]:
            sender.send(frame, more, copy=False)
        sender.send(frames[-1], 0, copy=False)
        receiver.recv_multipart(copy=False)

    dealer.send(b"hello")
    peer = router.recv_multipart()[0]
    raw_request, raw_reply = [b"pull", request.arrays[0]], [peer, reply.arrays[0]]  # bench_pull_push's raw frames
    rows: list[tuple[str, float]] = [
        ("pyzmq: send and receive the request's frames", _cpu_us(lambda: send_receive(request_frames, dealer, router))),
        ("pyzmq: send and receive the reply's frames", _cpu_us(lambda: send_receive([peer, *reply_frames], router,
                                                                                       dealer))),
        (RAW_ROWS[0], _cpu_us(lambda: send_receive(raw_request, dealer, router))),
        (RAW_ROWS[1], _cpu_us(lambda: send_receive(raw_reply, router, dealer))),
        ("codec: encode the request", _cpu_us(lambda: codec.encode(request))),
        ("codec: decode the request", _cpu_us(lambda: codec.decode(request_frames))),
        ("codec: encode the reply", _cpu_us(lambda: codec.encode(reply))),
        ("codec: decode the reply", _cpu_us(lambda: codec.decode(reply_frames))),
    ]
    dealer.close(0)
    router.close(0)
    ctx.term()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--trips", type=int, default=5000, help="round trips timed segment by segment")
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
    steps = floor()
    lines += ["", "What no authenticated pull can skip, timed alone in a tight loop (CPU µs per message, both "
              "sides of the wire in one thread: pyzmq's rows count a send and its receive)", "",
              "| step | µs |", "|---|---:|"]
    lines += [f"| {what} | {us:.1f} |" for what, us in steps]
    shoal_steps = sum(us for what, us in steps if what not in RAW_ROWS)
    beyond_raw = shoal_steps - sum(us for what, us in steps if what in RAW_ROWS)
    lines.append(f"| **sum of Shoal's steps: both sides of one round trip** | **{shoal_steps:.1f}** |")
    lines.append(f"| **beyond raw pyzmq's round trip (its frames' rows taken off)** | **{beyond_raw:.1f}** |")
    raw, ours = critical_path.raw_segments(args.trips), critical_path.shoal_segments(args.trips)
    lines += ["", f"A 1-key pull's round trip, worker and server in two processes: median µs of each segment over "
              f"{args.trips:,} calls (the wire: sending, ZeroMQ's I/O threads, the receiver's wake-up, receiving)", "",
              "| segment | raw pyzmq | Shoal | Shoal - raw |", "|---|---:|---:|---:|"]
    lines += [f"| {what} | {r:.1f} | {o:.1f} | {o - r:+.1f} |"
              for what, r, o in zip(critical_path.SEGMENTS, raw, ours, strict=True)]
    text = "\n".join(lines)
    print(text)
    write_results("request_cost", {"dim": DIM, "results": results, "floor_us": dict(steps),
                                   "beyond_raw_us": round(beyond_raw, 1),
                                   "round_trip_us": {"segments": list(critical_path.SEGMENTS), "raw": raw,
                                                     "shoal": ours}}, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
