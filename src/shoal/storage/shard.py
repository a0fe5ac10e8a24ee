"""One shard of one table: its rows and optimiser state in one shared segment.

The server creates the store; co-located workers attach to the same segment
and read and update rows themselves, under the same locks, with the same rule.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import numpy as np

from shoal.api.config import TableSpec
from shoal.api.errors import ProtocolError, ShapeError, SliceMovedError
from shoal.storage import kernels
from shoal.storage.initialize import fill_initial
from shoal.storage.rules import UpdateRule, rule_for
from shoal.storage.segment import Segment, StripedLocks, align

MAX_HOLDS = 255  # blocks in place open at once on one node's rows of a table (a row's pin is a byte)


@dataclass(frozen=True)
class ArraySlot:
    offset: int
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class ShardLayout:
    """Where each array of a shard lies in its segment; creator and attacher compute the same."""

    slots: dict[str, ArraySlot]
    size: int

    @classmethod
    def of(cls, spec: TableSpec, rule: UpdateRule, num_rows: int) -> ShardLayout:
        slots: dict[str, ArraySlot] = {}
        # Word 0: set once the shard has moved to another server; co-located readers
        # and writers check it under the row locks and go through the new owner.
        slots["header"] = ArraySlot(0, (8,), "uint64")
        offset = 64
        slots["values"] = ArraySlot(offset, (num_rows, spec.dim), spec.dtype)
        offset = align(offset + num_rows * spec.dim * np.dtype(spec.dtype).itemsize)
        for st in rule.state:
            dtype = st.dtype or spec.dtype
            shape = (num_rows, spec.dim) if st.per_value else (num_rows,)
            slots[st.name] = ArraySlot(offset, shape, dtype)
            offset = align(offset + int(np.prod(shape)) * np.dtype(dtype).itemsize)
        if spec.consistency.bound is not None:
            # Rows changed since the server last pushed them to subscribers (ESSP: the table's model,
            # or one its readers chose for some slices at run time).
            slots["dirty"] = ArraySlot(offset, (num_rows,), "uint8")
            offset = align(offset + num_rows)
        if spec.adaptive:
            # Whether this node owns a row, holds a replica of it, or neither; where the node's
            # server believes an absent row lives (its location cache, read by its workers);
            # and, for replicas, the row as of its last sync with the owner (the change made here
            # since is the difference: a write to a replica, a push or in place, writes its value
            # alone), with a mark per changed row (a sync then looks at a byte per replica, not at
            # its whole row).
            slots["presence"] = ArraySlot(offset, (num_rows,), "uint8")
            offset = align(offset + num_rows)
            slots["location"] = ArraySlot(offset, (num_rows,), "int8")
            offset = align(offset + num_rows)
            slots["base"] = ArraySlot(offset, (num_rows, spec.dim), spec.dtype)
            offset = align(offset + num_rows * spec.dim * np.dtype(spec.dtype).itemsize)
            slots["changed"] = ArraySlot(offset, (num_rows,), "uint8")
            offset = align(offset + num_rows)
            # Rows a worker's kernel holds in place (a byte per row: its hold's place in the table of
            # holds, which keeps each hold's process id), and what other writers added beside them meanwhile
            # (a byte per row, and the rows: ``storage.kernels``, pinned rows); pages of ``incoming``
            # take memory only once a held row is written to.
            slots["pinned"] = ArraySlot(offset, (num_rows,), "uint8")
            offset = align(offset + num_rows)
            slots["holds"] = ArraySlot(offset, (MAX_HOLDS + 1,), "int64")
            offset = align(offset + (MAX_HOLDS + 1) * 8)
            slots["arrived"] = ArraySlot(offset, (num_rows,), "uint8")
            offset = align(offset + num_rows)
            slots["incoming"] = ArraySlot(offset, (num_rows, spec.dim), spec.dtype)
            offset = align(offset + num_rows * spec.dim * np.dtype(spec.dtype).itemsize)
        return cls(slots, max(offset, 1))


def segment_label(cluster_id: str, table: str, shard: int) -> str:
    return f"shoal-{cluster_id}-{table}-s{shard}"


_NO_POSITIONS = np.empty(0, dtype=np.int64)


class ShardStore:
    """Rows ``0..num_rows-1`` of one shard; callers translate keys to rows."""

    def __init__(self, spec: TableSpec, shard: int, num_rows: int, segment: Segment) -> None:
        self.spec = spec
        self.shard = shard
        self.num_rows = num_rows
        self.segment = segment
        self.rule = rule_for(spec.optimizer)
        layout = ShardLayout.of(spec, self.rule, num_rows)
        arrays = {name: segment.array(s.offset, s.shape, s.dtype) for name, s in layout.slots.items()}
        self.header = arrays.pop("header")
        self.values = arrays.pop("values")
        self.dirty: np.ndarray | None = arrays.pop("dirty", None)
        self.presence: np.ndarray | None = arrays.pop("presence", None)
        self.location: np.ndarray | None = arrays.pop("location", None)
        self.base: np.ndarray | None = arrays.pop("base", None)
        self.changed: np.ndarray | None = arrays.pop("changed", None)
        self.pinned: np.ndarray | None = arrays.pop("pinned", None)
        self.holds: np.ndarray | None = arrays.pop("holds", None)
        self.arrived: np.ndarray | None = arrays.pop("arrived", None)
        self.incoming: np.ndarray | None = arrays.pop("incoming", None)
        self.state = arrays
        self._locks = StripedLocks(segment.fd) if spec.locking == "exact" else None
        # Where the adaptive reads and updates note their absent rows, reused under the row locks (which
        # exclude this process's other threads too): an array made per call cost 2-3 us of a local
        # push's 75 in MF's training loop, whose caches the batch's own work had emptied.
        self._absent_at = np.empty(0, dtype=np.int64)

    @classmethod
    def create(cls, spec: TableSpec, shard: int, keys: np.ndarray, cluster_id: str) -> ShardStore:
        """A fresh shard whose row ``i`` holds key ``keys[i]``, initialised per key."""
        rule = rule_for(spec.optimizer)
        layout = ShardLayout.of(spec, rule, len(keys))
        segment = Segment.create(segment_label(cluster_id, spec.name, shard), layout.size)
        store = cls(spec, shard, len(keys), segment)
        fill_initial(spec, keys, store.values)
        for st in rule.state:
            if st.fill:
                store.state[st.name][...] = st.fill
        return store

    @classmethod
    def receive(cls, spec: TableSpec, shard: int, num_rows: int, cluster_id: str) -> ShardStore:
        """An empty shard about to be filled with the rows and state of a slice moving here."""
        rule = rule_for(spec.optimizer)
        segment = Segment.create(segment_label(cluster_id, spec.name, shard), ShardLayout.of(spec, rule, num_rows).size)
        return cls(spec, shard, num_rows, segment)

    @classmethod
    def attach(cls, spec: TableSpec, shard: int, num_rows: int, fd: int, label: str) -> ShardStore:
        return cls(spec, shard, num_rows, Segment.attach(fd, label))

    @property
    def fd(self) -> int:
        return self.segment.fd

    def _hold(self, rows: np.ndarray | None, exclusive: bool) -> AbstractContextManager[None]:
        if self._locks is None:
            return nullcontext()
        return self._locks.hold(rows, exclusive)

    @property
    def locks(self) -> StripedLocks | None:
        """The stripes' locks (None for a lock-free table): for code that reads the rows by their
        address and takes the same locks itself (``server.lane``)."""
        return self._locks

    @property
    def retired(self) -> bool:
        return bool(self.header[0])

    def _check_live(self) -> None:
        if self.header[0]:
            raise SliceMovedError(f"slice {self.shard} of table {self.spec.name!r} has moved off this node")

    def read(self, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Gather ``rows`` into ``out`` (a new array if None)."""
        if out is None:
            out = np.empty((rows.shape[0], self.spec.dim), dtype=self.values.dtype)
        with self._hold(rows, exclusive=False):
            self._check_live()
            kernels.gather_rows(self.values, rows, out)
        return out

    def read_into(self, rows: np.ndarray, positions: np.ndarray, out: np.ndarray) -> None:
        """``out[positions[i]] = row rows[i]``: gather straight into the caller's order."""
        with self._hold(rows, exclusive=False):
            self._check_live()
            kernels.gather_place(self.values, rows, positions, out)

    def update(self, rows: np.ndarray, grads: np.ndarray) -> None:
        """Apply the table's rule to ``rows`` (finite values; see ``validate.drop_nonfinite``)."""
        rows, grads = self.rule.prepare(rows, grads)
        with self._hold(rows, exclusive=True):
            self._check_live()
            self.rule.apply(self.values, self.state, rows, grads)
            if self.dirty is not None:
                self.dirty[rows] = 1

    # -------------------------------------------------------- moving slices

    def retire(self, grace_s: float = 0.02) -> None:
        """Mark the shard moved: from now on no co-located reader or writer touches it.

        With exact locking the mark is set under every row lock, so a write
        either landed before it (and is in the snapshot taken next) or sees it.
        Lock-free (hogwild) writers check it without a lock, so wait a moment
        for any write already past the check.
        """
        with self._hold(None, exclusive=True):
            self.header[0] = 1
        if self._locks is None:
            time.sleep(grace_s)

    def revive(self) -> None:
        """Undo ``retire`` when a move fails: the shard stays here."""
        self.header[0] = 0

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Values, optimiser state and change marks by name (views: the shard must be retired or quiet)."""
        arrays = {"values": self.values, **self.state}
        if self.dirty is not None:
            arrays["dirty"] = self.dirty
        return arrays

    def load_rows(self, first_row: int, arrays: dict[str, np.ndarray]) -> None:
        """Fill rows ``first_row..`` of a received shard from a slice's arrays."""
        for name, target in self.state_arrays().items():
            source = arrays.get(name)
            if source is None:
                raise ProtocolError(f"slice state of {self.spec.name!r} lacks {name!r}")
            end = first_row + source.shape[0]
            if source.shape[1:] != target.shape[1:] or end > target.shape[0]:
                raise ShapeError(f"slice state {name!r} of shape {source.shape} does not fit rows "
                                 f"{first_row}..{end} of {target.shape}")
            target[first_row:end] = source

    # ------------------------------------------------- adaptive placement

    def hold(self, rows: np.ndarray | None, exclusive: bool = True,
             first_stripe: bool = False) -> AbstractContextManager[None]:
        """The row locks, for callers that read and change presence together with values; with
        ``first_stripe``, also row 0's stripe, which guards the table of holds."""
        if self._locks is None:
            return nullcontext()
        return self._locks.hold(rows, exclusive, first_stripe)

    def read_present(self, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Gather the rows present on this node into ``out`` (in the order of ``rows``); returns the
        positions of the absent ones.

        Presence is checked under the same lock that a relocation takes, so a
        row is read here or found absent, never read after it moved away.
        """
        assert self.presence is not None and self.arrived is not None and self.incoming is not None
        with self._hold(rows, exclusive=False):
            absent_at = self._absent_positions(rows.shape[0])
            absent = kernels.read_present(self.values, self.presence, self.arrived, self.incoming, rows, out,
                                          absent_at)
            return absent_at[:absent].copy() if absent else _NO_POSITIONS

    def update_present(self, rows: np.ndarray, grads: np.ndarray, scale: float) -> np.ndarray:
        """Add ``scale * grads`` to the rows present here (a replica's marked changed; a row held in
        place gets it beside, read with it); returns the positions of the absent rows, which the caller
        must send to their owner."""
        assert self.presence is not None and self.changed is not None
        assert self.pinned is not None and self.arrived is not None and self.incoming is not None
        with self._hold(rows, exclusive=True):
            absent_at = self._absent_positions(rows.shape[0])
            absent = kernels.add_present(self.values, self.changed, self.presence, self.pinned, self.arrived,
                                         self.incoming, rows, grads, scale, absent_at)
            return absent_at[:absent].copy() if absent else _NO_POSITIONS

    def _absent_positions(self, n: int) -> np.ndarray:
        """Room for ``n`` positions, for a caller holding the row locks (without locks, a new array)."""
        if self._locks is None:
            return np.empty(n, dtype=np.int64)
        if self._absent_at.shape[0] < n:
            self._absent_at = np.empty(max(n, 2 * self._absent_at.shape[0]), dtype=np.int64)
        return self._absent_at

    def take_dirty(self) -> np.ndarray:
        """Rows changed since the last call, and clear their marks.

        Marks are set under the write lock after the update lands, so a row
        whose update precedes this call is either returned now or next time.
        """
        if self.dirty is None:
            return np.empty(0, dtype=np.int64)
        with self._hold(None, exclusive=True):
            rows = np.flatnonzero(self.dirty)
            self.dirty[rows] = 0
        return rows

    def snapshot(self) -> dict[str, np.ndarray]:
        """A consistent copy of values and state."""
        with self._hold(None, exclusive=False):
            snap = {"values": self.values.copy()}
            snap.update({k: v.copy() for k, v in self.state.items()})
        return snap

    def close(self) -> None:
        del self.values
        del self.header
        self.dirty = None
        self.state = {}
        self.segment.close()
