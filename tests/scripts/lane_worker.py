"""A worker script for the lane's tests (``tests/client/test_lane.py``).

    lane_worker.py OUT_DIR MODE ROUNDS

* ``count``: every worker, ROUNDS times: push +1 to a key (waiting for its answer every other
  time, so that the next pull may take the lane; every fifth time as a push_pull, which goes
  the general way, between pushes on the lane in the worker's stream), then pull that key
  (every other time with three more; every third time with a pull of two more keys in flight)
  and note whether each holds at least this worker's own pushes to it; rank 0 moves the
  table's slice 1 to server 0 a third of the way through and back to server 1 at two thirds.
  At the end every worker pulls every key once the others are done. Writes
  OUT_DIR/w<rank>.json: its pushes per key, the reads that missed its own pushes, the final
  rows, its table's counters, how many of its pulls of several keys, and of its pulls right
  after a push it did not wait for, took the lane, and the servers' stats.
* ``forge``: rank 0 sends server 1's lane a request under a wrong key, one whose tag was cut,
  one replaying an older request number, one for a table read under SSP and one for a slice
  server 1 does not hold, then pushes whose turn in its stream has passed or not come, one of
  a NaN and one to a table whose rule keeps state (Adagrad), then pulls through the lane as
  usual; writes what came back for each, and the rows those pushes named.
* ``lossy``: ``count``, with a share of every worker's lane requests dropped unsent and of the
  answers that came dropped unread (a push's answer more often; seeded by rank), as a lossy wire
  would: the lane times out and
  is given up for a while, and what was in flight on it goes the general way, where a push the
  server applied already (its answer lost) is only acknowledged.
* ``pause``: rank 0 reads a row of server 1 through its lane, stops server 1 (SIGSTOP) for three
  resend timeouts, pushes +1 to the row on the lane without waiting and reads the row again
  (the lane goes unanswered, the push and the read go the general way, and the server, once
  back, applies the push once whichever copy it takes first), then reads it until the lane
  serves it again; writes what it read and how long the lane was given up for.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time

import numpy as np
import zmq

import shoal
from shoal.wire import lane
from shoal.wire.codec import tag_key
from shoal.wire.keyed_hash import key_words

KEYS = 64
DIM = 8


def count(ps: shoal.Worker, table: shoal.Table, out_dir: str, rounds: int) -> None:
    rng = np.random.default_rng(ps.rank)
    pushed = np.zeros(KEYS, dtype=np.int64)
    missed = []
    lane_batches = 0  # pulls of several keys that went (in part) through the lane
    lane_unwaited = 0  # pulls through the lane right after a push not waited for
    one = np.ones((1, DIM), dtype=np.float32)
    for i in range(rounds):
        if ps.rank == 0 and i in (rounds // 3, 2 * rounds // 3):
            ps.move_slice(table, 1, 0 if i == rounds // 3 else 1)
        key = np.array([rng.integers(KEYS)], dtype=np.int64)
        if i % 5 == 4:
            table.push_pull(key, one)  # the general way, in the stream between pushes on the lane
        else:
            push = table.push_async(key, one)
            if i % 2 == 0:
                push.wait()
        pushed[key[0]] += 1
        # Every other pull reads three more keys, in no order, often in both slices: one on this
        # worker's node and one not, or both on the other node's server once slice 1 moved there.
        keys = key if i % 4 < 2 else np.concatenate([key, rng.integers(KEYS, size=3)])
        # Every third round a read of two keys is in flight while the round's own read is made: its
        # answer comes first on a lane they share, and the wait for it takes it in.
        ahead = rng.integers(KEYS, size=2) if i % 3 == 0 else None
        ahead_future = table.pull_async(ahead) if ahead is not None else None
        ahead_pushed = pushed[ahead] if ahead is not None else None
        before = table.counters["lane_pulls"]
        rows = table.pull(keys)
        if table.counters["lane_pulls"] > before:
            lane_batches += keys.shape[0] > 1
            lane_unwaited += i % 2
        for k, row in zip(keys, rows[:, 0], strict=True):
            if row < pushed[k]:
                missed.append([i, int(k), float(row), int(pushed[k])])
        if ahead_future is not None:
            for k, row, own in zip(ahead, ahead_future.wait()[:, 0], ahead_pushed, strict=True):
                if row < own:
                    missed.append([i, int(k), float(row), int(own)])
    ps.wait_all()
    ps.barrier()
    final = table.pull(np.arange(KEYS, dtype=np.int64))
    ps.barrier()  # every worker's reads are in the servers' counts
    result = {"pushed": pushed.tolist(), "missed": missed, "final": final[:, 0].tolist(),
              "uniform": bool((final == final[:, :1]).all()), "counters": dict(table.counters),
              "lane batches": lane_batches, "lane unwaited": lane_unwaited,
              "servers": [s.get("stats", {}) for s in ps.server_stats()]}
    write(out_dir, ps.rank, result)


def forge(ps: shoal.Worker, table: shoal.Table, bounded: shoal.Table, stateful: shoal.Table, out_dir: str) -> None:
    result: dict[str, object] = {}
    if ps.rank == 0:
        deadline = time.monotonic() + 30
        while ps.lane(1) is None and time.monotonic() < deadline:  # its address asked for, then known
            table.pull(np.array([KEYS - 1], dtype=np.int64))
        to = ps.lane(1)
        assert to is not None, "server 1 has no lane"
        secret = ps.cluster.secret
        assert secret is not None
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVTIMEO, 500)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(to.address)

        def ask(key: bytes, req: int, cut: bool = False, name: str = table.name, shard: int = 1,
                pushed: np.ndarray | None = None, after: int = 0) -> str:
            frame = np.zeros(lane.FRAME0_BYTES, np.uint8)
            head = frame[:lane.HEADER_BYTES].view(np.int64)
            kind = lane.READ if pushed is None else lane.PUSH
            head[lane.MAGIC_AT], head[lane.KIND], head[lane.REQ], head[lane.SENDER] = lane.MAGIC, kind, req, 0
            head[lane.INCARNATION], head[lane.TABLE_ID] = 77, lane.table_id(name)
            head[lane.COUNT], head[lane.CLOCK] = 1, 0
            head[lane.STREAM], head[lane.AFTER] = ps.streams.incarnation, after
            lane.seal(key_words(tag_key(key)), frame)
            frames = [frame.tobytes()[:-1] if cut else frame.tobytes(), np.zeros(1, np.int64),
                      np.full(1, shard, np.int64)]  # row 0 of the slice
            sock.send_multipart(frames if pushed is None else [*frames, pushed])
            try:
                answer = sock.recv_multipart()
            except zmq.Again:
                return "no answer"
            kind = np.frombuffer(answer[0][:lane.HEADER_BYTES], np.int64)[lane.KIND]
            return {lane.ROWS: "rows", lane.GENERAL: "general", lane.DONE: "done"}.get(int(kind), f"kind {kind}")

        result["wrong key"] = ask(os.urandom(32), 10)
        result["cut tag"] = ask(secret, 11, cut=True)
        result["valid"] = ask(secret, 20)
        result["older"] = ask(secret, 19)
        result["again"] = ask(secret, 20)
        result["bounded table"] = ask(secret, 21, name=bounded.name)
        result["slice elsewhere"] = ask(secret, 22, shard=0)  # slice 0 is server 0's
        # Pushes of +1 to row 0 of slice 1 (key 32), none of which may be applied: this worker's stream
        # to server 1 has handled up to ``last`` (its pulls of the key above), so a push's turn is
        # ``after == last``.
        last = ps.streams.next_seq(1) - 1
        one = np.ones(DIM, np.float32)
        result["push whose turn passed"] = ask(secret, 23, pushed=one, after=last - 1)
        result["push whose turn is far"] = ask(secret, 24, pushed=one, after=last + 5)  # held, then general
        result["push of a NaN"] = ask(secret, 25, pushed=np.full(DIM, np.nan, np.float32), after=last)
        result["push of the wrong size"] = ask(secret, 26, pushed=np.ones(DIM + 1, np.float32), after=last)
        result["push to a table with state"] = ask(secret, 27, name=stateful.name, pushed=one, after=last)
        sock.close()
        ctx.term()
        before = table.counters["lane_pulls"]
        table.pull(np.array([KEYS - 1], dtype=np.int64))
        result["lane after"] = table.counters["lane_pulls"] - before
        for _ in range(5):
            bounded.pull(np.array([KEYS - 1], dtype=np.int64))
        result["bounded through the lane"] = bounded.counters["lane_pulls"]
        result["rows pushed to"] = [float(table.pull(np.array([KEYS // 2], np.int64))[0, 0]),
                                    float(stateful.pull(np.array([KEYS // 2], np.int64))[0, 0])]
        table.push(np.array([KEYS // 2], np.int64), np.ones((1, DIM), np.float32))
        result["a push after"] = float(table.pull(np.array([KEYS // 2], np.int64))[0, 0])
        result["pushes through the lane"] = table.counters["lane_pushes"]
    ps.barrier()
    write(out_dir, ps.rank, result)


def pause(ps: shoal.Worker, table: shoal.Table, out_dir: str) -> None:
    result: dict[str, object] = {}
    if ps.rank == 0:
        key = np.array([KEYS - 1], dtype=np.int64)  # slice 1: server 1's
        table.push(key, np.ones((1, DIM), dtype=np.float32))
        deadline = time.monotonic() + 30
        while ps.lane(1) is None and time.monotonic() < deadline:
            table.pull(key)
        before = dict(table.counters)
        result["lane before"] = int(table.pull(key)[0, 0]) if ps.lane(1) is not None else "no lane"
        server = next(s for s in ps.server_stats() if s.get("node") == 1)
        resend = ps.cluster.timeouts.resend_s
        os.kill(server["pid"], signal.SIGSTOP)
        resume = threading.Timer(3 * resend, os.kill, (server["pid"], signal.SIGCONT))
        resume.start()
        try:
            # Both go on the lane, unanswered; then the general way, where the server, once back, finds
            # the push applied (it reads its lane first) or applies it and refuses the lane's copy.
            pushed = table.push_async(key, np.ones((1, DIM), dtype=np.float32))
            result["while stopped"] = float(table.pull(key)[0, 0])
            pushed.wait()
        finally:
            resume.join()
        result["lane given up"] = ps.lane(1) is None and table.counters["lane_general"] > before.get("lane_general", 0)
        given_up = time.monotonic()
        lane_pulls = table.counters["lane_pulls"]
        while table.counters["lane_pulls"] == lane_pulls and time.monotonic() < given_up + 30:
            table.pull(key)
            time.sleep(0.01)
        result["lane again after s"] = time.monotonic() - given_up
        result["lane again"] = float(table.pull(key)[0, 0]) if table.counters["lane_pulls"] > lane_pulls else None
        result["resend s"] = resend
        server = next(s for s in ps.server_stats() if s.get("node") == 1)
        result["copies acknowledged"] = server.get("stats", {}).get("lane_push_copies", 0)
    ps.barrier()
    write(out_dir, ps.rank, result)


#: the share of lane requests and answers ``lossy`` drops; of a push's answers, more
LANE_LOSS = 0.03
PUSH_ANSWER_LOSS = 0.2


def lose_lane_messages(rank: int) -> None:
    """Drop ``LANE_LOSS`` of this process's lane requests unsent (they stay pending, unanswered), and
    of the answers it received (read, then taken as never come: the lane's wait ran out)."""
    from shoal.client import lane as worker_lane

    dice = random.Random(rank)
    send, receive = worker_lane._send, worker_lane._receive

    def send_lossy(*args: object) -> bool:
        return True if dice.random() < LANE_LOSS else bool(send(*args))

    def receive_lossy(*args: object) -> int:
        status = int(receive(*args))
        pushed = args[6] == lane.DONE  # (a push applied whose answer is lost: its general copy must not count)
        lost = dice.random() < (PUSH_ANSWER_LOSS if pushed else LANE_LOSS)
        return worker_lane.TIMEOUT if status == worker_lane.OK and lost else status

    worker_lane._send, worker_lane._receive = send_lossy, receive_lossy


def write(out_dir: str, rank: int, result: dict[str, object]) -> None:
    path = os.path.join(out_dir, f"w{rank}.json")
    with open(path + ".part", "w") as fh:
        json.dump(result, fh)
    os.replace(path + ".part", path)


def main() -> None:
    out_dir, mode, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ps = shoal.init()
    # Two slices, keys 0-31 on server 0 and 32-63 on server 1; every push adds its values.
    table = ps.table("lane", KEYS, DIM, mapping="range")
    ps.barrier()
    started = time.monotonic()
    if mode in ("count", "lossy"):
        if mode == "lossy":
            lose_lane_messages(ps.rank)
        count(ps, table, out_dir, rounds)
    elif mode == "pause":
        pause(ps, table, out_dir)
    else:
        forge(ps, table, ps.table("lane_ssp", KEYS, DIM, mapping="range", consistency=shoal.SSP(1)),
              ps.table("lane_adagrad", KEYS, DIM, mapping="range", optimizer=shoal.optim.Adagrad(lr=1.0)), out_dir)
    print(f"worker {ps.rank} done in {time.monotonic() - started:.1f}s", flush=True)
    ps.shutdown()


if __name__ == "__main__":
    main()
