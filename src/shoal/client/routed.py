"""Keys sent where a worker believes they are, and "moved" followed: one protocol for every table
whose keys can move (static slices, adaptive keys).

A server answers the keys of a pull or push that it does not hold "moved" (``wire.schema.Moved``):
nothing was applied or read at their positions, and it may say where it believes each key is now.
The access learns where they are (``_learn`` from the answer: an adaptive table notes the owners
in its location cache and goes to a key's home after two hops; ``_find_moved`` before sending
again: a static table asks the rendezvous for its layout, whose epochs order the moves), then sends
the refused parts again: a push at once, in the background after the receive that brought the
answer (it must land before this worker's later reads and fences), a read when its caller waits,
since a read may wait for its bound and the background must never wait. A call whose keys keep
moving gives up after the request timeout with ``SliceMovedError``; from its third attempt its
reads back off a little, to let a move settle.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from shoal.api.errors import ClosedError, ClusterError, RequestTimeoutError, ShoalError, SliceMovedError
from shoal.client.access import TableAccess
from shoal.client.calls import READS, WRITES, Call, Part, Positions, Rows
from shoal.client.context import TableView
from shoal.client.replica_view import WATCH_AFTER_S
from shoal.cluster.requests import Future
from shoal.placement.layout import TableLayout
from shoal.storage.shard import ShardStore
from shoal.wire.message import Message
from shoal.wire.ops import Op
from shoal.wire.schema import Moved

_FAILED_KEPT = 64  # failed calls kept for ``take_unobserved_error`` between its looks


class RoutedAccess(TableAccess):
    """Calls, their futures, and the "moved → learn where → send again" protocol; a kind routes."""

    def __init__(self, table: TableView, layout: TableLayout, local: dict[int, ShardStore] | None = None) -> None:
        super().__init__(table.name, layout, local)
        self.spec = table.spec
        self.worker = table.worker
        self.dtype = np.dtype(self.spec.dtype)
        self.counters = table.counters
        #: calls with parts answered "moved", waiting to be sent again
        self._moved_calls: list[Call] = []
        #: calls that failed since ``take_unobserved_error`` last looked
        self._failed: list[Call] = []

    # ------------------------------------------------------ what a kind does

    def _resend(self, call: Call, positions: np.ndarray, op: Op) -> None:
        """Send the keys of ``call`` at ``positions`` where they are believed to be now."""
        raise NotImplementedError

    def _learn(self, keys: np.ndarray, owners: np.ndarray) -> None:
        """A server said ``keys`` moved, and where it believes each is now (-1: not known)."""

    def moved_on_from(self, epoch: int) -> bool:
        """Whether keys routed by the map of ``epoch`` may be elsewhere now (kinds with one map)."""
        return False

    def _find_moved(self) -> None:
        """Before parts answered "moved" are sent again: learn where keys are now, if answers do not say."""

    def _before_reread(self) -> None:
        """Before a read is sent again: what must land first (a kind's pushes sent by an older map)."""

    # ---------------------------------------------------------------- calls

    def _fail(self, call: Call, error: ShoalError) -> None:
        """``call`` failed with ``error`` (its first error is the one raised)."""
        if call.error is not None:
            return
        call.error = error
        self._failed.append(call)
        if len(self._failed) > _FAILED_KEPT:  # nobody asks: keep the latest unobserved ones
            self._failed = [c for c in self._failed if not c.observed][-_FAILED_KEPT:]

    def _ended_unanswered(self, call: Call, part: Part) -> None:
        """A part's request ended with neither a reply nor an error: given up at a timeout
        (``wait_all``), or the worker was closed. Its call fails: its rows were never read."""
        if part.answered:
            return
        what = f"{part.op.name} of {self.spec.name!r} to server {part.node}"
        self._fail(call, ClosedError(f"the worker was closed before the {what} was answered")
                   if self.worker.tracker.closed else RequestTimeoutError(f"the {what} was given up unanswered"))

    def take_unobserved_error(self) -> ShoalError | None:
        failed, self._failed = self._failed, []
        return next((c.error for c in failed if not c.observed), None)

    def _call(self, op: Op, keys: np.ndarray, values: np.ndarray | None, result: Rows | None) -> Call:
        return Call(op, keys, values, result, self.worker.clock, self.reread, self.watch_servers, self.worker.now())

    def _rows(self, n: int, out: np.ndarray | None) -> Rows:
        return Rows(n, self.spec.dim, self.dtype, out)

    def _future(self, call: Call) -> Future[Any]:
        if call.finished():
            return Future.completed(call.outcome)
        return Future(self.worker.tracker, call, call.outcome, self.worker.cluster.timeouts.request_s)

    def _take_answer(self, call: Call, part_positions: Positions, keys: np.ndarray, op: Op, reply: Message) -> int:
        """Queue what ``reply`` to a part of ``call`` (its ``keys``, at ``part_positions``) says moved,
        place the rows it read; how many keys it served."""
        moved = Moved.in_reply(reply, keys.shape[0])
        if moved is not None:
            self._learn(keys[moved.positions], moved.owners)
            # A push that went in with only its read refused is not sent again: it would count twice.
            self.refused(call, call.positions(part_positions)[moved.positions], Op.PULL if moved.pushed else op)
        served = keys.shape[0] - (0 if moved is None else moved.positions.shape[0])
        if op in READS and served:
            assert call.result is not None
            if moved is None and part_positions is None:
                call.result.take_whole(reply)
            elif moved is None:
                call.result.place(call.positions(part_positions), reply)
            else:
                keep = np.ones(keys.shape[0], dtype=np.bool_)
                keep[moved.positions] = False
                call.result.place(call.positions(part_positions), reply, keep)
        return served

    # ---------------------------------------------------------------- moved

    def refused(self, call: Call, positions: np.ndarray, op: Op) -> None:
        """Nothing of ``op`` was done at ``positions`` of ``call``: they go where their keys are now."""
        call.moved.append((positions, op))
        if call not in self._moved_calls:
            self._moved_calls.append(call)

    def after_receive(self) -> None:
        """Send the parts answered "moved" where their keys are now (never waits for a bound)."""
        if self._moved_calls:
            self._resend_moved()

    def _resend_moved(self) -> None:
        calls = list(self._moved_calls)
        try:
            self._find_moved()  # answers meanwhile still find the refused pushes in _moved_calls
        except ShoalError as exc:
            for call in calls:
                call.moved.clear()
                self._fail(call, exc)
            self._moved_calls = [c for c in self._moved_calls if c not in calls]
            return
        for call in calls:
            if self._gave_up(call):
                call.moved.clear()
            else:
                self.counters["moved_retries"] += 1
                self._send_moved_again(call)
        self._moved_calls = [c for c in self._moved_calls if c.moved]  # refused again while sent: next round

    def _send_moved_again(self, call: Call) -> None:
        """Send the parts of ``call`` answered "moved" where their keys are now. Each stays in
        ``call.moved`` until it is sent: answers "moved" come in the order the requests were sent,
        not by clock, and a message stamped while an earlier iteration's refused push waits its
        turn must not count that push as landed (its settled clock would promise a fenced server
        every push before it)."""
        for entry in list(call.moved):
            positions, op = entry
            if op in READS:
                call.rereads.append(positions)  # after its push, if it has one: the stream keeps the order
            if op in WRITES:
                try:
                    self._resend(call, positions, Op.PUSH)
                except ShoalError as exc:
                    self._fail(call, exc)
            call.moved = [m for m in call.moved if m is not entry]

    def reread(self, call: Call) -> None:
        """The waiter of ``call`` reads again the rows answered "moved", where they are now."""
        positions = np.concatenate(call.rereads)
        call.rereads.clear()
        if self._expired(call):  # counted as an attempt when it was answered "moved" (``_resend_moved``)
            return
        if call.attempts > 2:
            time.sleep(min(0.005 * 2 ** call.attempts, 0.1))  # keys moving again and again: let them settle
        try:
            self._before_reread()
            self._resend(call, positions, Op.PULL)
        except ShoalError as exc:
            self._fail(call, exc)

    def _gave_up(self, call: Call) -> bool:
        """Count another attempt of ``call``; whether it is over (``_expired``)."""
        call.attempts += 1
        return self._expired(call)

    def _expired(self, call: Call) -> bool:
        """Whether ``call`` failed, or its keys kept moving past the request timeout (it fails now)."""
        if call.error is None and self.worker.now() - call.started > self.worker.cluster.timeouts.request_s:
            self._fail(call, SliceMovedError(
                f"keys of {self.spec.name!r} kept moving for {self.worker.cluster.timeouts.request_s:.0f}s: "
                f"sent {call.attempts} times"))
        return call.error is not None

    def watch_servers(self, call: Call) -> None:
        """While ``call`` waits: a server that died since it was sent fails its parts now, naming it,
        instead of after the request timeout; one that left sends what it never read elsewhere."""
        view = self.worker.replica_view
        if not call.parts or self.worker.now() - call.started < WATCH_AFTER_S:
            return
        view.refresh()  # at most once a second
        self.worker.follow_departures()
        for req, part in list(call.parts.items()):
            if part.node in view.exited:
                if part.op == Op.PULL and self.moved_on_from(part.epoch):
                    # A read (done again at no cost) whose slice may have left the server before it
                    # died: sent where the rows are now (or failed there, if they died with it).
                    part.answered = True
                    self.refused(call, call.positions(part.positions), Op.PULL)
                    self.worker.tracker.forget(req)
                    continue
                self._fail(call, ClusterError(
                    f"server {part.node} died while a {part.op.name} of {self.spec.name!r} waited for it: the "
                    "rows it held are gone"))
                self.worker.tracker.forget(req)
