"""The tables one server holds: key-level pull and push on its shards."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from shoal.api.config import TableSpec
from shoal.api.errors import KeyRangeError
from shoal.consistency.clocks import ClockTable
from shoal.consistency.controller import ShardController
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


@dataclass
class EagerUpdate:
    """Rows to push to one subscriber when the slowest clock advances (ESSP)."""

    worker: int
    keys: np.ndarray
    values: np.ndarray


class ServedTable:
    """A table's shards owned by one server node, and its synchronisation controller."""

    def __init__(self, spec: TableSpec, layout: TableLayout, node: int, cluster_id: str,
                 clocks: ClockTable, now: Callable[[], float] = time.monotonic) -> None:
        self.spec = spec
        self.layout = layout
        self.node = node
        self.stores: dict[int, ShardStore] = {
            shard: ShardStore.create(spec, shard, layout.mapping.keys_of(shard), cluster_id)
            for shard in layout.shards_of(node)
        }
        self.controller: ShardController[Any] = ShardController(spec.consistency, clocks, now)
        # ESSP: per shard, per worker, which rows that worker has fetched (and so caches).
        self._subscribed: dict[int, dict[int, np.ndarray]] = {s: {} for s in self.stores}

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

    def check(self, keys: np.ndarray) -> None:
        """Raise ``KeyRangeError`` unless every key is held here."""
        self._split(keys)

    def pull(self, keys: np.ndarray) -> np.ndarray:
        parts = self._split(keys)
        if len(parts) == 1 and parts[0][1] is None:
            return parts[0][0].read(parts[0][2])
        out = np.empty((keys.shape[0], self.spec.dim), dtype=self.spec.dtype)
        for store, pos, rows in parts:
            assert pos is not None  # several shards: each part names its positions
            kernels.place_rows(out, pos, store.read(rows))
        return out

    def subscribe(self, worker: int, keys: np.ndarray) -> None:
        """Remember that ``worker`` now caches the rows of ``keys`` (ESSP only)."""
        if not self.spec.consistency.eager:
            return
        for store, _, rows in self._split(keys):
            subs = self._subscribed[store.shard]
            mask = subs.get(worker)
            if mask is None:
                mask = subs[worker] = np.zeros(store.num_rows, dtype=np.bool_)
            mask[rows] = True

    def eager_updates(self) -> list[EagerUpdate]:
        """Changed rows for each subscriber, collected once per advance of the slowest clock.

        Every subscriber gets a message, empty or not: it tells the worker that
        the rows it caches from this server are current at the new clock.
        """
        if not self.spec.consistency.eager:
            return []
        per_worker: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        for shard, store in self.stores.items():
            changed = store.take_dirty()
            keys_of_rows = self.layout.mapping.keys_of(shard)
            for worker, mask in self._subscribed[shard].items():
                rows = changed[mask[changed]]
                per_worker.setdefault(worker, []).append((keys_of_rows[rows], store.read(rows)))
        updates = []
        for worker, parts in per_worker.items():
            keys = np.concatenate([k for k, _ in parts])
            values = np.concatenate([v for _, v in parts]) if parts else np.empty((0, self.spec.dim))
            updates.append(EagerUpdate(worker, keys, values.astype(self.spec.dtype, copy=False)))
        return updates

    def push(self, keys: np.ndarray, grads: np.ndarray) -> int:
        """Apply a push whole, or reject it whole; returns rows skipped as non-finite."""
        keys, grads, skipped = drop_nonfinite(keys, grads, self.spec)
        for store, pos, rows in self._split(keys):
            store.update(rows, grads if pos is None else grads[pos])
        self.controller.on_push()
        return skipped

    def close(self) -> None:
        for store in self.stores.values():
            store.close()
        self.stores.clear()
