"""Shoal across emulated hosts: network namespaces on a bridge, with and without a 1 Gbit cap.

    sudo python benchmarks/bench_emulated_hosts.py      # needs root (ip netns)

For an uncapped link and one capped at 1 Gbit/s with ``tc tbf``, side by side:

* raw pyzmq between two hosts: 16-byte round trip (p50) and a request answered
  by 2.56 MB (10,000 x 64 float32) or 16 MiB, as GB/s;
* Shoal with authentication on, a worker on host 0 and every key on host 1's
  server: pull of 1 key (p50) and pull / push of 10,000 x 64 float32, as ratios
  of the raw figures over the same link;
* MF on MovieLens 100k across three hosts (6 epochs) against the local launcher
  with three nodes on loopback: ratings/s and final RMSE.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]

from tests.support.netns import EmulatedHosts, run_cluster, unavailable_reason  # noqa: E402

from common import write_results  # noqa: E402

PORT = 29500
ROWS, DIM = 10_000, 64

RAW_SERVER = r"""
import sys, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.ROUTER)
s.bind(sys.argv[1])
payload = bytearray(16 << 20)
while True:
    peer, request = s.recv_multipart()
    if request == b"quit":
        break
    n = int(request)
    s.send_multipart([peer, memoryview(payload)[:n]], copy=n < 65536)
s.close(0)
ctx.term()
"""

RAW_CLIENT = r"""
import json, statistics, sys, time, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.DEALER)
s.connect(sys.argv[1])
def timed(n, count):
    out = []
    for _ in range(count):
        t = time.perf_counter()
        s.send(str(n).encode())
        s.recv(copy=False)
        out.append(time.perf_counter() - t)
    return statistics.median(out[1:])
result = {"rtt_16B_us": timed(16, 2000) * 1e6, "reply_2.56MB_s": timed(2_560_000, 60),
          "reply_16MiB_s": timed(16 << 20, 15)}
s.send(b"quit")
s.close(0)
ctx.term()
print(json.dumps(result))
"""

SHOAL_WORKER = r"""
import json, statistics, time
import numpy as np
import shoal
ps = shoal.init()
table = ps.table("bench", num_keys=4 * ROWS, dim=DIM, init=shoal.Uniform(-1, 1), optimizer=shoal.optim.SGD(lr=1e-6))
ps.barrier()
if ps.rank == 0:
    owner = table.layout.route(np.arange(4 * ROWS))[0]
    remote = np.flatnonzero(owner == 1)[:ROWS]
    values = np.full((ROWS, DIM), 1e-3, np.float32)
    def timed(fn, count):
        fn()
        out = []
        for _ in range(count):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        return statistics.median(out)
    result = {"pull_1_us": timed(lambda: table.pull(remote[:1]), 1000) * 1e6,
              "pull_10k_s": timed(lambda: table.pull(remote), 60),
              "push_10k_s": timed(lambda: table.push(remote, values), 60)}
    print("RESULT", json.dumps(result), flush=True)
ps.barrier()
ps.shutdown()
""".replace("ROWS", str(ROWS)).replace("DIM", str(DIM))


def raw_figures(hosts: EmulatedHosts) -> dict[str, float]:
    address = f"tcp://{hosts.addresses[1]}:{PORT}"
    server = hosts.popen(1, [sys.executable, "-c", RAW_SERVER, address])
    try:
        time.sleep(0.5)
        done = hosts.run(0, [sys.executable, "-c", RAW_CLIENT, address], timeout=300, capture_output=True, check=True)
        return json.loads(done.stdout)
    finally:
        try:
            server.wait(timeout=5)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=5)


def shoal_figures(hosts: EmulatedHosts, secret: str) -> dict[str, float]:
    outputs = run_cluster(hosts, [sys.executable, "-c", SHOAL_WORKER], secret, timeout=300)
    line = next(x for x in outputs[0].splitlines() if x.startswith("RESULT"))
    return json.loads(line.split(" ", 1)[1])


def mf(hosts: EmulatedHosts, secret: str, out: Path) -> dict[str, float]:
    command = [sys.executable, str(ROOT / "examples" / "mf" / "train.py"), "--quiet", "--epochs", "6"]
    run_cluster(hosts, [*command, "--out", str(out)], secret, timeout=600)
    result = json.loads(out.read_text())
    return {"ratings_per_s": result["ratings_per_s"], "rmse": result["rmse"][-1]}


def main() -> None:
    reason = unavailable_reason()
    if reason:
        print(f"skipped: {reason}")
        return
    work = Path(tempfile.mkdtemp(prefix="shoal-bench-"))
    secret = work / "secret"
    secret.write_text(os.urandom(32).hex())
    figures: dict[str, dict[str, float]] = {}
    for label, rate in (("uncapped", None), ("1gbit", "1gbit")):
        with EmulatedHosts(2, rate=rate) as hosts:
            raw = raw_figures(hosts)
            ps = shoal_figures(hosts, str(secret))
        figures[label] = {**raw, **ps}
        print(label, json.dumps(figures[label]))
    with EmulatedHosts(3, rate="1gbit") as hosts:
        across = mf(hosts, str(secret), work / "across.json")
    local_run = subprocess.run([sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", "3", "--", sys.executable,
                                str(ROOT / "examples" / "mf" / "train.py"), "--quiet", "--epochs", "6", "--out",
                                str(work / "local.json")], capture_output=True, text=True, timeout=600, check=True)
    assert local_run.returncode == 0
    local = json.loads((work / "local.json").read_text())
    mf_figures = {"across_3_hosts_1gbit": across,
                  "local_3_nodes": {"ratings_per_s": local["ratings_per_s"], "rmse": local["rmse"][-1]}}

    mb = ROWS * DIM * 4 / 1e9
    lines = ["| link | raw RTT 16 B p50 | raw 2.56 MB reply | raw 16 MiB reply | Shoal pull 1 key p50 | "
             "Shoal pull 10k x 64 | Shoal push 10k x 64 | pull / raw | push / raw |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label, f in figures.items():
        lines.append(
            f"| {label} | {f['rtt_16B_us']:.0f} us | {mb / f['reply_2.56MB_s']:.2f} GB/s | "
            f"{(16 << 20) / 1e9 / f['reply_16MiB_s']:.2f} GB/s | {f['pull_1_us']:.0f} us | "
            f"{mb / f['pull_10k_s']:.2f} GB/s | {mb / f['push_10k_s']:.2f} GB/s | "
            f"{f['reply_2.56MB_s'] / f['pull_10k_s']:.2f} | {f['reply_2.56MB_s'] / f['push_10k_s']:.2f} |")
    lines += ["", "| MF, MovieLens 100k, 6 epochs | ratings/s | RMSE |", "|---|---|---|"]
    for label, f in mf_figures.items():
        lines.append(f"| {label} | {f['ratings_per_s']:,.0f} | {f['rmse']:.4f} |")
    ratio = across["ratings_per_s"] / local["ratings_per_s"]
    lines.append(f"\nMF across 3 hosts (1 Gbit) / local launcher: {ratio:.2f}x ratings/s")
    table = "\n".join(lines)
    print(table)
    write_results("emulated_hosts", {"links": figures, "mf": mf_figures, "mf_ratio": ratio}, table)


if __name__ == "__main__":
    main()
