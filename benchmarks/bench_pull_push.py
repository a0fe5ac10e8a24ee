"""Remote pull and push through Shoal against raw pyzmq moving the same bytes.

    python benchmarks/bench_pull_push.py

The script launches itself as the only worker of a one-node cluster in classic
mode (every key goes to the server process over loopback tcp), and starts a raw
pyzmq ROUTER process beside it. For batches of 1, 100 and 10,000 keys of 64
float32 values it times, alternating round by round:

* pull: Shoal ``table.pull(keys)`` vs a raw request carrying the keys whose reply
  carries ``n x 64`` float32 (zero-copy on both sides, no gather, no checks);
* push: Shoal ``table.push(keys, values)`` (server applies SGD) vs a raw request
  carrying keys and values, answered by a short acknowledgement;
* pull, raw with a gather: the raw server gathers the keys' rows from a table as
  large as Shoal's (``NUM_KEYS`` x 64 float32, beyond the caches) before it
  replies, as any parameter server must; the raw contender above sends the first
  ``n`` rows of a small array as they lie. Shoal's pull against it is the share
  of the round trip that Shoal's own work costs.

Each is timed with one request at a time (latency-bound) and with four in
flight (``pull_async`` / ``push_async``, and four raw requests before the first
reply is read), which is how a training loop overlaps its calls.

For the 1-key pull and push, and the 10,000-key pull, it also counts CPU per call
on each side (the calling process's CPU time, and the serving process's from
``/proc``, alternating rounds of ``CPU_CALLS`` calls): on 2 cores a round trip's
wall time is about the caller's and the server's CPU in a row, so the sides say
where a ratio's shortfall lies.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
import zmq

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import interleaved, write_results  # noqa: E402

NUM_KEYS = 200_000
DIM = 64
BATCHES = (1, 100, 10_000)
IN_FLIGHT = 4
CPU_CALLS = 5_000  # calls per round of the CPU count (/proc's clock ticks are 10 ms)
CPU_CALLS_BIG = 500  # ... of 10,000 keys (each about 1 ms of CPU)
CPU_ROUNDS = 5

RAW_SERVER = r"""
import sys, zmq, numpy as np
ctx = zmq.Context()
s = ctx.socket(zmq.ROUTER)
port = s.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
rows = np.random.default_rng(0).random((10_000, 64)).astype(np.float32)
table = np.random.default_rng(1).random((int(sys.argv[1]), 64)).astype(np.float32)
while True:
    parts = s.recv_multipart(copy=False)
    peer, kind = parts[0], parts[1].bytes
    if kind == b"quit":
        break
    if kind == b"pull":
        n = len(parts[2].buffer) // 8
        s.send_multipart([peer, rows[:n]], copy=False)
    elif kind == b"gather":
        s.send_multipart([peer, table[np.frombuffer(parts[2].buffer, dtype=np.int64)]], copy=False)
    else:
        s.send_multipart([peer, b"ok"])
s.close(0)
ctx.term()
"""


def process_cpu_s(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far, every thread included."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serving_pid() -> int:
    """The job's server process: the launcher's other child (this worker's sibling)."""
    launcher = os.getppid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                server = b"server_main" in f.read()
        except OSError:  # ended meanwhile
            continue
        if parent == launcher and server:
            return int(entry)
    raise RuntimeError("the job's server process was not found")


def cpu_per_call(contenders: dict[str, tuple[Callable[[], object], int]], calls: int) -> dict[str, dict[str, float]]:
    """Per contender (a call and the pid serving it): median wall, caller CPU and server CPU, in µs
    per call, over alternating rounds of ``calls`` calls."""
    per: dict[str, list[tuple[float, float, float]]] = {name: [] for name in contenders}
    for _ in range(CPU_ROUNDS):
        for name, (fn, pid) in contenders.items():
            served, caller, wall = process_cpu_s(pid), time.process_time(), time.perf_counter()
            for _ in range(calls):
                fn()
            per[name].append(((time.perf_counter() - wall) / calls * 1e6,
                              (time.process_time() - caller) / calls * 1e6,
                              (process_cpu_s(pid) - served) / calls * 1e6))
    return {name: {what: statistics.median(r[i] for r in rounds) for i, what in enumerate(("wall", "caller", "server"))}
            for name, rounds in per.items()}


def worker() -> None:
    import shoal

    ps = shoal.init(local_access=False)
    table = ps.table("bench", NUM_KEYS, DIM, init=shoal.Normal(std=0.1), optimizer=shoal.optim.SGD(lr=1e-6))
    raw = subprocess.Popen([sys.executable, "-c", RAW_SERVER, str(NUM_KEYS)], stdout=subprocess.PIPE, text=True)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        assert raw.stdout is not None
        sock.connect(f"tcp://127.0.0.1:{raw.stdout.readline().strip()}")
        rng = np.random.default_rng(1)
        results = []
        keys_of: dict[int, np.ndarray] = {}
        for n in BATCHES:
            keys = np.sort(rng.choice(NUM_KEYS, size=n, replace=False)).astype(np.int64)
            values = rng.standard_normal((n, DIM)).astype(np.float32)

            def raw_pull(keys: np.ndarray = keys) -> None:
                sock.send_multipart([b"pull", keys], copy=False)
                reply = sock.recv_multipart(copy=False)
                np.frombuffer(reply[0].buffer, dtype=np.float32)

            def raw_gather_pull(keys: np.ndarray = keys) -> None:
                sock.send_multipart([b"gather", keys], copy=False)
                np.frombuffer(sock.recv_multipart(copy=False)[0].buffer, dtype=np.float32)

            def raw_push(keys: np.ndarray = keys, values: np.ndarray = values) -> None:
                sock.send_multipart([b"push", keys, values], copy=False)
                sock.recv_multipart(copy=False)

            def raw_pull_pipelined(keys: np.ndarray = keys) -> None:
                for _ in range(IN_FLIGHT):
                    sock.send_multipart([b"pull", keys], copy=False)
                for _ in range(IN_FLIGHT):
                    np.frombuffer(sock.recv_multipart(copy=False)[0].buffer, dtype=np.float32)

            def raw_push_pipelined(keys: np.ndarray = keys, values: np.ndarray = values) -> None:
                for _ in range(IN_FLIGHT):
                    sock.send_multipart([b"push", keys, values], copy=False)
                for _ in range(IN_FLIGHT):
                    sock.recv_multipart(copy=False)

            def shoal_pull_pipelined(keys: np.ndarray = keys) -> None:
                for f in [table.pull_async(keys) for _ in range(IN_FLIGHT)]:
                    f.wait()

            def shoal_push_pipelined(keys: np.ndarray = keys, values: np.ndarray = values) -> None:
                for f in [table.push_async(keys, values) for _ in range(IN_FLIGHT)]:
                    f.wait()

            times = interleaved({
                "raw_pull": raw_pull,
                "raw_gather_pull": raw_gather_pull,
                "shoal_pull": lambda keys=keys: table.pull(keys),
                "raw_push": raw_push,
                "shoal_push": lambda keys=keys, values=values: table.push(keys, values),
                "raw_pull_4": raw_pull_pipelined,
                "shoal_pull_4": shoal_pull_pipelined,
                "raw_push_4": raw_push_pipelined,
                "shoal_push_4": shoal_push_pipelined,
            })
            row = {"keys": n, "bytes": n * DIM * 4}
            for name, t in times.items():
                calls = IN_FLIGHT if name.endswith("_4") else 1
                row[f"{name}_us"] = t * 1e6 / calls
                row[f"{name}_keys_per_s"] = n * calls / t
            for op in ("pull", "push"):
                row[f"{op}_ratio"] = times[f"raw_{op}"] / times[f"shoal_{op}"]
                row[f"{op}_ratio_4"] = times[f"raw_{op}_4"] / times[f"shoal_{op}_4"]
            row["pull_ratio_gather"] = times["raw_gather_pull"] / times["shoal_pull"]
            row["raw_gather_ratio"] = times["raw_pull"] / times["raw_gather_pull"]
            results.append(row)
            print(f"{n:>6} keys: pull ratio {row['pull_ratio']:.2f} ({row['pull_ratio_4']:.2f} with "
                  f"{IN_FLIGHT} in flight; {row['pull_ratio_gather']:.2f} against raw with a gather); "
                  f"push ratio {row['push_ratio']:.2f} ({row['push_ratio_4']:.2f})", flush=True)
            keys_of[n] = keys
        one = np.array([12_345], dtype=np.int64)
        one_row = rng.standard_normal((1, DIM)).astype(np.float32)

        def raw_pull_one() -> None:
            sock.send_multipart([b"pull", one], copy=False)
            np.frombuffer(sock.recv_multipart(copy=False)[0].buffer, dtype=np.float32)

        def raw_push_one() -> None:
            sock.send_multipart([b"push", one, one_row], copy=False)
            sock.recv_multipart(copy=False)

        big_keys = keys_of[BATCHES[-1]]

        def raw_pull_big(kind: bytes) -> None:
            sock.send_multipart([kind, big_keys], copy=False)
            np.frombuffer(sock.recv_multipart(copy=False)[0].buffer, dtype=np.float32)

        server = serving_pid()
        cpu = cpu_per_call({"pull, raw": (raw_pull_one, raw.pid), "pull, shoal": (lambda: table.pull(one), server),
                            "push, raw": (raw_push_one, raw.pid),
                            "push, shoal": (lambda: table.push(one, one_row), server)}, CPU_CALLS)
        cpu_big = cpu_per_call({"raw": (lambda: raw_pull_big(b"pull"), raw.pid),
                                "raw with a gather": (lambda: raw_pull_big(b"gather"), raw.pid),
                                "shoal": (lambda: table.pull(big_keys), server)}, CPU_CALLS_BIG)
        sock.send_multipart([b"quit", b""])
    finally:
        raw.wait(timeout=10)
        sock.close(0)
        ctx.term()
    ps.shutdown()

    lines = ["Ratio = raw time / Shoal time (1.0: as fast as raw pyzmq moving the same bytes).", "",
             "| keys | in flight | Shoal pull µs/call | raw pull µs/call | pull ratio "
             "| Shoal push µs/call | raw push µs/call | push ratio |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        for sfx, depth in (("", 1), ("_4", IN_FLIGHT)):
            lines.append(f"| {r['keys']} | {depth} | {r[f'shoal_pull{sfx}_us']:.1f} | {r[f'raw_pull{sfx}_us']:.1f} | "
                         f"{r[f'pull_ratio{sfx}']:.2f} | {r[f'shoal_push{sfx}_us']:.1f} | "
                         f"{r[f'raw_push{sfx}_us']:.1f} | {r[f'push_ratio{sfx}']:.2f} |")
    big = results[-1]
    lines.append(f"\nRemote pull of 10,000 x 64 float32: {big['shoal_pull_keys_per_s'] / 1e6:.2f} M keys/s one at a "
                 f"time (ratio {big['pull_ratio']:.2f}), {big['shoal_pull_4_keys_per_s'] / 1e6:.2f} M keys/s with "
                 f"{IN_FLIGHT} in flight (ratio {big['pull_ratio_4']:.2f}).")
    lines += ["", "Pulls one at a time against a raw server that gathers the keys' rows from a table of "
              f"{NUM_KEYS:,} x {DIM} float32 before it replies (``table[keys]``):", "",
              "| keys | raw µs/call | raw with a gather µs/call | Shoal µs/call | raw with a gather against raw "
              "| Shoal against raw with a gather |", "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['keys']} | {r['raw_pull_us']:.1f} | {r['raw_gather_pull_us']:.1f} | {r['shoal_pull_us']:.1f} | "
              f"{r['raw_gather_ratio']:.2f} | {r['pull_ratio_gather']:.2f} |" for r in results]
    lines += ["", f"CPU per 10,000-key pull (µs; median of {CPU_ROUNDS} alternating rounds of {CPU_CALLS_BIG:,} "
              "calls):", "", "| contender | wall µs | caller CPU µs | server CPU µs | both sides' CPU over wall |",
              "|---|---:|---:|---:|---:|"]
    lines += [f"| {name} | {c['wall']:.1f} | {c['caller']:.1f} | {c['server']:.1f} | "
              f"{(c['caller'] + c['server']) / c['wall']:.2f} |" for name, c in cpu_big.items()]
    lines += ["", f"CPU per 1-key call (µs; median of {CPU_ROUNDS} alternating rounds of {CPU_CALLS:,} calls; caller: "
              "the worker process, every thread; server: the serving process, every thread)", "",
              "| call, contender | wall µs | caller CPU µs | server CPU µs |", "|---|---:|---:|---:|"]
    for op in ("pull", "push"):
        shoal_cpu, raw_cpu = cpu[f"{op}, shoal"], cpu[f"{op}, raw"]
        lines += [f"| {op}, {name} | {c['wall']:.1f} | {c['caller']:.1f} | {c['server']:.1f} |"
                  for name, c in (("raw", raw_cpu), ("shoal", shoal_cpu))]
        extra = {side: shoal_cpu[side] - raw_cpu[side] for side in ("wall", "caller", "server")}
        lines.append(f"| {op}, Shoal beyond raw | {extra['wall']:.1f} | {extra['caller']:.1f} | "
                     f"{extra['server']:.1f} |")
    table_md = "\n".join(lines)
    print("\n" + table_md)
    write_results("pull_push", {"dim": DIM, "num_keys": NUM_KEYS, "results": results, "cpu_per_1key_us": cpu,
                                "cpu_per_10k_pull_us": cpu_big},
                  table_md)


def main() -> int:
    if "SHOAL_RENDEZVOUS" in os.environ:
        worker()
        return 0
    import shoal.launch.local

    return shoal.launch.local.run([sys.executable, os.path.abspath(__file__)], nodes=1, local_access=False,
                                  prefix_output=False)


if __name__ == "__main__":
    sys.exit(main())
