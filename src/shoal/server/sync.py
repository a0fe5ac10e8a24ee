"""A server's synchronisation: worker clocks, held pulls, and eager pushes (DESIGN.md §4).

Every message from a worker carries its clock; the server learns clocks from
pushes, pulls and clock ticks alike and decides on its own, per table, when a
pull may be answered. Pulls released together for the same keys are gathered
and serialised once.
"""

from __future__ import annotations

import logging
import secrets
from collections import Counter
from collections.abc import Callable

import numpy as np

from shoal.api.errors import RequestTimeoutError, ShoalError
from shoal.consistency.clocks import ClockTable
from shoal.server.tables import ServedTable, SliceMoving
from shoal.storage.validate import as_keys
from shoal.wire.message import Message
from shoal.wire.ops import Op

log = logging.getLogger(__name__)

_WORKER_OPS = (Op.PULL, Op.PUSH, Op.PUSH_PULL, Op.CLOCK)

Send = Callable[[bytes, Message], None]


class Synchroniser:
    """Clocks, held pulls and subscriptions for every table of one server."""

    def __init__(self, clocks: ClockTable, tables: dict[str, ServedTable], send: Send,
                 max_hold_s: float = 600.0, hold_for_move: Send | None = None) -> None:
        self.clocks = clocks
        self.tables = tables
        self.send = send
        #: where a released pull goes when its slice is on its way to another server
        self.hold_for_move = hold_for_move
        self.max_hold_s = max_hold_s
        self.peers: dict[int, bytes] = {}  # worker rank -> its connection, for eager pushes
        self._rows_seq: Counter[tuple[int, str]] = Counter()  # eager messages sent per (worker, table)
        self._stream = secrets.token_hex(4)  # a restarted server numbers its messages afresh
        self.stats: Counter[str] = Counter()

    def held_count(self) -> int:
        """Pulls waiting for their staleness bound (or lazy deadline), over all tables."""
        return sum(len(t.controller.held) for t in list(self.tables.values()))

    def observe(self, peer: bytes, msg: Message) -> None:
        """Learn the sender's clock from any worker message; act if the slowest clock moved."""
        if msg.op not in _WORKER_OPS or not 0 <= msg.sender < self.clocks.num_workers:
            return
        if msg.op == Op.CLOCK and msg.body.get("final"):
            self.peers.pop(msg.sender, None)  # it has left: nothing more to push to it
            advanced = self.clocks.finish(msg.sender)
        else:
            self.peers[msg.sender] = peer
            advanced = self.clocks.observe(msg.sender, msg.clock)
        if advanced:
            self.stats["clock_advances"] += 1
            for table in self.tables.values():
                self._release(table)
                self._push_eagerly(table)

    def pull(self, table: ServedTable, peer: bytes, msg: Message) -> Message | None:
        """Answer now, or hold the pull (None) until the table's bound allows it.

        Keys are checked before a pull is held, so a held pull can always be served.
        """
        keys = as_keys(msg.arrays[0], table.spec)
        parts = table.split(keys)
        if table.controller.admit((peer, msg), msg.sender, msg.clock):
            return self._serve(table, msg, table.pull(keys, parts))
        return None

    def after_push(self, table: ServedTable) -> None:
        if table.controller.held and table.spec.consistency.lazy is not None:
            self._release(table)

    def tick(self) -> None:
        """Release pulls whose lazy wait ran out; fail those held so long their requester gave up."""
        for table in self.tables.values():
            if not table.controller.held:
                continue
            self._release(table)
            for pull in table.controller.expire(self.max_hold_s):
                peer, msg = pull.item
                behind = self.clocks.behind(pull.required) if pull.required is not None else []
                error = RequestTimeoutError(f"pull of {table.spec.name!r} at clock {pull.clock} held "
                                            f"{self.max_hold_s:.0f}s waiting for worker(s) {behind}")
                self.stats["held_pulls_expired"] += 1
                self.send(peer, msg.reply(Op.ERROR, {"code": error.code, "message": str(error)}))

    def next_deadline(self) -> float | None:
        deadlines = [d for t in self.tables.values() if (d := t.controller.next_deadline()) is not None]
        return min(deadlines) if deadlines else None

    # ------------------------------------------------------------- internals

    @staticmethod
    def _values(table: ServedTable, msg: Message) -> np.ndarray:
        return table.pull(as_keys(msg.arrays[0], table.spec))

    def _serve(self, table: ServedTable, msg: Message, values: np.ndarray) -> Message:
        if 0 <= msg.sender < self.clocks.num_workers:  # only workers subscribe; ids are bounded
            table.subscribe(msg.sender, msg.arrays[0])
        reply = msg.reply(Op.VALUES, arrays=[values])
        reply.clock = min(self.clocks.slowest, msg.clock)  # the rows hold every update before this clock
        return reply

    def _release(self, table: ServedTable) -> None:
        released = table.controller.release()
        if not released:
            return
        by_keys: dict[bytes, np.ndarray] = {}
        for peer, msg in released:
            try:
                signature = msg.arrays[0].tobytes()
                values = by_keys.get(signature)
                if values is None:
                    values = by_keys[signature] = self._values(table, msg)
                else:
                    self.stats["shared_serialisations"] += 1
                self.stats["released_pulls"] += 1
                reply = self._serve(table, msg, values)
            except SliceMoving:
                if self.hold_for_move is not None:
                    self.hold_for_move(peer, msg)
                continue
            except ShoalError as exc:  # this pull fails alone; the others are still answered
                reply = msg.reply(Op.ERROR, {"code": exc.code, "message": str(exc)})
            self.send(peer, reply)

    def _push_eagerly(self, table: ServedTable) -> None:
        shards = sorted(table.stores)
        for update in table.eager_updates():
            peer = self.peers.get(update.worker)
            if peer is None:
                continue
            self.stats["eager_messages"] += 1
            self.stats["eager_rows"] += int(update.keys.shape[0])
            # Numbered per worker and table: a worker applies "the rest did not change" only in order.
            self._rows_seq[(update.worker, table.spec.name)] += 1
            body = {"shards": shards, "seq": self._rows_seq[(update.worker, table.spec.name)], "stream": self._stream}
            self.send(peer, Message(Op.ROWS, table=table.spec.name, clock=self.clocks.slowest, body=body,
                                    arrays=[update.keys, update.values]))
