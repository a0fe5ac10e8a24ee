"""A server's replicated tables: its replicas of their shards, and gossip with the other replicas.

Every replica accepts pushes and serves pulls (multi-master). Gossip runs on
the server's loop: on each table's jittered schedule a replica sends its
version vector to one random live peer replica of the shard, which answers with
what the first lacks and its own vector, and so on (``replication.gossip``).
Peers are found through the rendezvous' status: addresses, liveness from
heartbeats, and a restarted peer's new address. Under a bound (BSP, SSP, ESSP) a
replica holds a read until every worker's clock tick has said how many pushes
it had made by then, and answers with the version the read must cover
(``replication.bounds``); the reader merges replicas until it does. Under ESSP
a replica also pushes the rows a worker reads from it to that worker as soon as
it holds what a later clock requires (``replication.eager``).
"""

from __future__ import annotations

import logging
import random
import secrets
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from shoal.api.config import ClusterSpec, TableSpec
from shoal.api.errors import (
    CheckpointError,
    ConfigError,
    KeyRangeError,
    ProtocolError,
    RequestTimeoutError,
    ShoalError,
    TableError,
)
from shoal.api.ids import MAX_INCARNATIONS, MAX_RANKS, RESTORED, server_node, worker_origin
from shoal.consistency.clocks import FINISHED, ClockTable
from shoal.placement.layout import TableLayout
from shoal.replication.bounds import PushCounts
from shoal.replication.eager import Subscribers
from shoal.replication.gossip import ANSWER, DIGEST, FINAL, GossipPayload, GossipSchedule
from shoal.replication.replica import ShardReplica
from shoal.server.peers import PeerDirectory
from shoal.server.streams import position_of
from shoal.server.tables import table_bytes
from shoal.storage import checkpoint
from shoal.storage.validate import as_keys, as_rows, drop_nonfinite
from shoal.wire import bodies
from shoal.wire.message import Message
from shoal.wire.ops import Op

log = logging.getLogger(__name__)

#: the propagation delays a replica reports for the model: those of the last few seconds
DELAY_WINDOW_S = 5.0


class ReplicatedTable:
    """This server's replicas of one replicated table."""

    def __init__(self, spec: TableSpec, num_nodes: int, node: int, rng: random.Random, clocks: ClockTable) -> None:
        if spec.replicas > num_nodes:
            raise ConfigError(f"table {spec.name!r} wants {spec.replicas} replicas on {num_nodes} server(s)")
        self.spec = spec
        self.layout = TableLayout.initial(spec, num_nodes)
        self.node = node
        self.replicas = {
            shard: ShardReplica(spec, shard, self.layout.mapping.keys_of(shard), node)
            for shard in range(self.layout.num_shards) if node in self.layout.replica_nodes(shard)
        }
        self.schedule = GossipSchedule(spec.gossip_ms / 1000.0, rng)
        bound = spec.consistency.bound
        #: under a bound: the workers' push counts at each clock, and the reads waiting for them
        # Before the table was made no worker pushed to it: the clocks known now start its counts.
        self.counts = None if bound is None else PushCounts(clocks.num_workers, self.layout.num_shards, bound,
                                                            [int(c) for c in clocks.learned])
        self.held: list[tuple[float, bytes, Message]] = []
        #: under ESSP: the workers that read each shard here, to push its rows to
        self.subscribers = Subscribers() if spec.consistency.eager else None
        self._keys = {shard: self.layout.mapping.keys_of(shard) for shard in self.replicas}

    def keys_at(self, shard: int, rows: np.ndarray) -> np.ndarray:
        """The keys of ``rows`` of ``shard``."""
        return self._keys[shard][rows]

    def replica(self, shard: int) -> ShardReplica:
        replica = self.replicas.get(shard)
        if replica is None:
            raise KeyRangeError(f"server {self.node} holds no replica of shard {shard} of table {self.spec.name!r}")
        return replica

    def rows_of(self, msg: Message, shard: int | None) -> tuple[ShardReplica, np.ndarray, np.ndarray]:
        """The replica a message names (its body's ``shard``), its keys, and their rows; keys must lie in
        that shard."""
        if shard is None:
            raise ProtocolError(f"{msg.op.name} on replicated table {self.spec.name!r} must name its shard")
        replica = self.replica(shard)
        keys = as_keys(msg.arrays[0], self.spec)
        rows = self.layout.mapping.rows_in(keys, shard)
        if rows is None:
            raise KeyRangeError(f"keys of {msg.op.name} are not all in shard {shard} of table {self.spec.name!r}")
        return replica, keys, rows


class ReplicationService:
    """Replicated tables of one server, and the gossip between replicas."""

    def __init__(self, node: int, cluster: ClusterSpec, peers: PeerDirectory,
                 reply: Callable[[bytes, Message], None], clocks: ClockTable, rng: random.Random | None = None,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.node = node
        #: the worker clocks this server has learned (a bounded table's counts start from them)
        self.clocks = clocks
        self.cluster = cluster
        self.reply = reply
        self.rng = rng or random.Random()
        self.tables: dict[str, ReplicatedTable] = {}
        self.alive = [True] * cluster.num_nodes
        #: when each server was last seen to die, and when each peer replica of a shard last answered a
        #: gossip digest of ours: a push waiting for one that only a dead replica had is given up once
        #: every live peer has answered since the death (what they had, we have)
        self.now = now
        self._died_at: dict[int, float] = {}
        self._incarnations: dict[int, int] = {}
        #: servers known to have registered (a status called them alive or counted an incarnation of
        #: them): only those can die
        self._registered: set[int] = set()
        self._answered_at: dict[tuple[str, int, int], float] = {}
        self._waiting_since: dict[tuple[str, int], float] = {}
        self.peers = peers
        self.stats: Counter[str] = Counter()
        self._held_replies: dict[int, tuple[bytes, Message]] = {}  # token -> waiting push (W > 1)
        self._tokens = 0
        self._series = secrets.token_hex(4)  # eager messages of a restarted server are a new series

    # ------------------------------------------------------------ membership

    def on_status(self, status: dict[str, Any]) -> None:
        """Follow the rendezvous: which servers live (a restarted one is new: its replicas start empty)."""
        alive = [bool(a) for a in status.get("alive", self.alive)]
        incarnations = status.get("incarnations") or []
        for n, lives in enumerate(alive):
            # A server not registered yet is not alive either, but it has not died: taken for dead, it
            # let a push that waits for an earlier one of its worker be applied past the gap. One that
            # registered and died between two statuses of ours (a short job on a busy machine) was
            # never called alive here, but it died all the same: what only it had is not coming.
            registered = lives or (n < len(incarnations) and int(incarnations[n]) >= 1)
            was_alive = n in self._registered and n < len(self.alive) and self.alive[n]
            if not lives and registered and (was_alive or n not in self._registered):
                self._died_at[n] = self.now()
            if registered:
                self._registered.add(n)
        self.alive = alive
        for n, incarnation in enumerate(incarnations):
            previous = self._incarnations.get(n, 1)  # unheard of until now: its first process, if 1
            if previous >= 1 and int(incarnation) > previous:  # a process started in a dead one's place
                self._died_at[n] = self.now()
            self._incarnations[n] = int(incarnation)

    def missing_peers(self) -> bool:
        """Whether a peer replica's address is still unknown (it has not registered yet, as at start-up):
        until it is, this server's replicas cannot gossip with it, and a push only one of them took
        is at risk if that server dies."""
        return any(n != self.node and n not in self.peers.addresses
                   for table in self.tables.values() for shard in table.replicas
                   for n in table.layout.replica_nodes(shard))

    keeps_rows_across_restart = True  # a replica started again regains its rows by gossip
    served_by_joined_servers = False  # replicas sit on the nodes the table was made on

    def build(self, spec: TableSpec, current: dict[str, Any] | None = None) -> ReplicatedTable:
        return ReplicatedTable(spec, self.cluster.num_nodes, self.node, self.rng, self.clocks)

    def install(self, spec: TableSpec, built: ReplicatedTable) -> None:
        self.tables[spec.name] = built

    def bytes_here(self, spec: TableSpec) -> int:
        num_nodes = self.cluster.num_nodes  # each shard has a replica on ``replicas`` of the nodes
        return -(-table_bytes(spec) * min(spec.replicas, num_nodes) // num_nodes)

    def spec(self, name: str) -> TableSpec:
        return self._table(name).spec

    def shards(self, name: str) -> list[int]:
        return sorted(self._table(name).replicas)

    def _table(self, name: str) -> ReplicatedTable:
        table = self.tables.get(name)
        if table is None:
            raise TableError(f"server {self.node} has no replicated table {name!r}")
        return table

    def share(self, name: str, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        raise TableError(f"replicated table {name!r} is reached through its replicas, not shared memory")

    def describe(self) -> dict[str, list[int]]:
        """The shards this server holds a replica of, by table."""
        return {name: sorted(table.replicas) for name, table in self.tables.items()}

    # -------------------------------------------------------------- requests

    def handle(self, peer: bytes, msg: Message) -> Message | None:
        table = self._table(msg.table)
        if msg.op == Op.PUSH:
            return self._push(table, peer, msg, bodies.Push.of(msg))
        if msg.op == Op.PULL:
            pull = bodies.Pull.of(msg)
            replica, _, rows = table.rows_of(msg, pull.shard)
            need: dict[str, Any] = {}
            if table.counts is not None:
                required = table.counts.required(replica.shard, msg.clock - table.counts.bound)
                if required is None:  # a worker has not said yet what it pushed before that clock
                    table.held.append((self.now(), peer, msg))
                    self.stats["bounded_reads_held"] += 1
                    return None
                need["need"] = sorted([o, s] for o, s in required.items())
            if pull.subscribe and table.subscribers is not None and 0 <= msg.sender < self.cluster.num_workers:
                need["rows_seq"] = table.subscribers.subscribe(msg.sender, peer, replica, rows)
                need["series"] = self._series
            if pull.totals:
                return msg.reply(Op.TOTALS, need or None, arrays=list(replica.totals(rows)))
            version = [[o, s] for o, s in sorted(replica.version().items())]
            return msg.reply(Op.VALUES, {"vv": version, **need}, arrays=[replica.read(rows)])
        if msg.op == Op.GOSSIP:
            self._gossip_in(table, msg)
            return None
        if msg.op == Op.GOSSIP_PERIOD:
            micros = bodies.GossipPeriod.of(msg).micros
            if not 1_000 <= micros <= 60_000_000:
                raise ConfigError(f"gossip period must lie in [1, 60000] ms, got {micros / 1000} ms")
            table.schedule.change(micros / 1e6)
            return msg.reply(Op.OK)
        if msg.op == Op.REPLICA_STATS:
            replica = table.replica(bodies.ReplicaStats.of(msg).shard)
            # At least two rounds of the slowest gossip (+-50%): a window without a whole round sees
            # only the end of the last one, its shortest delays.
            window = max(DELAY_WINDOW_S, 3.0 * table.schedule.period_s)
            delays = [[n, s.recent(window, 32, 512)] for n, s in sorted(replica.delays.items())]
            return msg.reply(Op.OK, {"shard": replica.shard, "node": self.node, "delays": delays,
                                     "rate": replica.accept_rate(), "vv": sorted(replica.version().items())})
        raise ProtocolError(f"replicated table {msg.table!r} does not serve {msg.op.name}")

    def on_clock(self, msg: Message) -> None:
        """A worker's clock tick: learn its push counts per shard of each bounded table, and answer the
        reads that were waiting for them."""
        bounded = [(name, table) for name, table in self.tables.items() if table.counts is not None]
        if not bounded:
            return
        body = bodies.Clock.of(msg)
        position = position_of(msg)
        if position is None:
            raise ProtocolError("a clock tick carries its place in its worker's stream")
        pushed = body.pushed or {}
        for name, table in bounded:
            assert table.counts is not None
            counts = pushed.get(name)
            if counts is not None and not (isinstance(counts, list) and all(
                    isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts)):
                raise ProtocolError(f"push counts of {name!r} must be ints >= 0, one per shard, got {counts!r}")
            if body.final:
                advanced = table.counts.finish(msg.sender, position.incarnation, counts)
                if table.subscribers is not None:
                    table.subscribers.drop(msg.sender)
            else:
                advanced = table.counts.report(msg.sender, position.incarnation, msg.clock, counts)
            if advanced and table.held:
                self._release(table)
            if advanced:
                self._push_eagerly(table)

    def _push_eagerly(self, table: ReplicatedTable) -> None:
        """ESSP: tell each subscriber of a shard whose replica here holds every push a read at the slowest
        reported clock must cover that its rows cover that clock, with those that changed since its
        last message. A replica still lacking some is retried when gossip brings them."""
        if table.subscribers is None or table.counts is None or table.counts.slowest >= FINISHED:
            return
        clock = table.counts.slowest
        for shard, replica in table.replicas.items():
            if not table.subscribers.waiting(shard, clock):
                continue
            required = table.counts.required(shard, clock)
            have = replica.version()
            if required is None or any(have.get(o, 0) < s for o, s in required.items()):
                continue
            vv = wire_version(replica)
            for update in table.subscribers.due(replica, clock):
                body = bodies.Rows([shard], update.seq, self._series, covers=clock, vv=vv)
                rows = body.to_message(table=table.spec.name, clock=clock,
                                       arrays=[table.keys_at(shard, update.rows), replica.read(update.rows)])
                self.stats["eager_messages"] += 1
                self.stats["eager_rows"] += int(update.rows.shape[0])
                self.reply(update.peer, rows)

    def _release(self, table: ReplicatedTable) -> None:
        held, table.held = table.held, []
        for _, peer, msg in held:
            try:
                reply = self.handle(peer, msg)  # held again if still too early
            except ShoalError as exc:
                reply = bodies.Error.about(exc).reply_to(msg)
            if reply is not None:
                self.reply(peer, reply)

    def _expire_held(self, table: ReplicatedTable) -> None:
        """Reads held so long that their requester has given up: answered with an error."""
        cutoff = self.now() - self.cluster.timeouts.request_s
        expired = [h for h in table.held if h[0] < cutoff]
        if not expired:
            return
        table.held = [h for h in table.held if h[0] >= cutoff]
        assert table.counts is not None
        for _, peer, msg in expired:
            error = RequestTimeoutError(f"read of {table.spec.name!r} at clock {msg.clock} held "
                                        f"{self.cluster.timeouts.request_s:.0f}s: not every worker reached clock "
                                        f"{msg.clock - table.counts.bound} (the slowest is at {table.counts.slowest})")
            self.reply(peer, bodies.Error.about(error).reply_to(msg))

    def _push(self, table: ReplicatedTable, peer: bytes, msg: Message, body: bodies.Push) -> Message | None:
        replica, keys, rows = table.rows_of(msg, body.shard)
        grads = as_rows(msg.arrays[1], keys.shape[0], table.spec, strict_dtype=True)
        rows, grads, _ = drop_nonfinite(rows, grads, table.spec)
        seq, incarnation = body.seq, body.inc
        if seq is None or incarnation is None or not (seq >= 1 and 1 <= incarnation < MAX_INCARNATIONS):
            raise ProtocolError("a push to a replicated table carries its number and its worker's incarnation "
                                f"(body.seq >= 1, body.inc in [1, 2**20)), got {seq!r} and {incarnation!r}")
        if not 0 <= msg.sender < min(self.cluster.num_workers, MAX_RANKS):  # each origin costs a shard of state
            raise ProtocolError(f"push from sender {msg.sender}, which is no worker")
        origin = worker_origin(msg.sender, incarnation)
        if body.floor is not None:
            if not 1 <= body.floor <= seq:
                raise ProtocolError(f"a push's floor lies in [1, its seq {seq}], got {body.floor!r}")
            replica.note_floor(origin, body.floor)
        self._tokens += 1
        accepted = replica.push(rows, grads, origin, seq, token=self._tokens)
        self.stats["replicated_pushes"] += 1
        if accepted is None:  # an earlier numbered push has not arrived yet: answer once it has
            self._held_replies[self._tokens] = (peer, msg)
            self.stats["pushes_held_for_gap"] += 1
            return None
        o, s, at = accepted
        self._answer_held(replica)  # this push may have been the one others waited for
        return msg.reply(Op.OK, {"origin": o, "seq": s, "at": at})

    def _answer_held(self, replica: ShardReplica) -> None:
        self._answer(replica.release_held())

    def _answer(self, released: list[tuple[Any, int, int, float]]) -> None:
        for token, origin, seq, at in released:
            waiting = self._held_replies.pop(token, None)
            if waiting is not None:
                peer, pushed = waiting
                self.reply(peer, pushed.reply(Op.OK, {"origin": origin, "seq": seq, "at": at}))

    # ---------------------------------------------------------------- gossip

    def next_round(self) -> float | None:
        return min((t.schedule.next_at for t in self.tables.values()), default=None)

    def tick(self) -> None:
        """Start the gossip rounds that are due; give up pushes that only a dead replica had."""
        live = {n for n in range(self.cluster.num_nodes) if self.alive[n]}
        for table in self.tables.values():
            if table.held:
                self._expire_held(table)
            self._push_eagerly(table)
            due = table.schedule.due()
            for shard, replica in table.replicas.items():
                if replica.waiting():
                    self._unblock(table, shard, replica, due)
                else:
                    self._waiting_since.pop((table.spec.name, shard), None)
                if not due:
                    continue
                replica.trim_log(live)
                peers = self._live_peers(table, shard)
                if peers:
                    self._send_gossip(table, self.rng.choice(peers), replica.digest())

    def _unblock(self, table: ReplicatedTable, shard: int, replica: ShardReplica, due: bool) -> None:
        """Pushes wait here for earlier ones of their worker. While every replica of the shard lives,
        gossip brings those. If one has died (a process started in its place, this one's own previous
        process included, has lost what it had), ask every live peer; when all have answered since the
        death and since the wait began, what is still missing was only at the dead one: give it up (a
        write quorum of 1 loses what the dead replica had not passed on) and apply the waiting pushes."""
        name = table.spec.name
        waiting_since = self._waiting_since.setdefault((name, shard), self.now())
        deaths = [self._died_at[n] for n in table.layout.replica_nodes(shard) if n in self._died_at]
        if not deaths:
            return
        since = max(*deaths, waiting_since)
        behind = [p for p in self._live_peers(table, shard) if self._answered_at.get((name, shard, p), -1.0) < since]
        if behind:
            if due:
                for peer in behind:
                    self._send_gossip(table, peer, replica.digest())
            return
        self.stats["pushes_given_up_with_dead_replica"] += sum(
            min(w) - replica.lattice.seq(o) - 1 for o, w in replica.held.items() if w)
        self._answer(replica.skip_gaps())
        self._waiting_since.pop((name, shard), None)

    def _live_peers(self, table: ReplicatedTable, shard: int) -> list[int]:
        return [n for n in table.layout.replica_nodes(shard)
                if n != self.node and self.alive[n] and n in self.peers.addresses]

    def _send_gossip(self, table: ReplicatedTable, node: int, payload: GossipPayload) -> None:
        body, arrays = payload.to_wire(table.spec.dim)
        self.stats["gossip_sent"] += 1
        try:
            sent = self.peers.tracker.notify(node, Message(Op.GOSSIP, table=table.spec.name, body=body, arrays=arrays))
        except ShoalError as exc:  # e.g. one origin's whole state exceeds the message limit
            sent = False
            self.stats["gossip_failed"] += 1
            log.error("server %d: gossip for table %r to server %d failed: %s (raise max_message_bytes?)",
                      self.node, table.spec.name, node, exc)
        if not sent and (payload.deltas or payload.states):
            # Not on its way after all (the peer's queue was full): the next answer sends it.
            table.replica(payload.shard).forget_sent(node)

    def _gossip_in(self, table: ReplicatedTable, msg: Message) -> None:
        sender = server_node(msg.sender, self.cluster.num_nodes)
        if sender is None:
            raise ProtocolError(f"gossip from sender {msg.sender}, which is no server")
        replica = table.replica(bodies.Gossip.of(msg).shard)
        try:
            payload = GossipPayload.from_wire(msg.body, msg.arrays, replica.num_rows, table.spec.dim)
        except ValueError as exc:
            raise ProtocolError(f"bad gossip from server {sender}: {exc}") from None
        self.stats["gossip_received"] += 1
        new = replica.absorb(payload)
        self.stats["gossip_updates_new"] += new
        if new:
            self._push_eagerly(table)  # what a read must cover may be here now
        have = replica.version()
        if payload.stage == ANSWER and all(have.get(o, 0) >= s for o, s in payload.version.items()):
            # the peer's whole answer to a digest of ours: we have every update it had
            self._answered_at[(table.spec.name, replica.shard, sender)] = self.now()
        self._answer_held(replica)
        budget = self.cluster.limits.max_message_bytes // 2
        if payload.stage == DIGEST:
            answer = replica.answer(sender, payload, ANSWER, budget)
            self._send_gossip(table, sender, answer)
        elif payload.stage == ANSWER:
            final = replica.answer(sender, payload, FINAL, budget)
            if final.deltas or final.states or final.fills:
                self._send_gossip(table, sender, final)

    # ----------------------------------------------------------- checkpoints

    def settle(self, name: str) -> tuple[list[str], list[list[Any]] | None]:
        """Gossip with every live peer replica now. Returns what else keeps the replicas from being final
        and this server's version per shard (``state_version``: the replicas of a shard agree once theirs
        are equal)."""
        table = self._table(name)
        why = []
        for shard, replica in sorted(table.replicas.items()):
            for node in self._live_peers(table, shard):
                self._send_gossip(table, node, replica.digest())
            if any(replica.held.values()):
                why.append(f"shard {shard} holds pushes that wait for earlier ones")
        return why, [[shard, state_version(replica)] for shard, replica in sorted(table.replicas.items())]

    def write(self, name: str, staging: Path, index: int) -> list[dict[str, Any]]:
        """Every replica here writes its rows with its own optimiser state."""
        table = self._table(name)
        entries = []
        for shard, replica in sorted(table.replicas.items()):
            if any(replica.held.values()):
                raise CheckpointError(f"shard {shard} of {name!r} holds pushes that wait for earlier ones; try again")
            entry = checkpoint.write_part(staging, index, f"n{self.node}-s{shard}",
                                          table.layout.mapping.keys_of(shard), replica.state_arrays())
            entries.append({**entry, "shard": shard, "node": self.node, "version": state_version(replica)})
        return entries

    def restore(self, name: str, path: Path, entry: dict[str, Any], write: bool) -> int:
        """Every replica here takes its keys' rows from the parts, this node's own parts last: where it
        wrote a row, its optimiser state is the one it kept. Returns the rows filled (``write`` False:
        that would be filled, writing nothing)."""
        table = self._table(name)
        # The restored rows of a peer that took the same checkpoint first may be here by gossip: they
        # are the same values, loaded again below, not updates.
        if any(any(seq for origin, seq in r.version().items() if origin != RESTORED) for r in table.replicas.values()):
            raise CheckpointError(f"replicated table {table.spec.name!r} has taken updates already: "
                                  "restore right after creating the tables, before training")
        own_last = sorted(entry["parts"], key=lambda part: part.get("node") == self.node)
        filled = {shard: np.zeros(replica.num_rows, dtype=np.bool_) for shard, replica in table.replicas.items()}
        for keys, arrays in checkpoint.read_parts(path, {**entry, "parts": own_last}):
            shards, rows = table.layout.mapping.locate(keys)
            for shard, replica in table.replicas.items():
                mine = np.flatnonzero(shards == shard)
                if not mine.size:
                    continue
                replica.load(rows[mine], arrays, mine, write)
                filled[shard][rows[mine]] = True
        return sum(int(f.sum()) for f in filled.values())


def wire_version(replica: ShardReplica) -> list[list[int]]:
    """A replica's version vector as sorted ``[origin, seq]`` pairs (origins it has no update of left out)."""
    return sorted([origin, seq] for origin, seq in replica.version().items() if seq)


def state_version(replica: ShardReplica) -> list[list[int]]:
    """``wire_version`` with, after each seq, how many updates the origin's state lacks, their numbers,
    and the fills it took (number, seq then): two replicas hold the same bits exactly when theirs are
    equal (at one version, one may have given up a push the other holds, or added one in another
    order)."""
    entries = []
    for origin, state in replica.lattice.origins.items():
        if state.seq:
            fills = [n for fill in state.filled for n in fill]
            entries.append([origin, state.seq, len(state.gaps), *state.gaps, *fills])
    return sorted(entries)
