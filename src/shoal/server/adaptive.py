"""Adaptive tables on one server: carries out what each table's ``PlacementMachine`` decides
(DESIGN.md §6).

The machine (``placement.machine``) decides where keys live and what to tell
other nodes; this service feeds it worker requests, placement messages from the
other servers and the clock, then sends the placement messages it asks for and
answers the requests it releases. Placement messages go in numbered channels
between servers (``cluster.links``), kept until acknowledged and sent again if
not: a ``state`` message is the only copy of its rows, and one for a server whose
address is not known yet waits for it.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from shoal.api.config import ClusterSpec, TableSpec
from shoal.api.errors import CheckpointError, ProtocolError, ShoalError, TableError
from shoal.api.ids import ADAPTIVE_SHARD, server_node
from shoal.cluster.links import Header, Links
from shoal.cluster.metrics import CpuAccount
from shoal.cluster.throttle import ThrottledWarnings
from shoal.consistency.clocks import ClockTable
from shoal.consistency.reached import ReachedClocks
from shoal.placement.adaptive_table import AdaptiveTable, Effects, Send
from shoal.placement.machine import PlacementMachine
from shoal.placement.messages import ACK, MAX_BATCH, from_parts, tables_of, to_parts
from shoal.placement.ownership import home_of
from shoal.server.peers import PeerDirectory
from shoal.server.tables import table_bytes
from shoal.storage import checkpoint
from shoal.storage.checkpoint import place_saved
from shoal.storage.kernels import OWNED, REPLICA, fold_arrived
from shoal.storage.validate import as_keys, as_rows, zero_nonfinite
from shoal.wire import bodies
from shoal.wire.message import Message
from shoal.wire.ops import Op
from shoal.wire.schema import Moved, intents_of

log = logging.getLogger(__name__)

_SENT = "sent placement messages"
_NOTHING_DUE = "nothing due"


class AdaptiveService:
    """The adaptive tables of one server and the messages that move their keys."""

    keeps_rows_across_restart = False
    served_by_joined_servers = False  # keys are homed over the nodes the table was made on

    def __init__(self, node: int, cluster: ClusterSpec, peers: PeerDirectory,
                 reply: Callable[[bytes, Message], None], clocks: ClockTable, reached: ReachedClocks,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.node = node
        self.now = now  # every timer of the service reads this clock (tests move it by hand)
        self.cluster = cluster
        self.reply = reply
        self.clocks = clocks
        self.reached = reached
        self.machines: dict[str, PlacementMachine] = {}
        self.peers = peers
        peers.on_address(self._send_queued)
        #: placement messages to each server until it acknowledges them, and what arrived of theirs
        self.links: Links[Message] = Links(now)
        self._warnings = ThrottledWarnings(log)
        self._own_stats: Counter[str] = Counter()
        self.cpu = CpuAccount()  # the part of each kind of placement message in the PLACEMENT messages' CPU
        #: the timer's passes over the tables, by whether they sent placement messages (a sync of the
        #: replicas, intents acted on) or found nothing due: what the timer's CPU is spent on
        self.passes = CpuAccount()
        #: which process of this node this is (the rendezvous's count of its registrations): its
        #: tables number their announcements from it
        self.incarnation = 1
        self._clock_seen = (0, now())
        self._clock_s = 0.0
        clocks.on_restart.append(self._worker_restarted)

    @property
    def tables(self) -> dict[str, AdaptiveTable]:
        return {name: machine.table for name, machine in self.machines.items()}

    @property
    def seconds_per_clock(self) -> float:
        """This node's workers' pace lately (0 until measured): what turns the clocks intents name into
        time. Their own: they are the ones whose intents this server acts on, and it reads their clocks
        in shared memory, where another node's workers' clocks come only with their messages (under ASP,
        a tick each quiet period, ``client.ticks``)."""
        return self._clock_s

    @property
    def stats(self) -> Counter[str]:
        """This server's counters with those of every adaptive table here (keys moved, requests held...)."""
        total = Counter(self._own_stats)
        total.update({f"placement_{name}": count for name, count in self.links.stats.items()})
        for machine in list(self.machines.values()):
            total.update(machine.table.stats)
        return total

    # ------------------------------------------------------------ membership

    def _send_queued(self, node: int) -> None:
        """A peer's address is known at last: what waited for it goes out."""
        for seq, msg in self.links.unsent(node):
            self._transmit(node, seq, msg)

    def missing_peers(self) -> bool:
        """Whether placement messages wait for a server whose address is not known yet (it registered
        after this server's last heartbeat, as at start-up): the next heartbeat tells it."""
        return any(self.links.unsent(node) for node in range(self.cluster.num_nodes)
                   if node != self.node and node not in self.peers.addresses)

    def build(self, spec: TableSpec, current: dict[str, Any] | None = None) -> AdaptiveTable:
        return AdaptiveTable(spec, self.node, self.cluster.num_nodes, self.cluster.cluster_id, self.incarnation)

    def install(self, spec: TableSpec, built: AdaptiveTable) -> None:
        self.machines[spec.name] = PlacementMachine(built)

    def bytes_here(self, spec: TableSpec) -> int:
        return table_bytes(spec)  # room for every key on every node: any key may come here

    def spec(self, name: str) -> TableSpec:
        return self._machine(name).table.spec

    def shards(self, name: str) -> list[int]:
        self._machine(name)
        return [ADAPTIVE_SHARD]  # one node-wide store

    def _machine(self, name: str) -> PlacementMachine:
        machine = self.machines.get(name)
        if machine is None:
            raise TableError(f"server {self.node} has no adaptive table {name!r}")
        return machine

    def share(self, name: str, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """The node-wide store of the table: co-located workers read and update present rows in it."""
        table = self._machine(name).table
        store = table.store
        return {"spec": table.spec.to_dict(),
                "shards": [{"shard": ADAPTIVE_SHARD, "num_rows": store.num_rows, "label": store.segment.label}]}, \
            [store.fd]

    # ------------------------------------------------------- worker requests

    def handle(self, peer: bytes, msg: Message) -> Message | None:
        if msg.op == Op.PLACEMENT:
            self._receive(msg)
            return None
        machine = self._machine(msg.table)
        spec = machine.table.spec
        ticket = (peer, msg)
        if msg.op == Op.PULL:
            return self.carry_out(machine.pull(as_keys(msg.arrays[0], spec), ticket, self.now()), ticket)
        if msg.op == Op.PUSH:
            keys = as_keys(msg.arrays[0], spec)
            grads, skipped = zero_nonfinite(as_rows(msg.arrays[1], keys.shape[0], spec, strict_dtype=True), spec)
            machine.table.stats["rows_skipped_nonfinite"] += skipped
            return self.carry_out(machine.push(keys, grads, ticket, self.now()), ticket)
        if msg.op == Op.LOCALIZE:
            self.carry_out(machine.localize(as_keys(msg.arrays[0], spec)))
            return msg.reply(Op.OK)
        if msg.op == Op.INTENT:
            # Taken in or refused: not waited for.
            self.reached.intent_read(msg.sender, msg.body.get("number"), msg.incarnation)
            # Every table's since the worker's last clock: all are checked before any is taken.
            intents = []
            for table, keys, start, end in intents_of(msg):
                target = self._machine(table)
                intents.append((target, as_keys(keys, target.table.spec), start, end))
            for target, keys, start, end in intents:
                target.intend(keys, start, end)
            return msg.reply(Op.OK)
        raise ProtocolError(f"adaptive table {msg.table!r} does not serve {msg.op.name}")

    def _receive(self, msg: Message) -> None:
        """A placement message from another server: what its channel holds ready now goes to the
        tables' machines, in the order sent (a repeat is dropped, one ahead of a missing one waits)."""
        sender = server_node(msg.sender, self.cluster.num_nodes)
        if sender is None:
            raise ProtocolError(f"placement message from sender {msg.sender}, which is no server")
        for table in tables_of(msg.body, msg.table):  # one not built here yet: refused unseen, it comes again
            self._machine(table)
        body = bodies.Placement.of(msg)
        held = body.held or 0
        if body.seq < 0 or body.base < 1 or body.acked < 0 or held < 0:
            raise ProtocolError(f"placement message from server {sender} with a bad channel header: seq "
                                f"{body.seq}, base {body.base}, acked {body.acked}, held {held}")
        header = Header(body.channel, body.seq, body.base, body.acks, body.acked, held)
        failure: ShoalError | None = None
        for ready in self.links.receive(sender, header, msg):
            try:
                self._deliver(sender, ready)
            except ShoalError as exc:  # a malformed one is given up; those behind it still go
                failure = failure or exc
        if failure is not None:
            raise failure

    def _deliver(self, sender: int, msg: Message) -> None:
        """Feed each table's machine its part of a placement message, and carry out what they decide."""
        effects = Effects()
        try:
            for table, message in zip(tables_of(msg.body, msg.table), from_parts(msg.body, msg.arrays),
                                      strict=True):
                started = time.thread_time()
                effects.extend(self._machine(table).receive(sender, message, self.now(), self._node_clock()))
                self.cpu.charge(message.kind, time.thread_time() - started)
        finally:  # what the messages before a malformed one asked for is carried out all the same
            self.carry_out(effects)

    def carry_out(self, effects: Effects, ticket: object = None) -> Message | None:
        """Send the placement messages a machine asked for and answer the requests it released; the
        answer to the request being handled (``ticket``) is returned, the others go through ``reply``."""
        if not effects.sends and not effects.answers:  # most timer passes: nothing to do
            return None
        batches: dict[int, list[Send]] = {}
        for send in effects.sends:  # one message per node: a batch of what the event sends there
            batches.setdefault(send.node, []).append(send)
        for node, batch in batches.items():
            self._send(node, batch)
        answer_now = None
        for answer in effects.answers:
            peer, msg = answer.ticket
            body = Moved(answer.moved, answer.owners).to_body() if answer.moved.size else {}
            reply = msg.reply(Op.OK, body) if answer.values is None else \
                msg.reply(Op.VALUES, body, arrays=[answer.values])
            if answer.ticket is ticket:
                answer_now = reply
            else:
                self.reply(peer, reply)
        return answer_now

    def _send(self, node: int, batch: list[Send]) -> None:
        for start in range(0, len(batch), MAX_BATCH):
            part = batch[start:start + MAX_BATCH]
            body, arrays = to_parts([s.message for s in part], [s.table for s in part])
            msg = Message(Op.PLACEMENT, table=part[0].table, body=body, arrays=arrays)
            self._own_stats["placement_messages_sent"] += 1
            given_up = self.links.stats["given_up"]
            seq = self.links.add(node, msg)
            if self.links.stats["given_up"] > given_up:
                self._warnings.warn(("given up", node), "server %d: server %d acknowledged none of the last %d "
                                    "placement messages (gone or stuck): the oldest are given up", self.node,
                                    node, self.links.unacknowledged(node))
            if node not in self.peers.addresses:
                self._own_stats["placement_queued_for_unknown_peer"] += 1
            else:
                self._transmit(node, seq, msg)

    def _transmit(self, node: int, seq: int, msg: Message, block: bool = True) -> None:
        """Send placement message ``seq`` to ``node`` (again), with what we owe it of acknowledgements.
        A full queue to a peer that stopped reading blocks a first send a bounded time; a repeat is
        not worth waiting for (it goes again later)."""
        header = self.links.header(node, seq)
        msg.body.update(channel=header.channel, seq=header.seq, base=header.base, acks=header.acks,
                        acked=header.acked)
        if header.held:
            msg.body["held"] = header.held
        else:
            msg.body.pop("held", None)  # a copy sent again once the gap it reported has closed
        self.peers.tracker.notify(node, msg, block=block)

    def _acknowledge(self, node: int) -> None:
        """An acknowledgement alone, for a peer we had nothing to send for a while (under any table:
        every server has them all)."""
        self._own_stats["placement_acks_sent"] += 1
        self._transmit(node, 0, Message(Op.PLACEMENT, table=next(iter(self.machines)), body={"kind": ACK}),
                       block=False)

    def _resend_and_acknowledge(self) -> None:
        """Send again what stays unacknowledged, and the acknowledgements that found nothing to ride on."""
        for node, seq, msg in self.links.due():
            if node in self.peers.addresses:
                self._transmit(node, seq, msg, block=False)
        for node in self.links.acks_due():
            if node in self.peers.addresses:
                self._acknowledge(node)

    # ----------------------------------------------------------------- timers

    def tick(self) -> None:
        """Feed each table's machine the time and its node's clock; carry out what it decides."""
        if not self.machines:  # no adaptive table (yet): every timer pass of a static job came here
            self._resend_and_acknowledge()
            return
        started = time.thread_time()
        now = self.now()
        node_clock = self._node_clock()
        seen, at = self._clock_seen
        if node_clock > seen:
            per_clock = (now - at) / (node_clock - seen)
            self._clock_s = per_clock if self._clock_s == 0 else 0.8 * self._clock_s + 0.2 * per_clock
            self._clock_seen = (node_clock, now)
        effects = Effects()  # every table's: what they send one node in this pass goes as one message
        try:
            for machine in list(self.machines.values()):
                effects.extend(machine.tick(now, node_clock, self._clock_s))
        finally:  # a state message is the only copy of its rows: what a table decided goes out regardless
            self.carry_out(effects)
        self._resend_and_acknowledge()
        self.passes.charge(_SENT if effects.sends else _NOTHING_DUE, time.thread_time() - started)

    def due(self) -> bool:
        """Whether ``tick`` would find anything to do now: a message to send again or to acknowledge,
        or a table's machine with work (``PlacementMachine.due``)."""
        now = self.now()
        deadline = self.links.next_deadline()
        if deadline is not None and deadline <= now:
            return True
        if not self.machines:
            return False
        node_clock = self._node_clock()
        return any(machine.due(now, node_clock, self._clock_s) for machine in self.machines.values())

    def _node_clock(self) -> int:
        """The slowest clock of this node's workers: as they reached it, where what they sent by then
        has been read here, else as heard."""
        per_node = self.cluster.workers_per_node
        first = self.node * per_node
        return min(self.reached.clocks(self.clocks.clocks[first:first + per_node].tolist(), first), default=0)

    def _worker_restarted(self, worker: int) -> None:
        """A worker was started again: if it is on this node, the intents declared here so far end
        (the node clock went back with it; the clocks they name were its earlier process's). Before
        anything else of the new process is handled: its own intents come after."""
        per_node = self.cluster.workers_per_node
        if per_node and worker // per_node == self.node:
            self.reached.restarted(worker)
            for machine in self.machines.values():
                machine.table.intents.end_all()
            self._clock_seen = (self._node_clock(), self.now())  # the pace is measured from here again

    def next_timer(self) -> float | None:
        deadlines = [m.next_wake() for m in self.machines.values()]
        streams = self.links.next_deadline()
        if streams is not None:
            deadlines.append(streams)
        return min(deadlines, default=None)

    # ----------------------------------------------------------- checkpoints

    def settle(self, name: str) -> tuple[list[str], list[list[Any]] | None]:
        """Send replicas' changes to their owners now; what still keeps the owners' rows from being final.

        With every worker stopped at a barrier nothing new starts: once every server has nothing
        unsettled, each owned row holds every change, wherever it was made.
        """
        effects, why = self._machine(name).settle(self.now())
        self.carry_out(effects)
        return why + self._waiting(), None

    def _waiting(self) -> list[str]:
        return ["messages wait for servers not yet known"] if self.missing_peers() else []

    def write(self, name: str, staging: Path, index: int) -> list[dict[str, Any]]:
        """The keys this node owns with their values and optimiser state (replicas are left out: their
        owners write them, with every replica's change once settled)."""
        table = self._machine(name).table
        why = self._machine(name).unsettled() + self._waiting()
        if why:
            raise CheckpointError(f"placement of {name!r} is still settling ({'; '.join(why)}); try again")
        store = table.store
        assert store.pinned is not None and store.arrived is not None and store.incoming is not None
        with store.hold(None, exclusive=True):
            # What arrived beside rows while they were held goes into their values, which are read here.
            if fold_arrived(store.values, store.pinned, store.arrived, store.incoming):
                raise CheckpointError(f"rows of {name!r} are held in place by a worker; try again")
            keys = np.flatnonzero(table.presence == OWNED)
            arrays = {key: array[keys] for key, array in store.state_arrays().items()}
        return [{**checkpoint.write_part(staging, index, f"n{self.node}-owned", keys, arrays), "node": self.node}]

    def restore(self, name: str, path: Path, entry: dict[str, Any], write: bool) -> int:
        """Put the rows of this node's home keys in place (``write`` False: only check that they fit);
        a job restores before keys move."""
        table = self._machine(name).table
        return sum(self._load_home_rows(table, keys.astype(np.int64, copy=False), arrays, write)
                   for keys, arrays in checkpoint.read_parts(path, entry))

    def _load_home_rows(self, table: AdaptiveTable, keys: np.ndarray, arrays: dict[str, np.ndarray],
                        write: bool) -> int:
        home = np.zeros(table.spec.num_keys, dtype=np.uint8)
        home[self.node::table.num_nodes] = OWNED
        if not np.array_equal(table.presence, home):
            raise CheckpointError(f"adaptive table {table.spec.name!r} has moved or replicated keys already: "
                                  "restore right after creating the tables, before training")
        mine = np.flatnonzero(home_of(keys, table.num_nodes) == self.node)
        store = table.store
        assert store.arrived is not None
        with store.hold(None, exclusive=True):
            place_saved(store.state_arrays(), keys[mine], arrays, mine, table.spec.name, write)
            if write:  # the rows are as saved: nothing added beside them before goes in
                store.arrived[keys[mine]] = 0
        return int(mine.size)

    def describe(self) -> dict[str, Any]:
        return {name: {"owned": int((t.presence == OWNED).sum()), "replicas": int((t.presence == REPLICA).sum()),
                       "window": t.window, "held": len(t.held), **dict(t.stats)} for name, t in self.tables.items()}

    def close(self) -> None:
        for machine in self.machines.values():
            machine.table.close()
