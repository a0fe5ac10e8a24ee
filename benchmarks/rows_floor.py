"""What moving rows between two servers costs at the least: CPU per MB of each step a placement
message's rows take, with Shoal's own kernels, codec and transport and no other Python around them.

    python benchmarks/rows_floor.py [--rounds 300]

A relocation gathers the rows at the old owner (``read_present``), encodes them (the codec's keyed
tag: over the header alone on loopback, as a local job's servers sign), hands them to ZeroMQ, whose
I/O threads move them over TCP; the new owner decodes them, checks them (dtype, shape, finite) and
writes them in (``receive_rows``). A replica's sync takes its changes (``take_changes``) and the
owner adds them (``add_present``); the answer gathers the owner's rows and the replica takes them
(``apply_synced``); a new replica is written with numpy (value and base), as ``_receive_replica``
does. Each step is timed alone in this process on batches of ``BATCH`` random keys of a table of
KGE's rows (1,600 bytes) far larger than the caches, as a loaded server meets them; the hop runs
both its sockets here, so this process's CPU holds both sides and ZeroMQ's I/O threads (and the
codec's Python, once per message of ``BATCH`` rows).
``bench_server_cpu.py`` multiplies these prices by the bytes each kind moved in its runs.
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections.abc import Callable

import numpy as np

import shoal
from shoal.api.config import TableSpec
from shoal.placement.adaptive_table import AdaptiveTable
from shoal.placement.messages import State, to_parts
from shoal.storage.kernels import (
    OWNED,
    REPLICA,
    add_present,
    any_nonfinite,
    apply_synced,
    read_present,
    receive_rows,
    take_changes,
)
from shoal.storage.validate import as_rows
from shoal.transport.zmq_transport import ZmqTransport
from shoal.wire.codec import Codec
from shoal.wire.message import Message
from shoal.wire.ops import Op

NUM_KEYS = 50_000  # rows of 1,600 bytes: 80 MB an array, far beyond the caches
DIM = 400  # KGE's rows: ComplEx dim 100, its Adagrad state beside
BATCH = 400  # keys a relocation's state carries on the Zipf graph (``server_cpu.md``)

#: the steps of each placement kind's rows, sender's first
STEPS_OF_KIND = {
    "state": ("gather", "hop", "check", "receive"),
    "replicate": ("gather", "hop", "check", "replica"),
    "sync": ("take changes", "hop", "check", "add"),
    "synced": ("gather", "hop", "check", "apply synced"),
}


def cpu_per_mb(rounds: int = 300, seed: int = 0) -> dict[str, float]:
    """Milliseconds of CPU per MB of rows for each step (and ``"hop"``: both sides of the transport)."""
    rng = np.random.default_rng(seed)
    spec = TableSpec("rows_floor", num_keys=NUM_KEYS, dim=DIM, techniques="auto", init=shoal.Constant(0.0))
    cluster = uuid.uuid4().hex[:12]
    here, there = AdaptiveTable(spec, 0, 2, cluster), AdaptiveTable(spec, 1, 2, cluster)
    transport = ZmqTransport()
    listener = transport.listen("tcp://127.0.0.1:0")
    connection = transport.connect(listener.address)
    try:
        for table in (here, there):  # every page touched before the clock starts
            store = table.store
            assert store.base is not None and store.incoming is not None
            store.values[:] = rng.standard_normal(store.values.shape, dtype=np.float32)
            store.base[:] = store.values
            store.incoming[:] = 0.0
        batches = [np.sort(rng.choice(NUM_KEYS, BATCH, replace=False)).astype(np.int64) for _ in range(rounds)]
        mb = BATCH * DIM * 4 / 1e6
        prices: dict[str, float] = {}

        def price(step: str, once: Callable[[np.ndarray], object], before: Callable[[np.ndarray], object] | None = None
                  ) -> None:
            if before is not None:  # the kernel loaded (or compiled) before the clock starts
                before(batches[0])
            once(batches[0])
            spent = 0.0
            for keys in batches:
                if before is not None:
                    before(keys)
                started = time.process_time()
                once(keys)
                spent += time.process_time() - started
            prices[step] = spent / (rounds * mb) * 1e3

        a, b = here.store, there.store
        assert a.arrived is not None and a.incoming is not None and a.presence is not None
        assert b.base is not None and b.changed is not None and b.pinned is not None
        assert b.arrived is not None and b.incoming is not None and b.presence is not None
        rows = np.empty((BATCH, DIM), dtype=np.float32)
        absent = np.empty(BATCH, dtype=np.int64)
        a.presence[:] = OWNED
        price("gather", lambda keys: read_present(a.values, a.presence, a.arrived, a.incoming, keys, rows, absent))

        codec = Codec(secret=b"rows floor", local=True)

        def hop(keys: np.ndarray) -> None:
            ints = np.zeros(BATCH, dtype=np.int64)
            body, arrays = to_parts([State(keys, rows, ints, np.zeros((BATCH, 2), dtype=np.int64), ints, ints, ints)])
            body.update(channel=1, seq=1, base=1, acks=0, acked=0)  # its place in a channel (``cluster.links``)
            connection.send(codec.encode(Message(Op.PLACEMENT, table=spec.name, body=body, arrays=arrays)))
            came = listener.recv(10.0)
            assert came is not None, "the hop's message did not come"
            codec.decode(came[1])
        price("hop", hop)
        price("check", lambda keys: any_nonfinite(as_rows(rows, BATCH, spec, strict_dtype=True)))

        def absent_there(keys: np.ndarray) -> None:
            b.presence[keys] = 0
        price("receive", lambda keys: receive_rows(b.values, b.base, b.changed, b.presence, b.pinned, b.arrived,
                                                   b.incoming, keys, rows), absent_there)

        def replica(keys: np.ndarray) -> None:
            b.values[keys] = rows
            b.base[keys] = rows
            b.presence[keys] = REPLICA
        price("replica", replica)

        def changed_replicas(keys: np.ndarray) -> None:
            b.presence[keys] = REPLICA
            b.changed[keys] = 1
        nothing_else = np.zeros(BATCH, dtype=np.bool_)
        price("take changes", lambda keys: take_changes(b.values, b.base, b.changed, b.pinned, b.arrived, b.incoming,
                                                        keys, nothing_else), changed_replicas)
        price("add", lambda keys: add_present(a.values, a.changed, a.presence, a.pinned, a.arrived, a.incoming,
                                              keys, rows, 1.0, absent))
        keep = np.zeros(BATCH, dtype=np.uint8)
        gone = np.empty(BATCH, dtype=np.int64)
        price("apply synced", lambda keys: apply_synced(b.values, b.base, b.changed, b.presence, b.pinned, b.arrived,
                                                        b.incoming, keys, rows, keep, gone), changed_replicas)
        return prices
    finally:
        connection.close()
        listener.close()
        transport.close()
        here.close()
        there.close()


def per_kind(prices: dict[str, float]) -> dict[str, float]:
    """Milliseconds of CPU per MB of rows for each kind of placement message: the sum of its steps."""
    return {kind: sum(prices[step] for step in steps) for kind, steps in STEPS_OF_KIND.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=300)
    args = p.parse_args()
    prices = cpu_per_mb(args.rounds)
    print("| step | ms of CPU per MB |\n|---|---:|")
    for step, ms in prices.items():
        print(f"| {step} | {ms:.3f} |")
    print("\n| placement kind | ms of CPU per MB, at the least |\n|---|---:|")
    for kind, ms in per_kind(prices).items():
        print(f"| {kind} | {ms:.3f} |")


if __name__ == "__main__":
    main()
