"""Moving slices of static tables between servers while training runs (DESIGN.md §3, QuanPS).

The rendezvous decides which slice goes where (a move asked for, the
rebalancer, a server joining or leaving) and hands the command to the owner in
its next heartbeat reply. The owner then:

1. marks the slice *moving*: requests for it are held, and co-located workers
   stop touching its shared memory (``ShardStore.retire``);
2. sends the rows, optimiser state and the ESSP subscriptions to the new owner
   in ``SLICE_STATE`` messages (chunked to the size limit); the new owner fences
   every worker's clock until the worker confirms that its pushes routed by the
   old layout have landed (``Synchroniser.fence``);
3. once the new owner has them, tells the rendezvous (``MOVE_DONE``), which
   bumps the table's epoch (the new owner tells it too, when it has every row:
   a move whose old owner dies or calls it failed after that is settled as
   done, and the layout names the server that holds the slice);
4. forgets the slice and answers every held request "moved": the worker
   refreshes its layout and sends them to the new owner.

Requests are held or refused whole, so nothing is applied twice or lost. A
move that fails (the new owner refuses it, or dies before answering) is undone:
the slice is served here again. A new owner that is alive but slow to answer
is waited for (its answer is asked for again until it comes): it takes the
slice with the last chunk, so undoing the move then would leave two servers
serving it, each with a share of the pushes.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shoal.api.config import ClusterSpec
from shoal.api.errors import ProtocolError, TableError
from shoal.api.ids import RENDEZVOUS
from shoal.cluster.requests import RequestTracker
from shoal.server.peers import PeerDirectory
from shoal.server.sync import Synchroniser
from shoal.server.tables import ServedTable
from shoal.storage.shard import ShardStore
from shoal.wire import bodies
from shoal.wire.message import Message
from shoal.wire.ops import Op
from shoal.wire.schema import is_int64

log = logging.getLogger(__name__)



@dataclass
class _Outgoing:
    table: str
    shard: int
    to: int
    epoch: int
    store: ShardStore | None = None
    reqs: set[int] = field(default_factory=set)
    report: int | None = None
    failed: bool = False
    handed: bool = False
    started: float = field(default_factory=time.monotonic)
    slow: bool = False  # the new owner has not answered within a request's timeout (said once)


@dataclass
class _Incoming:
    store: ShardStore
    subscribers: dict[int, np.ndarray]
    epoch: int
    #: rows whose chunk has come: chunks are requests of their own, served as they arrive, so the
    #: last may overtake one lost and sent again; the slice is taken once every row is in
    arrived: np.ndarray
    #: every worker's clock and settled clock as the old owner learnt them (with the last chunk)
    clocks: tuple[list[int], list[int]] | None = None


class SliceService:
    """Hands slices of this server's static tables to other servers, and takes them in."""

    def __init__(self, node: int, cluster: ClusterSpec, peers: PeerDirectory,
                 tables: dict[str, ServedTable], sync: Synchroniser, rendezvous: RequestTracker,
                 redispatch: Callable[[bytes, Message], None]) -> None:
        self.node = node
        self.cluster = cluster
        self.tables = tables
        self.sync = sync
        self.rendezvous = rendezvous
        self.redispatch = redispatch
        self.peers = peers
        self.outgoing: dict[tuple[str, int], _Outgoing] = {}
        self.incoming: dict[tuple[str, int], _Incoming] = {}
        #: requests for moving slices, answered when their move ends
        self.held: list[tuple[bytes, Message]] = []
        self.stats: Counter[str] = Counter()
        self.leave_requested = False
        #: ask the rendezvous again now: the next move of a table starts once the last one is known done
        self.heartbeat_now = False
        #: servers the rendezvous calls dead, or that left: a move to one of them is undone
        self.gone: set[int] = set()

    # ------------------------------------------------------------ commands

    def on_status(self, status: dict[str, Any]) -> None:
        """The moves the rendezvous wants this server to make."""
        self.gone = {n for n, alive in enumerate(status.get("alive") or []) if not alive}
        self.gone.update(int(n) for n in status.get("departed") or [])
        for cmd in status.get("moves") or []:
            if int(cmd["from"]) == self.node and (cmd["table"], int(cmd["shard"])) not in self.outgoing:
                self.start(str(cmd["table"]), int(cmd["shard"]), int(cmd["to"]), int(cmd["epoch"]))
        if self.node in (status.get("departed") or []) and not self.outgoing:
            self.leave_requested = True  # every slice is elsewhere now

    def start(self, name: str, shard: int, to: int, epoch: int) -> None:
        table = self.tables.get(name)
        if table is not None and table.layout.epoch >= epoch:
            return  # a command repeated by a heartbeat reply that crossed this move's end
        move = _Outgoing(name, shard, to, epoch)
        self.outgoing[(name, shard)] = move
        if table is None or shard not in table.stores or to not in self.peers.addresses:
            why = "no such table here" if table is None else (
                "slice not held here" if shard not in table.stores else f"server {to} unknown")
            log.warning("server %d: cannot move slice %d of %r to %d: %s", self.node, shard, name, to, why)
            move.failed = True
            self._report(move)
            return
        store = move.store = table.stores[shard]
        table.moving.add(shard)
        store.retire()
        table.mark_owed_changed(shard)
        self.stats["slices_sent"] += 1
        subscribers = table.subscribers(shard)
        ranks = sorted(subscribers)
        names = list(store.state_arrays())
        arrays = store.state_arrays()
        per_row = sum(a[:1].nbytes for a in arrays.values()) + len(ranks)
        chunk = max(1, self.cluster.limits.payload_bytes // max(per_row, 1))
        for first in range(0, max(store.num_rows, 1), chunk):
            last_row = min(store.num_rows, first + chunk)
            parts = [arrays[n][first:last_row] for n in names]
            parts += [subscribers[r][first:last_row].view(np.uint8) for r in ranks]
            last = last_row >= store.num_rows
            clocks = self.sync.clocks
            msg = bodies.SliceState(shard, epoch, first, store.num_rows, names, last, ranks,
                                    [int(c) for c in clocks.learned] if last else None,
                                    [int(c) for c in clocks.settled] if last else None,
                                    ).to_message(table=name, arrays=parts)
            move.reqs.add(self.peers.tracker.request(to, msg, _ignore, f"SLICE_STATE {name!r}/{shard} to server {to}"))

    def tick(self) -> None:
        """Advance moves: a handed-over slice is reported; one whose receiver is silent is undone."""
        if not self.outgoing:
            return
        self.peers.tracker.pump(0)
        for move in list(self.outgoing.values()):
            if move.report is not None:
                if self.rendezvous.done({move.report}) and (error := self.rendezvous.take_error(move.report)):
                    log.error("server %d: the rendezvous did not take the end of moving slice %d of %r: %s",
                              self.node, move.shard, move.table, error)
                    self._finish(move)
                continue
            if self.peers.tracker.done(move.reqs):
                errors = [e for r in sorted(move.reqs) if (e := self.peers.tracker.take_error(r))]
                if errors:
                    log.warning("server %d: server %d refused slice %d of %r: %s", self.node, move.to, move.shard,
                                move.table, errors[0])
                    move.failed = True
                else:
                    move.handed = True
                self._report(move)
            elif move.to in self.gone:
                log.warning("server %d: server %d is gone before it answered for slice %d of %r; keeping it",
                            self.node, move.to, move.shard, move.table)
                for req in move.reqs:
                    self.peers.tracker.forget(req)
                move.failed = True
                self._report(move)
            elif not move.slow and time.monotonic() - move.started > self.cluster.timeouts.request_s:
                log.warning("server %d: server %d has not answered for slice %d of %r within %.0fs; waiting (it "
                            "may have taken it)", self.node, move.to, move.shard, move.table,
                            self.cluster.timeouts.request_s)
                move.slow = True

    def _report(self, move: _Outgoing) -> None:
        msg = bodies.MoveDone(move.shard, move.to, move.epoch, move.handed).to_message(table=move.table)
        move.report = self.rendezvous.request(RENDEZVOUS, msg, lambda reply: self._settled(move, reply),
                                              f"MOVE_DONE {move.table!r}/{move.shard}")

    def _settled(self, move: _Outgoing, reply: Message) -> None:
        """The rendezvous's answer to our report names the slice's owner at the move's epoch: the new
        owner, if it reported taking the slice, whatever this server saw (its answer lost, or it
        called dead by a heartbeat missed); this server then lets the slice go."""
        owners, epoch = reply.body.get("owners"), reply.body.get("epoch")
        if (not move.handed and epoch == move.epoch and isinstance(owners, list)
                and 0 <= move.shard < len(owners) and owners[move.shard] == move.to):
            move.handed = True
            for req in move.reqs:
                self.peers.tracker.forget(req)
        self._finish(move)

    def _finish(self, move: _Outgoing) -> None:
        """The rendezvous knows: drop or keep the slice, then answer what waited for it."""
        self.outgoing.pop((move.table, move.shard), None)
        self.heartbeat_now = True
        table = self.tables.get(move.table)
        if table is not None and move.store is not None:
            if table.stores.get(move.shard) is not move.store:
                move.store.close()  # the slice came back (a later move) before this report was answered
                table.moving.discard(move.shard)
            elif move.handed:
                table.release_slice(move.shard, move.to, move.epoch)
                self.stats["slices_handed"] += 1
                # Pulls held here for their bound that read the slice can never be served here now
                # (a drained server leaves with them): answered "moved" below, they go where it is.
                shard = move.shard
                self.held += table.controller.take(
                    lambda item: bool((table.layout.mapping.locate(item[1].arrays[0])[0] == shard).any()))
            else:
                table.moving.discard(move.shard)
                move.store.revive()
                self.stats["slice_moves_failed"] += 1
        held, self.held = self.held, []
        for peer, msg in held:  # served here again, or refused "moved" and retried at the new owner
            self.redispatch(peer, msg)

    # ------------------------------------------------------------- receiving

    def receive(self, msg: Message) -> Message:
        """One chunk of a slice moving here; once every row has come, this server owns the slice."""
        state = bodies.SliceState.of(msg)
        table = self.tables.get(msg.table)
        if table is None:
            raise TableError(f"server {self.node} has no table {msg.table!r} to take slice {state.shard} of")
        shard = state.shard
        names = [str(n) for n in state.names]
        ranks = _ints(state.subscribers or [], "subscribers")
        if len(msg.arrays) != len(names) + len(ranks):
            raise ProtocolError(f"SLICE_STATE names {len(names)} arrays and {len(ranks)} subscribers, "
                                f"carries {len(msg.arrays)}")
        key = (msg.table, shard)
        if shard in table.stores and table.layout.epoch >= state.epoch:
            return msg.reply(Op.OK)  # a chunk sent again after the slice was taken: it is in already
        incoming = self.incoming.get(key)
        if incoming is not None and incoming.epoch != state.epoch:
            if incoming.epoch > state.epoch:
                raise ProtocolError(f"a chunk of an earlier move of slice {shard} of {msg.table!r}")
            incoming.store.close()  # what came of a move that was given up
            del self.incoming[key]
            incoming = None
        if incoming is None:
            if not 0 <= shard < table.layout.num_shards:
                raise ProtocolError(f"table {msg.table!r} has no slice {shard}")
            rows = table.layout.mapping.shard_size(shard)
            if state.num_rows != rows:
                raise ProtocolError(f"slice {shard} of {msg.table!r} has {rows} rows, not {state.num_rows}")
            store = ShardStore.receive(table.spec, shard, rows, self.cluster.cluster_id)
            incoming = self.incoming[key] = _Incoming(store, {r: np.zeros(rows, dtype=np.bool_) for r in ranks},
                                                      state.epoch, np.zeros(rows, dtype=np.bool_))
        first = state.first_row
        for rank, mask in zip(ranks, msg.arrays[len(names):], strict=True):
            if rank not in incoming.subscribers or mask.ndim != 1 \
                    or not 0 <= first <= first + mask.shape[0] <= incoming.store.num_rows:
                raise ProtocolError(f"SLICE_STATE of {msg.table!r}/{shard}: subscriber {rank}'s rows {first}.. "
                                    f"of shape {mask.shape} do not fit the slice or its first chunk")
        if first < 0:
            raise ProtocolError(f"SLICE_STATE of {msg.table!r}/{shard} starts at row {first}")
        arrays = dict(zip(names, msg.arrays[: len(names)], strict=True))
        counts = {a.shape[0] for a in arrays.values()} or {0}
        count = counts.pop()
        if counts or not 0 <= first <= first + count <= incoming.store.num_rows:
            raise ProtocolError(f"SLICE_STATE of {msg.table!r}/{shard}: rows {first}..{first + count} do not fit "
                                f"its {incoming.store.num_rows} rows")
        if state.clocks is not None or state.settled is not None:
            incoming.clocks = self._clocks(state, msg.table, shard)
        incoming.store.load_rows(first, arrays)
        incoming.arrived[first : first + count] = True
        for rank, mask in zip(ranks, msg.arrays[len(names):], strict=True):
            incoming.subscribers[rank][first : first + mask.shape[0]] = mask.astype(np.bool_)
        if incoming.arrived.all():
            del self.incoming[key]
            table.adopt_slice(incoming.store, state.epoch, incoming.subscribers)
            # Pushes for the slice may still be on their way elsewhere, to come here once refused:
            # until each worker confirms, count it only up to its settled clock.
            self.sync.fence(msg.table)
            if incoming.clocks is not None:
                self.sync.learn_clocks(*incoming.clocks)
            self.sync.adopted(msg.table)
            self.stats["slices_received"] += 1
            log.info("server %d: now serving slice %d of %r", self.node, shard, msg.table)
            self._report_taken(msg.table, shard, state.epoch)
        return msg.reply(Op.OK)

    def _clocks(self, state: bodies.SliceState, table: str, shard: int) -> tuple[list[int], list[int]]:
        learned = _ints(state.clocks, "clocks")
        settled = _ints(state.settled, "settled")
        workers = self.sync.clocks.num_workers
        if len(learned) != workers or len(settled) != workers or min(learned + settled, default=0) < 0:
            raise ProtocolError(f"SLICE_STATE of {table!r}/{shard}: clocks of {len(learned)} and {len(settled)} "
                                f"workers, not of the job's {workers}")
        return learned, settled

    def _report_taken(self, table: str, shard: int, epoch: int) -> None:
        """Tell the rendezvous this server serves the slice now. The old owner's report settles the
        move once it hears our answer; if it dies first, or calls the move failed (our answer lost,
        this server thought dead), the rendezvous settles it as done from ours instead of naming the
        old owner, and an old owner alive lets the slice go."""
        def failed(exc: Exception) -> None:
            log.warning("server %d: the rendezvous did not take that slice %d of %r is served here: %s",
                        self.node, shard, table, exc)

        msg = bodies.MoveDone(shard, self.node, epoch, True).to_message(table=table)
        self.rendezvous.request(RENDEZVOUS, msg, _ignore, f"MOVE_DONE {table!r}/{shard} (taken)", background=True,
                                on_error=failed)

    def hold(self, peer: bytes, msg: Message) -> None:
        self.stats["requests_held_for_moves"] += 1
        self.held.append((peer, msg))

    def take_load(self) -> dict[str, list[list[float]]]:
        """Per table, ``[slice, bytes, requests, seconds]`` since the last heartbeat."""
        out: dict[str, list[list[float]]] = {}
        for name, table in self.tables.items():
            load = table.take_load()
            if load:
                out[name] = [[float(s), *v] for s, v in sorted(load.items())]
        return out

    def close(self) -> None:
        for incoming in self.incoming.values():
            incoming.store.close()
        self.incoming.clear()


def _ignore(msg: Message) -> None:
    pass


def _ints(values: Any, name: str) -> list[int]:
    """A body field that must be a list of 64-bit ints (ranks), checked before any of it is used."""
    if not isinstance(values, list) or not all(is_int64(v) for v in values):
        raise ProtocolError(f"SLICE_STATE {name} must be a list of 64-bit ints, got {values!r}")
    return values

