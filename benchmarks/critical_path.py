"""Where a 1-key pull's round trip goes, segment by segment: Shoal against raw pyzmq.

The caller and the server run as two processes (the server's forked off, as a
launched job's are), and each notes ``time.perf_counter()`` (the machine's one
monotonic clock, the same in both processes) when a message leaves and when one
arrives: Shoal's through a ZeroMQ transport whose listeners and connections take
the notes, raw pyzmq's around its own ``send`` and ``recv``. Each call is split
into the caller's work before its request leaves, the wire to the server
(sending, ZeroMQ's I/O threads, the wake-up, receiving), the server's work, the
wire back, and the caller's work once the reply is in. Medians over every call:
where raw pyzmq and Shoal spend the same (the wire) and where Shoal spends more.
"""

from __future__ import annotations

import bisect
import multiprocessing as mp
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection as Pipe
from typing import Any

import numpy as np
import zmq

import shoal
from shoal.api.config import ClusterSpec, Limits
from shoal.client.worker import Worker
from shoal.cluster.rendezvous import Rendezvous
from shoal.server.server import ParameterServer
from shoal.transport.base import Connection, Frames, Listener
from shoal.transport.zmq_transport import ZmqConnection, ZmqListener, ZmqTransport
from shoal.wire.codec import Codec

DIM = 64
SEGMENTS = ("caller: the call until its request leaves", "wire to the server", "server: request in to reply out",
            "wire back", "caller: reply in to the call's return", "round trip")
Stamps = list[tuple[str, float]]  # ("sent" | "received", perf_counter)


class _NotingListener(ZmqListener):
    stamps: Stamps

    def recv(self, timeout: float | None) -> tuple[bytes, Frames] | None:
        item = super().recv(timeout)
        if item is not None:
            self.stamps.append(("received", time.perf_counter()))
        return item

    def send(self, peer: bytes, frames: Sequence[Any]) -> bool:
        self.stamps.append(("sent", time.perf_counter()))
        return super().send(peer, frames)


class _NotingConnection(ZmqConnection):
    stamps: Stamps

    def send(self, frames: Sequence[Any], block: bool = True) -> bool:
        self.stamps.append(("sent", time.perf_counter()))
        return super().send(frames, block)

    def recv(self, timeout: float | None) -> Frames | None:
        frames = super().recv(timeout)
        if frames is not None:
            self.stamps.append(("received", time.perf_counter()))
        return frames


class NotingTransport(ZmqTransport):
    """ZeroMQ whose listeners note when each message arrives and each answer leaves, and whose
    connection to ``noted`` (the worker's to its server; not the rendezvous's) when each request
    leaves and each reply arrives."""

    def __init__(self, noted: str | None = None) -> None:
        super().__init__()
        self.stamps: Stamps = []
        self.noted = noted

    def listen(self, address: str, max_frame_bytes: int | None = None) -> Listener:
        listener = _NotingListener(self.ctx, address, max_frame_bytes)
        listener.stamps = self.stamps
        return listener

    def connect(self, address: str) -> Connection:
        if address != self.noted:
            return ZmqConnection(self.ctx, address)
        conn = _NotingConnection(self.ctx, address)
        conn.stamps = self.stamps
        return conn


def _serve_shoal(pipe: Pipe, cluster_id: str, secret: bytes) -> None:
    """A rendezvous and a server noting their messages; the notes go back on ``pipe`` when asked."""
    transport, quiet = NotingTransport(), ZmqTransport()  # the rendezvous's own messages are not noted
    limits = Limits()
    rendezvous = Rendezvous(quiet, Codec(limits, secret), "tcp://127.0.0.1:0", cluster_id, 1, 1,
                            end_when_workers_leave=False).start()
    server = ParameterServer(0, ClusterSpec(cluster_id, 1, 1, rendezvous.address, secret, limits), transport,
                             share_memory=False)
    pipe.send((rendezvous.address, server.address))

    def control() -> None:
        pipe.recv()  # the calls start: what came before is set-up
        transport.stamps.clear()
        pipe.recv()
        pipe.send(list(transport.stamps))
        server.stop()

    threading.Thread(target=control, daemon=True).start()
    server.run()
    rendezvous.stop()
    transport.close()
    quiet.close()


def _serve_raw(pipe: Pipe) -> None:
    """A ROUTER answering each request with one row (``bench_pull_push.py``'s raw contender), noting
    when each request arrives and each reply leaves."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    pipe.send(sock.bind_to_random_port("tcp://127.0.0.1"))
    row = np.ones((1, DIM), np.float32)
    stamps: Stamps = []
    while True:
        parts = sock.recv_multipart(copy=False)
        stamps.append(("received", time.perf_counter()))
        if parts[1].bytes == b"quit":
            break
        stamps.append(("sent", time.perf_counter()))
        sock.send_multipart([parts[0], row], copy=False)
    pipe.send(stamps[:-1])
    sock.close(0)
    ctx.term()


def _segments(calls: list[tuple[float, float]], caller: Stamps, server: Stamps) -> list[float]:
    """Median µs of each segment, over the calls whose four stamps were all found inside them."""
    sent = [t for kind, t in caller if kind == "sent"]
    back = [t for kind, t in caller if kind == "received"]
    arrived = [t for kind, t in server if kind == "received"]
    answered = [t for kind, t in server if kind == "sent"]

    def first(times: list[float], start: float, end: float) -> float | None:
        i = bisect.bisect_left(times, start)
        return times[i] if i < len(times) and times[i] <= end else None

    rows = []
    for start, end in calls:
        a, b, c, d = (first(times, start, end) for times in (sent, arrived, answered, back))
        if a is not None and b is not None and c is not None and d is not None:
            rows.append((a - start, b - a, c - b, d - c, end - d, end - start))
    return [float(v) for v in np.median(np.array(rows) * 1e6, axis=0)]


def _timed(call: Callable[[], object], count: int) -> list[tuple[float, float]]:
    clock = time.perf_counter
    spans = []
    for _ in range(count):
        start = clock()
        call()
        spans.append((start, clock()))
    return spans


def shoal_segments(count: int) -> list[float]:
    context = mp.get_context("spawn")  # a fresh interpreter: nothing of this one's sockets or threads
    mine, theirs = context.Pipe()
    secret, cluster_id = os.urandom(32), "b" + uuid.uuid4().hex[:10]
    process = context.Process(target=_serve_shoal, args=(theirs, cluster_id, secret), daemon=True)
    process.start()
    rendezvous, server = mine.recv()
    transport = NotingTransport(noted=server)
    worker = Worker(ClusterSpec(cluster_id, 1, 1, rendezvous, secret, Limits()), 0, 0, transport,
                    local_access=False)
    try:
        table = worker.table("path", 100_000, DIM, init=shoal.Normal(std=0.1), optimizer=shoal.optim.SGD(lr=1e-6))
        keys = np.array([12_345], dtype=np.int64)
        _timed(lambda: table.pull(keys), 1000)  # warm: compiled kernels, connections
        mine.send("start")
        transport.stamps.clear()
        calls = _timed(lambda: table.pull(keys), count)
        mine.send("stop")
        return _segments(calls, list(transport.stamps), mine.recv())
    finally:
        worker.shutdown()
        process.join(30)
        transport.close()


def raw_segments(count: int) -> list[float]:
    context = mp.get_context("spawn")
    mine, theirs = context.Pipe()
    process = context.Process(target=_serve_raw, args=(theirs,), daemon=True)
    process.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{mine.recv()}")
    keys = np.array([12_345], dtype=np.int64)
    stamps: Stamps = []
    clock = time.perf_counter

    def pull() -> None:
        stamps.append(("sent", clock()))
        sock.send_multipart([b"pull", keys], copy=False)
        reply = sock.recv_multipart(copy=False)
        stamps.append(("received", clock()))
        np.frombuffer(reply[0].buffer, np.float32)

    _timed(pull, 1000)
    stamps.clear()
    calls = _timed(pull, count)
    sock.send_multipart([b"quit", b""])
    server = [s for s in mine.recv() if s[1] >= calls[0][0]]  # the warm-up's notes were the server's too
    process.join(30)
    sock.close(0)
    ctx.term()
    return _segments(calls, stamps, server)
