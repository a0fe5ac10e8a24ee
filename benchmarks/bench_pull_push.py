"""Remote pull and push through Shoal against raw pyzmq moving the same bytes.

    python benchmarks/bench_pull_push.py

The script launches itself as the only worker of a one-node cluster in classic
mode (every key goes to the server process over loopback tcp), and starts a raw
pyzmq ROUTER process beside it. For batches of 1, 100 and 10,000 keys of 64
float32 values it times, alternating round by round:

* pull: Shoal ``table.pull(keys)`` vs a raw request carrying the keys whose reply
  carries ``n x 64`` float32 (zero-copy on both sides, no gather, no checks);
* push: Shoal ``table.push(keys, values)`` (server applies SGD) vs a raw request
  carrying keys and values, answered by a short acknowledgement.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import zmq

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import interleaved, write_results  # noqa: E402

NUM_KEYS = 200_000
DIM = 64
BATCHES = (1, 100, 10_000)

RAW_SERVER = r"""
import sys, zmq, numpy as np
ctx = zmq.Context()
s = ctx.socket(zmq.ROUTER)
port = s.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
rows = np.random.default_rng(0).random((10_000, 64)).astype(np.float32)
while True:
    parts = s.recv_multipart(copy=False)
    peer, kind = parts[0], parts[1].bytes
    if kind == b"quit":
        break
    if kind == b"pull":
        n = len(parts[2].buffer) // 8
        s.send_multipart([peer, rows[:n]], copy=False)
    else:
        s.send_multipart([peer, b"ok"])
s.close(0)
ctx.term()
"""


def worker() -> None:
    import shoal

    ps = shoal.init(local_access=False)
    table = ps.table("bench", NUM_KEYS, DIM, init=shoal.Normal(std=0.1), optimizer=shoal.optim.SGD(lr=1e-6))
    raw = subprocess.Popen([sys.executable, "-c", RAW_SERVER], stdout=subprocess.PIPE, text=True)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        assert raw.stdout is not None
        sock.connect(f"tcp://127.0.0.1:{raw.stdout.readline().strip()}")
        rng = np.random.default_rng(1)
        results = []
        for n in BATCHES:
            keys = np.sort(rng.choice(NUM_KEYS, size=n, replace=False)).astype(np.int64)
            values = rng.standard_normal((n, DIM)).astype(np.float32)

            def raw_pull(keys: np.ndarray = keys) -> None:
                sock.send_multipart([b"pull", keys], copy=False)
                reply = sock.recv_multipart(copy=False)
                np.frombuffer(reply[0].buffer, dtype=np.float32)

            def raw_push(keys: np.ndarray = keys, values: np.ndarray = values) -> None:
                sock.send_multipart([b"push", keys, values], copy=False)
                sock.recv_multipart(copy=False)

            times = interleaved({
                "raw_pull": raw_pull,
                "shoal_pull": lambda keys=keys: table.pull(keys),
                "raw_push": raw_push,
                "shoal_push": lambda keys=keys, values=values: table.push(keys, values),
            })
            row = {"keys": n, "bytes": n * DIM * 4}
            for name, t in times.items():
                row[f"{name}_us"] = t * 1e6
                row[f"{name}_keys_per_s"] = n / t
            row["pull_ratio"] = times["raw_pull"] / times["shoal_pull"]
            row["push_ratio"] = times["raw_push"] / times["shoal_push"]
            results.append(row)
            print(f"{n:>6} keys: pull {row['shoal_pull_us']:9.1f} us vs raw {row['raw_pull_us']:9.1f} us "
                  f"(ratio {row['pull_ratio']:.2f}); push {row['shoal_push_us']:9.1f} us vs raw "
                  f"{row['raw_push_us']:9.1f} us (ratio {row['push_ratio']:.2f})", flush=True)
        sock.send_multipart([b"quit", b""])
    finally:
        raw.wait(timeout=10)
        sock.close(0)
        ctx.term()
    ps.shutdown()

    lines = ["| keys | bytes | Shoal pull µs | raw pull µs | pull ratio | Shoal push µs | raw push µs | push ratio |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['keys']} | {r['bytes']} | {r['shoal_pull_us']:.1f} | {r['raw_pull_us']:.1f} | "
                     f"{r['pull_ratio']:.2f} | {r['shoal_push_us']:.1f} | {r['raw_push_us']:.1f} | "
                     f"{r['push_ratio']:.2f} |")
    big = results[-1]
    lines.append(f"\nRemote pull of 10,000 x 64 float32: {big['shoal_pull_keys_per_s'] / 1e6:.2f} M keys/s, "
                 f"{big['pull_ratio']:.2f} of raw pyzmq moving the same bytes (ratio = raw time / Shoal time).")
    table_md = "\n".join(lines)
    print("\n" + table_md)
    write_results("pull_push", {"dim": DIM, "num_keys": NUM_KEYS, "results": results}, table_md)


def main() -> int:
    if "SHOAL_RENDEZVOUS" in os.environ:
        worker()
        return 0
    import shoal.launch.local

    return shoal.launch.local.run([sys.executable, os.path.abspath(__file__)], nodes=1, local_access=False,
                                  prefix_output=False)


if __name__ == "__main__":
    sys.exit(main())
