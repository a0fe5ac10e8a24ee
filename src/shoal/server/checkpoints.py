"""Writing this server's slices into a checkpoint, and loading the rows it owns from one.

The worker that coordinates a checkpoint stops every worker at a barrier first,
so what a server writes is a snapshot at a clock boundary. A server writes the
slices it holds (values and optimiser state, by global key); on restore it
loads, from every part of a table, the rows whose keys it owns under its own
layout, whatever the number of servers that wrote them.

Adaptive tables are settled first (``SETTLE``: replicas' changes reach their
owners); then each server writes the keys it owns, and on restore loads its
home keys: the coordinator checks that every key was written exactly once.
Replicated tables are settled by gossip with every peer replica until the
replicas of each shard hold the same version vector; then every replica writes
its rows with its own optimiser state, and on restore each replica loads its
keys, its own node's optimiser state where that node wrote one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from shoal.api.config import TableSpec
from shoal.api.errors import CheckpointError, TableError
from shoal.server.adaptive import AdaptiveService
from shoal.server.replicated import ReplicatedTable, ReplicationService, wire_version
from shoal.server.tables import ServedTable
from shoal.storage import checkpoint
from shoal.wire.message import Message
from shoal.wire.ops import Op


class CheckpointService:
    def __init__(self, node: int, tables: dict[str, ServedTable], adaptive: AdaptiveService,
                 replication: ReplicationService, lost: dict[str, str]) -> None:
        self.node = node
        self.tables = tables
        self.adaptive = adaptive
        self.replication = replication
        #: tables whose rows here were lost; a restore brings them back
        self.lost = lost

    def settle(self, msg: Message) -> Message:
        """Send the named adaptive tables' pending replica changes and start gossip for the replicated
        ones; reply with what is still unsettled and the replicated tables' version vectors per shard."""
        unsettled: dict[str, list[str]] = {}
        versions: dict[str, list[list[Any]]] = {}
        for name in map(str, msg.body["tables"]):
            adaptive = self.adaptive.tables.get(name)
            replicated = self.replication.tables.get(name)
            if adaptive is not None:
                unsettled[name] = self.adaptive.settle(adaptive)
            elif replicated is not None:
                versions[name], unsettled[name] = self.replication.settle(replicated)
            else:
                raise TableError(f"server {self.node} has no adaptive or replicated table {name!r}")
        return msg.reply(Op.OK, {"unsettled": unsettled, "versions": versions})

    def write(self, msg: Message) -> Message:
        """Write every slice this server holds of the named tables; reply with the parts' entries."""
        staging = checkpoint.check_staging(str(msg.body["staging"]))
        parts: dict[str, list[dict[str, Any]]] = {}
        for index, name in enumerate(msg.body["tables"]):
            if str(name) in self.lost:
                raise CheckpointError(self.lost[str(name)])
            adaptive = self.adaptive.tables.get(str(name))
            if adaptive is not None:
                why = self.adaptive.unsettled(adaptive)
                if why:
                    raise CheckpointError(f"placement of {name!r} is still settling ({'; '.join(why)}); try again")
                keys, arrays = self.adaptive.owned_rows(adaptive)
                entry = checkpoint.write_part(staging, index, f"n{self.node}-owned", keys, arrays)
                parts[str(name)] = [{**entry, "node": self.node}]
                continue
            replicated = self.replication.tables.get(str(name))
            if replicated is not None:
                parts[str(name)] = self._write_replicas(staging, index, replicated)
                continue
            table = self._table(str(name))
            if table.moving:
                raise CheckpointError(f"slices {sorted(table.moving)} of {name!r} are moving; try again")
            entries = []
            for shard, store in sorted(table.stores.items()):
                snapshot = store.snapshot()
                entry = checkpoint.write_part(staging, index, f"n{self.node}-s{shard}",
                                              table.layout.mapping.keys_of(shard), snapshot)
                entries.append({**entry, "shard": shard})
            parts[str(name)] = entries
        return msg.reply(Op.OK, {"parts": parts})

    def _write_replicas(self, staging: Path, index: int, table: ReplicatedTable) -> list[dict[str, Any]]:
        entries = []
        for shard, replica in sorted(table.replicas.items()):
            if any(replica.held.values()):
                raise CheckpointError(f"shard {shard} of {table.spec.name!r} holds pushes that wait for "
                                      "earlier ones; try again")
            entry = checkpoint.write_part(staging, index, f"n{self.node}-s{shard}",
                                          table.layout.mapping.keys_of(shard), replica.state_arrays())
            entries.append({**entry, "shard": shard, "node": self.node, "version": wire_version(replica)})
        return entries

    def restore(self, msg: Message) -> Message:
        """Load the rows this server owns of every table the checkpoint and this server share.

        A restore runs twice: first with ``commit`` false, which reads and checks every part (size,
        SHA-256, keys, arrays fitting the table) and counts the rows it would load, writing nothing;
        the coordinator sends ``commit`` true only once every server has checked, so a damaged
        checkpoint loads nothing anywhere.
        """
        path = Path(str(msg.body["path"]))
        write = bool(msg.body["commit"])
        manifest = checkpoint.read_manifest(path)
        loaded: dict[str, int] = {}
        for name, entry in manifest["tables"].items():
            adaptive = self.adaptive.tables.get(name)
            replicated = self.replication.tables.get(name)
            table = self.tables.get(name)
            served = adaptive or replicated or table
            if served is None:
                continue
            spec = served.spec
            saved = TableSpec.from_dict(entry["spec"])
            if saved != spec:
                raise CheckpointError(f"table {name!r} was saved with spec {saved.to_dict()}, not {spec.to_dict()}")
            if adaptive is not None:
                loaded[name] = sum(self.adaptive.load_home_rows(adaptive, keys.astype(np.int64, copy=False), arrays,
                                                                write)
                                   for keys, arrays in checkpoint.read_parts(path, entry))
                continue
            if replicated is not None:
                if any(any(r.version().values()) for r in replicated.replicas.values()):
                    raise CheckpointError(f"replicated table {name!r} has taken updates already: "
                                          "restore right after creating the tables, before training")
                # This node's own parts last: where it wrote a row, its optimiser state is the one it kept.
                own_last = sorted(entry["parts"], key=lambda part: part.get("node") == self.node)
                loaded[name] = self.replication.load(replicated, checkpoint.read_parts(path, {**entry,
                                                                                          "parts": own_last}), write)
                continue
            assert table is not None
            if table.moving:
                raise CheckpointError(f"slices {sorted(table.moving)} of {name!r} are moving; try again")
            loaded[name] = sum(self._load(table, keys, arrays, write)
                               for keys, arrays in checkpoint.read_parts(path, entry))
        if write:
            for name in loaded:
                self.lost.pop(name, None)
        return msg.reply(Op.OK, {"rows": loaded})

    def _load(self, table: ServedTable, keys: np.ndarray, arrays: dict[str, np.ndarray], write: bool) -> int:
        shards, rows = table.layout.mapping.locate(keys.astype(np.int64, copy=False))
        held = np.array(sorted(table.stores), dtype=np.int64)
        # One sort groups the part's rows by slice: no pass over every key per slice held here.
        order = np.flatnonzero(np.isin(shards, held))
        order = order[np.argsort(shards[order], kind="stable")]
        grouped = shards[order]
        starts, ends = np.searchsorted(grouped, held), np.searchsorted(grouped, held, side="right")
        for shard, start, end in zip(held.tolist(), starts, ends, strict=True):
            mine = order[start:end]
            if not mine.size:
                continue
            store = table.stores[shard]
            with store.hold(None, exclusive=True):
                targets = store.state_arrays()
                dirty = targets.pop("dirty", None)
                checkpoint.place_saved(targets, rows[mine], arrays, mine, table.spec.name, write)
                if dirty is not None and write:
                    dirty[rows[mine]] = 0
        return int(order.size)

    def _table(self, name: str) -> ServedTable:
        table = self.tables.get(name)
        if table is None:
            raise TableError(f"server {self.node} has no static table {name!r} to checkpoint")
        return table
