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
A part answered "moved" (its slice is elsewhere now) is sent again where the
slice is, by a layout fetched from the rendezvous (``client.routed``, the
protocol adaptive tables follow too): a push as soon as the answer arrives, so a
push in flight during a move lands before the worker confirms the move to the
new owner (``client.fences``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from shoal.api.consistency import Consistency
from shoal.api.errors import (
    CheckpointError,
    ClusterError,
    NotServedError,
    RequestTimeoutError,
    ShoalError,
    SliceMovedError,
    TableError,
)
from shoal.client import lane as lane_access
from shoal.client.calls import READS, WRITES, Call, Part, Positions
from shoal.client.context import TableView
from shoal.client.fences import Fences
from shoal.client.in_place import InPlace
from shoal.client.process_cache import PendingWrite, ProcessCache
from shoal.client.routed import RoutedAccess
from shoal.cluster.requests import Future
from shoal.consistency.cache import RowCache
from shoal.consistency.schemes import SliceSchemes
from shoal.placement.layout import TableLayout
from shoal.storage import kernels
from shoal.storage.rules import rule_for
from shoal.storage.shard import ShardStore
from shoal.wire import lane
from shoal.wire.message import Message
from shoal.wire.ops import Op

_NO_ROWS = np.empty((0, 0), np.float32)  # a lane push's: it reads nothing
_REFRESH_AGAIN_S = 0.02  # while the rendezvous lags behind a move a server told of: how often to ask it
_WHOLE = None  # positions standing for "every key of the call, in order"


class _Laned:
    """A part of a call sent on a lane: the request, its server, the positions of the call it reads
    or writes (None: all of them), the array a read's rows come into, the layout epoch that routed it."""

    __slots__ = ("lane", "pending", "node", "at", "out", "epoch")

    def __init__(self, to: lane_access.WorkerLane, pending: lane_access.Pending, node: int, at: Positions,
                 out: np.ndarray, epoch: int) -> None:
        self.lane, self.pending, self.node, self.at, self.out, self.epoch = to, pending, node, at, out, epoch


class StaticAccess(RoutedAccess):
    """Pull, push and push_pull for one static table."""

    def __init__(self, table: TableView, layout: TableLayout, local: dict[int, ShardStore]) -> None:
        super().__init__(table, layout, local)
        self.table = table
        self.staleness = table.staleness
        row_bytes = self.spec.dim * self.dtype.itemsize + 8
        self._chunk = max(1, self.worker.cluster.limits.payload_bytes // (2 * row_bytes))
        self.bound = self.spec.consistency.bound
        #: the model this worker reads each slice under (the table's, unless changed at run time)
        self.schemes = SliceSchemes(self.spec.name, self.spec.consistency, layout.num_shards)
        #: the process cache of remote rows (bounded models only: ASP always asks)
        self.cache = (ProcessCache(self.spec, self.schemes, self.worker, self.counters, self.staleness,
                                   self._pending_writes) if self.bound is not None else None)
        #: push parts not acknowledged yet, by request: the cache adds them to rows that predate them
        self._unacked: dict[int, tuple[Call, Part]] = {}
        #: calls being routed right now (a wait inside may refresh the layout) and stores they may
        #: still use, closed once none is
        self._routing = 0
        self._unmapped: list[ShardStore] = []
        #: pushes started so far (each push call's index), and when the layout was last asked for
        self.pushes_started = 0
        self._refreshed_at = 0.0
        self.fences = Fences(self)
        #: what a local call is called in the error that its node's server died (made once: a call
        #: on local rows costs a few microseconds, and formatting would be a sizeable part of them)
        self._local_call_names = {op: f"a {op.name} of rows of {self.spec.name!r}" for op in (*READS, *WRITES)}
        self._lane_id = lane.table_id(self.spec.name)
        self._row_bytes = self.spec.dim * self.dtype.itemsize
        # A push the lane's compiled code can apply: it adds the values (no optimiser state beside them)
        rule = rule_for(self.spec.optimizer)
        self._pushes_on_lane = (self.bound is None and rule.scale is not None and not rule.state
                                and self.dtype == np.float32)

    @property
    def row_cache(self) -> RowCache | None:
        return self.cache.rows if self.cache is not None else None

    # ----------------------------------------------------------------- calls

    def pull(self, keys: np.ndarray, out: np.ndarray | None) -> Future[np.ndarray]:
        self._settle_moved_pushes()
        call = self._call(Op.PULL, keys, None, self._rows(keys.shape[0], out))
        self._run(call, _WHOLE)
        return self._future(call)

    def push(self, keys: np.ndarray, values: np.ndarray) -> Future[None]:
        if self.cache is not None:
            self.cache.own_change(keys, values)
        call = self._numbered(self._call(Op.PUSH, keys, values, None))
        self._run(call, _WHOLE)
        return self._future(call)

    def push_pull(self, keys: np.ndarray, values: np.ndarray, out: np.ndarray | None) -> Future[np.ndarray]:
        self._settle_moved_pushes()
        if self.cache is not None:
            self.cache.own_change(keys, values)
        call = self._numbered(self._call(Op.PUSH_PULL, keys, values, self._rows(keys.shape[0], out)))
        self._run(call, _WHOLE)
        return self._future(call)

    def in_place(self, keys: np.ndarray) -> InPlace:
        """This node's slice's rows of ``keys``; a node holding several slices of the table has no one
        array of its rows, and a table without row locks could have a slice move away under a kernel."""
        if self.spec.locking != "exact":
            raise TableError(f"rows of {self.spec.name!r} in place need locking='exact': a slice of a lock-free "
                             "table could move away while a kernel writes it")
        if len(self.local) > 1:
            raise TableError(f"this node holds {len(self.local)} slices of {self.spec.name!r}; rows in place are "
                             "one slice's (create it with one slice per server)")
        if not self.local:  # no slice here (or no local access): every key is elsewhere
            return InPlace(self.spec.name, None, keys, self.spec.dim, self.dtype, self.counters)
        self.worker.check_local_server(f"rows of {self.spec.name!r} in place")
        store = next(iter(self.local.values()))
        shards, rows = self.layout.mapping.locate(keys)
        return InPlace(self.spec.name, store, keys, self.spec.dim, self.dtype, self.counters, rows, shards,
                       check=self.worker.check_local_server)

    def set_consistency(self, model: Consistency, slices: list[int] | None) -> None:
        """Read ``slices`` (all: None) under ``model`` from now on. Requests in flight finish first: a
        row they bring back was read under the old model, and a slice whose eager pushes start must
        cache only rows its servers push (``ProcessCache.switched``)."""
        chosen = self.schemes.check(model, slices, self.spec.locking)  # a generator is read once, here
        self.worker.wait_all()
        switched = self.schemes.set(model, chosen, self.spec.locking)
        if self.cache is not None and switched:
            self.cache.switched({s: self.layout.mapping.keys_of(s) for s in switched})
        self.counters["scheme_changes"] += 1

    def consistency_of(self, shard: int) -> Consistency | None:
        return self.schemes.models[shard]

    def _numbered(self, call: Call) -> Call:
        self.pushes_started += 1
        call.index = self.pushes_started
        return call

    # ------------------------------------------------------------- routing

    def _resend(self, call: Call, positions: np.ndarray, op: Op) -> None:
        self._run(call, positions, op)

    def _run(self, call: Call, pos: Positions, op: Op | None = None) -> None:
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

    def _route(self, call: Call, pos: Positions, layout: TableLayout, local: dict[int, ShardStore],
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
        first = int(owner[0])  # if one node holds every key, it holds the first
        groups: list[tuple[int, np.ndarray | None]]
        if counts[first] == n:  # every key on one remote node: the batch goes as it is
            if op == Op.PULL and self._through_lane(call, first, shard, rows, pos, layout.epoch):
                return
            groups = [(first, None)]
        else:
            order, starts = kernels.partition_by_owner(owner, counts.shape[0])
            groups = [(node, order[starts[node] : starts[node + 1]]) for node in range(counts.shape[0])
                      if starts[node + 1] > starts[node]]
        needed = [node for node, _ in groups if node != me or not local]
        if self._routes_to_dead(needed) and self.moved_on_from(layout.epoch):
            self._route(call, pos, self.layout, self.local, op)  # the slices left before their server died
            return
        self._check_alive(needed, layout, shard)
        laned: list[tuple[int, np.ndarray, Positions]] = []
        for node, sub in groups:
            at = pos if sub is None else (sub if pos is None else pos[sub])
            if node == me and local:
                self._local(call, local, shard if sub is None else shard[sub], rows if sub is None else rows[sub], at,
                            op)
                continue
            if op == Op.PULL and self.cache is not None:
                assert call.result is not None
                at = self.cache.serve(call.keys if at is None else call.keys[at], shard if sub is None else shard[sub],
                                      at, call.keys.shape[0], call.result.array())
                if at is not None and at.shape[0] == 0:
                    continue
            if not self.worker.server_alive(node):  # it left (drained) and this layout predates that
                self.refused(call, call.positions(at), op)
                continue
            if op == Op.PULL and sub is not None and self.cache is None:
                laned.append((node, sub, at))
                continue
            self._send_chunks(call, node, at, n, layout.epoch, op)
        for node, sub, at in laned:
            if not self._through_lane(call, node, shard[sub], rows[sub], at, layout.epoch):
                self._send_chunks(call, node, at, n, layout.epoch, op)

    def _send_chunks(self, call: Call, node: int, at: Positions, n: int, epoch: int, op: Op) -> None:
        """Send the part of ``call`` at ``at`` (None: all ``n`` keys) to ``node``, in messages of at most
        ``_chunk`` keys."""
        count = n if at is None else at.shape[0]
        chunks = (at,) if count <= self._chunk else self._chunks(at, count, call.keys.shape[0])
        for chunk in chunks:
            self._send(call, node, chunk, epoch, op)

    def _through_lane(self, call: Call, node: int, shard: np.ndarray, rows: np.ndarray, at: Positions,
                      epoch: int) -> bool:
        """Ask for ``rows`` (in slices ``shard``) of the pull ``call``, at its positions ``at`` (None: all
        of them), on server ``node``'s lane (``client.lane``), if it serves them: an ASP read of up
        to ``lane.MAX_ROWS`` rows and ``lane.MAX_BYTES``, read once the server has handled this
        worker's requests to it so far (so after its pushes, as the general path's read would be in
        the worker's stream). The answer is taken when the call is waited for (``_take_laned``)."""
        n = rows.shape[0]
        if (self.bound is not None or not self.schemes.uniform or n > lane.MAX_ROWS
                or n * self._row_bytes > lane.MAX_BYTES):
            return False
        exited = self.worker.replica_view.exited
        if (exited and node in exited) or (to := self.worker.lane(node)) is None:
            return False
        assert call.result is not None
        out = call.result.array() if at is None else np.empty((n, self.spec.dim), self.dtype)
        if not out.flags.c_contiguous:
            return False
        streams = self.worker.streams
        pending = to.send(self.worker.tracker.number, self.worker.rank, self._lane_id, rows, shard, call.clock,
                          (streams.incarnation, streams.next_seq(node) - 1), out)
        if pending is None:
            self.worker.lane_failed(node, to)
            self.counters["lane_general"] += 1
            return False
        call.laned.append(_Laned(to, pending, node, at, out, epoch))
        call.take_laned = self._take_laned
        return True

    def _future(self, call: Call) -> Future[Any]:
        if call.laned and not call.parts:  # only lane reads in flight: waited for on the lane alone
            return Future.running(functools.partial(self._finish_laned, call), call.finished)
        return super()._future(call)

    def _finish_laned(self, call: Call) -> Any:
        """Wait for the lane's answers to ``call``, then for what went the general way instead."""
        self._take_laned(call, True)
        if not call.finished():
            self.worker.tracker.wait_until(call.finished, call.awaited, self.worker.cluster.timeouts.request_s,
                                           call.step)
        return call.outcome()

    def _take_laned(self, call: Call, wait: bool) -> None:
        """Take the answers to ``call``'s lane requests (waiting for each, if ``wait``): a read's rows
        placed, or the part sent the general way (a push's answer ends its tracker request:
        ``_lane_push_answered``)."""
        for part in list(call.laned):
            part.lane.collect(part.pending, wait)
            status = part.pending.status
            if status is None:
                continue  # not here yet
            call.laned.remove(part)
            if part.pending.done == lane.DONE:
                continue
            n = part.pending.count
            if status == lane_access.OK:
                if part.at is not None:
                    assert call.result is not None
                    call.result.place_rows(part.at, part.out)
                self.counters["lane_pulls"] += 1
                self.counters["rows_pulled"] += n
                self.staleness.record(call.clock - part.pending.clock, n)
                continue
            if status == lane_access.TIMEOUT:
                self.worker.lane_failed(part.node, part.lane)
            self.counters["lane_general"] += 1
            self._send_chunks(call, part.node, part.at, n, part.epoch, Op.PULL)

    def _routes_to_dead(self, nodes: list[int]) -> bool:
        exited = self.worker.replica_view.exited
        return bool(exited) and not exited.isdisjoint(nodes)

    def moved_on_from(self, epoch: int) -> bool:
        """Whether the rendezvous has a layout newer than ``epoch``: asked when a dead server's slices
        are needed, for they may have moved off it before it died (its new owner told the rendezvous
        so, ``server.slicing``)."""
        if self.layout.epoch <= epoch:
            self.refresh_layout()
        return self.layout.epoch > epoch

    def _check_alive(self, nodes: list[int], layout: TableLayout, shard: np.ndarray) -> None:
        """A call that needs a dead server's rows fails at once, before any part of it is sent. Only a
        server whose process has ended counts: one that is merely silent may answer yet, and a call
        waiting for it fails after the request timeout, naming it."""
        exited = self.worker.replica_view.exited
        if not exited:  # the usual case: no server has ended
            return
        dead = sorted(set(nodes) & exited)
        if dead:
            lost = sorted({int(s) for s in np.unique(shard) if int(layout.owners[s]) in dead})
            raise ClusterError(f"server(s) {dead} died: slices {lost} of {self.spec.name!r} that this call needs "
                               "were held there and are gone (--on-server-failure continue keeps only "
                               "replicated tables whole); nothing of the call was sent")

    def _chunks(self, pos: Positions, count: int, total: int) -> Iterator[Positions]:
        if count <= self._chunk:
            yield pos
            return
        every = np.arange(total) if pos is None else pos
        for start in range(0, count, self._chunk):
            yield every[start : start + self._chunk]

    def _send(self, call: Call, node: int, pos: Positions, epoch: int, op: Op) -> None:
        whole = pos is None  # one destination, one message: no gather, no scatter
        arrays = [call.keys if whole else call.keys[pos]]
        writes, reads = op in WRITES, op in READS
        if writes:
            assert call.values is not None
            arrays.append(call.values if whole else call.values[pos])
        msg = Message(op, table=self.spec.name, clock=call.clock, arrays=arrays)
        if reads and not self.schemes.uniform:  # the reader's model for these slices, if not the table's
            named = self.schemes.named(self.layout.mapping.locate(arrays[0])[0])
            if named is not None:
                msg.body["consistency"] = named
        count = arrays[0].shape[0]
        reply_bytes = count * self.spec.dim * self.dtype.itemsize if reads else 0
        worker = self.worker
        to = self._push_lane(call, node, epoch, arrays) if op == Op.PUSH else None
        with worker.streams.stamped(node, msg, worker.settled_clock()) as seq:
            part = Part(node, seq, pos, epoch, op)
            track = worker.tracker.request if to is None else worker.tracker.register
            req = track(node, msg, functools.partial(self._on_reply, call, part, arrays[0]),
                        f"{op.name} of {count} key(s) of {self.spec.name!r}", reply_bytes=reply_bytes,
                        on_error=functools.partial(self._on_error, call, part),
                        on_end=functools.partial(self._on_end, call, part))
        part.req = req
        call.parts[req] = part
        if writes:
            self._unacked[req] = (call, part)
        self.counters["requests"] += 1
        if to is not None:
            self._push_through_lane(call, part, to, arrays[0], arrays[1])

    def _push_lane(self, call: Call, node: int, epoch: int, arrays: list[np.ndarray]) -> lane_access.WorkerLane | None:
        """The lane to push this part of ``call`` on, if one takes it: an ASP push the server applies by
        adding (``Sum``, ``SGD``), of up to ``lane.MAX_ROWS`` rows and ``lane.MAX_BYTES``, sent the first
        time by the layout in use (a part sent again after a move goes the general way)."""
        keys, values = arrays
        n = keys.shape[0]
        if (not self._pushes_on_lane or call.attempts or epoch != self.layout.epoch or not self.schemes.uniform
                or n > lane.MAX_ROWS or n * self._row_bytes > lane.MAX_BYTES or not values.flags.c_contiguous):
            return None
        exited = self.worker.replica_view.exited
        return None if exited and node in exited else self.worker.lane(node)

    def _push_through_lane(self, call: Call, part: Part, to: lane_access.WorkerLane, keys: np.ndarray,
                           values: np.ndarray) -> None:
        """Send push ``part`` of ``call`` (its tracker request registered, not sent) on the lane ``to``,
        as the request of this worker's stream to that server it is numbered; the general way if the
        lane does not take it."""
        worker = self.worker
        shard, rows = self.layout.mapping.locate(keys)
        pending = to.send_push(part.req, worker.tracker.incarnation, worker.rank, self._lane_id, rows, shard, values,
                               call.clock, (worker.streams.incarnation, part.seq - 1),
                               functools.partial(self._lane_push_answered, part, to))
        if pending is None:
            self._lane_push_answered(part, to, None)
            return
        call.laned.append(_Laned(to, pending, part.node, part.positions, _NO_ROWS, part.epoch))
        call.take_laned = self._take_laned

    def _lane_push_answered(self, part: Part, to: lane_access.WorkerLane, pending: lane_access.Pending | None) -> None:
        """The lane's answer to push ``part`` (None: it could not be sent): applied, its request ends as
        if answered the general way; else it goes the general way now, where the server applies it
        once (its copy of one the lane applied late is only acknowledged)."""
        tracker = self.worker.tracker
        if pending is not None and pending.status == lane_access.OK:
            self.counters["lane_pushes"] += 1
            tracker.complete(part.req, Message(Op.OK, req=part.req, table=self.spec.name))
            return
        if pending is None or pending.status == lane_access.TIMEOUT:
            self.worker.lane_failed(part.node, to)
        self.counters["lane_general"] += 1
        tracker.send_now(part.req)

    def _on_reply(self, call: Call, part: Part, keys: np.ndarray, msg: Message) -> None:
        part.answered = True
        self.worker.streams.answered(part.node, part.seq)
        # Answered: applied, or refused and queued to go again. The cache must not take it for a push
        # still awaiting its answer when it keeps the rows of this very reply.
        self._unacked.pop(part.req, None)
        # A server without the part's slice answers all of it "moved" (sent again by ``client.routed``)
        if not self._take_answer(call, part.positions, keys, part.op, msg) or part.op not in READS:
            return
        self.staleness.record(call.clock - msg.clock, keys.shape[0])
        self.counters["rows_pulled"] += keys.shape[0]
        if self.cache is not None:
            self.cache.keep(part.node, msg, keys, msg.arrays[0])

    def _on_error(self, call: Call, part: Part, error: ShoalError) -> None:
        part.answered = True
        if isinstance(error, NotServedError):  # its server left before reading it: as if answered "moved"
            self.refused(call, call.positions(part.positions), part.op)
            return
        self.worker.streams.answered(part.node, part.seq)
        self._fail(call, error)

    def _on_end(self, call: Call, part: Part) -> None:
        self.worker.streams.ended(part.node, part.seq)
        call.parts.pop(part.req, None)
        self._unacked.pop(part.req, None)
        self._ended_unanswered(call, part)

    def after_receive(self) -> None:
        """Send parts answered "moved" where their slices are now, and answer fences once the pushes
        they wait for have landed."""
        super().after_receive()
        if self.fences.waiting:
            self.fences.answer()

    def on_server_message(self, server: int, msg: Message) -> bool:
        if msg.op == Op.FENCE:
            self.fences.on_fence(server, msg)
        elif msg.op == Op.ROWS and self.cache is not None:
            self.cache.on_server_rows(msg)  # rows a server pushed unasked (ESSP)
        else:
            return False
        return True

    def _find_moved(self) -> None:
        self.refresh_layout()

    def _before_reread(self) -> None:
        self._settle_moved_pushes()

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
        if (not self._unacked and not self._moved_calls) or not self.routed_before(self.layout.epoch):
            return

        def awaited() -> set[int]:
            return {req for req, (_, part) in self._unacked.items() if part.epoch < self.layout.epoch}

        self.worker.tracker.wait_until(lambda: not self.routed_before(self.layout.epoch), awaited,
                                       self.worker.cluster.timeouts.request_s)

    # --------------------------------------------------------- checkpoints

    def check_checkpoint(self, parts: list[dict[str, Any]], staging: Path) -> None:
        """Each slice written once (none moved meanwhile)."""
        written = sorted(int(p["shard"]) for p in parts)
        expected = list(range(self.layout.num_shards))
        if written != expected:
            raise CheckpointError(f"slices of {self.name!r} written {written}, expected each of {expected} once "
                                  f"(a slice moved during the checkpoint)")

    # ------------------------------------------------------------- layout

    def forget_cached(self) -> None:
        if self.cache is not None:
            self.cache.forget()

    def _pending_writes(self) -> Iterator[PendingWrite]:
        """This table's pushes that servers may not have applied yet (for the cache)."""
        for call, part in list(self._unacked.values()):
            yield (part.node, part.seq, *call.written(part.positions))
        for call in self._moved_calls:
            for positions in call.unsent_writes():
                yield (-1, 0, *call.written(positions))

    def refresh_layout(self) -> None:
        """Fetch this table's slice owners from the rendezvous; map the slices now on this node."""
        self._refreshed_at = self.worker.now()
        reply = self.worker.fetch_layout(self.spec.name)
        epoch = int(reply["epoch"])
        if epoch < self.layout.epoch:
            return
        self._use_layout(reply["owners"], epoch)

    def learn_move(self, shard: int, node: int, epoch: int) -> bool:
        """Route by a layout of at least ``epoch``, whose last move took ``shard`` to ``node`` (told by a
        server that took part in it, which may know it before the rendezvous records it; -1: the
        rendezvous knows it); False while this worker cannot have that layout yet."""
        if self.layout.epoch >= epoch:
            return True
        told = shard >= 0
        if (self.layout.epoch < epoch - 1 or not told) and self.worker.now() - self._refreshed_at > _REFRESH_AGAIN_S:
            self.refresh_layout()  # moves are one at a time: the rendezvous has every one before this
        if self.layout.epoch >= epoch:
            return True
        if self.layout.epoch < epoch - 1 or not told:
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

    # ---------------------------------------------------------- local rows

    def _local(self, call: Call, local: dict[int, ShardStore], shard: np.ndarray | None, rows: np.ndarray,
               pos: Positions, op: Op) -> None:
        """Serve rows of this node's slices in shared memory, in the caller's process."""
        writes, reads = op in WRITES, op in READS
        if reads:
            assert call.result is not None
            slowest = self._local_bound(self.bound if self.schemes.uniform else
                                        self.schemes.bound_for(next(iter(local)) if shard is None else shard))
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
                    self.refused(call, call.positions(p), op)
                    continue
                if self.cache is not None:
                    self.cache.wrote_locally(*call.written(p))
            if reads:
                assert call.result is not None
                try:
                    if p is None:
                        store.read(r, out=call.result.array())
                    else:
                        store.read_into(r, p, call.result.array())
                except SliceMovedError:  # its rows are read where the slice is now
                    self.refused(call, call.positions(p), Op.PULL)
        self.worker.check_local_server(self._local_call_names[op])

    def _local_bound(self, bound: int | None) -> int:
        """Wait until the local server's clocks allow a read at this worker's clock under ``bound``;
        the slowest clock."""
        clocks = self.worker.local_clocks
        if clocks is None:
            return self.worker.clock
        slowest = min(clocks.tolist())  # a few workers' clocks: numpy's reduction costs more than the list
        if bound is None:
            return min(slowest, self.worker.clock)
        required = self.worker.clock - bound
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
