"""A worker's access to an adaptive table: local rows in shared memory, the rest wherever they moved.

Rows present on this node (owned or replicated here) are read and updated in
shared memory, checking presence under the row locks so a row that moves away
is never written after it left. Requests for the other rows go to where the
worker's location cache says they live; keys answered "moved" are noted in the
cache with where they went and sent again (``client.routed``, the protocol static
slices follow too), after two hops to the key's home, which knows.
Intents are buffered and sent to the node's server at each clock tick (or when
``wait_local`` waits for their keys).
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import numpy as np

from shoal.api.errors import CheckpointError, RequestTimeoutError, ShoalError
from shoal.client.calls import READS, WRITES, Call, Part
from shoal.client.context import TableView
from shoal.client.in_place import InPlace
from shoal.client.routed import RoutedAccess
from shoal.cluster.requests import Future
from shoal.placement.layout import TableLayout
from shoal.placement.ownership import LocationCache
from shoal.storage import checkpoint
from shoal.storage.kernels import ABSENT, any_shared
from shoal.storage.rules import rule_for
from shoal.storage.shard import ShardStore
from shoal.wire.message import Message
from shoal.wire.ops import Op


class AdaptiveAccess(RoutedAccess):
    """Pull, push, localize and intent for one adaptive table."""

    def __init__(self, table: TableView, layout: TableLayout, store: ShardStore | None) -> None:
        super().__init__(table, layout)
        self.store = store  # None in classic mode: every row is asked for
        self._dead_stores: list[ShardStore] = []  # mapped from a server that died: unmapped on close
        #: pushes sent to other nodes, maybe not acknowledged yet, with the keys they sent there
        self._pushes_open: list[tuple[Call, np.ndarray]] = []
        self.hints = LocationCache(self.spec.num_keys, self.worker.num_nodes)
        #: where this node's server believes keys live (None in classic mode)
        self.node_hints = store.location if store is not None else None
        self._row_bytes = self.spec.dim * self.dtype.itemsize
        self._intents: list[tuple[np.ndarray, int, int]] = []
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
        self._after_own_pushes(keys)
        rows = np.empty((keys.shape[0], self.spec.dim), dtype=self.spec.dtype) if out is None else out
        if self.store is not None:
            pos = self.store.read_present(keys, rows)
            self.worker.check_local_server(f"a pull of {self.spec.name!r}")
            self.counters["rows_local"] += keys.shape[0] - pos.shape[0]
        else:
            pos = np.arange(keys.shape[0])
        if not pos.size:
            return Future.done_with(rows)
        call = self._call(Op.PULL, keys, None, self._rows(keys.shape[0], rows))
        self._send(call, pos, Op.PULL)
        return self._future(call)

    def push(self, keys: np.ndarray, values: np.ndarray) -> Future[None]:
        if self.store is not None:
            pos = self.store.update_present(keys, values, self.scale)
            self.worker.check_local_server(f"a push to {self.spec.name!r}")
            self.counters["rows_local"] += keys.shape[0] - pos.shape[0]
        else:
            pos = np.arange(keys.shape[0])
        if not pos.size:
            return Future.done_with(None)
        call = self._call(Op.PUSH, keys, values, None)
        self._send(call, pos, Op.PUSH)
        self._pushes_open.append((call, keys[pos]))
        return self._future(call)

    def _after_own_pushes(self, keys: np.ndarray) -> None:
        """Read-your-writes: a read of keys this worker pushed to other nodes waits for those pushes'
        acknowledgements. Adaptive requests travel outside the workers' ordered streams (a key's
        owner changes under them): a read sent after a push could overtake it, or, the key come here
        meanwhile, read this node's row before the push reached it (the push lost once and sent
        again, or slow on its way to the key's old owner)."""
        if not self._pushes_open:
            return
        self._pushes_open = [(c, sent) for c, sent in self._pushes_open if not c.finished()]
        for call, sent in self._pushes_open:
            if not call.finished() and any_shared(sent, keys):
                try:
                    self.worker.tracker.wait_until(call.finished, call.awaited,
                                                   self.worker.cluster.timeouts.request_s, call.step)
                except RequestTimeoutError:
                    pass  # the push failed (its own future says so): this read does not

    def in_place(self, keys: np.ndarray) -> InPlace:
        if self.store is not None:
            self.worker.check_local_server(f"rows of {self.spec.name!r} in place")
        return InPlace(self.spec.name, self.store, keys, self.spec.dim, self.dtype, self.counters,
                       check=self.worker.check_local_server)

    def localize(self, keys: np.ndarray) -> None:
        """Ask for ``keys`` to live on this worker's node (asynchronous)."""
        self.worker.tracker.notify(self.worker.node, Message(Op.LOCALIZE, table=self.spec.name, arrays=[keys]))

    def intent(self, keys: np.ndarray, start: int, end: int) -> None:
        """Declare that ``keys`` will be used in clocks ``[start, end)``; sent at the next clock tick."""
        self._intents.append((keys, start, end))
        self.worker.intents_declared = True

    def wait_local(self, keys: np.ndarray, timeout: float) -> int:
        """Wait until ``keys`` are present on this node or ``timeout`` seconds pass; how many are not.

        Intents declared so far go to this node's server first (they would wait for the next clock
        tick), which brings their keys here by the clocks they start at. Presence is read in shared
        memory: waiting sends nothing.
        """
        self.worker.send_intents()
        if self.store is None:
            return int(keys.shape[0])  # classic mode: no row is ever read here
        presence = self.store.presence
        assert presence is not None  # an adaptive store has one
        deadline = time.monotonic() + timeout
        pause = 0.0005
        while True:
            self.worker.check_local_server(f"waiting for keys of {self.spec.name!r}")
            absent = int(np.count_nonzero(presence[keys] == ABSENT))
            if absent == 0 or time.monotonic() >= deadline:
                return absent
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.02)

    def lose_local(self) -> None:
        # Unmapped when the table closes, not now: a block in place (or a call under way) may still
        # hold the dead server's rows.
        if self.store is not None:
            self._dead_stores.append(self.store)
        self.store = self.node_hints = None

    def close(self) -> None:
        """Unmap this node's rows (the worker shuts down): a process that outlives its job (a notebook,
        an actor) kept every adaptive table's memory mapped."""
        for store in [*self._dead_stores, *([self.store] if self.store is not None else [])]:
            store.close()
        self._dead_stores = []
        self.store = self.node_hints = None

    def take_intents(self) -> list[tuple[np.ndarray, int, int]]:
        intents, self._intents = self._intents, []
        if self.worker.num_nodes == 1:  # every key lives here already: nothing to act on
            self.counters["intents_skipped"] += len(intents)
            return []
        self.counters["intents_sent"] += len(intents)
        return intents

    # --------------------------------------------------------- checkpoints

    @property
    def settles(self) -> bool:
        return True  # replicas' changes on their way to the keys' owners

    def check_checkpoint(self, parts: list[dict[str, Any]], staging: Path) -> None:
        """Each key written once, by its owner (none moved meanwhile)."""
        num_keys = self.spec.num_keys
        keys = np.concatenate([checkpoint.part_keys(staging, p) for p in parts]) if parts else np.empty(0, np.int64)
        counts = np.bincount(keys, minlength=num_keys) if keys.size else np.zeros(num_keys, np.int64)
        if counts.shape[0] != num_keys or (counts != 1).any():
            raise CheckpointError(f"keys of {self.name!r}: {int((counts == 0).sum())} written by no server, "
                                  f"{int((counts > 1).sum())} by several (a key moved during the checkpoint)")

    # -------------------------------------------------------------- routing

    def _resend(self, call: Call, positions: np.ndarray, op: Op) -> None:
        self._send(call, positions, op)

    def _learn(self, keys: np.ndarray, owners: np.ndarray) -> None:
        self.hints.learn(keys, owners)

    def _send(self, call: Call, pos: np.ndarray, op: Op) -> None:
        """The keys of ``call`` at ``pos`` to where the location cache says they are, after
        ``call.attempts`` answers "moved" (two hops on hints, then the key's home)."""
        keys = call.keys
        where = self.hints.route(keys[pos], call.attempts)
        if call.attempts == 0 and self.node_hints is not None:
            # A key absent here that this worker's cache places here has left: this node's server
            # handed it over (or heard where it went) and knows where it is (one hop saved).
            stale = where == self.worker.node
            where[stale] = self.node_hints[keys[pos[stale]]]
        for node in np.unique(where):
            part_pos = pos[where == node]
            arrays = [keys[part_pos]]
            if op in WRITES:
                assert call.values is not None
                arrays.append(call.values[part_pos])
            msg = Message(op, table=self.spec.name, clock=self.worker.clock, arrays=arrays)
            part = Part(int(node), 0, part_pos, 0, op)
            reply_bytes = part_pos.shape[0] * self._row_bytes if op in READS else 0
            part.req = self.worker.tracker.request(
                int(node), msg, functools.partial(self._on_reply, call, part, arrays[0]),
                f"{op.name} of {part_pos.shape[0]} key(s) of {self.spec.name!r}", reply_bytes=reply_bytes,
                on_error=functools.partial(self._on_error, call, part),
                on_end=functools.partial(self._on_end, call, part))
            call.parts[part.req] = part
            self.counters["requests"] += 1

    def _on_reply(self, call: Call, part: Part, keys: np.ndarray, msg: Message) -> None:
        part.answered = True
        self.counters["rows_remote"] += self._take_answer(call, part.positions, keys, part.op, msg)

    def _on_error(self, call: Call, part: Part, error: ShoalError) -> None:
        part.answered = True
        self._fail(call, error)

    def _on_end(self, call: Call, part: Part) -> None:
        call.parts.pop(part.req, None)
        self._ended_unanswered(call, part)
