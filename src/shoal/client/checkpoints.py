"""Collective checkpoint and restore, coordinated by rank 0 between two barriers.

Every worker calls ``ps.checkpoint(root)`` at the same point of its loop (a
clock boundary). The first barrier stops everyone with their pushes applied;
rank 0 has every server write its slices into a staging directory, checks that
each slice was written exactly once, and commits; the second barrier tells
every rank the outcome. ``root`` must be a directory every server writes and
every worker reads (a shared file system when the cluster spans machines).

Adaptive tables are settled first: rank 0 asks every server to send its
replicas' changes to their owners until no server has any left or waiting for
an answer; then each owner writes its keys, and rank 0 checks that every key
was written exactly once (a key that moved meanwhile makes it try again).
Replicated tables are settled by gossip: rank 0 has every server gossip with
all its peer replicas until the replicas of each shard report the same version
vector (every update any of them accepted is in each); then every replica
writes its rows and optimiser state, and rank 0 checks that each shard's parts
carry one version. Only servers the rendezvous' heartbeats call alive take
part: a dead server fails the checkpoint unless every table in it is
replicated, whose live replicas then write it.
"""

from __future__ import annotations

import logging
import os
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from shoal.api.errors import CheckpointError, ShoalError
from shoal.client.context import WorkerContext
from shoal.cluster import membership
from shoal.storage import checkpoint
from shoal.wire import bodies
from shoal.wire.schema import BarrierNote

log = logging.getLogger(__name__)

_ATTEMPTS = 5  # a slice or key on its way to another server makes a server refuse; try again a little later
_SILENT = BarrierNote(False, "rank 0 said nothing")


def save(worker: WorkerContext, root: str | os.PathLike[str], tables: Iterable[str] | None, keep: int) -> Path:
    names = _covered_tables(worker, tables)
    worker.barrier()
    note = None
    if worker.rank == 0:
        try:
            note = BarrierNote(True, str(_write(worker, Path(root), names, keep)))
        except (ShoalError, OSError) as exc:  # every rank hears of it at the barrier below
            note = BarrierNote(False, f"{type(exc).__name__}: {exc}")
    outcome = worker.barrier(note).get(0, _SILENT)
    if not outcome.ok:
        raise CheckpointError(f"checkpoint at clock {worker.clock} under {str(root)!r} failed on rank 0: "
                              f"{outcome.detail}")
    return Path(outcome.detail)


def restore(worker: WorkerContext, root: str | os.PathLike[str]) -> int:
    path = checkpoint.latest(root)
    manifest = checkpoint.read_manifest(path)
    for name, entry in manifest["tables"].items():
        table = worker.tables.get(name)
        if table is not None:
            checkpoint.check_saved_spec(name, entry, table.spec)
    worker.barrier()
    note = None
    if worker.rank == 0:
        note = BarrierNote(True, str(path))
        try:
            _load(worker, path, manifest)
        except (ShoalError, OSError) as exc:
            note = BarrierNote(False, f"{type(exc).__name__}: {exc}")
    outcome = worker.barrier(note).get(0, _SILENT)
    if not outcome.ok:
        raise CheckpointError(f"restoring {str(path)!r} failed on rank 0: {outcome.detail}")
    clock = int(manifest["clock"])
    worker.resume_clock(clock)
    return clock


def _covered_tables(worker: WorkerContext, tables: Iterable[str] | None) -> list[str]:
    names = sorted(worker.tables) if tables is None else list(tables)
    for name in names:
        table = worker.tables.get(name)
        if table is None:
            raise CheckpointError(f"no table {name!r} here to checkpoint")
    return names


def _servers(worker: WorkerContext, names: list[str]) -> list[int]:
    """The servers that take part: those the rendezvous' heartbeats say are alive. A dead server
    only costs replicas of replicated tables; a table of any other kind lost its rows there. A server
    that left (drained by any worker, its slices handed over) or joined is followed first."""
    try:
        status = membership.status(worker.tracker, worker.cluster.timeouts.replica_s)
    except ShoalError:  # the rendezvous is slow: ask every server, and a dead one times out by name
        alive = None
    else:
        worker.follow_servers(status.get("servers") or [])
        alive = status.get("alive")
    servers = worker.live_servers()
    live = [n for n in servers if alive is None or (n < len(alive) and alive[n])]
    lost = [name for name in names if not worker.tables[name].access.survives_a_server]
    if len(live) < len(servers) and lost:
        raise CheckpointError(f"server(s) {sorted(set(servers) - set(live))} are dead (no heartbeat): "
                              f"{lost} lost the rows held there")
    return live


def _settle(worker: WorkerContext, names: list[str], servers: list[int]) -> None:
    """Until every server says its adaptive tables' rows are final (every replica change at its owner)
    and the replicas of every replicated shard hold the same updates."""
    settling = [name for name in names if worker.tables[name].access.settles]
    if not settling:
        return
    timeout_s = worker.cluster.timeouts.request_s
    deadline = time.monotonic() + timeout_s
    while True:
        replies = _ask_servers(worker, bodies.Settle(settling), servers)
        why = {f"{name}: {w}" for body in replies for name, ws in body["unsettled"].items() for w in ws}
        versions: dict[tuple[str, int], set[Any]] = defaultdict(set)
        for body in replies:
            for name, shards in body.get("versions", {}).items():
                for shard, version in shards:
                    versions[name, int(shard)].add(_frozen(version))
        why |= {f"{name}: the replicas of shard {shard} differ (gossip under way)"
                for (name, shard), seen in versions.items() if len(seen) > 1}
        if not why:
            return
        if time.monotonic() > deadline:
            raise CheckpointError(f"tables did not settle within {timeout_s:.0f}s: {'; '.join(sorted(why))}")
        time.sleep(0.02)


def _frozen(version: list[list[int]]) -> tuple[tuple[int, ...], ...]:
    """A replica's ``state_version`` entries, hashable."""
    return tuple(tuple(int(n) for n in entry) for entry in version)


def _write(worker: WorkerContext, root: Path, names: list[str], keep: int) -> Path:
    for attempt in range(_ATTEMPTS):
        staging = checkpoint.new_staging(root, worker.clock)
        try:
            servers = _servers(worker, names)
            _settle(worker, names, servers)
            replies = _ask_servers(worker, bodies.Checkpoint(str(staging), names), servers)
            tables = {name: {"spec": worker.tables[name].spec.to_dict(),
                             "parts": _parts(worker, name, replies, staging)} for name in names}
        except CheckpointError as exc:
            checkpoint.discard(staging)
            if attempt == _ATTEMPTS - 1:
                raise
            log.info("checkpoint attempt %d: %s", attempt + 1, exc)
            time.sleep(0.2 * (attempt + 1))
            continue
        except BaseException:
            checkpoint.discard(staging)
            raise
        manifest = {"clock": worker.clock, "num_workers": worker.num_workers,
                    "num_servers": len(worker.live_servers()), "tables": tables}
        return checkpoint.commit(root, staging, manifest, keep)
    raise AssertionError("unreachable")


def _parts(worker: WorkerContext, name: str, replies: list[dict[str, Any]], staging: Path) -> list[dict[str, Any]]:
    """The parts of table ``name``, checked by its access to hold each row once."""
    parts = [p for body in replies for p in body["parts"].get(name, [])]
    worker.tables[name].access.check_checkpoint(parts, staging)
    return parts


def _load(worker: WorkerContext, path: Path, manifest: dict[str, Any]) -> None:
    """Every server checks every part it needs first; only when all have does any of them load a row.
    A server the heartbeats call dead fails it at once, by name (unless only replicated tables are
    restored: their live replicas take the rows)."""
    servers = _servers(worker, [name for name in manifest["tables"] if name in worker.tables])
    for commit in (False, True):
        replies = _ask_servers(worker, bodies.Restore(str(path), commit), servers)
        for name in manifest["tables"]:
            if name not in worker.tables:
                continue
            rows = sum(int(body["rows"].get(name, 0)) for body in replies)
            expected = worker.tables[name].access.rows_held(servers)
            if rows != expected:
                done = "loaded" if commit else "found"
                raise CheckpointError(f"servers {done} {rows} rows of {name!r} in {str(path)!r}, expected {expected}")


def _ask_servers(worker: WorkerContext, body: bodies.Body, servers: list[int]) -> list[dict[str, Any]]:
    replies = worker.tracker.gather(servers, lambda n: body.to_message(), body.op.name,
                                    worker.cluster.timeouts.request_s)
    return list(replies.values())
