"""A server's static tables: each slice here until it moves, pulls held by the bound.

Pulls go through the synchroniser (``server.sync``), which holds them until the
table's consistency bound is met; pushes apply the update rule to the slices'
shared memory. A request for a slice that is not here (it moved, or never was)
is answered "moved" with nothing applied (``wire.schema.Moved``, as an adaptive
table answers for keys that left); one for a slice on its way out waits for the
move to end (``SliceMoving``, held by ``server.slicing``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from shoal.api.config import TableSpec
from shoal.api.errors import CheckpointError, ProtocolError, SliceMovedError, TableError
from shoal.consistency.clocks import ClockTable
from shoal.placement.layout import TableLayout
from shoal.server.sync import Synchroniser
from shoal.server.tables import ServedTable, moved_answer, read_after_push, table_bytes
from shoal.storage import checkpoint
from shoal.storage.validate import as_keys, as_rows
from shoal.wire.message import Message
from shoal.wire.ops import Op
from shoal.wire.schema import is_int64

_MOST_SERVERS = 1 << 16  # a layout naming a server beyond would size every routing count by it


class StaticService:
    """The static tables of one server (the same dict the synchroniser and the slice mover use)."""

    keeps_rows_across_restart = False
    served_by_joined_servers = True

    def __init__(self, node: int, num_nodes: int, cluster_id: str, tables: dict[str, ServedTable],
                 clocks: ClockTable, sync: Synchroniser) -> None:
        self.node = node
        self.num_nodes = num_nodes
        self.cluster_id = cluster_id
        self.tables = tables
        self.clocks = clocks
        self.sync = sync

    def build(self, spec: TableSpec, current: dict[str, Any] | None = None) -> ServedTable:
        layout = TableLayout.initial(spec, self.num_nodes)
        if current is not None:  # slices may have moved since the table was created
            owners, epoch = current.get("owners"), current.get("epoch")
            if (not isinstance(owners, list) or len(owners) != layout.num_shards or not isinstance(epoch, int)
                    or epoch < 0 or not all(type(o) is int and 0 <= o < _MOST_SERVERS for o in owners)):
                raise ProtocolError(f"the layout of table {spec.name!r} must name a server for each of its "
                                    f"{layout.num_shards} slices and an epoch, got {current!r:.200}")
            layout = layout.at(owners, epoch)
        return ServedTable(spec, layout, self.node, self.cluster_id, self.clocks, now=self.sync.now)

    def install(self, spec: TableSpec, built: ServedTable) -> None:
        self.tables[spec.name] = built

    def bytes_here(self, spec: TableSpec) -> int:
        return -(-table_bytes(spec) // self.num_nodes)  # its share of the slices

    def spec(self, name: str) -> TableSpec:
        return self._table(name).spec

    def shards(self, name: str) -> list[int]:
        return sorted(self._table(name).stores)

    def _table(self, name: str) -> ServedTable:
        table = self.tables.get(name)
        if table is None:
            raise TableError(f"server {self.node} has no table {name!r}")
        return table

    # -------------------------------------------------------------- requests

    def handle(self, peer: bytes, msg: Message) -> Message | None:
        table = self._table(msg.table)
        try:
            if msg.op == Op.PULL:
                return self.sync.pull(table, peer, msg)
            if msg.op == Op.PUSH:
                skipped = self._push(table, msg)
                return msg.reply(Op.OK, {"skipped": skipped} if skipped else None)
            if msg.op == Op.PUSH_PULL:
                self._push(table, msg)
                msg = read_after_push(msg)  # from here on only the read may be refused
                return self.sync.pull(table, peer, msg)
        except SliceMovedError:
            if msg.op in (Op.PUSH, Op.PUSH_PULL) and "stream" in msg.body:
                # The worker sends the push again by a fresh layout, and the part for slices still
                # here comes back here: until then its later clock ticks must not count here.
                self.sync.refuse_reads(msg.sender, msg.table)
            return moved_answer(msg)
        raise ProtocolError(f"static table {msg.table!r} does not serve {msg.op.name}")

    def _push(self, table: ServedTable, msg: Message) -> int:
        keys = as_keys(msg.arrays[0], table.spec)
        grads = as_rows(msg.arrays[1], keys.shape[0], table.spec, strict_dtype=True)
        skipped = table.push(keys, grads)
        self.sync.after_push(table)
        return skipped

    def share(self, name: str, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        table = self._table(name)
        stores = dict(table.stores)  # this runs beside the loop, which may move slices meanwhile
        wanted = request.get("shards")
        if wanted is not None and not (isinstance(wanted, list) and all(is_int64(s) for s in wanted)):
            raise ProtocolError(f"shards must be a list of slice numbers, got {wanted!r}")
        shards = [s for s in sorted(stores) if (wanted is None or s in wanted) and not stores[s].retired]
        info = [{"shard": s, "num_rows": stores[s].num_rows, "label": stores[s].segment.label} for s in shards]
        return {"spec": table.spec.to_dict(), "shards": info}, [stores[s].fd for s in shards]

    def describe(self) -> dict[str, Any]:
        return {"tables": {n: {"shards": sorted(t.stores), "rows": sum(s.num_rows for s in t.stores.values()),
                               "epoch": t.layout.epoch} for n, t in self.tables.items()},
                "controllers": {n: t.controller.stats.as_dict() for n, t in self.tables.items()}}

    # ----------------------------------------------------------- checkpoints

    def settle(self, name: str) -> tuple[list[str], list[list[Any]] | None]:
        """A static table is final once the workers stop at the checkpoint's barrier."""
        self._table(name)
        return [], None

    def write(self, name: str, staging: Path, index: int) -> list[dict[str, Any]]:
        table = self._table(name)
        if table.moving:
            raise CheckpointError(f"slices {sorted(table.moving)} of {name!r} are moving; try again")
        entries = []
        for shard, store in sorted(table.stores.items()):
            entry = checkpoint.write_part(staging, index, f"n{self.node}-s{shard}", table.layout.mapping.keys_of(shard),
                                          store.snapshot())
            entries.append({**entry, "shard": shard})
        return entries

    def restore(self, name: str, path: Path, entry: dict[str, Any], write: bool) -> int:
        table = self._table(name)
        if table.moving:
            raise CheckpointError(f"slices {sorted(table.moving)} of {name!r} are moving; try again")
        return sum(self._load(table, keys, arrays, write) for keys, arrays in checkpoint.read_parts(path, entry))

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

    def close(self) -> None:
        for table in self.tables.values():
            table.close()
        self.tables.clear()
