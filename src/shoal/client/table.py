"""A worker's handle on one table: pull, push and push_pull, sync and async.

A batch of keys is split by owning node. Rows of this node's shards are read
and written directly in shared memory, under the shard's locks and with the
table's update rule: no message, no server CPU. Every other node gets one
message (or a few, if a batch exceeds the message size limit), all in flight
at once; replies are placed back in the caller's key order.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from shoal.api.config import TableSpec
from shoal.api.errors import (
    ClosedError,
    ProtocolError,
    RequestTimeoutError,
    ShapeError,
    ShoalError,
    SliceMovedError,
    TableError,
)
from shoal.client.adaptive import AdaptiveAccess
from shoal.client.replicated import ReplicatedAccess
from shoal.client.sampling import Sampler, make_sampler
from shoal.cluster.requests import Future
from shoal.consistency.cache import RowCache
from shoal.consistency.staleness import StalenessHistogram
from shoal.placement.layout import TableLayout
from shoal.storage import kernels
from shoal.storage.shard import ShardStore
from shoal.storage.validate import as_keys, as_rows, drop_nonfinite
from shoal.wire.message import Message
from shoal.wire.ops import Op

if TYPE_CHECKING:
    from shoal.client.worker import Worker

_HEADER_ROOM = 64 * 1024
_EAGER_WAIT_S = 5.0
_MOVE_RETRIES = 8  # refreshes of the layout for one call before its slice is deemed lost
_ALL = np.empty(0, dtype=np.int64)  # stands for "every key, in order"
_EAGER_GAP = 32  # eager messages held behind a missing one before it is taken as lost


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
        self.bound = spec.consistency.bound
        #: the process cache of remote rows (bounded models only: ASP always asks)
        self.cache = (RowCache(spec.num_keys, spec.dim, self.dtype, layout.num_shards)
                      if self.bound is not None else None)
        #: ESSP: per server stream, the next eager message expected and the bumps waiting for it
        self._eager_next: dict[tuple[int, str], int] = {}
        self._eager_pending: dict[tuple[int, str], dict[int, tuple[list[int], int]]] = {}
        #: how stale each read row was: reader's clock minus the clock its row is current at
        self.staleness = StalenessHistogram()
        self.counters: Counter[str] = Counter()
        #: replicated tables go through quorums instead of the owner-per-key path
        self.replicated = ReplicatedAccess(self) if spec.replicated else None
        #: adaptive tables: rows move and replicate; local ones are in this node's store
        self.adaptive = AdaptiveAccess(self, next(iter(local.values()), None)) if spec.adaptive else None
        if spec.adaptive:
            self.local = {}  # the node store is the adaptive access's, with presence checks
        self._sampler: Sampler | None = None

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
        if self.replicated is not None or self.adaptive is not None:
            # Requests go out now; waiting, failover or following moved keys run in wait().
            access = self.replicated or self.adaptive
            finish = access.pull(keys, result.array())  # type: ignore[union-attr]
            return Future(None, set(), lambda: (finish(), result.get())[1], 0.0)
        sent = self._run(Op.PULL, keys, None, result)
        return self._future(sent, Op.PULL, keys, None, result, result.get)

    def push_async(self, keys: Any, values: Any) -> Future[None]:
        """Start a push. ``values`` must not be modified until the future is done."""
        keys = as_keys(keys, self.spec)
        values = as_rows(values, keys.shape[0], self.spec)
        keys, values, _ = drop_nonfinite(keys, values, self.spec)  # the policy applies before any row lands
        if self.replicated is not None or self.adaptive is not None:
            access = self.replicated or self.adaptive
            return Future(None, set(), access.push(keys, values), 0.0)  # type: ignore[union-attr]
        sent = self._run(Op.PUSH, keys, values, None)
        return self._future(sent, Op.PUSH, keys, values, None, lambda: None)

    def push_pull_async(self, keys: Any, values: Any, out: np.ndarray | None = None) -> Future[np.ndarray]:
        keys = as_keys(keys, self.spec)
        values = as_rows(values, keys.shape[0], self.spec)
        finite_keys, finite_values, skipped = drop_nonfinite(keys, values, self.spec)
        if self.replicated is not None or self.adaptive is not None:
            access = self.replicated or self.adaptive
            access.push(finite_keys, finite_values)()  # type: ignore[union-attr]
            return self.pull_async(keys, out)
        if skipped:  # rare: the push shrinks but every key still wants its row back
            self.push_async(finite_keys, finite_values).wait()
            return self.pull_async(keys, out)
        result = _Rows(keys.shape[0], self.dim, self.dtype, self._checked_out(keys.shape[0], out))
        sent = self._run(Op.PUSH_PULL, keys, values, result)
        return self._future(sent, Op.PUSH_PULL, keys, values, result, result.get)

    # ----------------------------------------------------- adaptive placement

    def localize(self, keys: Any) -> None:
        """Ask for ``keys`` to move to this worker's node (adaptive tables; asynchronous)."""
        if self.adaptive is None:
            raise TableError(f"table {self.name!r} is static; create it with techniques='relocation' or 'auto'")
        self.adaptive.localize(as_keys(keys, self.spec))

    def intent(self, keys: Any, start: int, end: int | None = None) -> None:
        """Declare that ``keys`` will be used in clocks ``[start, end)`` (default: just clock ``start``).

        The node's server acts on it ahead of time (relocate or replicate); it
        never blocks the caller. Static tables ignore intents.
        """
        if self.adaptive is not None:
            self.adaptive.intent(as_keys(keys, self.spec), int(start), int(start) + 1 if end is None else int(end))

    # ------------------------------------------------------------- sampling

    def register_sampling(self, weights: Any = None, scheme: str = "naive", reuse: int = 4,
                          pool_size: int = 4096, seed: int | None = None) -> None:
        """Register the distribution samples come from (uniform if ``weights`` is None) and the scheme:
        ``naive``, ``preloc`` (keys brought here by intent before the clock they are prepared for),
        ``pool`` (each pooled key reused ``reuse`` times) or ``local`` (keys present here)."""
        self._sampler = make_sampler(self, weights, scheme, reuse, pool_size,
                                     self.worker.rank if seed is None else seed)

    def prepare_sample(self, n: int, clock: int | None = None) -> int:
        """Draw ``n`` keys for use at ``clock`` (default: now); returns a handle for ``pull_sample``."""
        if self._sampler is None:
            raise TableError(f"register_sampling() on table {self.name!r} first")
        return self._sampler.prepare(n, clock)

    def sample_keys(self, n: int) -> np.ndarray:
        """Draw ``n`` keys under the ``naive``, ``preloc`` (drawn as ``naive``) or ``local`` scheme
        without their rows, for a caller that pulls them together with other keys (one gather, one
        request per server)."""
        if self._sampler is None:
            raise TableError(f"register_sampling() on table {self.name!r} first")
        return self._sampler.draw(n)

    def pull_sample(self, handle: int) -> tuple[np.ndarray, np.ndarray]:
        """The keys of a prepared sample and their rows."""
        if self._sampler is None:
            raise TableError(f"register_sampling() on table {self.name!r} first")
        return self._sampler.pull(handle)

    # ------------------------------------------------------------- internals

    def _checked_out(self, n: int, out: np.ndarray | None) -> np.ndarray | None:
        if out is not None and (out.shape != (n, self.dim) or out.dtype != self.dtype
                                or not out.flags.c_contiguous or not out.flags.writeable):
            raise ShapeError(f"out must be a writable C-contiguous ({n}, {self.dim}) {self.dtype} array, "
                             f"got {out.shape} {out.dtype}")
        return out

    def _run(self, op: Op, keys: np.ndarray, values: np.ndarray | None, result: _Rows | None) -> dict[int, np.ndarray]:
        """Serve local rows now, send the rest; returns the requests in flight and the positions each carries."""
        n = keys.shape[0]
        sent: dict[int, np.ndarray] = {}
        if n == 0:
            return sent
        if len(self.local) == 1:  # the common co-located case: try "all keys local" in one pass
            shard_id = next(iter(self.local))
            local_rows = self.layout.mapping.rows_in(keys, shard_id)
            if local_rows is not None:
                self._local(op, keys, None, local_rows, None, values, result)
                return sent
        owner, shard, rows, counts = self.layout.route(keys)
        me = self.worker.node
        if self.local and me < counts.shape[0] and counts[me] == n:
            self._local(op, keys, shard, rows, None, values, result)
            return sent
        single = np.flatnonzero(counts == n)
        parts: list[tuple[int, np.ndarray]]
        if single.size:  # every key on one remote node: the batch goes as it is
            parts = [(int(single[0]), _ALL)]
        else:
            order, starts = kernels.partition_by_owner(owner, counts.shape[0])
            parts = [(node, order[starts[node] : starts[node + 1]]) for node in range(counts.shape[0])
                     if starts[node + 1] > starts[node]]
        for node, pos in parts:
            if node == me and self.local:
                self._local(op, keys, shard[pos], rows[pos], pos, values, result)
                continue
            if op == Op.PULL and self.cache is not None:
                remaining = self._from_cache(keys, shard, pos, result)  # type: ignore[arg-type]
                if remaining is None:
                    continue
                pos = remaining
            count = n if pos is _ALL else pos.shape[0]
            for chunk in self._chunks(np.arange(n) if pos is _ALL and n > self._chunk else pos, count):
                try:
                    sent[self._send(op, node, keys, values, result, chunk)] = chunk
                except ClosedError:
                    if self.worker.tracker.closed or self.worker.server_alive(node):
                        raise
                    # The server left (drained) and this layout predates it: its slices are elsewhere.
                    self._redo(op, keys, values, result, np.arange(n) if chunk is _ALL else chunk, 1)
        return sent

    def _future(self, sent: dict[int, np.ndarray], op: Op, keys: np.ndarray, values: np.ndarray | None,
                result: _Rows | None, finish: Callable[[], Any], attempt: int = 0) -> Future[Any]:
        recover = functools.partial(self._recover, op, keys, values, result, sent, attempt)
        return Future(self.worker.tracker, set(sent), finish, self.worker.cluster.timeouts.request_s, recover)

    def _recover(self, op: Op, keys: np.ndarray, values: np.ndarray | None, result: _Rows | None,
                 sent: dict[int, np.ndarray], attempt: int, errors: dict[int, ShoalError]) -> None:
        """Requests refused because their slice moved were not applied: send them where it is now."""
        for error in errors.values():
            if not isinstance(error, SliceMovedError) or attempt >= _MOVE_RETRIES:
                raise error
        positions = [np.arange(keys.shape[0]) if sent[r] is _ALL else sent[r] for r in sorted(errors)]
        self._redo(op, keys, values, result, np.concatenate(positions), attempt + 1)

    def _redo(self, op: Op, keys: np.ndarray, values: np.ndarray | None, result: _Rows | None,
              pos: np.ndarray, attempt: int) -> None:
        """Serve ``keys[pos]`` again with a fresh layout, into the same result."""
        self.counters["moved_retries"] += 1
        if attempt > 1:
            time.sleep(min(0.01 * 2 ** attempt, 0.5))  # a slice moving again and again: let it settle
        self.refresh_layout()
        sub_keys = keys[pos]
        sub_values = None if values is None else values[pos]
        sub = None if result is None else _Rows(pos.shape[0], self.dim, self.dtype, None)
        sent = self._run(op, sub_keys, sub_values, sub)
        self._future(sent, op, sub_keys, sub_values, sub, lambda: None, attempt).wait()
        if result is not None and sub is not None:
            result.array()[pos] = sub.array()

    # ------------------------------------------------------------- layout

    def forget_cached(self) -> None:
        """Drop cached remote rows (their values changed under us: a restore)."""
        if self.cache is not None:
            self.cache = RowCache(self.spec.num_keys, self.spec.dim, self.dtype, self.layout.num_shards)

    def refresh_layout(self) -> None:
        """Fetch this table's slice owners from the rendezvous; map the slices now on this node."""
        reply = self.worker.fetch_layout(self.name)
        epoch = int(reply["epoch"])
        if epoch < self.layout.epoch:
            return
        self.layout = self.layout.at(reply["owners"], epoch)
        if self.worker.local_access:
            self.local = self.worker.local_slices(self.spec, self.layout, self.local)
        self.counters["layout_refreshes"] += 1

    def _from_cache(self, keys: np.ndarray, shard: np.ndarray, pos: np.ndarray, result: _Rows) -> np.ndarray | None:
        """Serve keys whose cached rows are fresh enough; returns the positions still to pull."""
        assert self.cache is not None and self.bound is not None
        self.worker.tracker.pump(0)  # apply rows servers pushed eagerly since the last call
        whole = pos is _ALL
        sel_keys = keys if whole else keys[pos]
        sel_shard = shard if whole else shard[pos]
        versions = self.cache.versions(sel_keys, sel_shard)
        clock = self.worker.clock
        required = max(clock - self.bound, 0)  # a row never fetched (version -1) is never fresh
        fresh = versions >= required
        if self.spec.consistency.eager and not fresh.all() and (versions >= 0).any():
            versions = self._await_eager(sel_keys, sel_shard, required)
            fresh = versions >= required
        hits = int(np.count_nonzero(fresh))
        if not hits:
            return pos
        where = np.arange(keys.shape[0]) if whole else pos
        result.array()[where[fresh]] = self.cache.values[sel_keys[fresh]]
        self.staleness.record(clock - versions[fresh])
        self.counters["rows_from_cache"] += hits
        if hits == fresh.shape[0]:
            return None
        return where[~fresh]

    def _await_eager(self, keys: np.ndarray, shard: np.ndarray, required: int) -> np.ndarray:
        """ESSP: rows this worker caches come to it when the slowest clock advances, so
        wait for that push instead of asking; rows never cached are pulled as usual."""
        assert self.cache is not None
        cached = self.cache.version[keys] >= 0
        # A push that does not come (a server's reply queue was full, say) ends in a pull.
        deadline = time.monotonic() + min(self.worker.cluster.timeouts.request_s, _EAGER_WAIT_S)
        versions = self.cache.versions(keys, shard)
        self.counters["reads_awaiting_push"] += 1
        while (versions[cached] < required).any():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break  # the stale rows are pulled instead; the pull names the server if it is gone
            self.worker.tracker.pump(min(remaining, 0.5))
            versions = self.cache.versions(keys, shard)
        return versions

    def _local(self, op: Op, keys: np.ndarray, shard: np.ndarray | None, rows: np.ndarray, pos: np.ndarray | None,
               values: np.ndarray | None, result: _Rows | None) -> None:
        """Serve rows of this node's shards in shared memory, in the caller's process."""
        if result is not None:
            slowest = self._local_bound()
            self.staleness.record(self.worker.clock - slowest, rows.shape[0])
            self.counters["rows_local"] += rows.shape[0]
        moved: list[np.ndarray] = []
        for store, sel in self._by_local_shard(shard):
            r = rows if sel is None else rows[sel]
            p = pos if sel is None else (sel if pos is None else pos[sel])
            try:
                if values is not None:
                    v = values if p is None else values[p]
                    store.update(r, v)
                if result is not None:
                    if p is None:
                        store.read(r, out=result.array())
                    else:
                        store.read_into(r, p, result.array())
            except SliceMovedError:  # nothing of this part was applied: it goes to the new owner
                moved.append(np.arange(keys.shape[0]) if p is None else p)
        if moved:
            self._redo(op, keys, values, result, np.concatenate(moved), 1)

    def _local_bound(self) -> int:
        """Wait until the local server's clocks allow a read at this worker's clock; the slowest clock."""
        clocks = self.worker.local_clocks
        if clocks is None:
            return self.worker.clock
        slowest = int(clocks.min())
        if self.bound is None:
            return min(slowest, self.worker.clock)
        required = self.worker.clock - self.bound
        if slowest >= required:
            return min(slowest, self.worker.clock)
        self.counters["local_reads_waited"] += 1
        deadline = time.monotonic() + self.worker.cluster.timeouts.request_s
        pause = 1e-5
        while slowest < required:
            if time.monotonic() > deadline:
                behind = [int(w) for w in np.flatnonzero(clocks < required)]
                raise RequestTimeoutError(
                    f"local read of {self.name!r} at clock {self.worker.clock} waited "
                    f"{self.worker.cluster.timeouts.request_s:.1f}s for worker(s) {behind} to reach clock {required}")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
            self.worker.tracker.pump(0)  # own requests overdue (a lost clock, say) go out again meanwhile
            slowest = int(clocks.min())
        return min(slowest, self.worker.clock)

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
        else:
            place = result.take_whole if whole else functools.partial(result.place, pos)
            on_reply = functools.partial(self._on_rows, place, arrays[0], self.worker.clock)
        self.counters["requests"] += 1
        count = keys.shape[0] if whole else pos.shape[0]
        reply_bytes = 0 if result is None else count * self.dim * self.dtype.itemsize
        return self.worker.tracker.request(node, msg, on_reply, f"{op.name} of {count} key(s) of {self.name!r}",
                                           reply_bytes=reply_bytes)


    def _on_rows(self, place: Callable[[Message], None], keys: np.ndarray, clock: int, msg: Message) -> None:
        """A reply with rows: put them in place, count their staleness, keep them in the cache."""
        place(msg)
        self.staleness.record(clock - msg.clock, keys.shape[0])
        self.counters["rows_pulled"] += keys.shape[0]
        if self.cache is not None:
            self.cache.store(keys, msg.arrays[0], msg.clock)

    def on_server_rows(self, msg: Message) -> None:
        """Rows a server pushed unasked (ESSP): refresh the cache, and the clock of every cached row."""
        if self.cache is None:
            return
        keys, rows = msg.arrays
        if rows.shape[1:] != (self.dim,) or rows.dtype != self.dtype:
            raise ProtocolError(f"server pushed rows of shape {rows.shape} {rows.dtype} for table {self.name!r}")
        self.cache.store(keys.astype(np.int64, copy=False), rows, msg.clock)  # newer rows: safe in any order
        self.counters["eager_messages"] += 1
        self.counters["eager_rows"] += keys.shape[0]
        bump = ([int(s) for s in msg.body["shards"]], msg.clock)
        seq = msg.body.get("seq")
        if not isinstance(seq, int):
            self.cache.bump(*bump)
            return
        # "Rows not resent did not change" holds only after every earlier message of the stream
        # arrived: apply bumps in order, and forget the cache if one never comes (it was lost).
        stream = (msg.sender, str(msg.body.get("stream")))
        expected = self._eager_next.get(stream, 1)
        pending = self._eager_pending.setdefault(stream, {})
        if seq >= expected:
            pending[seq] = bump
        while expected in pending:
            self.cache.bump(*pending.pop(expected))
            expected += 1
        if len(pending) > _EAGER_GAP:
            self.counters["eager_gaps"] += 1
            self.forget_cached()
            expected = max(pending) + 1
            pending.clear()
        self._eager_next[stream] = expected


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
