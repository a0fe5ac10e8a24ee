"""The tables one server holds: key-level pull and push on its shards."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from shoal.api.config import TableSpec
from shoal.api.errors import ShoalError, SliceMovedError, TableError
from shoal.consistency.clocks import ClockTable
from shoal.consistency.controller import ShardController
from shoal.placement.layout import TableLayout, row_bytes
from shoal.storage import kernels
from shoal.storage.shard import ShardStore
from shoal.storage.validate import drop_nonfinite
from shoal.wire.message import Message
from shoal.wire.ops import Op
from shoal.wire.schema import Moved

#: a request's keys by the slice holding them: ``(store, positions or None for all in order, rows)``
Parts = list[tuple[ShardStore, np.ndarray | None, np.ndarray]]


def table_bytes(spec: TableSpec) -> int:
    """Bytes a whole table needs: values plus the update rule's per-row state."""
    return spec.num_keys * row_bytes(spec)


def moved_answer(request: Message) -> Message:
    """The answer to a pull or push refused because a slice it needs is not here: every key "moved",
    nothing applied; the worker asks the rendezvous where the slices are and sends it again. The read
    of a ``PUSH_PULL`` whose push went in (``read_after_push``) says so: the worker only reads again."""
    pushed = request.body.get("pushed") is True
    return request.reply(Op.OK, Moved.every(request.arrays[0].shape[0], pushed).to_body())


def read_after_push(request: Message) -> Message:
    """The read of a ``PUSH_PULL`` whose push was applied: a ``PULL`` with its request number, clock
    and body (its place in the worker's stream, the model it reads by), marked so that refusing it
    later (its slice moved while it was held for its bound, say) does not have the push sent again."""
    return Message(Op.PULL, req=request.req, table=request.table, epoch=request.epoch, clock=request.clock,
                   sender=request.sender, incarnation=request.incarnation, flags=request.flags,
                   body={**request.body, "pushed": True}, arrays=request.arrays[:1])


class SliceMoving(Exception):
    """A request touches a slice on its way to another server: hold it until the move ends."""


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
        self.stores: dict[int, ShardStore] = {}
        try:
            for shard in layout.shards_of(node):
                self.stores[shard] = ShardStore.create(spec, shard, layout.mapping.keys_of(shard), cluster_id)
        except BaseException as exc:
            self.close()  # a table is made whole or not at all: a failed one keeps no memory or descriptors
            if isinstance(exc, (OSError, ShoalError)):  # e.g. out of descriptors for a table of very many slices
                raise TableError(f"server {node} cannot hold the slices of table {spec.name!r}: {exc}") from None
            raise
        self.controller: ShardController[Any] = ShardController(spec.consistency, clocks, now)
        # ESSP: per shard, per worker, which rows that worker has fetched (and so caches).
        self._subscribed: dict[int, dict[int, np.ndarray]] = {s: {} for s in self.stores}
        #: per shard, per subscriber not reachable from here yet: rows changed that it has not been sent
        self._owed: dict[int, dict[int, np.ndarray]] = {}
        #: slices being handed to another server: requests for them wait for the move to end
        self.moving: set[int] = set()
        #: the move that brought ``layout`` to its epoch, as ``(slice, its new owner)``; None when this
        #: server took no part in it (the table was made at that epoch: the rendezvous knows it)
        self.last_move: tuple[int, int] | None = None
        #: per slice: bytes in and out, requests, and seconds spent on them, since the last report
        #: (Python lists: every request adds to one, and a numpy element costs more to add to)
        self.load: dict[int, list[float]] = {s: [0.0, 0.0, 0.0] for s in self.stores}
        self._row_bytes = spec.dim * np.dtype(spec.dtype).itemsize

    def split(self, keys: np.ndarray) -> Parts:
        """``(store, positions, rows)`` per shard; positions None means all keys, in order.

        Raises ``SliceMovedError`` unless every key is held here (``SliceMoving`` if on its way out).
        """
        owner, shard, rows, counts = self.layout.route(keys)
        if self.node >= counts.shape[0] or counts[self.node] != keys.shape[0]:
            bad = int(keys[np.flatnonzero(owner != self.node)[0]])
            s = int(self.layout.mapping.locate(np.array([bad], dtype=np.int64))[0][0])
            raise SliceMovedError(f"key {bad} of table {self.spec.name!r} is in slice {s}, which server "
                                  f"{self.node} does not hold at epoch {self.layout.epoch}")
        if self.moving and np.isin(shard, list(self.moving)).any():
            raise SliceMoving()
        if len(self.stores) == 1:
            return [(next(iter(self.stores.values())), None, rows)]
        shard_ids = sorted(self.stores)
        index = np.searchsorted(shard_ids, shard)
        order, starts = kernels.partition_by_owner(index, len(shard_ids))
        parts: Parts = []
        for i, sid in enumerate(shard_ids):
            pos = order[starts[i] : starts[i + 1]]
            if pos.size:
                parts.append((self.stores[sid], pos, rows[pos]))
        return parts

    def _count(self, store: ShardStore, rows: int, started: float) -> None:
        load = self.load[store.shard]
        load[0] += rows * self._row_bytes
        load[1] += 1
        load[2] += time.perf_counter() - started

    def count_served(self, shard: int, rows: int, requests: int) -> None:
        """Rows of slice ``shard`` read or written another way (the lane, ``server.lane``): its load as
        the rebalancer sees it (bytes and requests; their time is not measured there)."""
        load = self.load.get(shard)
        if load is not None:
            load[0] += rows * self._row_bytes
            load[1] += requests

    def take_load(self) -> dict[int, list[float]]:
        """Per-slice load since the last call (and reset it)."""
        out = {s: [float(x) for x in v] for s, v in self.load.items() if v[1]}
        for v in self.load.values():
            v[:] = [0.0, 0.0, 0.0]
        return out

    def pull(self, keys: np.ndarray, parts: Parts | None = None) -> np.ndarray:
        """Rows of ``keys`` (``parts``: their ``split``, if the caller has it already)."""
        parts = self.split(keys) if parts is None else parts
        if len(parts) == 1 and parts[0][1] is None:
            started = time.perf_counter()
            out = parts[0][0].read(parts[0][2])
            self._count(parts[0][0], keys.shape[0], started)
            return out
        out = np.empty((keys.shape[0], self.spec.dim), dtype=self.spec.dtype)
        for store, pos, rows in parts:
            assert pos is not None  # several shards: each part names its positions
            started = time.perf_counter()
            store.read_into(rows, pos, out)  # straight into the reply's order: one copy, not two
            self._count(store, rows.shape[0], started)
        return out

    def subscribe(self, worker: int, keys: np.ndarray) -> None:
        """Remember that ``worker`` now caches the rows of ``keys``, read under ESSP."""
        for store, _, rows in self.split(keys):
            subs = self._subscribed[store.shard]
            mask = subs.get(worker)
            if mask is None:
                mask = subs[worker] = np.zeros(store.num_rows, dtype=np.bool_)
            mask[rows] = True

    def eager_updates(self, reachable: Callable[[int], bool]) -> list[EagerUpdate]:
        """Changed rows for each subscriber, collected once per advance of the slowest clock.

        Every ``reachable`` subscriber gets a message, empty or not: it tells the
        worker that the rows it caches from this server are current at the new
        clock. One not reachable yet (a slice's subscriber this server has not
        heard from) is owed its changed rows until it is.
        """
        if not any(self._subscribed.values()):
            return []  # no reader of this table's slices here reads under ESSP
        per_worker: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        for shard, store in self.stores.items():
            if shard in self.moving:
                continue  # its changed rows travel with it; the new owner pushes them
            changed = store.take_dirty()
            owed = self._owed.get(shard, {})
            keys_of_rows = self.layout.mapping.keys_of(shard)
            for worker, mask in self._subscribed[shard].items():
                rows = changed[mask[changed]]
                if worker in owed:
                    rows = np.union1d(owed.pop(worker), rows)
                if not reachable(worker):
                    if rows.size:
                        self._owed.setdefault(shard, {})[worker] = rows
                    continue
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
        for store, pos, rows in self.split(keys):
            started = time.perf_counter()
            store.update(rows, grads if pos is None else grads[pos])
            self._count(store, rows.shape[0], started)
        self.controller.on_push()
        return skipped

    # -------------------------------------------------------- moving slices

    def mark_owed_changed(self, shard: int) -> None:
        """Slice ``shard`` is about to be sent away: rows owed to a subscriber travel as changed rows,
        which its new owner sends to every subscriber."""
        owed = self._owed.pop(shard, {})
        store = self.stores[shard]
        if owed and store.dirty is not None:
            store.dirty[np.unique(np.concatenate(list(owed.values())))] = 1

    def release_slice(self, shard: int, to: int, epoch: int) -> None:
        """The slice now lives on ``to``: forget it here."""
        store = self.stores.pop(shard)
        self._subscribed.pop(shard, None)
        self._owed.pop(shard, None)
        self.load.pop(shard, None)
        self.moving.discard(shard)
        if epoch >= self.layout.epoch:  # a move reported late leaves a later one behind the epoch
            self.last_move = (shard, to)
        self.layout = self.layout.at(_with_owner(self.layout.owners, shard, to), max(epoch, self.layout.epoch))
        store.close()

    def adopt_slice(self, store: ShardStore, epoch: int, subscribers: dict[int, np.ndarray]) -> None:
        """A slice handed over from another server is served here from now on."""
        self.stores[store.shard] = store
        self._subscribed[store.shard] = subscribers
        if store.dirty is not None and subscribers:
            # Every row a subscriber caches goes to it again with this server's first eager message:
            # one of the previous owner's may have been lost on the way, and from here on "rows not
            # resent did not change" vouches for the copies the subscriber holds.
            store.dirty[np.logical_or.reduce(list(subscribers.values()))] = 1
        self.load[store.shard] = [0.0, 0.0, 0.0]
        if epoch >= self.layout.epoch:
            self.last_move = (store.shard, self.node)
        self.layout = self.layout.at(_with_owner(self.layout.owners, store.shard, self.node),
                                     max(epoch, self.layout.epoch))

    def subscribers(self, shard: int) -> dict[int, np.ndarray]:
        return self._subscribed.get(shard, {})

    def close(self) -> None:
        for store in self.stores.values():
            store.close()
        self.stores.clear()


def _with_owner(owners: np.ndarray, shard: int, node: int) -> np.ndarray:
    out = owners.copy()
    out[shard] = node
    return out
