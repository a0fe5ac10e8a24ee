"""Adaptive tables on one server: keys that relocate and hot keys that replicate (DESIGN.md §6).

Every node keeps a row for every key in shared memory, with its presence
(absent, owned, replica) and where the server believes absent keys live.
Co-located workers read and update present rows themselves; requests for
absent rows come here and are answered with the rows this node has and
"moved, try node n" for the others.

Between servers (all one-way messages, op ``PLACEMENT``):

* ``relocate`` (requester -> home): move keys to the requester; the home
  records the new owner and asks the old one for a ``handover``;
* ``handover`` (home -> owner): give up keys; the owner sends their ``state``;
* ``state`` (old owner -> new owner): rows and interest; requests that waited
  for them are served;
* ``owner`` (owner -> home): keys an owner moved on its own (intent-driven);
* ``announce`` (node -> owner): a node's workers will (or no longer) use keys;
* ``replicate`` (owner -> node): a replica of keys;
* ``sync`` / ``synced`` (replica -> owner -> replica): the replica's change since
  the last sync, and the owner's row after adding it; with ``drop`` the replica
  goes away after its last change is in. A part for keys that moved on is
  passed to their owner, which answers it too: ``synced`` counts such parts.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shoal.api.config import ClusterSpec, TableSpec
from shoal.api.errors import CheckpointError, ConfigError, ProtocolError, TableError
from shoal.api.ids import ADAPTIVE_SHARD, server_node, server_sender
from shoal.consistency.clocks import ClockTable
from shoal.placement.intent import Action, NodeIntents, OwnerInterest, smoothed_window
from shoal.placement.ownership import MAX_HOPS, Directory, LocationCache, home_of
from shoal.server.peers import PeerDirectory
from shoal.server.tables import table_bytes
from shoal.storage import checkpoint
from shoal.storage.checkpoint import place_saved
from shoal.storage.kernels import ABSENT, OWNED, REPLICA, any_nonfinite, take_pending
from shoal.storage.shard import ShardStore
from shoal.storage.validate import as_keys, as_rows, zero_nonfinite
from shoal.wire.message import Message
from shoal.wire.ops import Op

log = logging.getLogger(__name__)

_CARRIES_ROWS = ("state", "replicate", "sync", "synced")  # placement messages with rows in their second array
_ACTION_S = 0.005  # about how long a relocation or replication takes here: sets the action window
_HELD_S = 2.0  # a request waiting for rows on their way here longer than this is answered "moved"
_SYNC_HOPS = 16  # a replica's change chasing a key that keeps moving: after this many hops it is logged and lost


@dataclass(eq=False)  # compared by identity: field equality would compare arrays (and raise)
class Held:
    """A worker request waiting for keys on their way here."""

    peer: bytes
    msg: Message
    waiting_for: np.ndarray
    #: for a push held in part: where the held keys sat in the original request
    positions: np.ndarray | None = None
    since: float = 0.0  # when it began to wait, on the service's clock


class AdaptiveTable:
    """One node's view of an adaptive table."""

    def __init__(self, spec: TableSpec, node: int, num_nodes: int, cluster_id: str) -> None:
        if num_nodes > 63:
            raise ConfigError("adaptive tables support at most 63 nodes")
        self.spec = spec
        self.node = node
        self.num_nodes = num_nodes
        keys = np.arange(spec.num_keys, dtype=np.int64)
        self.store = ShardStore.create(spec, ADAPTIVE_SHARD, keys, cluster_id)
        assert self.store.presence is not None and self.store.pending is not None
        assert self.store.location is not None
        self.presence = self.store.presence
        self.presence[node::num_nodes] = OWNED  # keys start at home
        self.directory = Directory(spec.num_keys, num_nodes, node)
        # In shared memory: this node's workers read where the keys that left went.
        self.hints = LocationCache(spec.num_keys, num_nodes, shared=self.store.location)
        self.incoming = np.zeros(spec.num_keys, dtype=np.bool_)
        self.held: list[Held] = []
        self.deferred_handovers: list[tuple[np.ndarray, int]] = []
        self.interest = OwnerInterest(spec.num_keys)
        self.intents = NodeIntents(spec.num_keys)
        self.replica_owner = np.full(spec.num_keys, -1, dtype=np.int64)
        self.dropping = np.zeros(spec.num_keys, dtype=np.bool_)
        #: per owner: answers ("synced") still due for this node's syncs, forwarded parts included
        self.syncs_unanswered: Counter[int] = Counter()
        #: parts of replicas' syncs for keys on their way here: added when the keys arrive
        self.deferred_syncs: list[tuple[np.ndarray, np.ndarray, np.ndarray, int, int, int]] = []
        self.next_sync = 0.0
        self.window = 1  # clocks ahead that intents are acted on
        self.acted_at = -1  # the node clock the window was last estimated at
        self.window_estimate = 1.0
        self.stats: Counter[str] = Counter()

    @property
    def scale(self) -> float:
        assert self.store.rule.scale is not None  # adaptive tables have additive rules
        return self.store.rule.scale

    def where(self, keys: np.ndarray) -> np.ndarray:
        """Best knowledge of each key's owner: the directory for home keys, else the hint."""
        owners = self.hints.hint[keys].astype(np.int64)
        home = self.directory.is_home(keys)
        owners[home] = self.directory.owner[keys[home]]
        return owners

    def close(self) -> None:
        self.store.close()


class AdaptiveService:
    """The adaptive tables of one server and the messages that move their keys."""

    def __init__(self, node: int, cluster: ClusterSpec, peers: PeerDirectory,
                 reply: Callable[[bytes, Message], None], clocks: ClockTable,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.node = node
        self.now = now  # every timer of the service reads this clock (tests move it by hand)
        self.cluster = cluster
        self.reply = reply
        self.clocks = clocks
        self.tables: dict[str, AdaptiveTable] = {}
        self.peers = peers
        peers.on_address(self._send_queued)
        #: messages for servers whose address we do not know yet (they must not be lost: a
        #: state message is the only copy of its rows)
        self._outbox: dict[int, list[Message]] = defaultdict(list)
        self.stats: Counter[str] = Counter()
        self._clock_seen = (0, now())
        self._clock_s = 0.0

    # ------------------------------------------------------------ membership

    def _send_queued(self, node: int) -> None:
        """A peer's address is known at last: what waited for it goes out."""
        for msg in self._outbox.pop(node, []):
            self.peers.tracker.notify(node, msg)

    keeps_rows_across_restart = False
    served_by_joined_servers = False  # keys are homed over the nodes the table was made on

    def build(self, spec: TableSpec, current: dict[str, Any] | None = None) -> AdaptiveTable:
        return AdaptiveTable(spec, self.node, self.cluster.num_nodes, self.cluster.cluster_id)

    def install(self, spec: TableSpec, built: AdaptiveTable) -> None:
        self.tables[spec.name] = built

    def bytes_here(self, spec: TableSpec) -> int:
        return table_bytes(spec)  # room for every key on every node: any key may come here

    def spec(self, name: str) -> TableSpec:
        return self._table(name).spec

    def shards(self, name: str) -> list[int]:
        self._table(name)
        return [ADAPTIVE_SHARD]  # one node-wide store

    def _table(self, name: str) -> AdaptiveTable:
        table = self.tables.get(name)
        if table is None:
            raise TableError(f"server {self.node} has no adaptive table {name!r}")
        return table

    def share(self, name: str, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """The node-wide store of the table: co-located workers read and update present rows in it."""
        table = self._table(name)
        store = table.store
        return {"spec": table.spec.to_dict(),
                "shards": [{"shard": ADAPTIVE_SHARD, "num_rows": store.num_rows, "label": store.segment.label}]}, \
            [store.fd]

    # ------------------------------------------------------- worker requests

    def handle(self, peer: bytes, msg: Message) -> Message | None:
        table = self._table(msg.table)
        if msg.op == Op.PULL:
            return self._pull(table, peer, msg)
        if msg.op == Op.PUSH:
            return self._push(table, peer, msg)
        if msg.op == Op.LOCALIZE:
            self._localize(table, as_keys(msg.arrays[0], table.spec))
            return msg.reply(Op.OK)
        if msg.op == Op.INTENT:
            start, end = int(msg.body["start"]), int(msg.body["end"])
            table.intents.add(as_keys(msg.arrays[0], table.spec), start, end)
            return msg.reply(Op.OK)
        if msg.op == Op.PLACEMENT:
            self._placement(table, msg)
            return None
        raise ProtocolError(f"adaptive table {msg.table!r} does not serve {msg.op.name}")

    def _moved(self, table: AdaptiveTable, keys: np.ndarray, absent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Positions of absent keys, and those of them on their way here (the request waits for these)."""
        pos = np.flatnonzero(absent)
        if not pos.size:
            return pos, pos
        missing = keys[pos]
        coming = table.incoming[missing] | (table.where(missing) == self.node)
        return pos, missing[coming]

    def _answer(self, table: AdaptiveTable, msg: Message, keys: np.ndarray, pos: np.ndarray,
                values: np.ndarray | None, positions: np.ndarray | None = None) -> Message:
        """Rows (or the acknowledgement) plus, for keys not here, where they went.

        ``positions`` maps a partly held push back to the request the worker sent.
        """
        owners = table.where(keys[pos]) if pos.size else np.empty(0, dtype=np.int64)
        moved = pos if positions is None else positions[pos]
        body = {"moved": moved.tolist(), "owners": owners.tolist()} if pos.size else {}
        if pos.size:
            table.stats["answered_moved"] += int(pos.size)
        if values is None:
            return msg.reply(Op.OK, body)
        return msg.reply(Op.VALUES, body, arrays=[values])

    def _pull(self, table: AdaptiveTable, peer: bytes, msg: Message) -> Message | None:
        keys = as_keys(msg.arrays[0], table.spec)
        out = np.zeros((keys.shape[0], table.spec.dim), dtype=table.spec.dtype)
        absent = table.store.read_present(keys, np.arange(keys.shape[0]), out)
        pos, coming = self._moved(table, keys, absent)
        if coming.size:
            table.held.append(Held(peer, msg, coming, since=self.now()))
            table.stats["requests_held"] += 1
            return None
        return self._answer(table, msg, keys, pos, out)

    def _push(self, table: AdaptiveTable, peer: bytes, msg: Message,
              positions: np.ndarray | None = None) -> Message | None:
        keys = as_keys(msg.arrays[0], table.spec)
        grads = as_rows(msg.arrays[1], keys.shape[0], table.spec, strict_dtype=True)
        if positions is None:  # first arrival (a held rest was checked then)
            grads, skipped = zero_nonfinite(grads, table.spec)
            table.stats["rows_skipped_nonfinite"] += skipped
        absent = table.store.update_present(keys, grads, table.scale)
        pos, coming = self._moved(table, keys, absent)
        if coming.size:
            # The present part is in; the rest waits for its rows and is applied on arrival.
            rest = dataclasses.replace(msg, arrays=[keys[pos], grads[pos]])  # its stream and number kept
            where = pos if positions is None else positions[pos]
            table.held.append(Held(peer, rest, coming, where, since=self.now()))
            table.stats["requests_held"] += 1
            return None
        return self._answer(table, msg, keys, pos, None, positions)

    def _replay_held(self, table: AdaptiveTable) -> None:
        ready = [h for h in table.held if (table.presence[h.waiting_for] != ABSENT).all()]
        if not ready:
            return
        table.held = [h for h in table.held if h not in ready]
        for h in ready:
            if h.msg.op == Op.PULL:
                reply = self._pull(table, h.peer, h.msg)
            else:
                reply = self._push(table, h.peer, h.msg, h.positions)
            if reply is not None:
                self.reply(h.peer, reply)

    # ------------------------------------------------------------ relocation

    def _localize(self, table: AdaptiveTable, keys: np.ndarray) -> None:
        """A local worker asks for keys to live here: ask their homes."""
        keys = keys[(table.presence[keys] != OWNED) & ~table.incoming[keys]]
        if not keys.size:
            return
        table.incoming[keys] = True
        table.stats["localize_requested"] += int(keys.size)
        homes = home_of(keys, table.num_nodes)
        for home in np.unique(homes):
            part = keys[homes == home]
            self._send(table, int(home), "relocate", {"to": self.node}, [part])

    def _relocate_at_home(self, table: AdaptiveTable, keys: np.ndarray, to: int) -> None:
        table.hints.learn(keys[table.directory.is_home(keys)], to)
        for owner, part in table.directory.move(keys, to).items():
            self._send(table, owner, "handover", {"to": to, "hops": 0}, [part])

    def _handover(self, table: AdaptiveTable, keys: np.ndarray, to: int, hops: int) -> None:
        """Give up owned keys; pass on a request for keys we do not own."""
        owned = keys[table.presence[keys] == OWNED]
        if owned.size:
            self._give(table, owned, to)
        rest = keys[table.presence[keys] != OWNED]
        coming = rest[table.incoming[rest]]
        if coming.size:
            table.deferred_handovers.append((coming, to))
        rest = rest[~table.incoming[rest]]
        if rest.size and hops < MAX_HOPS + 1:
            for node, part in _group(table.hints.route(rest, hops), rest):
                if node != self.node:
                    self._send(table, node, "handover", {"to": to, "hops": hops + 1}, [part])

    def _give(self, table: AdaptiveTable, keys: np.ndarray, to: int) -> None:
        """Hand owned keys and their interest to ``to``; from now on requests for them are redirected."""
        if to == self.node:
            return
        with table.store.hold(None, exclusive=True):
            values = table.store.values[keys].copy()
            table.presence[keys] = ABSENT
        table.hints.learn(keys, to)
        interest = table.interest.interest[keys].copy()
        replicas = table.interest.replicas[keys].copy()
        table.interest.interest[keys] = 0
        table.interest.replicas[keys] = 0
        table.stats["keys_relocated_away"] += int(keys.size)
        self._send(table, to, "state", {}, [keys, values, interest, replicas])

    def _receive_state(self, table: AdaptiveTable, keys: np.ndarray, values: np.ndarray, interest: np.ndarray,
                       replicas: np.ndarray, sender: int) -> None:
        store = table.store
        assert store.pending is not None
        with store.hold(None, exclusive=True):
            # A replica here becomes the row: its changes not yet synced stay in. Only a replica's
            # pending row can be non-zero; the others are left untouched (a first write to a page of
            # shared memory costs a page fault: 2 ms for 250 rows here).
            replica_keys = keys[table.presence[keys] == REPLICA]
            store.values[keys] = values
            store.values[replica_keys] += store.pending[replica_keys]
            store.pending[replica_keys] = 0
            table.presence[keys] = OWNED
        table.replica_owner[keys] = -1
        table.dropping[keys] = False
        table.incoming[keys] = False
        table.hints.learn(keys, self.node)
        table.interest.interest[keys] |= interest
        table.interest.replicas[keys] |= replicas
        table.stats["keys_relocated_here"] += int(keys.size)
        # The homes already know: they started the move, or the old owner told them.
        for holder in _bits(np.bitwise_or.reduce(replicas) if replicas.size else 0):
            self._send(table, holder, "owner", {"owner": self.node}, [keys[(replicas >> holder) & 1 == 1]])
        deferred, table.deferred_handovers = table.deferred_handovers, []
        for k, to in deferred:
            self._handover(table, k, to, 0)
        syncs, table.deferred_syncs = table.deferred_syncs, []
        for k, deltas, drop, origin, target, hops in syncs:
            self._sync_at_owner(table, k, deltas, drop, origin, target, hops)
        self._replay_held(table)

    def _tell_homes(self, table: AdaptiveTable, keys: np.ndarray, owner: int) -> None:
        """Keys moved without their homes asking (an intent-driven move): tell the homes."""
        homes = home_of(keys, table.num_nodes)
        for home in np.unique(homes):
            self._send(table, int(home), "owner", {"owner": owner}, [keys[homes == home]])

    # ------------------------------------------------------------ replication

    def _replicate_to(self, table: AdaptiveTable, keys: np.ndarray, node: int) -> None:
        keys = keys[(table.interest.replicas[keys] >> node) & 1 == 0]
        if not keys.size:
            return
        with table.store.hold(None, exclusive=False):
            values = table.store.values[keys].copy()
        table.interest.replicas[keys] |= 1 << node
        table.stats["replicas_made"] += int(keys.size)
        self._send(table, node, "replicate", {}, [keys, values])

    def _receive_replica(self, table: AdaptiveTable, keys: np.ndarray, values: np.ndarray, owner: int) -> None:
        with table.store.hold(None, exclusive=True):
            fresh = table.presence[keys] == ABSENT
            keys, values = keys[fresh], values[fresh]
            table.store.values[keys] = values  # pending rows of absent keys are zero already
            table.presence[keys] = REPLICA
        table.replica_owner[keys] = owner
        table.dropping[keys] = False
        table.stats["replicas_held"] += int(keys.size)
        self._replay_held(table)

    def _sync(self, table: AdaptiveTable) -> None:
        """Send each owner the change its replicas here saw since the last sync (one sync in flight per owner)."""
        store = table.store
        assert store.pending is not None
        replicas = np.flatnonzero(table.presence == REPLICA)
        if not replicas.size:
            return
        owners = table.replica_owner[replicas]
        for owner, keys in _group(owners, replicas):
            if table.syncs_unanswered[owner]:
                continue
            with store.hold(None, exclusive=True):
                changed, deltas = take_pending(store.pending, keys, table.dropping[keys])
            if not changed.size:
                continue
            drop = table.dropping[changed]
            table.syncs_unanswered[owner] = 1
            table.stats["sync_sent"] += 1
            self._send(table, owner, "sync", {"origin": self.node, "target": owner, "hops": 0},
                       [changed, deltas, drop.astype(np.uint8)])

    def _sync_at_owner(self, table: AdaptiveTable, keys: np.ndarray, deltas: np.ndarray, drop: np.ndarray,
                       origin: int, target: int, hops: int) -> None:
        """Add a replica's change. The part for keys that moved on is passed on (their owner adds it),
        the part for keys on their way here waits for them; the answer says how many such parts there
        are, and the replica waits for their answers too (nothing it sent is unaccounted for)."""
        owned = table.presence[keys] == OWNED
        rest = np.flatnonzero(~owned)
        parts = 0
        if rest.size and hops >= _SYNC_HOPS:
            table.stats["sync_rows_lost"] += int(rest.size)
            log.error("server %d: a replica's change to %d key(s) of %r found no owner in %d hops: lost",
                      self.node, rest.size, table.spec.name, hops)
        elif rest.size:
            dest = table.where(keys[rest])
            if hops >= MAX_HOPS:  # the home knows the owner
                away = ~table.directory.is_home(keys[rest])
                dest[away] = home_of(keys[rest][away], table.num_nodes)
            table.stats["sync_forwarded"] += int(rest.size)
            for owner, part in _group(dest, rest):
                parts += 1
                if owner == self.node:  # ours, not here yet
                    table.deferred_syncs.append((keys[part], deltas[part], drop[part], origin, target, hops))
                else:
                    self._send(table, owner, "sync", {"origin": origin, "target": target, "hops": hops + 1},
                               [keys[part], deltas[part], drop[part]])
        keys, deltas, drop = keys[owned], deltas[owned], drop[owned]
        with table.store.hold(None, exclusive=True):
            table.store.values[keys] += deltas  # keys of one sync are distinct
            values = table.store.values[keys].copy()
        dropped = keys[drop.astype(bool)]
        table.interest.replicas[dropped] &= ~(1 << origin)
        self._send(table, origin, "synced", {"target": target, "parts": parts}, [keys, values, drop])

    def _synced(self, table: AdaptiveTable, keys: np.ndarray, values: np.ndarray, drop: np.ndarray,
                target: int, parts: int) -> None:
        store = table.store
        assert store.pending is not None
        table.syncs_unanswered[target] = max(0, table.syncs_unanswered[target] + parts - 1)
        with store.hold(None, exclusive=True):
            replica = table.presence[keys] == REPLICA
            keys, values, drop = keys[replica], values[replica], drop[replica].astype(bool)
            store.values[keys] = values + store.pending[keys]
            # A replica goes once its last change is in; changes made meanwhile go in the next sync.
            gone = keys[drop & ~np.any(store.pending[keys] != 0, axis=1)]
            table.presence[gone] = ABSENT
        table.dropping[gone] = False
        table.replica_owner[gone] = -1
        table.stats["replicas_dropped"] += int(gone.size)

    # ---------------------------------------------------------------- intent

    def _announce(self, table: AdaptiveTable, keys: np.ndarray, active: bool, node: int, hops: int) -> None:
        """At (what we think is) the owner: note a node's interest and act on it."""
        owned = keys[table.presence[keys] == OWNED]
        if owned.size:
            if active:
                table.interest.announce(owned, node)
                for action, part in table.interest.decide(table.spec.techniques, owned, node, self.node).items():
                    if action == Action.RELOCATE and part.size:
                        self._give(table, part, node)
                        self._tell_homes(table, part, node)
                    elif action == Action.REPLICATE and part.size:
                        self._replicate_to(table, part, node)
            else:
                table.interest.withdraw(owned, node)
        rest = keys[table.presence[keys] != OWNED]
        if rest.size and hops <= MAX_HOPS:
            for owner, part in _group(table.where(rest) if hops < MAX_HOPS else home_of(rest, table.num_nodes), rest):
                if owner != self.node:
                    self._send(table, owner, "announce", {"active": active, "node": node, "hops": hops + 1}, [part])

    def _act_on_intents(self, table: AdaptiveTable) -> None:
        if table.spec.techniques == "static":
            return
        per_node = self.cluster.workers_per_node
        local_workers = range(self.node * per_node, (self.node + 1) * per_node)
        clock = int(self.clocks.clocks[local_workers.start:local_workers.stop].min()) if per_node else 0
        if clock != table.acted_at:  # the estimate moves once per clock, not per pass of the loop
            table.acted_at = clock
            table.window_estimate = smoothed_window(_ACTION_S, self._clock_s, table.window_estimate)
            table.window = math.ceil(table.window_estimate)
        if not table.intents.any_due(clock, table.window):  # most passes: nothing to do
            return
        start, stop = table.intents.due(clock, table.window)
        if start.size:
            # Interest came back before a replica here sent its last change: keep the replica (the
            # owner, still counting it, would not send it again).
            table.dropping[start] = False
            table.stats["intents_announced"] += int(start.size)
            self._announce(table, start, True, self.node, 0)
        if stop.size:
            table.stats["intents_withdrawn"] += int(stop.size)
            replicas = stop[table.presence[stop] == REPLICA]
            table.dropping[replicas] = True
            self._announce(table, stop, False, self.node, 0)

    # --------------------------------------------------------------- messages

    def _send(self, table: AdaptiveTable, node: int, kind: str, body: dict[str, Any],
              arrays: list[np.ndarray]) -> None:
        msg = Message(Op.PLACEMENT, table=table.spec.name, body={"kind": kind, **body}, arrays=arrays)
        self.stats[f"placement_{kind}_sent"] += 1
        if node == self.node:  # to ourselves: no message
            msg.sender = server_sender(self.node)
            self._placement(table, msg)
        elif node not in self.peers.addresses:
            self._outbox[node].append(msg)
            self.stats["placement_queued_for_unknown_peer"] += 1
        else:
            self.peers.tracker.notify(node, msg, block=True)  # placement messages carry rows: never dropped

    def _placement(self, table: AdaptiveTable, msg: Message) -> None:
        sender = server_node(msg.sender, self.cluster.num_nodes)
        if sender is None:
            raise ProtocolError(f"placement message from sender {msg.sender}, which is no server")
        # Each kind's fields and arrays were checked against ``wire.schema.PLACEMENT_KINDS`` on arrival.
        kind, body, arrays = msg.body["kind"], msg.body, msg.arrays
        try:
            keys = as_keys(arrays[0], table.spec)
            rows = as_rows(arrays[1], keys.shape[0], table.spec, strict_dtype=True) if kind in _CARRIES_ROWS else None
            if rows is not None and any_nonfinite(rows):
                # Rows are checked where they enter (pushes): a peer sending NaN/Inf is broken. Nothing applied.
                log.error("server %d: %s message of %r from server %d carries NaN/Inf: dropped",
                          self.node, kind, table.spec.name, sender)
                raise ProtocolError(f"placement {kind!r} from server {sender} carries NaN/Inf")
            if kind == "relocate":
                self._relocate_at_home(table, keys, _node(body["to"], table))
            elif kind == "handover":
                self._handover(table, keys, _node(body["to"], table), _count(body["hops"]))
            elif kind == "owner":
                owner = _node(body["owner"], table)
                table.directory.record(keys[table.directory.is_home(keys)], owner)
                table.hints.learn(keys, owner)
                held = keys[table.presence[keys] == REPLICA]
                table.replica_owner[held] = owner
            elif kind == "announce":
                self._announce(table, keys, body["active"], _node(body["node"], table), _count(body["hops"]))
            else:
                assert rows is not None  # the other kinds carry rows
                if kind == "state":
                    self._receive_state(table, keys, rows, arrays[2].astype(np.int64), arrays[3].astype(np.int64),
                                        sender)
                elif kind == "replicate":
                    self._receive_replica(table, keys, rows, sender)
                elif kind == "sync":
                    self._sync_at_owner(table, keys, rows, arrays[2], _node(body["origin"], table),
                                        _node(body["target"], table), _count(body["hops"]))
                else:  # synced
                    self._synced(table, keys, rows, arrays[2], _node(body["target"], table), _count(body["parts"]))
        except ValueError as exc:  # a node that is no node of the table, a count out of range
            raise ProtocolError(f"malformed placement message {kind!r}: {exc}") from None

    # ----------------------------------------------------------------- timers

    def tick(self) -> None:
        """Act on intents that came into the window, sync replicas, and answer requests that waited
        too long for rows that did not come (the requester then retries elsewhere)."""
        slowest = self.clocks.slowest
        seen, at = self._clock_seen
        now = self.now()
        if slowest > seen:
            per_clock = (now - at) / (slowest - seen)
            self._clock_s = per_clock if self._clock_s == 0 else 0.8 * self._clock_s + 0.2 * per_clock
            self._clock_seen = (slowest, now)
        for table in self.tables.values():
            self._act_on_intents(table)
            if now >= table.next_sync:
                table.next_sync = now + table.spec.sync_ms / 1000.0
                self._sync(table)
            stale = [h for h in table.held if now - h.since > _HELD_S]
            if stale:
                table.held = [h for h in table.held if h not in stale]
                table.stats["held_requests_timed_out"] += len(stale)
                for h in stale:  # serve what is here now; the rest is "moved"
                    keys = as_keys(h.msg.arrays[0], table.spec)
                    if h.msg.op == Op.PULL:
                        values = np.zeros((keys.shape[0], table.spec.dim), dtype=table.spec.dtype)
                        absent = table.store.read_present(keys, np.arange(keys.shape[0]), values)
                        reply = self._answer(table, h.msg, keys, np.flatnonzero(absent), values)
                    else:
                        grads = as_rows(h.msg.arrays[1], keys.shape[0], table.spec, strict_dtype=True)
                        absent = table.store.update_present(keys, grads, table.scale)
                        reply = self._answer(table, h.msg, keys, np.flatnonzero(absent), None, h.positions)
                    self.reply(h.peer, reply)

    def next_timer(self) -> float | None:
        return min((t.next_sync for t in self.tables.values()), default=None)

    # ----------------------------------------------------------- checkpoints

    def settle(self, name: str) -> tuple[list[str], list[list[Any]] | None]:
        """Send replicas' changes to their owners now; what still keeps the owners' rows from being final.

        With every worker stopped at a barrier nothing new starts: once every server has nothing
        unsettled, each owned row holds every change, wherever it was made.
        """
        table = self._table(name)
        self._sync(table)
        return self.unsettled(table), None

    def unsettled(self, table: AdaptiveTable) -> list[str]:
        assert table.store.pending is not None
        why = []
        replicas = np.flatnonzero(table.presence == REPLICA)
        if replicas.size and table.store.pending[replicas].any():
            why.append("replicas have changes not yet sent to their owners")
        unanswered = sum(table.syncs_unanswered.values())
        if unanswered:
            why.append(f"{unanswered} replica sync(s) unanswered")
        if table.incoming.any() or table.deferred_syncs or table.deferred_handovers:
            why.append(f"{int(table.incoming.sum())} key(s) on their way here")
        if table.held:
            why.append(f"{len(table.held)} request(s) waiting for keys")
        if any(self._outbox.values()):
            why.append("messages wait for servers not yet known")
        return why

    def write(self, name: str, staging: Path, index: int) -> list[dict[str, Any]]:
        """The keys this node owns with their values and optimiser state (replicas are left out: their
        owners write them, with every replica's change once settled)."""
        table = self._table(name)
        why = self.unsettled(table)
        if why:
            raise CheckpointError(f"placement of {name!r} is still settling ({'; '.join(why)}); try again")
        store = table.store
        with store.hold(None, exclusive=False):
            keys = np.flatnonzero(table.presence == OWNED)
            arrays = {key: array[keys] for key, array in store.state_arrays().items()}
        return [{**checkpoint.write_part(staging, index, f"n{self.node}-owned", keys, arrays), "node": self.node}]

    def restore(self, name: str, path: Path, entry: dict[str, Any], write: bool) -> int:
        """Put the rows of this node's home keys in place (``write`` False: only check that they fit);
        a job restores before keys move."""
        table = self._table(name)
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
        with table.store.hold(None, exclusive=True):
            place_saved(table.store.state_arrays(), keys[mine], arrays, mine, table.spec.name, write)
        return int(mine.size)

    def describe(self) -> dict[str, Any]:
        return {name: {"owned": int((t.presence == OWNED).sum()), "replicas": int((t.presence == REPLICA).sum()),
                       "window": t.window, "held": len(t.held), **dict(t.stats)} for name, t in self.tables.items()}

    def close(self) -> None:
        for table in self.tables.values():
            table.close()


def _group(where: np.ndarray, keys: np.ndarray) -> list[tuple[int, np.ndarray]]:
    return [(int(n), keys[where == n]) for n in np.unique(where)]


def _bits(mask: int) -> list[int]:
    return [i for i in range(64) if (int(mask) >> i) & 1]


def _node(value: Any, table: AdaptiveTable) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < table.num_nodes:
        raise ValueError(f"bad node {value!r}")
    return value


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1 << 20:
        raise ValueError(f"bad count {value!r}")
    return value
