"""Rows a compiled kernel reads and writes where they lie: a node's shared memory.

``RowsInPlace`` gives each key's slot in a store's ``values``: a kernel then
reads and updates those rows with no copy and no message, and none of them
moves away until the block ends. Keys not on this node get slot -1; the caller
reaches them with pull and push, after the block.

In an adaptive table's store a key's row is the key, present or not. Its rows
are pinned, not locked (``storage.kernels``: pinned rows): the row locks are
taken only while the hold marks its rows; it lets them go with no lock, so the
node's server goes on serving meanwhile, other nodes' pulls and pushes
included, and a hold costs one lock round. A writer that finds a row pinned
(the server adding another node's push or a replica's change, syncing or making
a replica the owner; another worker's push) adds its change beside the row, and
the row's next writer or hold folds it in once the hold let go; a row pinned
does not move away or stop being a replica until then. A row another hold has
pinned is elsewhere for this one (slot -1: its pull reads it with what arrived
beside it, its push adds beside it, with no message).

A replica's row must send what was written to it to its owner. The store keeps
each replica's row as of its last sync (``ShardStore.base``), so what a kernel
writes there is the change the next sync sends, with no copy: the replicas among
the keys are marked changed when the hold begins, and a sync meanwhile (which
may take part of it) leaves a held row marked.

In a static slice the caller gives each key's row (-1 for keys of other
slices), and the slice may have moved away since (then every key is elsewhere).
Its rows stay locked, exclusively, from ``open`` to ``close``, as every writer of
the node locks them. Rows of a static slice read under ESSP are marked changed
on close, so the server sends them to the slice's readers.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from shoal.api.errors import TableError
from shoal.storage import kernels
from shoal.storage.shard import MAX_HOLDS, ShardStore

# A hold's process, kept in the store's table of holds: the server lets go of the rows of a process
# that died holding them. os.getpid is a system call: once per process (and once in a forked child).
_pid = os.getpid()


def _new_process() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_new_process)


class RowsInPlace:
    """The rows of ``keys`` in ``store``, held from ``open`` to ``close``."""

    __slots__ = ("store", "keys", "rows", "values", "state", "slots", "absent", "_replicas", "_lock", "_hold")

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
        self._lock: Any = None  # a static slice's locks, taken for the whole block
        self._hold = 0  # an adaptive store's hold (its place in the store's table of holds) for the whole block

    def open(self) -> None:
        store = self.store
        rows, shards = self.rows
        n = self.keys.shape[0]
        self.slots = np.empty(n, dtype=np.int64)
        absent_at = np.empty(n, dtype=np.int64)
        if rows is None:
            assert store.presence is not None and store.changed is not None
            assert store.pinned is not None and store.holds is not None
            assert store.arrived is not None and store.incoming is not None
            # The table of holds is shared by the node's processes: a place in it is taken under the lock
            # of row 0's stripe too (two holds of rows in other stripes took the same place at once).
            with store.hold(self.keys, exclusive=True, first_stripe=True):
                absent, self._replicas, self._hold = kernels.pin_in_place(
                    store.values, store.presence, store.changed, store.pinned, store.holds, store.arrived,
                    store.incoming, _pid, self.keys, self.slots, absent_at)
            if not self._hold:
                raise TableError(f"more than {MAX_HOLDS} blocks hold rows of {store.spec.name!r} in place on this "
                                 "node at once")
            self.absent = absent_at[:absent]
            return
        lock = store.hold(rows, exclusive=True)
        lock.__enter__()
        try:
            if store.retired:  # the slice moved away before the block: every key is elsewhere
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
        """Let the rows go (an adaptive store's with no lock; a static slice's marked changed for its ESSP
        readers); returns how many keys were held at a replica row."""
        store = self.store
        hold, self._hold = self._hold, 0
        if hold:
            assert store.pinned is not None and store.holds is not None
            kernels.release(store.pinned, store.holds, hold, self.slots)
            return int(self._replicas)
        lock, self._lock = self._lock, None
        if lock is None:
            return 0
        try:
            if store.dirty is not None and self.absent.shape[0] < self.slots.shape[0]:
                store.dirty[self.slots[self.slots >= 0]] = 1
            return 0
        finally:
            lock.__exit__(None, None, None)


_NONE = np.empty(0, dtype=np.int64)

