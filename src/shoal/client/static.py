"""A worker's access to a static table: each slice at one server until it is moved.

A batch of keys is split by owning node. Rows of this node's slices are read
and written directly in shared memory, under the slice's locks and with the
table's update rule: no message, no server CPU. Every other node gets one
message (or a few, if a batch exceeds the message size limit), all in flight
at once, numbered in this worker's stream to that server (``client.streams``)
so the server handles them in the order they were sent; replies are placed back
in the caller's key order.

Under a bounded model a process cache keeps remote rows with the clock they are
current at, and this worker's own pushes are applied to it, so a read from the
cache holds every earlier push of this worker (read-my-writes, as SSP promises).
A part refused because its slice moved is sent again where the slice is now,
as soon as the refusal arrives: a push in flight during a move lands before
the worker confirms the move to the new owner (``Worker`` answers its fences).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from shoal.api.errors import (
    ClosedError,
    ClusterError,
    ProtocolError,
    RequestTimeoutError,
    ShoalError,
    SliceMovedError,
)
from shoal.cluster.requests import Future
from shoal.consistency.cache import RowCache
from shoal.placement.layout import TableLayout
from shoal.storage import kernels
from shoal.storage.rules import rule_for
from shoal.storage.shard import ShardStore
from shoal.wire.message import Message
from shoal.wire.ops import Op

if TYPE_CHECKING:
    from shoal.client.table import Table

_HEADER_ROOM = 64 * 1024
_EAGER_WAIT_S = 5.0
_EAGER_GAP = 32  # eager messages held behind a missing one before it is taken as lost
_REFRESH_AGAIN_S = 0.02  # while the rendezvous lags behind a move a server told of: how often to ask it
_WATCH_AFTER_S = 0.5  # a call waiting longer than this asks whether the servers it waits for are alive
_WHOLE = None  # positions standing for "every key of the call, in order"

Positions = np.ndarray | None


_WRITES = (Op.PUSH, Op.PUSH_PULL)
_READS = (Op.PULL, Op.PUSH_PULL)


class _Part:
    """One request of a call: where it went, its place in the stream, and which keys it carries."""

    __slots__ = ("node", "seq", "positions", "epoch", "op", "req")

    def __init__(self, node: int, seq: int, positions: Positions, epoch: int, op: Op) -> None:
        self.node, self.seq, self.positions, self.epoch, self.op = node, seq, positions, epoch, op
        self.req = 0


class _Call:
    """One pull, push or push_pull: its parts in flight, and the parts to send again after a move.

    A part refused because its slice moved goes where the slice is now: its push at once, in the
    background (``StaticAccess.resend_moved``), its read when the caller waits (``step``), because
    a read may have to wait for its bound and the background must never wait.
    """

    def __init__(self, access: StaticAccess, op: Op, keys: np.ndarray, values: np.ndarray | None,
                 result: _Rows | None, clock: int) -> None:
        self.access = access
        self.op, self.keys, self.values, self.result, self.clock = op, keys, values, result, clock
        self.parts: dict[int, _Part] = {}
        #: positions refused because their slice moved, with the op they were sent with
        self.moved: list[tuple[np.ndarray, Op]] = []
        #: positions whose rows are to be read again where their slice is now
        self.rereads: list[np.ndarray] = []
        self.attempts = 0
        self.started = time.monotonic()
        self.error: ShoalError | None = None
        #: pushes are numbered in the order they start (a fence waits for those before a point)
        self.index = 0

    def finished(self) -> bool:
        return not self.parts and not self.moved and (not self.rereads or self.error is not None)

    def awaited(self) -> set[int]:
        return set(self.parts)

    def step(self) -> None:
        if self.rereads and self.error is None:
            self.access.reread(self)
        self.access.watch_servers(self)

    def written(self, part_positions: Positions) -> tuple[np.ndarray, np.ndarray]:
        """The keys and values a push part carries."""
        assert self.values is not None
        if part_positions is None:
            return self.keys, self.values
        return self.keys[part_positions], self.values[part_positions]

    def unsent_writes(self) -> list[np.ndarray]:
        """Positions of pushes refused by a moved slice, not sent again yet."""
        return [positions for positions, op in self.moved if op in _WRITES]

    def positions(self, part_positions: Positions) -> np.ndarray:
        return np.arange(self.keys.shape[0]) if part_positions is None else part_positions

    def outcome(self) -> Any:
        if self.error is not None:
            raise self.error
        return None if self.result is None else self.result.get()


class StaticAccess:
    """Pull, push and push_pull for one static table."""

    def __init__(self, table: Table, layout: TableLayout, local: dict[int, ShardStore]) -> None:
        self.table = table
        self.spec = table.spec
        self.worker = table.worker
        self.layout = layout
        self.local = local
        self.dtype = np.dtype(self.spec.dtype)
        self.counters = table.counters
        self.staleness = table.staleness
        row_bytes = self.spec.dim * self.dtype.itemsize + 8
        self._chunk = max(1, (self.worker.cluster.limits.max_message_bytes - _HEADER_ROOM) // (2 * row_bytes))
        self.bound = self.spec.consistency.bound
        #: the process cache of remote rows (bounded models only: ASP always asks)
        self.cache = (RowCache(self.spec.num_keys, self.spec.dim, self.dtype, layout.num_shards)
                      if self.bound is not None else None)
        #: what a push adds to a row in the cache, per unit of pushed value; None: the rule is not additive
        self._scale = rule_for(self.spec.optimizer).scale
        #: ESSP: per server stream, the next eager message expected and the bumps waiting for it
        self._eager_next: dict[tuple[int, str], int] = {}
        self._eager_pending: dict[tuple[int, str], dict[int, tuple[list[int], int]]] = {}
        #: push parts not acknowledged yet, by request: the cache adds them to rows that predate them
        self._unacked: dict[int, tuple[_Call, _Part]] = {}
        #: pushes with parts refused by a moved slice, waiting to be sent again
        self._moved_calls: list[_Call] = []
        #: calls being routed right now (a wait inside may refresh the layout) and stores they may
        #: still use, closed once none is
        self._routing = 0
        self._unmapped: list[ShardStore] = []
        #: pushes written in this node's shared memory lately: (the seq our next request to this node's
        #: server carried then, keys, values); rows that server sent before handling it lack them
        self._local_writes: list[tuple[int, np.ndarray, np.ndarray]] = []
        #: pushes started so far (each push call's index), and when the layout was last asked for
        self.pushes_started = 0
        self._refreshed_at = 0.0

    # ----------------------------------------------------------------- calls

    def pull(self, keys: np.ndarray, out: np.ndarray | None) -> Future[np.ndarray]:
        self._settle_moved_pushes()
        call = _Call(self, Op.PULL, keys, None, _Rows(keys.shape[0], self.spec.dim, self.dtype, out),
                     self.worker.clock)
        self._run(call, _WHOLE)
        return self._future(call)

    def push(self, keys: np.ndarray, values: np.ndarray) -> Future[None]:
        self._own_change(keys, values)
        call = self._numbered(_Call(self, Op.PUSH, keys, values, None, self.worker.clock))
        self._run(call, _WHOLE)
        return self._future(call)

    def push_pull(self, keys: np.ndarray, values: np.ndarray, out: np.ndarray | None) -> Future[np.ndarray]:
        self._settle_moved_pushes()
        self._own_change(keys, values)
        call = self._numbered(_Call(self, Op.PUSH_PULL, keys, values,
                                    _Rows(keys.shape[0], self.spec.dim, self.dtype, out), self.worker.clock))
        self._run(call, _WHOLE)
        return self._future(call)

    def _numbered(self, call: _Call) -> _Call:
        self.pushes_started += 1
        call.index = self.pushes_started
        return call

    def _future(self, call: _Call) -> Future[Any]:
        if call.finished():
            return Future(None, set(), call.outcome, 0.0)
        return Future(self.worker.tracker, call, call.outcome, self.worker.cluster.timeouts.request_s)

    # ------------------------------------------------------------- routing

    def _run(self, call: _Call, pos: Positions, op: Op | None = None) -> None:
        """Serve local rows now and send the rest, for the keys of ``call`` at ``pos`` (all: None).

        A wait inside (a local read's bound, an eager push awaited) may refresh the layout: the call
        goes on by the layout and stores it started with; a part sent by them to a slice that moved
        meanwhile is refused and sent again.
        """
        self._routing += 1
        try:
            self._route(call, pos, self.layout, self.local, call.op if op is None else op)
        finally:
            self._routing -= 1
            if not self._routing and self._unmapped:
                for store in self._unmapped:
                    store.close()
                self._unmapped.clear()

    def _route(self, call: _Call, pos: Positions, layout: TableLayout, local: dict[int, ShardStore],
               op: Op) -> None:
        keys = call.keys if pos is None else call.keys[pos]
        n = keys.shape[0]
        if n == 0:
            return
        if len(local) == 1:  # the common co-located case: try "all keys local" in one pass
            shard_id = next(iter(local))
            local_rows = layout.mapping.rows_in(keys, shard_id)
            if local_rows is not None:
                self._local(call, local, None, local_rows, pos, op)
                return
        owner, shard, rows, counts = layout.route(keys)
        me = self.worker.node
        if local and me < counts.shape[0] and counts[me] == n:
            self._local(call, local, shard, rows, pos, op)
            return
        single = np.flatnonzero(counts == n)
        groups: list[tuple[int, np.ndarray | None]]
        if single.size:  # every key on one remote node: the batch goes as it is
            groups = [(int(single[0]), None)]
        else:
            order, starts = kernels.partition_by_owner(owner, counts.shape[0])
            groups = [(node, order[starts[node] : starts[node + 1]]) for node in range(counts.shape[0])
                      if starts[node + 1] > starts[node]]
        self._check_alive([node for node, _ in groups if node != me or not local], layout, shard)
        for node, sub in groups:
            at = pos if sub is None else (sub if pos is None else pos[sub])
            if node == me and local:
                self._local(call, local, shard if sub is None else shard[sub], rows if sub is None else rows[sub], at,
                            op)
                continue
            if op == Op.PULL and self.cache is not None:
                at = self._from_cache(call, shard if sub is None else shard[sub], at)
                if at is not None and at.shape[0] == 0:
                    continue
            count = n if at is None else at.shape[0]
            for chunk in self._chunks(at, count, call.keys.shape[0]):
                try:
                    self._send(call, node, chunk, layout.epoch, op)
                except ClosedError:
                    if self.worker.tracker.closed or self.worker.server_alive(node):
                        raise
                    # The server left (drained) and this layout predates it: its slices are elsewhere.
                    self._refused(call, call.positions(chunk), op)

    def _check_alive(self, nodes: list[int], layout: TableLayout, shard: np.ndarray) -> None:
        """A call that needs a dead server's rows fails at once, before any part of it is sent."""
        alive = self.worker.replica_view.alive
        dead = [n for n in nodes if n < len(alive) and not alive[n]]
        if dead:
            lost = sorted({int(s) for s in np.unique(shard) if int(layout.owners[s]) in dead})
            raise ClusterError(f"server(s) {dead} died: slices {lost} of {self.spec.name!r} that this call needs "
                               "were held there and are gone (--on-server-failure continue keeps only "
                               "replicated tables whole); nothing of the call was sent")

    def watch_servers(self, call: _Call) -> None:
        """While ``call`` waits: a server that died since it was sent fails its parts now, naming it,
        instead of after the request timeout."""
        view = self.worker.replica_view
        if not call.parts or time.monotonic() - call.started < _WATCH_AFTER_S:
            return
        view.refresh()  # at most once a second
        for req, part in list(call.parts.items()):
            if part.node < len(view.alive) and not view.alive[part.node]:
                self.worker.tracker.forget(req)
                call.error = call.error or ClusterError(
                    f"server {part.node} died while a {part.op.name} of {self.spec.name!r} waited for it: the "
                    "rows it held are gone")

    def _chunks(self, pos: Positions, count: int, total: int) -> Iterator[Positions]:
        if count <= self._chunk:
            yield pos
            return
        every = np.arange(total) if pos is None else pos
        for start in range(0, count, self._chunk):
            yield every[start : start + self._chunk]

    def _send(self, call: _Call, node: int, pos: Positions, epoch: int, op: Op) -> None:
        whole = pos is None  # one destination, one message: no gather, no scatter
        arrays = [call.keys if whole else call.keys[pos]]
        writes, reads = op in _WRITES, op in _READS
        if writes:
            assert call.values is not None
            arrays.append(call.values if whole else call.values[pos])
        msg = Message(op, table=self.spec.name, clock=call.clock, arrays=arrays)
        count = arrays[0].shape[0]
        reply_bytes = count * self.spec.dim * self.dtype.itemsize if reads else 0
        worker = self.worker
        seq = worker.streams.stamp(node, msg, worker.settled_clock())
        part = _Part(node, seq, pos, epoch, op)
        req = worker.tracker.request(
            node, msg, functools.partial(self._on_reply, call, part, arrays[0]),
            f"{op.name} of {count} key(s) of {self.spec.name!r}", reply_bytes=reply_bytes,
            on_error=functools.partial(self._on_error, call, part),
            on_end=functools.partial(self._on_end, call, part))
        part.req = req
        call.parts[req] = part
        if writes:
            self._unacked[req] = (call, part)
        self.counters["requests"] += 1

    def _on_reply(self, call: _Call, part: _Part, keys: np.ndarray, msg: Message) -> None:
        self.worker.streams.answered(part.node, part.seq)
        if part.op not in _READS:
            return
        assert call.result is not None
        if part.positions is None:
            call.result.take_whole(msg)
        else:
            call.result.place(part.positions, msg)
        self.staleness.record(call.clock - msg.clock, keys.shape[0])
        self.counters["rows_pulled"] += keys.shape[0]
        if self.cache is not None:
            self._keep(part.node, msg, keys, msg.arrays[0])

    def _on_error(self, call: _Call, part: _Part, error: ShoalError) -> None:
        self.worker.streams.answered(part.node, part.seq)
        if isinstance(error, SliceMovedError):  # nothing of the part was applied: it goes where the slice is
            self._refused(call, call.positions(part.positions), part.op)
        elif call.error is None:
            call.error = error

    def _on_end(self, call: _Call, part: _Part) -> None:
        self.worker.streams.ended(part.node, part.seq)
        call.parts.pop(part.req, None)
        self._unacked.pop(part.req, None)

    def _refused(self, call: _Call, positions: np.ndarray, op: Op) -> None:
        call.moved.append((positions, op))
        if call not in self._moved_calls:
            self._moved_calls.append(call)

    @property
    def has_moved(self) -> bool:
        """Parts refused by moved slices wait to be sent again (``resend_moved``)."""
        return bool(self._moved_calls)

    def resend_moved(self) -> None:
        """Send the pushes refused by moved slices where their slices are now (after a layout refresh);
        reads refused are left to their waiters (``reread``). Never waits for a bound."""
        calls = list(self._moved_calls)
        if not calls:
            return
        try:
            self.refresh_layout()  # replies meanwhile still find the refused pushes in _moved_calls
        except ShoalError as exc:
            for call in calls:
                call.moved.clear()
                call.error = call.error or exc
            self._moved_calls = [c for c in self._moved_calls if c not in calls]
            return
        self._moved_calls = [c for c in self._moved_calls if c not in calls]
        for call in calls:
            moved, call.moved = call.moved, []
            if self._gave_up(call):
                continue
            self.counters["moved_retries"] += 1
            for positions, op in moved:
                if op in _READS:
                    call.rereads.append(positions)  # after its push, if it has one: the stream keeps the order
                if op in _WRITES:
                    try:
                        self._run(call, positions, Op.PUSH)
                    except ShoalError as exc:
                        call.error = call.error or exc

    def reread(self, call: _Call) -> None:
        """The waiter of ``call`` reads again the rows refused by moved slices, where they are now."""
        positions = np.concatenate(call.rereads)
        call.rereads.clear()
        if self._gave_up(call):
            return
        if call.attempts > 2:
            time.sleep(min(0.005 * 2 ** call.attempts, 0.1))  # a slice moving again and again: let it settle
        try:
            self._settle_moved_pushes()
            self._run(call, positions, Op.PULL)
        except ShoalError as exc:
            call.error = call.error or exc

    def _gave_up(self, call: _Call) -> bool:
        call.attempts += 1
        if call.error is None and time.monotonic() - call.started > self.worker.cluster.timeouts.request_s:
            call.error = SliceMovedError(
                f"keys of {self.spec.name!r} kept moving for {self.worker.cluster.timeouts.request_s:.0f}s: "
                f"{call.attempts} layout refreshes for one call")
        return call.error is not None

    def oldest_open_push(self) -> int | None:
        """The clock of this table's oldest push not acknowledged yet (None: all are)."""
        clocks = [call.clock for call, _ in self._unacked.values()]
        clocks += [call.clock for call in self._moved_calls if call.unsent_writes()]
        return min(clocks) if clocks else None

    def routed_before(self, epoch: int) -> bool:
        """Whether a push of this worker routed by a layout older than ``epoch`` is not settled yet
        (in flight, or refused by a moved slice and waiting to go where the slice is)."""
        return any(part.epoch < epoch for _, part in self._unacked.values()) or \
            any(call.unsent_writes() for call in self._moved_calls)

    def _settle_moved_pushes(self) -> None:
        """A read comes after this worker's pushes routed by an older layout have landed where their
        slices are now: a read sent to the new owner would not otherwise wait for them."""
        if not self.routed_before(self.layout.epoch):
            return

        def awaited() -> set[int]:
            return {req for req, (_, part) in self._unacked.items() if part.epoch < self.layout.epoch}

        self.worker.tracker.wait_until(lambda: not self.routed_before(self.layout.epoch), awaited,
                                       self.worker.cluster.timeouts.request_s)

    # ------------------------------------------------------------- layout

    def forget_cached(self) -> None:
        """Drop cached remote rows (their values changed under us: a restore)."""
        if self.cache is not None:
            self.cache = RowCache(self.spec.num_keys, self.spec.dim, self.dtype, self.layout.num_shards)

    def refresh_layout(self) -> None:
        """Fetch this table's slice owners from the rendezvous; map the slices now on this node."""
        self._refreshed_at = time.monotonic()
        reply = self.worker.fetch_layout(self.spec.name)
        epoch = int(reply["epoch"])
        if epoch < self.layout.epoch:
            return
        self._use_layout(reply["owners"], epoch)

    def learn_move(self, shard: int, node: int, epoch: int) -> bool:
        """Route by the move of ``shard`` to ``node`` at ``epoch`` (told by its new owner, which may know
        it before the rendezvous records it); False while this worker's layout is too old to take it."""
        if self.layout.epoch >= epoch:
            return True
        if self.layout.epoch < epoch - 1 and time.monotonic() - self._refreshed_at > _REFRESH_AGAIN_S:
            self.refresh_layout()  # moves are one at a time: the rendezvous has every one before this
        if self.layout.epoch >= epoch:
            return True
        if self.layout.epoch < epoch - 1:
            return False
        owners = self.layout.owners.copy()
        owners[shard] = node
        self._use_layout(owners, epoch)
        return True

    def pushes_open(self, upto: int) -> bool:
        """Whether a push of this table started no later than push ``upto`` has not landed yet."""
        return any(call.index <= upto for call, _ in self._unacked.values()) or \
            any(call.index <= upto and call.unsent_writes() for call in self._moved_calls)

    def _use_layout(self, owners: Any, epoch: int) -> None:
        self.layout = self.layout.at(owners, epoch)
        if self.worker.local_access:
            kept = self.worker.local_slices(self.spec, self.layout, self.local)
            dropped = [st for s, st in self.local.items() if kept.get(s) is not st]
            self.local = kept
            if self._routing:
                self._unmapped += dropped  # a call being routed may still read them
            else:
                for store in dropped:
                    store.close()
        self.counters["layout_refreshes"] += 1

    # ------------------------------------------------------------- the cache

    def _own_change(self, keys: np.ndarray, values: np.ndarray) -> None:
        """A push changes this worker's cached copies of its rows at once: by the same change where
        the rule is additive, otherwise by dropping them (the next read asks the server)."""
        if self.cache is None:
            return
        cached = self.cache.version[keys] >= 0
        if cached.any():
            self._change_cached(keys[cached], values[cached])

    def _keep(self, node: int, msg: Message, keys: np.ndarray, rows: np.ndarray, pushed: bool = False) -> None:
        """Cache rows a server sent, with this worker's pushes they do not include yet added (or, for
        a rule that is not additive, not cached at all)."""
        assert self.cache is not None
        seen = msg.body.get("seen")
        handled = self.worker.streams.handled(node)
        if not isinstance(seen, int) or seen < handled:
            if pushed:
                self.cache.drop(keys)  # the bump that follows must not vouch for the rows held now
            return  # read before a push of ours that is acknowledged since: it would miss that push
        stored = self.cache.store(keys, rows, msg.clock, msg.epoch, seen, pushed)
        if self._local_writes and node == self.worker.node:
            self._local_writes = [w for w in self._local_writes if w[0] > handled]
            for marker, keys_written, values in self._local_writes:
                if marker > seen:  # written in shared memory after the server read these rows
                    self._reapply(stored, keys_written, values)
        if not stored.size or (not self._unacked and not self._moved_calls):
            return
        for call, part in list(self._unacked.values()):
            if part.node == node and part.seq <= seen:
                continue  # the rows include it
            self._reapply(stored, *call.written(part.positions))
        for call in self._moved_calls:
            for positions in call.unsent_writes():
                self._reapply(stored, *call.written(positions))

    def _remember_local_write(self, keys: np.ndarray, values: np.ndarray) -> None:
        streams, here = self.worker.streams, self.worker.node
        handled = streams.handled(here)
        self._local_writes = [w for w in self._local_writes if w[0] > handled]
        self._local_writes.append((streams.next_seq(here), keys, values))

    def _reapply(self, stored: np.ndarray, keys: np.ndarray, values: np.ndarray) -> None:
        """Add this worker's push of ``values`` at ``keys`` to the rows just ``stored`` (or drop them,
        for a rule that is not additive): the server sent them before it had the push."""
        mask = np.isin(keys, stored)
        if mask.any():
            self._change_cached(keys[mask], values[mask])

    def _change_cached(self, keys: np.ndarray, values: np.ndarray) -> None:
        assert self.cache is not None
        if self._scale is None:
            self.cache.drop(keys)
        else:
            self.cache.add(keys, values, self._scale)

    def _from_cache(self, call: _Call, shard: np.ndarray, pos: Positions) -> Positions:
        """Serve keys whose cached rows are fresh enough; returns the positions still to pull."""
        assert self.cache is not None and self.bound is not None and call.result is not None
        self.worker.tracker.pump(0)  # apply rows servers pushed eagerly since the last call
        keys = call.keys if pos is None else call.keys[pos]
        versions = self.cache.versions(keys, shard)
        clock = self.worker.clock
        required = max(clock - self.bound, 0)  # a row never fetched (version -1) is never fresh
        fresh = versions >= required
        if self.spec.consistency.eager and not fresh.all() and (versions >= 0).any():
            versions = self._await_eager(keys, shard, required)
            fresh = versions >= required
        hits = int(np.count_nonzero(fresh))
        if not hits:
            return pos
        where = np.arange(call.keys.shape[0]) if pos is None else pos
        call.result.array()[where[fresh]] = self.cache.values[keys[fresh]]
        self.staleness.record(clock - versions[fresh])
        self.counters["rows_from_cache"] += hits
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

    def on_server_rows(self, msg: Message) -> None:
        """Rows a server pushed unasked (ESSP): refresh the cache, and the clock of every cached row."""
        if self.cache is None:
            return
        keys, rows = msg.arrays
        if rows.shape[1:] != (self.spec.dim,) or rows.dtype != self.dtype:
            raise ProtocolError(f"server pushed rows of shape {rows.shape} {rows.dtype} for table "
                                f"{self.spec.name!r}")
        self._keep(msg.sender, msg, keys.astype(np.int64, copy=False), rows, pushed=True)
        self.counters["eager_messages"] += 1
        self.counters["eager_rows"] += keys.shape[0]
        bump = ([int(s) for s in msg.body["shards"]], msg.clock)
        seq = msg.body.get("seq")
        if not isinstance(seq, int):
            self.cache.bump(*bump)
            return
        # "Rows not resent did not change" holds only after every earlier message of the stream
        # arrived: apply bumps in order, and forget the cache if one never comes (it was lost).
        stream = (msg.sender, str(msg.body.get("series")))
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

    # ---------------------------------------------------------- local rows

    def _local(self, call: _Call, local: dict[int, ShardStore], shard: np.ndarray | None, rows: np.ndarray,
               pos: Positions, op: Op) -> None:
        """Serve rows of this node's slices in shared memory, in the caller's process."""
        writes, reads = op in _WRITES, op in _READS
        if reads:
            assert call.result is not None
            slowest = self._local_bound()
            self.staleness.record(self.worker.clock - slowest, rows.shape[0])
            self.counters["rows_local"] += rows.shape[0]
        for store, sel in _by_local_shard(local, shard):
            r = rows if sel is None else rows[sel]
            p = pos if sel is None else (sel if pos is None else pos[sel])
            if writes:
                assert call.values is not None
                try:
                    store.update(r, call.values if p is None else call.values[p])
                except SliceMovedError:  # nothing of this part was applied: it goes to the new owner
                    self._refused(call, call.positions(p), op)
                    continue
                if self.cache is not None:
                    self._remember_local_write(*call.written(p))
            if reads:
                assert call.result is not None
                try:
                    if p is None:
                        store.read(r, out=call.result.array())
                    else:
                        store.read_into(r, p, call.result.array())
                except SliceMovedError:  # its rows are read where the slice is now
                    self._refused(call, call.positions(p), Op.PULL)
        self.worker.check_local_server(f"a {op.name} of {rows.shape[0]} row(s) of {self.spec.name!r}")

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
            self.worker.check_local_server(f"a read of {self.spec.name!r} waiting for clock {required}")
            if time.monotonic() > deadline:
                behind = [int(w) for w in np.flatnonzero(clocks < required)]
                raise RequestTimeoutError(
                    f"local read of {self.spec.name!r} at clock {self.worker.clock} waited "
                    f"{self.worker.cluster.timeouts.request_s:.1f}s for worker(s) {behind} to reach clock {required}")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
            self.worker.tracker.pump(0)  # own requests overdue (a lost clock, say) go out again meanwhile
            slowest = int(clocks.min())
        return min(slowest, self.worker.clock)

    def lose_local(self) -> None:
        """This node's server died: no slice is local any more (a call being routed may still hold its
        stores; they are closed after it)."""
        self._unmapped += self.local.values()
        self.local = {}
        if not self._routing:
            self.close()

    def close(self) -> None:
        for store in [*self.local.values(), *self._unmapped]:
            store.close()
        self.local, self._unmapped = {}, []


def _by_local_shard(local: dict[int, ShardStore], shard: np.ndarray | None
                    ) -> Iterator[tuple[ShardStore, np.ndarray | None]]:
    if len(local) == 1 or shard is None:
        yield next(iter(local.values())), None
        return
    for sid, store in local.items():
        sel = np.flatnonzero(shard == sid)
        if sel.size:
            yield store, sel


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

