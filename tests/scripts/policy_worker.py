"""A worker script for the server-failure policies: what a call does once a server has died.

    policy_worker.py INFO_DIR POLICY

Two nodes, one worker each. Tables: "plain" (static, keys 0..19 on node 0 and 20..39 on node 1)
and "rep" (2 replicas). Every worker pushes +1 to every key of both, then rank 0 writes
INFO_DIR/servers.json (server pids) and every worker waits for INFO_DIR/go (the test kills server
1 and writes it); under ``restart`` each waits until server 1 has registered again. Each then records
in INFO_DIR/result<rank>.json, for each call, "ok" or the error's class and message and how long
it took: a pull of node 1's keys of "plain", a push to them, a push to node 0's keys, and a push
and pull of "rep"; rank 0 also records the push counts of node 1's replica (restart: it is used)
and, once every worker has made its calls, a pull of node 1's keys of "plain".
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

import shoal

ON_NODE_0, ON_NODE_1 = np.arange(20), np.arange(20, 40)


def attempt(call) -> dict:
    start = time.monotonic()
    try:
        value = call()
        outcome = {"ok": True, "value": None if value is None else np.asarray(value).ravel()[:3].tolist()}
    except shoal.ShoalError as exc:
        outcome = {"ok": False, "error": type(exc).__name__, "message": str(exc)}
    outcome["seconds"] = round(time.monotonic() - start, 3)
    return outcome


def main() -> None:
    info = sys.argv[1]
    ps = shoal.init()
    plain = ps.table("plain", 40, 1)
    rep = ps.table("rep", 40, 1, replicas=2, gossip_ms=20)
    ones = np.ones((20, 1), np.float32)
    plain.push(np.arange(40), np.ones((40, 1), np.float32))
    rep.push(np.arange(40), np.ones((40, 1), np.float32))
    ps.barrier()
    if ps.rank == 0:
        with open(os.path.join(info, "servers.json"), "w") as fh:
            json.dump({"pids": [s["pid"] for s in ps.server_stats()]}, fh)
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(info, "go")) and time.monotonic() < deadline:
        time.sleep(0.05)
    while sys.argv[2] == "restart" and time.monotonic() < deadline:
        status = ps.cluster_status()
        if status["incarnations"][1] > 1 and status["alive"][1]:
            break
        time.sleep(0.1)
    result = {
        "pull_node1": attempt(lambda: plain.pull(ON_NODE_1)),
        "push_node1": attempt(lambda: plain.push(ON_NODE_1, ones)),
        "push_node0": attempt(lambda: plain.push(ON_NODE_0, ones)),
        "rep_push": attempt(lambda: rep.push(np.arange(40), np.ones((40, 1), np.float32))),
        "rep_pull": attempt(lambda: rep.pull(np.arange(40))),
    }
    ps.barrier()  # every worker has made its calls
    if ps.rank == 0:
        stats = {s["node"]: s.get("stats", {}) for s in ps.server_stats() if not s.get("unreachable")}
        result["node1_replicated_pushes"] = stats.get(1, {}).get("replicated_pushes", 0)
        result["final_node1"] = attempt(lambda: plain.pull(ON_NODE_1))
    with open(os.path.join(info, f"result{ps.rank}.json"), "w") as fh:
        json.dump(result, fh)
    ps.shutdown()


if __name__ == "__main__":
    main()
