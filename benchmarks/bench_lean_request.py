"""How fast a remote request can be: a 1-key pull through the leanest path in Python that keeps
Shoal's checks, the same steps compiled, raw pyzmq and Shoal, side by side.

    python benchmarks/bench_lean_request.py [--calls 5000] [--rounds 5]

The per-message target asks a 1-key remote pull within 1.5x of raw pyzmq's round
trip moving the same bytes. Shoal's path is a chain of layers on both sides
(``request_cost.md``). The lean contender is what a fast path in Python could
at best be: one function a side, no layers, each step of Shoal's request that a
guarantee needs and nothing else, with Shoal's own codec pieces:

* worker: the keys checked (int64, in range) and their shard found; the header
  (the codec's msgspec ``Header``) with the request's number, the sender, its
  incarnation and its place in the worker's stream; the keyed BLAKE3 tag over it
  (loopback: the header alone, as Shoal's codec signs there); one send; a wait
  bounded by a timeout (the socket's receive timeout), as a request that may be
  lost must have; the
  reply's tag checked, its header decoded and matched to the request, its rows
  viewed in place once their size fits the header's shape.
* server: one receive; the tag checked and the header decoded; the version, op,
  table and frames checked; the replay guard (a request number not taken from
  that sender's incarnation before, else its kept reply sent again); the
  stream's order (the worker's next request); the keys checked and the rows
  gathered under the shard's stripe lock (a thread lock and an fcntl record lock,
  as a node's processes share them); the reply's header and tag; one send; the
  reply kept for a repeat.

Left out, as a fast path would check them cheaply or not need them on a static
ASP table: metrics (counters, latency histograms, CPU accounting), clocks and
staleness (no read waits under ASP), slice moves (a table-wide flag), the
process cache (none under ASP), error replies (the slow path's).

The compiled contender takes the same steps with each side in one compiled function
(``compiled_request.py``): numba calls the libzmq that pyzmq ships and the C library's locks
through ``ctypes``, on pyzmq's own sockets, and computes the keyed BLAKE3 tag itself; its
header is a fixed row of int64s instead of msgpack. It is what the request costs once it
leaves the interpreter.

Each contender's server is a process of its own (Shoal's: a one-node job's server,
which this script joins as the only worker); rounds of ``--calls`` calls
alternate between them, and each round counts the caller's CPU and the serving
process's (``/proc``), as ``bench_pull_push.py`` does.
"""

from __future__ import annotations

import argparse
import fcntl
import hmac
import os
import secrets
import subprocess
import sys
import tempfile
import threading

import blake3
import msgspec
import numpy as np
import zmq

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_pull_push  # noqa: E402
import compiled_request as compiled  # noqa: E402
from common import write_results  # noqa: E402
from shoal.wire import keyed_hash  # noqa: E402
from shoal.wire.keyed_hash import key_words  # noqa: E402

NUM_KEYS = 200_000
DIM = 64
SHARD_KEYS = NUM_KEYS  # one server, one shard
STRIPES = 64
TIMEOUT_MS = 10_000
TABLE = "bench"


def _codec_parts() -> tuple[type, int, int, int, int, int]:
    from shoal.wire.codec import TAG_BYTES, Header
    from shoal.wire.ops import PROTOCOL_VERSION, Flag, Op

    return Header, TAG_BYTES, PROTOCOL_VERSION, int(Flag.SIGNED_HEADER), int(Op.PULL), int(Op.VALUES)


def lean_server(secret: bytes) -> None:
    """Serve lean pulls of one table until a request for table ``quit`` comes."""
    from shoal.storage.kernels import first_out_of_range, gather_rows
    from shoal.wire.codec import tag_key

    header_type, tag_bytes, version, signed_header, pull, values_op = _codec_parts()
    key = tag_key(secret)
    encode = msgspec.msgpack.Encoder().encode
    decode = msgspec.msgpack.Decoder(header_type).decode
    rows = np.random.default_rng(0).random((SHARD_KEYS, DIM), dtype=np.float32)
    first_out_of_range(np.zeros(1, np.int64), 1)  # compiled before the first request
    gather_rows(rows, np.zeros(1, np.int64), np.empty((1, DIM), np.float32))
    stripes = tempfile.TemporaryFile()
    stripes_fd = stripes.fileno()
    thread_lock = threading.Lock()
    incarnation = secrets.randbits(40)
    replay: dict[int, tuple[int, int, list[object]]] = {}  # sender: (incarnation, last req, its reply)
    next_seq: dict[int, int] = {}  # sender: the next request of its stream

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    print(sock.bind_to_random_port("tcp://127.0.0.1"), flush=True)
    while True:
        peer, first, *arrays = sock.recv_multipart(copy=False)
        frame = first.buffer
        if frame.nbytes <= tag_bytes:
            continue  # unsigned: the slow path refuses it
        head = frame[:-tag_bytes]
        if not hmac.compare_digest(blake3.blake3(head, key=key).digest(), frame[-tag_bytes:]):
            continue  # a wrong tag: the slow path refuses it
        h = decode(head)
        if h.table == "quit":
            break
        if h.v != version or h.op != pull or h.table != TABLE or len(arrays) != 1 or h.dtype != ["<i8"]:
            continue  # the slow path's
        seen = replay.get(h.sender)
        if seen is not None and seen[0] == h.inc and h.req <= seen[1]:
            if h.req == seen[1]:
                sock.send_multipart(seen[2], copy=False)  # sent again: answered again
            continue
        stream = h.body.get("stream")
        if type(stream) is not list or len(stream) != 4 or stream[1] != next_seq.get(h.sender, 1):
            continue  # out of its stream's order: the slow path holds it
        next_seq[h.sender] = stream[1] + 1
        keys = np.frombuffer(arrays[0].buffer, dtype=np.int64)
        count = keys.shape[0]
        if h.shapes != [[count]] or first_out_of_range(keys, SHARD_KEYS) >= 0:
            continue  # the slow path answers with the error
        out = np.empty((count, DIM), dtype=np.float32)
        stripe = int(keys[0]) % STRIPES
        with thread_lock:
            fcntl.lockf(stripes_fd, fcntl.LOCK_SH, 1, stripe, os.SEEK_SET)
            gather_rows(rows, keys, out)
            fcntl.lockf(stripes_fd, fcntl.LOCK_UN, 1, stripe, os.SEEK_SET)
        reply = encode(header_type(version, values_op, h.req, h.table, h.epoch, h.clock, 0, incarnation, signed_header,
                                   ["<f4"], [[count, DIM]], {"seen": stream[1]}))
        frames: list[object] = [peer, reply + blake3.blake3(reply, key=key).digest(), out]
        sock.send_multipart(frames, copy=False)
        replay[h.sender] = (h.inc, h.req, frames)
    sock.close(0)
    ctx.term()


def compiled_server(secret: bytes) -> None:
    """Serve compiled pulls of one table (``compiled_request.serve``) until a request for table ``quit``."""
    from shoal.wire.codec import tag_key

    rows = np.random.default_rng(0).random((SHARD_KEYS, DIM), dtype=np.float32)
    stripes = tempfile.TemporaryFile()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    print(sock.bind_to_random_port("tcp://127.0.0.1"), flush=True)
    compiled.serve(sock.underlying, key_words(tag_key(secret)), rows, stripes.fileno(), compiled.new_mutex(),
                   secrets.randbits(40), STRIPES)
    sock.close(0)
    ctx.term()


class CompiledClient:
    """The worker's side of a compiled pull: one call of ``compiled_request.pull``."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], port: int, secret: bytes, sender: int = 0) -> None:
        from shoal.wire.codec import tag_key

        self.key = key_words(tag_key(secret))
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.handle = self.sock.underlying
        self.state = np.array([sender, secrets.randbits(40), 0, 0], dtype=np.int64)
        self.frame = np.empty(compiled.FRAME0, np.uint8)
        self.tag = np.empty(compiled.TAG_BYTES, np.uint8)
        self.scratch = np.empty(2, np.int64)

    def pull(self, keys: np.ndarray) -> np.ndarray:
        if keys.dtype != np.int64 or keys.ndim != 1:
            raise ValueError("keys must be a vector of int64")
        out = np.empty((keys.shape[0], DIM), dtype=np.float32)
        code = compiled.pull(self.handle, self.key, keys, NUM_KEYS, out, self.state, self.frame, self.tag, self.scratch)
        if code:
            raise RuntimeError(f"compiled pull failed ({code}: see compiled_request.pull)")
        return out

    def quit(self) -> None:
        frame = np.zeros(compiled.FRAME0, np.uint8)
        head = frame[:compiled.HEADER_BYTES].view(np.int64)
        head[0], head[3] = compiled.VERSION, compiled.QUIT
        keyed_hash.keyed_blake3(self.key, frame, compiled.HEADER_BYTES, frame, compiled.HEADER_BYTES)
        self.sock.send(frame)
        self.sock.close(linger=1000)


class LeanClient:
    """The worker's side of a lean pull."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], port: int, secret: bytes, sender: int = 0) -> None:
        from shoal.storage.kernels import first_out_of_range
        from shoal.wire.codec import tag_key

        self.first_out_of_range = first_out_of_range
        (self.header_type, self.tag_bytes, self.version, self.signed_header, self.pull_op,
         self.values_op) = _codec_parts()
        self.key = tag_key(secret)
        self.encode = msgspec.msgpack.Encoder().encode
        self.decode = msgspec.msgpack.Decoder(self.header_type).decode
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)  # the wait's bound, without a poll before each receive
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.sender = sender
        self.incarnation = secrets.randbits(40)
        self.req = 0
        self.seq = 0

    def pull(self, keys: np.ndarray) -> np.ndarray:
        count = keys.shape[0]
        if keys.dtype != np.int64 or keys.ndim != 1 or self.first_out_of_range(keys, NUM_KEYS) >= 0:
            raise ValueError("keys must be int64 in range")
        shard = int(keys[0]) // SHARD_KEYS  # the one server's (a batch on one node: its first key's owner)
        assert shard == 0
        self.req += 1
        self.seq += 1
        head = self.encode(self.header_type(self.version, self.pull_op, self.req, TABLE, 0, 0, self.sender,
                                            self.incarnation, self.signed_header, ["<i8"], [[count]],
                                            {"stream": [self.incarnation, self.seq, self.seq - 1, 0]}))
        self.sock.send_multipart([head + blake3.blake3(head, key=self.key).digest(), keys], copy=False)
        try:
            first, values = self.sock.recv_multipart(copy=False)
        except zmq.Again:
            raise TimeoutError(f"request {self.req} not answered within {TIMEOUT_MS} ms") from None
        frame = first.buffer
        head_in = frame[:-self.tag_bytes]
        if not hmac.compare_digest(blake3.blake3(head_in, key=self.key).digest(), frame[-self.tag_bytes:]):
            raise ValueError("reply with a wrong tag")
        reply = self.decode(head_in)
        if reply.req != self.req or reply.op != self.values_op or reply.shapes != [[count, DIM]]:
            raise ValueError("not the reply to this request")
        rows = np.frombuffer(values.buffer, dtype=np.float32)
        if rows.shape[0] != count * DIM:
            raise ValueError("reply rows do not fit their header")
        return rows.reshape(count, DIM)

    def quit(self) -> None:
        head = self.encode(self.header_type(self.version, self.pull_op, 0, "quit", 0, 0, 0, self.incarnation,
                                            self.signed_header, [], [], {}))
        self.sock.send_multipart([head + blake3.blake3(head, key=self.key).digest()])
        self.sock.close(linger=1000)


def worker(calls: int, rounds: int) -> None:
    import shoal

    bench_pull_push.CPU_ROUNDS = rounds
    ps = shoal.init(local_access=False)
    table = ps.table(TABLE, NUM_KEYS, DIM, init=shoal.Normal(std=0.1), optimizer=shoal.optim.SGD(lr=1e-6))
    secret = os.urandom(32)
    raw = subprocess.Popen([sys.executable, "-c", bench_pull_push.RAW_SERVER, str(NUM_KEYS)], stdout=subprocess.PIPE,
                           text=True)
    lean, compiled = (subprocess.Popen([sys.executable, os.path.abspath(__file__), flag], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE) for flag in ("--lean-server", "--compiled-server"))
    ctx = zmq.Context()
    raw_sock = ctx.socket(zmq.DEALER)
    try:
        assert raw.stdout is not None
        for helper in (lean, compiled):
            assert helper.stdin is not None
            helper.stdin.write(secret.hex().encode() + b"\n")
            helper.stdin.flush()
        raw_sock.connect(f"tcp://127.0.0.1:{raw.stdout.readline().strip()}")
        assert lean.stdout is not None and compiled.stdout is not None
        client = LeanClient(ctx, int(lean.stdout.readline().strip()), secret)
        compiled_client = CompiledClient(ctx, int(compiled.stdout.readline().strip()), secret)
        one = np.array([12_345], dtype=np.int64)

        def raw_pull() -> None:
            raw_sock.send_multipart([b"pull", one], copy=False)
            np.frombuffer(raw_sock.recv_multipart(copy=False)[0].buffer, dtype=np.float32)

        np.testing.assert_array_equal(client.pull(one).shape, (1, DIM))
        np.testing.assert_array_equal(compiled_client.pull(one), client.pull(one))  # the same rows
        for _ in range(500):  # warm: connections, compiled kernels, caches
            raw_pull()
            client.pull(one)
            compiled_client.pull(one)
            table.pull(one)
        cpu = bench_pull_push.cpu_per_call({"raw": (raw_pull, raw.pid),
                                            "lean": (lambda: client.pull(one), lean.pid),
                                            "compiled": (lambda: compiled_client.pull(one), compiled.pid),
                                            "shoal": (lambda: table.pull(one), bench_pull_push.serving_pid())},
                                           calls)
        raw_sock.send_multipart([b"quit", b""])
        client.quit()
        compiled_client.quit()
    finally:
        for helper in (raw, lean, compiled):
            try:
                helper.wait(timeout=10)
            except subprocess.TimeoutExpired:  # left waiting by a failure above
                helper.kill()
                helper.wait()
        ctx.destroy(linger=0)  # every socket, also those a failure above left open
    ps.shutdown()

    lines = [f"A 1-key pull of 64 float32 over loopback tcp, authenticated where Shoal's is (µs per call; median of "
             f"{rounds} alternating rounds of {calls:,} calls; caller: this process; server: the serving "
             "process, every thread). Ratio: raw's wall time / the contender's (the target: >= 0.67).", "",
             "| contender | wall µs | ratio | caller CPU µs | server CPU µs | CPU beyond raw µs |",
             "|---|---:|---:|---:|---:|---:|"]
    base = cpu["raw"]
    for name, c in cpu.items():
        beyond = c["caller"] + c["server"] - base["caller"] - base["server"]
        lines.append(f"| {name} | {c['wall']:.1f} | {base['wall'] / c['wall']:.2f} | {c['caller']:.1f} | "
                     f"{c['server']:.1f} | {beyond:.1f} |")
    text = "\n".join(lines)
    print("\n" + text)
    write_results("lean_request", {"dim": DIM, "calls": calls, "rounds": rounds, "cpu_per_1key_pull_us": cpu}, text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5_000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lean-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--compiled-server", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.lean_server:
        lean_server(bytes.fromhex(sys.stdin.readline().strip()))
        return 0
    if args.compiled_server:
        compiled_server(bytes.fromhex(sys.stdin.readline().strip()))
        return 0
    if "SHOAL_RENDEZVOUS" in os.environ:
        worker(args.calls, args.rounds)
        return 0
    import shoal.launch.local

    return shoal.launch.local.run([sys.executable, os.path.abspath(__file__), "--calls", str(args.calls),
                                   "--rounds", str(args.rounds)], nodes=1, local_access=False, prefix_output=False)


if __name__ == "__main__":
    sys.exit(main())
