"""What each placement event costs a server, without sockets: CPU per event and per key.

    python benchmarks/bench_placement.py [--rounds 200]

Two nodes' ``PlacementMachine``s of an adaptive table shaped like the KGE
app's entities (200,000 keys, rows of 400 float32) exchange the messages of a
relocation, a replication and a replica's sync, on keys drawn at random over the
table as a job's batches are, each passed through the wire
encoding (``to_parts``/``from_parts``) as a server does. Every event is timed
on its own (thread CPU, median over rounds): what the server spends on its
numpy and compiled work per message, before the socket and the codec
(``request_cost.md``) add theirs. A server on KGE auto handles a few hundred
such events a second (``kge.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import shoal  # noqa: E402
from common import write_results  # noqa: E402
from shoal.api.config import TableSpec  # noqa: E402
from shoal.placement import held as held_module  # noqa: E402
from shoal.placement import intent as intent_module  # noqa: E402
from shoal.placement import machine as machine_module  # noqa: E402
from shoal.placement.adaptive_table import AdaptiveTable, Effects  # noqa: E402
from shoal.placement.machine import PlacementMachine  # noqa: E402
from shoal.placement.messages import Announce, PlacementMessage, from_parts, to_parts  # noqa: E402
from shoal.storage.kernels import REPLICA, warm_up  # noqa: E402

NUM_KEYS = 200_000
DIM = 400
MOVED = 250  # keys one relocation event moves (a KGE batch's share)
REPLICAS = 300  # replica rows one sync carries
KERNELS = ("shoal.storage.kernels", "shoal.placement.kernels")  # the modules of the compiled kernels


def _wire(message: PlacementMessage) -> PlacementMessage:
    body, arrays = to_parts([message])
    return next(iter(from_parts(body, arrays)))


def _only(effects: Effects, kind: str) -> PlacementMessage:
    sent = [s.message for s in effects.sends if s.message.kind == kind]
    assert len(sent) == 1, [s.message.kind for s in effects.sends]
    return sent[0]


class Timer:
    """Each event's thread CPU, and the part of it spent in the compiled kernels the placement code
    calls (their names in its modules wrapped while the timer lives: ``kernels_timed``)."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}
        self.in_kernels: dict[str, list[float]] = {}
        self.keys: dict[str, int] = {}
        self.kernel_s = 0.0

    def __call__(self, name: str, keys: int, fn: Callable[..., Any], *args: Any) -> Any:
        start, kernels = time.thread_time(), self.kernel_s
        result = fn(*args)
        self.times.setdefault(name, []).append(time.thread_time() - start)
        self.in_kernels.setdefault(name, []).append(self.kernel_s - kernels)
        self.keys[name] = keys
        return result

    @contextlib.contextmanager
    def kernels_timed(self) -> Iterator[None]:
        """Every kernel the placement modules call, timed into ``kernel_s`` (about a µs a call more)."""
        wrapped = []
        for module in (machine_module, intent_module, held_module):
            for name, value in list(vars(module).items()):
                if callable(value) and not isinstance(value, type) and getattr(value, "__module__", "") in KERNELS:
                    wrapped.append((module, name, value))
                    setattr(module, name, self._timed(value))
        try:
            yield
        finally:
            for module, name, value in wrapped:
                setattr(module, name, value)

    def _timed(self, kernel: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            start = time.thread_time()
            try:
                return kernel(*args)
            finally:
                self.kernel_s += time.thread_time() - start
        return timed


def run(rounds: int) -> Timer:
    warm_up(np.float32)
    spec = TableSpec("bench", num_keys=NUM_KEYS, dim=DIM, techniques="auto", init=shoal.Constant(0.0))
    cluster_id = uuid.uuid4().hex[:12]
    tables = [AdaptiveTable(spec, node, 2, cluster_id) for node in range(2)]
    machines = [PlacementMachine(t) for t in tables]
    timer = Timer()
    stack = contextlib.ExitStack()
    stack.enter_context(timer.kernels_timed())
    # Keys homed at node 0 (its first owner), in a random order: a job's batches are scattered over the
    # table, and consecutive keys would share cache lines a job's do not.
    even = np.random.default_rng(0).permutation(np.arange(0, NUM_KEYS, 2, dtype=np.int64))
    now = 0.0
    try:
        # The first keys are wanted on both nodes for the whole run: node 1 gets replicas of them.
        shared = np.sort(even[:REPLICAS])
        for machine in machines:
            machine.intend(shared, 0, 1 << 40)
        machines[0].tick(now, 0, 0.01)
        announced = _only(machines[1].tick(now, 0, 0.01), "announce")
        replicate = _only(machines[0].receive(1, _wire(announced), now, 0), "replicate")
        machines[1].receive(0, _wire(replicate), now, 0)
        assert int((tables[1].presence[shared] == REPLICA).sum()) == REPLICAS
        for i in range(rounds):
            now += 0.06  # past the sync period
            # A relocation: node 1 alone announces fresh keys; their owner hands them over.
            keys = np.sort(even[REPLICAS + i * MOVED: REPLICAS + (i + 1) * MOVED])
            announce = _wire(Announce(keys, True, 1, generation=i + 1))
            state = _only(timer("announce at the owner: relocate", MOVED, machines[0].receive, 1, announce, now, 0),
                          "state")
            state = timer("wire: encode and decode a state", MOVED, _wire, state)
            timer("state at the new owner", MOVED, machines[1].receive, 0, state, now, 0)
            # A replica's sync: node 1's workers changed the rows; the owner adds and answers.
            tables[1].store.update_present(shared, np.full((REPLICAS, DIM), 1e-6, np.float32), 1.0)
            sync = _wire(_only(timer("sync timer at the replica", REPLICAS, machines[1].tick, now, 0, 0.01), "sync"))
            synced = _wire(_only(timer("sync at the owner", REPLICAS, machines[0].receive, 1, sync, now, 0), "synced"))
            timer("answer at the replica", REPLICAS, machines[1].receive, 0, synced, now, 0)
        expected = np.float32(rounds * 1e-6)
        assert np.allclose(tables[0].store.values[shared, 0], expected, rtol=1e-3), "a sync was lost or doubled"
    finally:
        stack.close()
        for table in tables:
            table.close()
    return timer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=200)
    args = p.parse_args()
    timer = run(args.rounds)
    lines = [f"One server's CPU per placement event ({NUM_KEYS:,} keys of {DIM} float32, median of {args.rounds})",
             "", "| event | keys | µs per event | µs per key | of which in compiled kernels |",
             "|---|---:|---:|---:|---:|"]
    results = {}
    for name, times in timer.times.items():
        us = statistics.median(times) * 1e6
        keys = timer.keys[name]
        share = sum(timer.in_kernels[name]) / sum(times) if sum(times) else 0.0
        results[name] = {"keys": keys, "us": us, "us_per_key": us / keys, "kernels_share": share}
        lines.append(f"| {name} | {keys} | {us:.0f} | {us / keys:.2f} | {share:.0%} |")
    table_md = "\n".join(lines)
    print(table_md)
    write_results("placement", {"rounds": args.rounds, "results": results}, table_md)


if __name__ == "__main__":
    main()
