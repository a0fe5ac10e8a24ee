"""A worker's handle on one table: pull, push and push_pull, sync and async.

A batch of keys is split by owning node. Rows of this node's shards are read
and written directly in shared memory, under the shard's locks and with the
table's update rule: no message, no server CPU. Every other node gets one
message (or a few, if a batch exceeds the message size limit), all in flight
at once; replies are placed back in the caller's key order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from shoal.api.config import TableSpec
from shoal.api.errors import ProtocolError, ShapeError
from shoal.cluster.requests import Future
from shoal.placement.layout import TableLayout
from shoal.storage import kernels
from shoal.storage.shard import ShardStore
from shoal.storage.validate import as_keys, as_rows, drop_nonfinite
from shoal.wire.message import Message
from shoal.wire.ops import Op

if TYPE_CHECKING:
    from shoal.client.worker import Worker

_HEADER_ROOM = 64 * 1024
_ALL = np.empty(0, dtype=np.int64)  # stands for "every key, in order"


class Table:
    """Rows ``0..num_keys-1`` of ``dim`` values, wherever they live."""

    def __init__(self, worker: Worker, spec: TableSpec, layout: TableLayout, local: dict[int, ShardStore]) -> None:
        self.worker = worker
        self.spec = spec
        self.layout = layout
        self.local = local
        self.dtype = np.dtype(spec.dtype)
        row_bytes = spec.dim * self.dtype.itemsize + 8
        self._chunk = max(1, (worker.cluster.limits.max_message_bytes - _HEADER_ROOM) // (2 * row_bytes))

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def num_keys(self) -> int:
        return self.spec.num_keys

    @property
    def dim(self) -> int:
        return self.spec.dim

    def __repr__(self) -> str:
        return f"Table({self.name!r}, num_keys={self.num_keys}, dim={self.dim}, dtype={self.spec.dtype})"

    # ------------------------------------------------------------ public API

    def pull(self, keys: Any, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``keys`` in the caller's order, as a ``(len(keys), dim)`` array."""
        return self.pull_async(keys, out).wait()

    def push(self, keys: Any, values: Any) -> None:
        """Apply the table's update rule with ``values`` (gradients or deltas) at ``keys``."""
        self.push_async(keys, values).wait()

    def push_pull(self, keys: Any, values: Any, out: np.ndarray | None = None) -> np.ndarray:
        """Push, then return the updated rows of the same keys, in one round trip."""
        return self.push_pull_async(keys, values, out).wait()

    def pull_async(self, keys: Any, out: np.ndarray | None = None) -> Future[np.ndarray]:
        keys = as_keys(keys, self.spec)
        result = _Rows(keys.shape[0], self.dim, self.dtype, self._checked_out(keys.shape[0], out))
        reqs = self._run(Op.PULL, keys, None, result)
        return Future(self.worker.tracker, reqs, result.get, self.worker.cluster.timeouts.request_s)

    def push_async(self, keys: Any, values: Any) -> Future[None]:
        """Start a push. ``values`` must not be modified until the future is done."""
        keys = as_keys(keys, self.spec)
        values = as_rows(values, keys.shape[0], self.spec)
        reqs = self._run(Op.PUSH, keys, values, None)
        return Future(self.worker.tracker, reqs, lambda: None, self.worker.cluster.timeouts.request_s)

    def push_pull_async(self, keys: Any, values: Any, out: np.ndarray | None = None) -> Future[np.ndarray]:
        keys = as_keys(keys, self.spec)
        values = as_rows(values, keys.shape[0], self.spec)
        finite_keys, finite_values, skipped = drop_nonfinite(keys, values, self.spec)
        if skipped:  # rare: the push shrinks but every key still wants its row back
            self._run(Op.PUSH, finite_keys, finite_values, None)
            return self.pull_async(keys, out)
        result = _Rows(keys.shape[0], self.dim, self.dtype, self._checked_out(keys.shape[0], out))
        reqs = self._run(Op.PUSH_PULL, keys, values, result)
        return Future(self.worker.tracker, reqs, result.get, self.worker.cluster.timeouts.request_s)

    # ------------------------------------------------------------- internals

    def _checked_out(self, n: int, out: np.ndarray | None) -> np.ndarray | None:
        if out is not None and (out.shape != (n, self.dim) or out.dtype != self.dtype
                                or not out.flags.c_contiguous or not out.flags.writeable):
            raise ShapeError(f"out must be a writable C-contiguous ({n}, {self.dim}) {self.dtype} array, "
                             f"got {out.shape} {out.dtype}")
        return out

    def _run(self, op: Op, keys: np.ndarray, values: np.ndarray | None, result: _Rows | None) -> set[int]:
        """Serve local rows now, send the rest; returns the ids of requests in flight."""
        if op == Op.PUSH:
            # The NaN/Inf policy applies to the whole push, before any row lands anywhere.
            keys, values, _ = drop_nonfinite(keys, values, self.spec)  # type: ignore[arg-type]
        n = keys.shape[0]
        if n == 0:
            return set()
        if len(self.local) == 1:  # the common co-located case: try "all keys local" in one pass
            shard_id, store = next(iter(self.local.items()))
            local_rows = self.layout.mapping.rows_in(keys, shard_id)
            if local_rows is not None:
                self._local(op, None, local_rows, None, values, result)
                return set()
        owner, shard, rows, counts = self.layout.route(keys)
        me = self.worker.node
        if self.local and counts[me] == n:
            self._local(op, shard, rows, None, values, result)
            return set()
        if not self.local or counts[me] == 0:
            single = np.flatnonzero(counts == n)
            if single.size:  # every key on one remote node: send the batch as it is
                pos = np.arange(n) if n > self._chunk else _ALL
                return {self._send(op, int(single[0]), keys, values, result, c) for c in self._chunks(pos, n)}
        order, starts = kernels.partition_by_owner(owner, counts.shape[0])
        reqs: set[int] = set()
        for node in range(starts.shape[0] - 1):
            pos = order[starts[node] : starts[node + 1]]
            if not pos.size:
                continue
            if node == me and self.local:
                self._local(op, shard[pos], rows[pos], pos, values, result)
                continue
            for chunk in self._chunks(pos, pos.shape[0]):
                reqs.add(self._send(op, node, keys, values, result, chunk))
        return reqs

    def _local(self, op: Op, shard: np.ndarray | None, rows: np.ndarray, pos: np.ndarray | None,
               values: np.ndarray | None, result: _Rows | None) -> None:
        """Serve rows of this node's shards in shared memory, in the caller's process."""
        for store, sel in self._by_local_shard(shard):
            r = rows if sel is None else rows[sel]
            p = pos if sel is None else (sel if pos is None else pos[sel])
            if values is not None:
                v = values if p is None else values[p]
                store.update(r, v)
            if result is not None:
                if p is None:
                    store.read(r, out=result.array())
                else:
                    store.read_into(r, p, result.array())

    def _by_local_shard(self, shard: np.ndarray | None) -> Iterator[tuple[ShardStore, np.ndarray | None]]:
        if len(self.local) == 1 or shard is None:
            yield next(iter(self.local.values())), None
            return
        for sid, store in self.local.items():
            sel = np.flatnonzero(shard == sid)
            if sel.size:
                yield store, sel

    def _chunks(self, pos: np.ndarray, n: int) -> Iterator[np.ndarray]:
        if n <= self._chunk:
            yield pos
            return
        for start in range(0, n, self._chunk):
            yield pos[start : start + self._chunk]

    def _send(self, op: Op, node: int, keys: np.ndarray, values: np.ndarray | None,
              result: _Rows | None, pos: np.ndarray) -> int:
        whole = pos is _ALL  # one destination, one message: no gather, no scatter
        arrays = [keys if whole else keys[pos]]
        if values is not None:
            arrays.append(values if whole else values[pos])
        msg = Message(op, table=self.name, clock=self.worker.clock, arrays=arrays)
        on_reply: Callable[[Message], None]
        if result is None:
            on_reply = _ignore
        elif whole:
            on_reply = result.take_whole
        else:
            on_reply = functools.partial(result.place, pos)
        count = keys.shape[0] if whole else pos.shape[0]
        return self.worker.tracker.request(node, msg, on_reply, f"{op.name} of {count} key(s) of {self.name!r}")


class _Rows:
    """The rows a pull returns, filled by local reads and replies as they arrive.

    When one reply carries every row in order and the caller gave no ``out``,
    the reply's own (writable) frame becomes the result: no copy at all.
    """

    def __init__(self, n: int, dim: int, dtype: np.dtype, out: np.ndarray | None) -> None:
        self.n, self.dim, self.dtype = n, dim, dtype
        self._array = out

    def array(self) -> np.ndarray:
        if self._array is None:
            self._array = np.empty((self.n, self.dim), dtype=self.dtype)
        return self._array

    def get(self) -> np.ndarray:
        return self.array()

    def take_whole(self, msg: Message) -> None:
        rows = self._checked(msg, self.n)
        if self._array is None and rows.flags.writeable:
            self._array = rows
        else:
            self.array()[...] = rows

    def place(self, pos: np.ndarray, msg: Message) -> None:
        kernels.place_rows(self.array(), pos, self._checked(msg, pos.shape[0]))

    def _checked(self, msg: Message, n: int) -> np.ndarray:
        rows = msg.arrays[0] if msg.op == Op.VALUES and msg.arrays else None
        if rows is None or rows.shape != (n, self.dim) or rows.dtype != self.dtype:
            got = None if rows is None else (rows.shape, rows.dtype)
            raise ProtocolError(f"expected {n} row(s) of {self.dim} {self.dtype} in reply, got {msg.op.name} {got}")
        return rows


def _ignore(msg: Message) -> None:
    pass
