"""Options of the MF example for replicated tables: the dynamic read quorum, the gossip period over
training, and the records a benchmark checks the probabilistic model against."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import shoal


def dynamic(text: str) -> shoal.Dynamic:
    """``P,K,LATENCY_MS``: the smallest read quorum with P(missing <= K) >= P within LATENCY_MS."""
    p, k, latency_ms = text.split(",")
    return shoal.Dynamic(p=float(p), k=int(k), latency_ms=float(latency_ms))


def gossip_schedule(entries: list[str]) -> dict[int, float]:
    """``EPOCH:MS`` entries as {epoch (0-based): gossip period in ms}."""
    schedule = {}
    for entry in entries:
        epoch, ms = entry.split(":")
        schedule[int(epoch) - 1] = float(ms)
    return schedule


def note_epoch(directory: str, epoch: int, gossip_ms: float | None) -> None:
    """When each epoch starts (and the gossip period it sets), for a harness that disturbs replicas at
    given epochs and for the timeline of the records."""
    with open(os.path.join(directory, "epochs.jsonl"), "a") as fh:
        fh.write(json.dumps({"t": time.time(), "epoch": epoch + 1, "gossip_ms": gossip_ms}) + "\n")


def record(tables: list[Any]) -> None:
    """Keep every read, acknowledged push and read-quorum choice of these replicated tables."""
    for table in tables:
        table.access.record = True


def write_records(directory: str, rank: int, tables: list[Any]) -> None:
    """This rank's records; rank 0 adds, per table and shard, what the model is fitted from now."""
    out: dict[str, Any] = {}
    for table in tables:
        access = table.access
        entry: dict[str, Any] = {"reads": access.reads, "acks": access.acks, "choices": access.choices}
        if rank == 0:
            models = {}
            for shard in range(table.layout.num_shards):
                live = access.view.live(access.shards[shard].nodes)
                model = access.model(shard, live)
                models[str(shard)] = {
                    "replicas": live, "rates": {str(o): r for o, r in model.rates.items()},
                    "delays": {f"{o}>{j}": s.values() for (o, j), s in model.delays.items()},
                    "read_latency": {str(j): s.values() for j, s in model.read_latency.items()}}
            entry["models"] = models
        out[table.name] = entry
    with open(os.path.join(directory, f"record{rank}.json"), "w") as fh:
        json.dump(out, fh)
