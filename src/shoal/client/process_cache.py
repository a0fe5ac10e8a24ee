"""A worker's process cache of a static table's remote rows, holding this worker's own pushes.

Bounded models (BSP, SSP, ESSP) serve a read from the cache when its row is
current enough for the model of its slice (``consistency.schemes``). A
worker's own pushes change its cached rows at once (an additive rule adds the
change, another drops the row), so a read holds them, as SSP's read-my-writes
promises. Rows a server sends are kept only when more recent than the cached
ones, and the worker's pushes they do not include yet (not acknowledged by that
server when it read them, or written into this node's shared memory after it
did) are added back. Rows that may or may not hold a push (handled by their
server but not answered, or sent to a server whose slice has moved to theirs
since) are not kept: a later read asks for them.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable

import numpy as np

from shoal.api.config import TableSpec
from shoal.api.errors import ProtocolError
from shoal.client.calls import Positions
from shoal.client.context import WorkerContext
from shoal.consistency.cache import RowCache
from shoal.consistency.schemes import EAGER_WAIT_S, SliceSchemes
from shoal.consistency.staleness import StalenessHistogram
from shoal.storage.rules import rule_for
from shoal.wire import bodies
from shoal.wire.message import Message

_EAGER_GAP = 32  # eager messages held behind a missing one before it is taken as lost
# ... or held this long: a server's messages to us arrive in the order it sent them, so one missing
# behind a later one was lost (a read waiting for its rows would otherwise wait out EAGER_WAIT_S)
_EAGER_GAP_S = 0.1

#: a push of ours a server may not have applied yet: (server, seq in our stream to it, keys, values);
#: server -1 for one not sent anywhere now (refused by a moved slice, to go again)
PendingWrite = tuple[int, int, np.ndarray, np.ndarray]


class ProcessCache:
    """The cached rows of one static table under a bounded model."""

    def __init__(self, spec: TableSpec, schemes: SliceSchemes, worker: WorkerContext, counters: Counter[str],
                 staleness: StalenessHistogram, pending: Callable[[], Iterable[PendingWrite]]) -> None:
        self.spec = spec
        self.schemes = schemes
        self.num_shards = int(schemes.bounds.shape[0])
        self.worker = worker
        self.counters = counters
        self.staleness = staleness
        self.dtype = np.dtype(spec.dtype)
        #: this worker's pushes not acknowledged yet: added to rows a server sent before it had them
        self._pending = pending
        #: what a push adds to a row, per unit of pushed value; None: the rule is not additive
        self._scale = rule_for(spec.optimizer).scale
        self.rows = RowCache(spec.num_keys, spec.dim, self.dtype, self.num_shards)
        #: pushes written in this node's shared memory lately: (the seq our next request to this node's
        #: server carried then, keys, values); rows that server sent before handling it lack them
        self._local_writes: list[tuple[int, np.ndarray, np.ndarray]] = []
        #: ESSP: per server stream, the next eager message expected and the later ones waiting for it
        self._eager_next: dict[tuple[int, str], int] = {}
        self._eager_pending: dict[tuple[int, str], dict[int, Message]] = {}
        #: per stream with a missing message, since when a later one waits behind it
        self._eager_gap_since: dict[tuple[int, str], float] = {}
        #: per server, the seq of our first request after the cache was last forgotten: answers to
        #: earlier ones are not taken
        self._floor: dict[int, int] = {}

    def forget(self) -> None:
        """Drop every cached row (their values changed under us: a restore, a lost eager message).
        Answers to requests sent before are not taken: one on its way, or sent again from the
        server's memory of it, may be older than what was lost, and a later eager message's "the
        rest did not change" would vouch for it."""
        self.rows = RowCache(self.spec.num_keys, self.spec.dim, self.dtype, self.num_shards)
        streams = self.worker.streams
        self._floor = {node: streams.next_seq(node) for node in range(len(self.worker.servers))}

    def switched(self, slices: dict[int, np.ndarray]) -> None:
        """Eager pushes of these slices (with their keys) started or stopped: forget their rows. A
        server vouches with its pushes only for rows it knows are cached, those read under ESSP."""
        for shard, keys in slices.items():
            self.rows.forget_slice(shard, keys)

    # ------------------------------------------------------- own pushes

    def own_change(self, keys: np.ndarray, values: np.ndarray) -> None:
        """A push changes this worker's cached copies of its rows at once."""
        cached = self.rows.version[keys] >= 0
        if cached.any():
            self._change(keys[cached], values[cached])

    def wrote_locally(self, keys: np.ndarray, values: np.ndarray) -> None:
        """A push went straight into this node's shared memory: rows its server sent before it next
        hears from us may lack it."""
        streams, here = self.worker.streams, self.worker.node
        handled = streams.handled(here)
        self._local_writes = [w for w in self._local_writes if w[0] > handled]
        self._local_writes.append((streams.next_seq(here), keys, values))

    def keep(self, node: int, msg: Message, keys: np.ndarray, rows: np.ndarray, pushed: bool = False) -> None:
        """Cache rows server ``node`` sent (in reply, or ``pushed`` unasked), with this worker's pushes
        they do not include yet added back."""
        seen = msg.body.get("seen")
        handled = self.worker.streams.handled(node)
        # An answer to a request sent before the cache was forgotten may have been read before the
        # eager message that went missing (the server's later eager messages follow that one).
        early = not pushed and isinstance(seen, int) and seen < self._floor.get(node, 0)
        if not isinstance(seen, int) or seen < handled or early:
            if pushed:
                self.rows.drop(keys)  # the bump that follows must not vouch for the rows held now
            return  # read before a push of ours that is acknowledged since (it would miss it), or early
        stored = self.rows.store(keys, rows, msg.clock, msg.epoch, seen, pushed)
        if not stored.size:
            return
        if self._local_writes and node == self.worker.node:
            self._local_writes = [w for w in self._local_writes if w[0] > handled]
            for marker, written, values in self._local_writes:
                if marker > seen:  # written in shared memory after the server read these rows
                    self._reapply(stored, written, values)
        for server, seq, written, values in self._pending():
            if server == -1 or (server == node and seq > seen):  # nowhere yet, or after the server read
                self._reapply(stored, written, values)
            elif server != node:
                # Sent to another server, now rows of ``node``: its slice moved, and the rows hold the
                # push if that server applied it before the slice left (its answer lost or late). Which
                # is not known here, so those rows are not kept.
                self.rows.drop(written[np.isin(written, stored)])
            else:
                # Handled there before it read these rows, yet not answered (the answer was lost): it
                # was applied, or refused because a slice of it had moved ("seen" counts both). Which
                # one is not known here, so its rows are not kept: a later read asks for them.
                self.rows.drop(written)

    def _reapply(self, stored: np.ndarray, keys: np.ndarray, values: np.ndarray) -> None:
        mask = np.isin(keys, stored)
        if mask.any():
            self._change(keys[mask], values[mask])

    def _change(self, keys: np.ndarray, values: np.ndarray) -> None:
        if self._scale is None:
            self.rows.drop(keys)
        else:
            self.rows.add(keys, values, self._scale)

    # ------------------------------------------------------------ reads

    def serve(self, keys: np.ndarray, shard: np.ndarray, pos: Positions, total: int, out: np.ndarray) -> Positions:
        """Fill ``out`` at ``pos`` (all ``total`` positions: None) from rows fresh enough for this
        worker's clock; returns the positions still to pull."""
        self.worker.tracker.pump(0)  # apply rows servers pushed eagerly since the last call
        versions = self.rows.versions(keys, shard)
        clock = self.worker.clock
        schemes = self.schemes
        # A row never fetched (version -1) is never fresh.
        required = np.maximum(clock - (schemes.bounds[0] if schemes.uniform else schemes.bounds[shard]), 0)
        fresh = versions >= required
        if not fresh.all() and (versions >= 0).any():
            eager = schemes.eager[0] if schemes.uniform else schemes.eager[shard]
            if np.any(eager & ~fresh & (versions >= 0)):
                versions = self._await_eager(keys, shard, required, eager)
                fresh = versions >= required
        hits = int(np.count_nonzero(fresh))
        if not hits:
            return pos
        where = np.arange(total) if pos is None else pos
        out[where[fresh]] = self.rows.values[keys[fresh]]
        self.staleness.record(clock - versions[fresh])
        self.counters["rows_from_cache"] += hits
        return where[~fresh]

    def _await_eager(self, keys: np.ndarray, shard: np.ndarray, required: np.ndarray,
                     eager: np.ndarray | np.bool_) -> np.ndarray:
        """ESSP: rows this worker caches come to it when the slowest clock advances, so
        wait for that push instead of asking; rows not cached are pulled as usual, and so are
        rows dropped while we wait (a pushed row older than our acknowledged pushes is dropped:
        no push will vouch for it again)."""
        # A push that does not come (a server's reply queue was full, say) ends in a pull.
        deadline = time.monotonic() + min(self.worker.cluster.timeouts.request_s, EAGER_WAIT_S)
        versions = self.rows.versions(keys, shard)
        self.counters["reads_awaiting_push"] += 1
        while (eager & (versions >= 0) & (versions < required)).any():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break  # the stale rows are pulled instead; the pull names the server if it is gone
            self.worker.tracker.pump(min(remaining, _EAGER_GAP_S))
            self._drop_lost()  # a push held behind a lost one would never come
            versions = self.rows.versions(keys, shard)
        return versions

    def on_server_rows(self, msg: Message) -> None:
        """Rows a server pushed unasked (ESSP): refresh the cache, and the clock of every cached row."""
        keys, rows = msg.arrays
        if rows.shape[1:] != (self.spec.dim,) or rows.dtype != self.dtype:
            raise ProtocolError(f"server pushed rows of shape {rows.shape} {rows.dtype} for table "
                                f"{self.spec.name!r}")
        self.counters["eager_messages"] += 1
        self.counters["eager_rows"] += keys.shape[0]
        body = bodies.Rows.of(msg)
        if body.seq is None:
            self._take_pushed(msg, body)
            return
        # Each message holds the rows changed since the one before, and "rows not resent did not
        # change" holds only once every earlier message is in: take them whole and in order (an
        # earlier one arriving late would put older rows over newer ones of the same "seen"), and
        # forget the cache if one never comes (it was lost). One older than those taken is stale.
        stream = (msg.sender, str(body.series))
        expected = self._eager_next.get(stream, 1)
        pending = self._eager_pending.setdefault(stream, {})
        if body.seq >= expected:
            pending[body.seq] = msg
        while expected in pending:
            held = pending.pop(expected)
            self._take_pushed(held, bodies.Rows.of(held))
            expected += 1
        self._eager_next[stream] = expected
        if not pending:
            self._eager_gap_since.pop(stream, None)
        elif len(pending) > _EAGER_GAP:
            self._lost(stream)
        else:
            self._eager_gap_since.setdefault(stream, time.monotonic())
        self._drop_lost()

    def _drop_lost(self) -> None:
        """Take a message missing behind a later one of its stream for ``_EAGER_GAP_S`` as lost."""
        if not self._eager_gap_since:
            return
        now = time.monotonic()
        for stream, since in list(self._eager_gap_since.items()):
            if now - since > _EAGER_GAP_S:
                self._lost(stream)

    def _lost(self, stream: tuple[int, str]) -> None:
        """A message of ``stream`` never came: forget the cache (what it vouched for is unknown) and
        go on from the messages that came after it."""
        pending = self._eager_pending[stream]
        self.counters["eager_gaps"] += 1
        self.forget()
        self._eager_next[stream] = max(pending) + 1
        pending.clear()
        self._eager_gap_since.pop(stream, None)

    def _take_pushed(self, msg: Message, body: bodies.Rows) -> None:
        keys, rows = msg.arrays
        self.keep(msg.sender, msg, keys.astype(np.int64, copy=False), rows, pushed=True)
        # Only the slices this worker reads under ESSP: only their cached rows are the server's subscribed ones.
        eager = self.schemes.eager
        self.rows.bump([int(s) for s in body.shards if 0 <= s < eager.shape[0] and eager[s]], msg.clock)
