"""A worker's access to an adaptive table: local rows in shared memory, the rest wherever they moved.

Rows present on this node (owned or replicated here) are read and updated in
shared memory, checking presence under the row locks so a row that moves away
is never written after it left. Requests for the other rows go to where the
worker's location cache says they live; an answer "moved, try n" updates the
cache and the request follows, after two hops to the key's home, which knows.
Intents are buffered and sent to the node's server at each clock tick.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from shoal.api.errors import RequestTimeoutError
from shoal.client.access import TableAccess
from shoal.client.context import TableView
from shoal.cluster.requests import Future
from shoal.placement.layout import TableLayout
from shoal.placement.ownership import LocationCache
from shoal.storage import kernels
from shoal.storage.rules import rule_for
from shoal.storage.shard import ShardStore
from shoal.wire.message import Message
from shoal.wire.ops import Op

T = TypeVar("T")


class AdaptiveAccess(TableAccess):
    """Pull, push, localize and intent for one adaptive table."""

    def __init__(self, table: TableView, layout: TableLayout, store: ShardStore | None) -> None:
        super().__init__(table.name, layout)
        self.spec = table.spec
        self.worker = table.worker
        self.store = store  # None in classic mode: every row is asked for
        self.hints = LocationCache(self.spec.num_keys, self.worker.num_nodes)
        #: where this node's server believes keys live (None in classic mode)
        self.node_hints = store.location if store is not None else None
        self.counters = table.counters
        self._row_bytes = self.spec.dim * np.dtype(self.spec.dtype).itemsize
        self._intents: list[tuple[np.ndarray, int, int]] = []
        self._replies: dict[int, Message] = {}
        scale = rule_for(self.spec.optimizer).scale
        assert scale is not None  # adaptive tables have additive rules (TableSpec checks)
        self.scale = scale

    # ----------------------------------------------------------------- calls

    @property
    def presence(self) -> np.ndarray | None:
        return self.store.presence if self.store is not None else None

    @property
    def relocates(self) -> bool:
        return True

    def pull(self, keys: np.ndarray, out: np.ndarray | None) -> Future[np.ndarray]:
        rows = np.empty((keys.shape[0], self.spec.dim), dtype=self.spec.dtype) if out is None else out
        if self.store is not None:
            absent = self.store.read_present(keys, np.arange(keys.shape[0]), rows)
            self.worker.check_local_server(f"a pull of {self.spec.name!r}")
            pos = np.flatnonzero(absent)
            self.counters["rows_local"] += keys.shape[0] - pos.shape[0]
        else:
            pos = np.arange(keys.shape[0])
        if not pos.size:
            return Future.completed(lambda: rows)
        return self._remote(Op.PULL, keys, None, rows, pos, lambda: rows)

    def push(self, keys: np.ndarray, values: np.ndarray) -> Future[None]:
        if self.store is not None:
            absent = self.store.update_present(keys, values, self.scale)
            self.worker.check_local_server(f"a push to {self.spec.name!r}")
            pos = np.flatnonzero(absent)
            self.counters["rows_local"] += keys.shape[0] - pos.shape[0]
        else:
            pos = np.arange(keys.shape[0])
        if not pos.size:
            return Future.completed(lambda: None)
        return self._remote(Op.PUSH, keys, values, None, pos, lambda: None)

    def localize(self, keys: np.ndarray) -> None:
        """Ask for ``keys`` to live on this worker's node (asynchronous)."""
        self.worker.tracker.notify(self.worker.node, Message(Op.LOCALIZE, table=self.spec.name, arrays=[keys]))

    def intent(self, keys: np.ndarray, start: int, end: int) -> None:
        """Declare that ``keys`` will be used in clocks ``[start, end)``; sent at the next clock tick."""
        self._intents.append((keys, start, end))

    def lose_local(self) -> None:
        self.store = self.node_hints = None

    def on_clock(self) -> None:
        self.flush_intents()

    def flush_intents(self) -> None:
        if self.worker.num_nodes == 1:  # every key lives here already: nothing to act on
            self.counters["intents_skipped"] += len(self._intents)
            self._intents.clear()
            return
        for keys, start, end in self._intents:
            self.worker.tracker.notify(self.worker.node, Message(Op.INTENT, table=self.spec.name,
                                                                 body={"start": start, "end": end}, arrays=[keys]))
        self.counters["intents_sent"] += len(self._intents)
        self._intents.clear()

    # -------------------------------------------------------------- routing

    def _remote(self, op: Op, keys: np.ndarray, values: np.ndarray | None, out: np.ndarray | None,
                pos: np.ndarray, result: Callable[[], T]) -> Future[T]:
        """Send the keys at ``pos`` where the location cache says they are; waiting follows moved
        keys (at most two hops to their home, which knows), then returns ``result()``."""
        pending = self._send(op, keys, values, pos, 0)
        deadline = time.monotonic() + self.worker.cluster.timeouts.request_s

        def follow() -> None:
            nonlocal pending
            hops = 0
            while pending:
                replies = self._wait(pending, deadline)
                again: list[np.ndarray] = []
                for (sent_pos, _), reply in zip(pending, replies, strict=True):
                    moved = np.asarray(reply.body.get("moved", []), dtype=np.int64)
                    if out is not None and reply.op == Op.VALUES:
                        rows = reply.arrays[0]
                        keep = np.ones(sent_pos.shape[0], dtype=np.bool_)
                        keep[moved] = False
                        kernels.place_rows(out, sent_pos[keep], rows[keep])
                    if moved.size:
                        self.hints.learn(keys[sent_pos[moved]], np.asarray(reply.body["owners"], dtype=np.int64))
                        again.append(sent_pos[moved])
                    self.counters["rows_remote"] += sent_pos.shape[0] - moved.shape[0]
                if not again:
                    return
                hops += 1
                self.counters["moved_retries"] += 1
                if hops > 2:  # the key is on its way somewhere: give it a moment
                    time.sleep(0.001 * 2 ** min(hops - 3, 6))
                pending = self._send(op, keys, values, np.concatenate(again), hops)

        def finish() -> T:
            follow()
            return result()

        return Future.running(finish, lambda: self.worker.tracker.answered({req for _, req in pending}))

    def _send(self, op: Op, keys: np.ndarray, values: np.ndarray | None, pos: np.ndarray, hops: int
              ) -> list[tuple[np.ndarray, int]]:
        where = self.hints.route(keys[pos], hops)
        if hops == 0 and self.node_hints is not None:
            # A key absent here that this worker's cache places here has left: this node's server
            # handed it over (or heard where it went) and knows where it is (one hop saved).
            stale = where == self.worker.node
            where[stale] = self.node_hints[keys[pos[stale]]]
        sent = []
        for node in np.unique(where):
            part = pos[where == node]
            arrays = [keys[part]] if values is None else [keys[part], values[part]]
            msg = Message(op, table=self.spec.name, clock=self.worker.clock, body={"hops": hops}, arrays=arrays)
            what = f"{op.name} of {part.shape[0]} key(s) of {self.spec.name!r}"
            reply_bytes = part.shape[0] * self._row_bytes if values is None else 0
            req = self.worker.tracker.request(int(node), msg, self._keep, what, reply_bytes=reply_bytes)
            sent.append((part, req))
            self.counters["requests"] += 1
        return sent

    def _wait(self, pending: list[tuple[np.ndarray, int]], deadline: float) -> list[Message]:
        tracker = self.worker.tracker
        reqs = {req for _, req in pending}
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RequestTimeoutError(f"keys of {self.spec.name!r} kept moving until the request timeout")
        tracker.wait(reqs, remaining)
        replies = []
        for _, req in pending:
            error = tracker.take_error(req)
            if error is not None:
                raise error
            replies.append(self._replies.pop(req))
        return replies

    def _keep(self, msg: Message) -> None:
        self._replies[msg.req] = msg

