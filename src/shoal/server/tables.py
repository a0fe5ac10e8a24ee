"""The tables one server holds: key-level pull and push on its shards."""

from __future__ import annotations

import numpy as np

from shoal.api.config import TableSpec
from shoal.api.errors import KeyRangeError
from shoal.placement.layout import TableLayout
from shoal.storage import kernels
from shoal.storage.rules import rule_for
from shoal.storage.shard import ShardStore
from shoal.storage.validate import drop_nonfinite


def table_bytes(spec: TableSpec) -> int:
    """Bytes a whole table needs: values plus the update rule's per-row state."""
    itemsize = np.dtype(spec.dtype).itemsize
    per_row = spec.dim * itemsize
    for st in rule_for(spec.optimizer).state:
        width = spec.dim if st.per_value else 1
        per_row += width * np.dtype(st.dtype or spec.dtype).itemsize
    return spec.num_keys * per_row


class ServedTable:
    """A table's shards owned by one server node."""

    def __init__(self, spec: TableSpec, layout: TableLayout, node: int, cluster_id: str) -> None:
        self.spec = spec
        self.layout = layout
        self.node = node
        self.stores: dict[int, ShardStore] = {
            shard: ShardStore.create(spec, shard, layout.mapping.keys_of(shard), cluster_id)
            for shard in layout.shards_of(node)
        }

    def _split(self, keys: np.ndarray) -> list[tuple[ShardStore, np.ndarray | None, np.ndarray]]:
        """``(store, positions, rows)`` per shard; positions None means all keys, in order."""
        owner, shard, rows, counts = self.layout.route(keys)
        if counts[self.node] != keys.shape[0]:
            bad = int(keys[np.flatnonzero(owner != self.node)[0]])
            raise KeyRangeError(f"key {bad} of table {self.spec.name!r} is not held by server {self.node}")
        if len(self.stores) == 1:
            return [(next(iter(self.stores.values())), None, rows)]
        shard_ids = sorted(self.stores)
        index = np.searchsorted(shard_ids, shard)
        order, starts = kernels.partition_by_owner(index, len(shard_ids))
        parts: list[tuple[ShardStore, np.ndarray | None, np.ndarray]] = []
        for i, sid in enumerate(shard_ids):
            pos = order[starts[i] : starts[i + 1]]
            if pos.size:
                parts.append((self.stores[sid], pos, rows[pos]))
        return parts

    def pull(self, keys: np.ndarray) -> np.ndarray:
        parts = self._split(keys)
        if len(parts) == 1 and parts[0][1] is None:
            return parts[0][0].read(parts[0][2])
        out = np.empty((keys.shape[0], self.spec.dim), dtype=self.spec.dtype)
        for store, pos, rows in parts:
            assert pos is not None  # several shards: each part names its positions
            kernels.place_rows(out, pos, store.read(rows))
        return out

    def push(self, keys: np.ndarray, grads: np.ndarray) -> int:
        """Apply a push whole, or reject it whole; returns rows skipped as non-finite."""
        keys, grads, skipped = drop_nonfinite(keys, grads, self.spec)
        for store, pos, rows in self._split(keys):
            store.update(rows, grads if pos is None else grads[pos])
        return skipped

    def close(self) -> None:
        for store in self.stores.values():
            store.close()
        self.stores.clear()
