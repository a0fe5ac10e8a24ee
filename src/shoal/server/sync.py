"""A server's synchronisation: worker clocks, held pulls, and eager pushes (DESIGN.md §4).

Every message from a worker carries its clock; the server learns clocks from
pushes, pulls and clock ticks alike and decides on its own, per table, when a
pull may be answered. Pulls released together for the same keys are gathered
and serialised once.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable

import numpy as np

from shoal.api.consistency import Consistency, consistency_from_dict
from shoal.api.errors import ConfigError, ProtocolError, RequestTimeoutError, ShoalError, SliceMovedError
from shoal.consistency.clocks import FINISHED, ClockTable
from shoal.server.streams import position_of, settled_of
from shoal.server.tables import ServedTable, SliceMoving, moved_answer
from shoal.storage.validate import as_keys
from shoal.wire import bodies
from shoal.wire.message import Message
from shoal.wire.ops import Op

log = logging.getLogger(__name__)

_WORKER_OPS = (Op.PULL, Op.PUSH, Op.PUSH_PULL, Op.CLOCK, Op.CONFIRM)
_FENCE_AGAIN_S = 0.5  # a fenced worker that has not confirmed is told again this often

Send = Callable[[bytes, Message], None]


class Synchroniser:
    """Clocks, held pulls, subscriptions and fences for every table of one server."""

    def __init__(self, clocks: ClockTable, tables: dict[str, ServedTable], send: Send,
                 max_hold_s: float = 600.0, hold_for_move: Send | None = None,
                 seen: Callable[[int], int] = lambda worker: 0, now: Callable[[], float] = time.monotonic) -> None:
        self.clocks = clocks
        self.tables = tables
        self.send = send
        #: where a released pull goes when its slice is on its way to another server
        self.hold_for_move = hold_for_move
        #: the highest request of a worker handled here: rows sent to it include its pushes up to there
        self.seen = seen
        self.now = now
        self.max_hold_s = max_hold_s
        self.peers: dict[int, bytes] = {}  # worker rank -> its connection, for eager pushes
        self._rows_seq: Counter[tuple[int, str]] = Counter()  # eager messages sent per (worker, table)
        self._stream = secrets.token_hex(4)  # a restarted server numbers its messages afresh
        #: per worker and table, the latest fence awaiting its confirmation: the table's epoch here then,
        #: and the move that brought it there (``ServedTable.last_move``)
        self.fences: dict[int, dict[str, tuple[int, tuple[int, int] | None]]] = {}
        #: (worker, table): a push of it was refused here and comes back; its reads wait for it
        self.refusing: set[tuple[int, str]] = set()
        self._fence_told: dict[int, float] = {}
        #: per worker, the incarnation of its stream last heard (a later one: the worker was started again)
        self._incarnations: dict[int, int] = {}
        self.stats: Counter[str] = Counter()

    def held_count(self) -> int:
        """Pulls waiting for their staleness bound (or lazy deadline), over all tables."""
        return sum(len(t.controller.held) for t in list(self.tables.values()))

    def observe(self, peer: bytes, msg: Message) -> None:
        """Learn the sender's clock from a tick, or from a request about a table synchronised here (in
        the worker's stream, ``server.streams``: handled after every earlier one, so a clock counts after
        the pushes of the clocks before it); act if the slowest clock moved. A request about an adaptive
        or replicated table is outside the stream, handled as it arrives: its clock would overtake a
        push of an earlier clock sent again after a loss."""
        if msg.op not in _WORKER_OPS or not 0 <= msg.sender < self.clocks.num_workers:
            return
        position = position_of(msg)
        if msg.op != Op.CLOCK and msg.table not in self.tables:
            self.peers[msg.sender] = peer
            return
        known = self._incarnations.get(msg.sender)
        if position is not None and known is not None and position.incarnation > known:
            self.clocks.restart(msg.sender, msg.clock, min(position.settled, msg.clock))  # started again
        if position is not None and (known is None or position.incarnation > known):
            self._incarnations[msg.sender] = position.incarnation
        if msg.op == Op.CLOCK and bodies.Clock.of(msg).final:
            self.peers.pop(msg.sender, None)  # it has left: nothing more to push to it
            self.fences.pop(msg.sender, None)  # it waited for all its pushes before leaving
            self.refusing = {(w, t) for w, t in self.refusing if w != msg.sender}
            advanced = self.clocks.finish(msg.sender)
        else:
            known = msg.sender in self.peers
            self.peers[msg.sender] = peer
            advanced = self.clocks.observe(msg.sender, msg.clock, settled_of(msg))
            if not known and msg.sender in self.fences:
                self._tell_fences(msg.sender)
        if advanced:
            self._advanced()

    def _advanced(self) -> None:
        self.stats["clock_advances"] += 1
        for table in self.tables.values():
            self._release(table)
            self._push_eagerly(table)

    # ------------------------------------------------------------- fences

    def adopted(self, table: str) -> None:
        """A slice of ``table`` moved here: under ESSP its subscribers get its changed rows now. Its
        previous owner left them to this one, and waiting for the slowest clock to advance again
        would keep readers waiting that are the slowest themselves."""
        served = self.tables.get(table)
        if served is not None:
            self._push_eagerly(served)

    def fence(self, table: str) -> None:
        """A slice of ``table`` moved here: a worker may still have pushes for it on their way elsewhere
        (routed by an older layout), to come here once refused. Count each worker only up to its settled
        clock until it confirms that it routes by this move and that those pushes landed."""
        for worker in range(self.clocks.num_workers):
            self.fence_worker(worker, table)

    def learn_clocks(self, learned: list[int], settled: list[int]) -> None:
        """What a slice's previous owner knew of every worker's clock, come with the slice: a server
        that joined the job hears nothing from a worker that left, or that works elsewhere, and held
        reads for it for good. Taken once ``fence`` counts each worker only up to its settled clock
        (as that server learnt it), so no push still on its way here is counted as in."""
        advanced = False
        for worker, (clock, done) in enumerate(zip(learned, settled, strict=True)):
            if clock >= FINISHED:
                self.fences.pop(worker, None)
                advanced |= self.clocks.finish(worker)
            else:
                advanced |= self.clocks.observe(worker, clock, done)
        if advanced:
            self._advanced()

    def refuse_reads(self, worker: int, table: str) -> None:
        """A push of ``worker`` was refused here because part of it moved away; the other part comes
        back here after its later requests. Fence its clock, and refuse its reads of ``table`` (which
        would miss that push) until it confirms: it reads again after sending the push again."""
        self.fence_worker(worker, table)
        if worker in self.fences:
            self.refusing.add((worker, table))

    def fence_worker(self, worker: int, table: str) -> None:
        """Count ``worker`` only up to its settled clock until it confirms that it routes ``table`` by
        this server's layout (its epoch now) and that its pushes routed before have landed.

        Every fence names the move behind that epoch, however it came about (a slice taken here,
        a push refused here): a worker must route by it before it confirms, even when the rendezvous
        has not recorded it yet. A confirmation without it would send the worker's next pushes for
        the slice where it was, while this server counted its clocks in full."""
        if not 0 <= worker < self.clocks.num_workers or self.clocks.learned[worker] >= FINISHED:
            return  # not a worker, or it has left, every push of it applied
        served = self.tables[table]
        epoch = served.layout.epoch
        held = self.fences.setdefault(worker, {})
        if table not in held or held[table][0] <= epoch:
            held[table] = (epoch, served.last_move)
        self.clocks.fence(worker)
        self.stats["fences"] += 1
        if worker in self.peers:
            self._tell_fences(worker)

    def confirm(self, worker: int, table: str, epoch: int) -> None:
        """``worker`` routes ``table`` by a layout of at least ``epoch`` and its pushes routed before
        have all landed."""
        held = self.fences.get(worker)
        if held is None or table not in held or held[table][0] > epoch:
            return
        del held[table]
        self.refusing.discard((worker, table))
        if held:
            return
        del self.fences[worker]
        if self.clocks.unfence(worker):
            self._advanced()

    def _tell_fences(self, worker: int) -> None:
        peer = self.peers.get(worker)
        if peer is None:
            return
        self._fence_told[worker] = self.now()
        for table, (epoch, move) in self.fences.get(worker, {}).items():
            shard, owner = (-1, -1) if move is None else move
            self.send(peer, bodies.Fence(epoch, shard, owner).to_message(table=table))

    def pull(self, table: ServedTable, peer: bytes, msg: Message) -> Message | None:
        """Answer now, or hold the pull (None) until the table's bound allows it.

        Keys are checked before a pull is held, so a held pull can always be served.
        """
        keys = as_keys(msg.arrays[0], table.spec)
        if (msg.sender, table.spec.name) in self.refusing:
            raise SliceMovedError(f"a push of worker {msg.sender} to {table.spec.name!r} was refused here; its "
                                  "reads are too until it has sent that push again where its slices are")
        parts = table.split(keys)
        if table.controller.admit((peer, msg), msg.sender, msg.clock, _model_of(table, msg)):
            return self._serve(table, msg, table.pull(keys, parts))
        return None

    def after_push(self, table: ServedTable) -> None:
        if table.controller.held and table.controller.holds_lazily():
            self._release(table)

    def tick(self) -> None:
        """Release pulls whose lazy wait ran out; fail those held so long their requester gave up;
        remind fenced workers (a one-way message may be lost)."""
        now = self.now()
        for worker in self.fences:
            if now - self._fence_told.get(worker, 0.0) > _FENCE_AGAIN_S:
                self._tell_fences(worker)
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
                self.send(peer, bodies.Error.about(error).reply_to(msg))

    def next_deadline(self) -> float | None:
        deadlines = [d for t in self.tables.values() if (d := t.controller.next_deadline()) is not None]
        return min(deadlines) if deadlines else None

    # ------------------------------------------------------------- internals

    @staticmethod
    def _values(table: ServedTable, msg: Message) -> np.ndarray:
        return table.pull(as_keys(msg.arrays[0], table.spec))

    def _serve(self, table: ServedTable, msg: Message, values: np.ndarray) -> Message:
        if 0 <= msg.sender < self.clocks.num_workers and _model_of(table, msg).eager:
            table.subscribe(msg.sender, msg.arrays[0])  # only workers subscribe; ids are bounded
        # The rows were read after this request (and its push, if it has one): they include it too.
        position = position_of(msg)
        seen = None if position is None else {"seen": max(self.seen(msg.sender), position.seq)}
        reply = msg.reply(Op.VALUES, seen, arrays=[values])
        reply.clock = min(self.clocks.slowest, msg.clock)  # the rows hold every update before this clock
        reply.epoch = table.layout.epoch  # a slice's later owners serve it at later epochs
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
            except SliceMovedError:
                reply = moved_answer(msg)
            except ShoalError as exc:  # this pull fails alone; the others are still answered
                reply = bodies.Error.about(exc).reply_to(msg)
            self.send(peer, reply)

    def _push_eagerly(self, table: ServedTable) -> None:
        # "Rows not resent did not change" covers the slices held here and not moving: a moving slice's
        # changed rows travel with it, and its new owner sends them.
        shards = sorted(s for s in table.stores if s not in table.moving)
        for update in table.eager_updates(lambda worker: worker in self.peers):
            peer = self.peers[update.worker]
            self.stats["eager_messages"] += 1
            self.stats["eager_rows"] += int(update.keys.shape[0])
            # Numbered per worker and table: a worker applies "the rest did not change" only in order.
            self._rows_seq[(update.worker, table.spec.name)] += 1
            body = bodies.Rows(shards, self._rows_seq[(update.worker, table.spec.name)], self._stream,
                               self.seen(update.worker))
            self.send(peer, body.to_message(table=table.spec.name, epoch=table.layout.epoch, clock=self.clocks.slowest,
                                            arrays=[update.keys, update.values]))


def _model_of(table: ServedTable, msg: Message) -> Consistency:
    """The model ``msg``'s reader holds the rows it reads to: the table's, unless it names another
    for the slices it reads (``consistency.schemes``)."""
    named = msg.body.get("consistency")
    if named is None:
        return table.spec.consistency
    try:
        return consistency_from_dict(named)
    except ConfigError as exc:
        raise ProtocolError(f"a read of {table.spec.name!r} names a model that is not one: {exc}") from None
