"""``Table.in_place``: a compiled kernel's zero-copy hold on the rows that are on this node.

The rows are an adaptive table's (those present here, owned or replicated) or a
static table's (this node's slice of it).

A worker that updates a few rows per example (AdaPM's way: one Adagrad step per
triple) cannot pay a pull and a push per example; on the rows its node holds it
needs none. ``with table.in_place(keys) as rows:`` gives ``rows.values`` (this
node's rows of the table, in shared memory) and ``rows.slots`` (each key's row
in it, -1 for a key elsewhere): the kernel reads and writes ``values[slots[i]]``
directly, and the keys at ``rows.absent`` go through pull and push after the
block. Until the block ends none of those rows moves away, and no other writer
touches their values, so nothing written in place is lost or written after its
row left. An adaptive table's rows are pinned, not locked (``storage.in_place``):
the node's server goes on serving meanwhile, and what other writers add to a
held row (other nodes' pushes, replicas' changes, the node's other workers)
waits beside it (read with it) and goes in after the block; a row another block
holds is elsewhere for this one. A static slice's rows are locked for the block:
keep it to one small batch, as the node's server waits for them. Writes in place
are the update rule (the table's own applies to pushes); they are not checked for
NaN or Inf.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np

from shoal.api.errors import TableError
from shoal.storage.in_place import RowsInPlace
from shoal.storage.shard import ShardStore


class OpenHolds:
    """How many of one table's blocks in place are open (at most one): a pull, push or second hold of the
    table meanwhile would wait forever for the locks the open one holds. A count, not the set of holds:
    every call of the table checks it."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0


class InPlace:
    """The rows of some keys of one table on this node, held for a ``with`` block."""

    __slots__ = ("name", "keys", "values", "state", "slots", "absent", "table_holds", "_rows", "_counters",
                 "_open", "_check")

    def __init__(self, name: str, store: ShardStore | None, keys: np.ndarray, dim: int, dtype: np.dtype,
                 counters: Counter[str], rows: np.ndarray | None = None, shards: np.ndarray | None = None,
                 check: Callable[[str], None] | None = None) -> None:
        """``store``: this node's rows (None: it has none); ``rows`` and ``shards``: in a static slice,
        each key's row and slice; ``check``: raises if the node's server died (its memory is nobody's)."""
        self.name = name
        self.keys = keys
        self._rows = RowsInPlace(store, keys, rows, shards) if store is not None else None
        self._counters = counters
        self._check = check
        self._open = False
        #: this node's rows of the table (shared memory; empty where the node has none): valid in the block
        self.values: np.ndarray = self._rows.values if self._rows is not None else np.empty((0, dim), dtype)
        #: the update rule's per-row state beside ``values`` (a static table's Adagrad accumulators), by name
        self.state: dict[str, np.ndarray] = self._rows.state if self._rows is not None else {}
        #: per key, its row in ``values``, or -1 where the key is not on this node (set on entering)
        self.slots: np.ndarray = _NONE
        #: positions (in ``keys``) of the keys not on this node: pull and push them after the block
        self.absent: np.ndarray = _NONE
        #: the table's count of open holds (its own where the table gives none)
        self.table_holds = OpenHolds()

    @property
    def is_open(self) -> bool:
        return self._open

    def __enter__(self) -> InPlace:
        if self._open or self.table_holds.count:
            raise TableError(f"rows of {self.name!r} are already held in place by a block: end it first")
        rows = self._rows
        if rows is not None:
            rows.open()
            self.slots, self.absent = rows.slots, rows.absent
        else:  # no rows here (no local access, or this node's server died): every key is elsewhere
            self.slots, self.absent = np.full(self.keys.shape[0], -1, dtype=np.int64), np.arange(self.keys.shape[0])
        self._open = True
        self.table_holds.count += 1
        self._counters["rows_in_place"] += self.keys.shape[0] - self.absent.shape[0]
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if not self._open:
            return
        self._open = False
        self.table_holds.count -= 1
        if self._rows is not None:
            replicas = self._rows.close()
            if replicas:
                self._counters["replica_rows_in_place"] += replicas
            # What the block wrote went into the server's memory: not applied if it died meanwhile (an
            # error the block raised itself goes on as it is).
            if self._check is not None and kind is None:
                self._check(f"a block in place on {self.name!r}")


_NONE = np.empty(0, dtype=np.int64)
