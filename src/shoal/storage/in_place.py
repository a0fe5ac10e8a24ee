"""Rows a compiled kernel reads and writes where they lie: a node's shared memory, locked meanwhile.

``RowsInPlace`` locks the row stripes of some keys in a store, exclusively, as
every writer of the node does (the server relocating rows, syncing replicas,
moving a slice away and applying other nodes' pushes; the node's other workers),
and gives each key's slot in the store's ``values``: a kernel then reads and
updates those rows with no copy and no message, and none of them moves away or
changes under it until the block ends. Keys not on this node get slot -1; the
caller reaches them with pull and push, after the block. In an adaptive table's
store a key's row is the key, present or not; in a static slice the caller
gives each key's row (-1 for keys of other slices), and the slice may have moved
away since (then every key is elsewhere). Rows of a static slice read under ESSP
are marked changed on close, so the server sends them to the slice's readers.

A replica's row must send what was written to it to its owner. The store keeps
each replica's row as of its last sync (``ShardStore.base``), so what a kernel
writes there is the change the next sync sends, with no copy: the replicas among
the keys are marked changed when the block opens (no sync reads them before it
ends), as a push to a replica marks them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shoal.storage import kernels
from shoal.storage.shard import ShardStore


class RowsInPlace:
    """The rows of ``keys`` in ``store``, locked from ``open`` to ``close``."""

    __slots__ = ("store", "keys", "rows", "values", "state", "slots", "absent", "_replicas", "_lock")

    def __init__(self, store: ShardStore, keys: np.ndarray, rows: np.ndarray | None = None,
                 shards: np.ndarray | None = None) -> None:
        """``rows`` and ``shards``: a static slice's, each key's row and slice (None: an adaptive store,
        where a key's row is the key)."""
        assert (store.presence is None) == (rows is not None) == (shards is not None)
        self.store = store
        self.keys = keys
        self.rows = (rows, shards)
        #: the store's rows (a view of shared memory); index it with ``slots``
        self.values = store.values
        #: the update rule's per-row state (Adagrad's accumulators, Adam's moments), by name
        self.state = store.state
        #: per key, its row in ``values``, or -1 if the key is not on this node (set by ``open``)
        self.slots = _NONE
        #: positions (in ``keys``) of the keys not on this node (set by ``open``)
        self.absent = _NONE
        self._replicas = 0  # keys held at a replica row (set by ``open``)
        self._lock: Any = None

    def open(self) -> None:
        store = self.store
        rows, shards = self.rows
        lock = store.hold(self.keys if rows is None else rows, exclusive=True)
        lock.__enter__()
        try:
            n = self.keys.shape[0]
            self.slots = np.empty(n, dtype=np.int64)
            absent_at = np.empty(n, dtype=np.int64)
            if rows is None:
                assert store.presence is not None and store.changed is not None
                absent, self._replicas = kernels.slots_in_place(store.presence, store.changed, self.keys, self.slots,
                                                                absent_at)
            elif store.retired:  # the slice moved away before the block: every key is elsewhere
                self.slots[:] = -1
                absent_at[:] = np.arange(n)
                absent = n
            else:
                assert shards is not None
                absent = kernels.slice_slots_in_place(shards, rows, store.shard, self.slots, absent_at)
            self.absent = absent_at[:absent]
        except BaseException:
            lock.__exit__(None, None, None)
            raise
        self._lock = lock

    def close(self) -> int:
        """Unlock, after marking a static slice's rows changed for its ESSP readers; returns how many
        keys were held at a replica row."""
        store = self.store
        lock, self._lock = self._lock, None
        if lock is None:
            return 0
        try:
            if store.dirty is not None and self.absent.shape[0] < self.slots.shape[0]:
                store.dirty[self.slots[self.slots >= 0]] = 1
            return int(self._replicas)
        finally:
            lock.__exit__(None, None, None)


_NONE = np.empty(0, dtype=np.int64)

