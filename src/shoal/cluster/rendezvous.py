"""The rendezvous: where servers and workers find each other, and where barriers meet.

It holds membership (who is there, at which address), barrier generations and
the layouts of static tables (which server holds each slice, see
``cluster.slices``), never parameters, so it is not a scheduler: once a worker
knows the servers and layouts, the data path never touches it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shoal.api.config import RebalancePolicy, TableSpec
from shoal.api.errors import ClusterError, ProtocolError, ReplayError, ServerError, ShoalError
from shoal.api.ids import SERVERS, server_sender
from shoal.cluster.replay import ReplayGuard, Verdict
from shoal.cluster.roles import RENDEZVOUS_OPS, Roles
from shoal.cluster.slices import SliceAuthority
from shoal.cluster.throttle import ThrottledWarnings
from shoal.placement.layout import check_limits
from shoal.transport.base import Transport, is_loopback
from shoal.wire import bodies
from shoal.wire.codec import Codec
from shoal.wire.message import Message
from shoal.wire.ops import Flag, Op
from shoal.wire.schema import BarrierNote, is_int64

log = logging.getLogger(__name__)

_POLL_S = 0.4  # longest a server's heartbeat is held waiting for a move to hand it
_STALL_S = 0.5  # the loop wakes every 0.1 s at most: a longer gap is time it did not run


@dataclass
class Member:
    role: str
    node: int
    rank: int
    address: str
    pid: int
    metrics: str | None = None  # its Prometheus endpoint, if it has one


class Rendezvous:
    """Membership and barriers for one cluster of ``num_nodes`` servers and ``num_workers`` workers."""

    def __init__(
        self,
        transport: Transport,
        codec: Codec,
        address: str,
        cluster_id: str,
        num_nodes: int,
        num_workers: int,
        dead_after_s: float = 2.0,
        now: Callable[[], float] = time.monotonic,
        rebalance: RebalancePolicy | None = None,
        end_when_workers_leave: bool = True,
    ) -> None:
        self.codec = codec
        self.cluster_id = cluster_id
        self.num_nodes = num_nodes
        self.num_workers = num_workers
        self.listener = transport.listen(address)
        self.address = self.listener.address
        self.codec = codec.for_wire(is_loopback(self.address))
        self.roles = Roles(num_workers, num_nodes)
        self.servers: dict[int, Member] = {}
        self.workers: dict[int, Member] = {}
        self.left: set[int] = set()
        self._exited_workers: set[int] = set()  # ``worker_exited``: taken by the serve loop
        self.shutdown_requested = False
        #: False: the cluster lives on after every worker left, until shut down (embedded clusters, tests)
        self.end_when_workers_leave = end_when_workers_leave
        self.dead_after_s = dead_after_s
        self.now = now
        self.last_seen: dict[int, float] = {}
        #: servers whose process is known to have ended (the local launcher watches them): dead at once
        self.exited: set[int] = set()
        #: departed servers that stopped reading, with the last request of each worker they handled
        self.gone: dict[int, list[list[int]]] = {}
        self.incarnations: dict[int, int] = {}
        self.worker_incarnations: dict[int, int] = {}
        #: table specs as created by workers, so a restarted server can recreate its tables
        self.tables: dict[str, dict[str, Any]] = {}
        #: which workers created each table, and the tables already warned of as created by only some
        self._creators: dict[str, set[int]] = {}
        self._warned_tables: set[str] = set()
        self._barriers: dict[int, list[tuple[bytes, Message, bodies.Barrier]]] = {}
        #: layouts of static tables, slice moves, joins, drains and the rebalancer
        self.slices = SliceAuthority(num_nodes, rebalance or RebalancePolicy(enabled=False), now)
        #: servers' heartbeats held as long polls: node -> (peer, request, answer-by time)
        self._polls: dict[int, tuple[bytes, Message, float]] = {}
        # A request sent again is answered again, never served twice (a REGISTER counts incarnations).
        self._replay = ReplayGuard(keep_reply_bytes=1 << 20)
        self._told_finished: set[int] = set()
        self._warnings = ThrottledWarnings(log)  # bad messages may come by the thousand
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --------------------------------------------------------------- running

    def start(self) -> Rendezvous:
        self._thread = threading.Thread(target=self.serve, name="shoal-rendezvous", daemon=True)
        self._thread.start()
        return self

    def serve(self) -> None:
        last = self.now()
        while not self._stop.is_set():
            # A loop that did not run for a while (an overloaded machine) heard no heartbeat either:
            # that silence is ours, not the servers'.
            now = self.now()
            stalled = now - last - _STALL_S
            if stalled > 0:
                for node in self.last_seen:
                    self.last_seen[node] += stalled
            last = now
            # Once the job is finished, look often: held polls are answered and ``stop`` joins at once.
            item = self.listener.recv(0.002 if self.finished else 0.02 if self._polls else 0.1)
            try:
                if item is not None:
                    self._handle(*item)
                if self._exited_workers - self.left:
                    self._workers_left(self._exited_workers - self.left)
                self._end_moves_of_dead_servers()
                self.slices.tick()
                self._answer_polls()
            except Exception:  # one bad message must not end the cluster's rendezvous
                log.exception("rendezvous: failure handling a message")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.listener.close()

    def linger(self, host_node: int, timeout_s: float) -> None:
        """Keep answering until every other live server has been told that the job is finished,
        at most ``timeout_s``: used where a server hosts the rendezvous."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            alive = self.alive()
            waiting = [n for n in range(self.num_nodes) if n != host_node and alive[n] and n not in self._told_finished]
            if not waiting:
                return
            time.sleep(0.05)

    # ---------------------------------------------------------------- status

    @property
    def ready(self) -> bool:
        return all(n in self.servers or n in self.slices.departed for n in range(self.num_nodes))

    @property
    def departed(self) -> set[int]:
        """Servers that handed over all their slices and left."""
        return self.slices.departed

    @property
    def finished(self) -> bool:
        return self.shutdown_requested or (self.end_when_workers_leave and self.num_workers > 0
                                           and len(self.left) >= self.num_workers)

    def alive(self) -> list[bool]:
        """Servers heard from within ``dead_after_s`` (their heartbeats come every half second) whose
        process is not known to have ended."""
        now = self.now()
        return [n in self.last_seen and now - self.last_seen[n] <= self.dead_after_s and n not in self.departed
                and n not in self.exited for n in range(self.num_nodes)]

    def server_exited(self, node: int) -> None:
        """The process of server ``node`` has ended (its launcher saw it): it is dead now, not once its
        heartbeats have been missed for ``dead_after_s``. Called from the launcher's thread."""
        self.exited.add(node)

    def _end_moves_of_dead_servers(self) -> None:
        """A move whose source died never reports its end: give it up, or the table's later moves
        (the rebalancer's, a drain's) wait behind it for good."""
        if not self.slices.active:
            return
        alive = self.alive()
        for node in {item.move.source for item in self.slices.active.values()}:
            if node in self.exited or (node in self.last_seen and not alive[node]):
                self.slices.source_gone(node)

    def worker_exited(self, rank: int) -> None:
        """The process of worker ``rank`` has ended well (its launcher saw it), whether or not it said
        goodbye: it reaches no barrier any more. Called from the launcher's thread; the serve loop
        takes it as the worker's leaving."""
        self._exited_workers.add(rank)

    def status(self) -> dict[str, Any]:
        members = {f"{m.role} {m.node if m.role == 'server' else m.rank}": m
                   for m in [*self.servers.values(), *self.workers.values()]}
        return {
            "cluster_id": self.cluster_id,
            "num_nodes": self.num_nodes,
            "num_workers": self.num_workers,
            "servers": [self.servers[n].address if n in self.servers and n not in self.departed else None
                        for n in range(self.num_nodes)],
            "departed": sorted(self.departed),
            "layouts": self.slices.all_layouts(),
            "workers": sorted(self.workers),
            "pids": {name: m.pid for name, m in members.items()},
            "metrics": {name: m.metrics for name, m in members.items() if m.metrics},
            "left": sorted(self.left),
            "ready": self.ready,
            "finished": self.finished,
            "alive": self.alive(),
            "exited": sorted(self.exited),
            "gone": {str(n): handled for n, handled in self.gone.items()},
            "incarnations": [self.incarnations.get(n, 0) for n in range(self.num_nodes)],
            "tables": list(self.tables.values()),
            "barriers": {str(g): sorted(b.rank for _, _, b in w) for g, w in self._barriers.items()},
        }

    # -------------------------------------------------------------- handling

    def _reply(self, peer: bytes, msg: Message) -> None:
        """Send the reply ``msg`` (kept, to answer a repeat of its request with)."""
        frames = self.codec.encode(msg)
        self._replay.answered(msg.incarnation, msg.req, frames, sum(len(f) for f in frames))
        self.listener.send(peer, frames)

    def _handle(self, peer: bytes, frames: list) -> None:
        try:
            msg = self.codec.decode(frames)
        except ShoalError as exc:
            self._warnings.warn("bad message", "rendezvous: dropping bad message: %s", exc)
            req = getattr(exc, "req", None)
            if isinstance(req, int):
                err = bodies.Error.about(exc).to_message(req=req)
                self.listener.send(peer, Codec(self.codec.limits).encode(err))
            return
        try:
            if self._repeated(peer, msg):
                return
            self.roles.check(msg, RENDEZVOUS_OPS)
            self._dispatch(peer, msg)
        except ShoalError as exc:  # a request that cannot be met gets a typed error, not silence
            self._reply(peer, bodies.Error.about(exc, "rendezvous").reply_to(msg))
        except Exception as exc:  # a bug: report it and answer (unanswered, its repeats would wait for good)
            log.exception("rendezvous: failure serving %s", msg.op.name)
            self._reply(peer, bodies.Error.about(ServerError(f"rendezvous failed serving {msg.op.name}: {exc!r}"))
                        .reply_to(msg))

    def _repeated(self, peer: bytes, msg: Message) -> bool:
        """Whether ``msg`` repeats one already here (answered again if its reply was kept); raises
        ``ReplayError`` for one older than what is remembered of its sender."""
        redoable = msg.op == Op.LAYOUT or (msg.op == Op.CLUSTER_STATUS and msg.sender < SERVERS)
        verdict, reply = self._replay.admit(msg.sender, msg.incarnation, msg.req, bool(msg.flags & Flag.NO_REPLY),
                                            redoable)
        if verdict is Verdict.STALE:
            self._warnings.warn("replayed", "rendezvous: refused a replayed %s from sender %s", msg.op.name,
                                msg.sender)
            raise ReplayError(f"request {msg.req} of sender {msg.sender} was served already, or is older than "
                              "this rendezvous remembers")
        if verdict is Verdict.NEW or (verdict is Verdict.ANSWERED and reply is None and redoable):
            return False  # new, or a read whose reply was not kept: read again
        if reply is not None and not msg.flags & Flag.NO_REPLY:  # sent again by a peer that did not hear back
            self.listener.send(peer, reply)
        return True

    def _dispatch(self, peer: bytes, msg: Message) -> None:
        if msg.op == Op.REGISTER:
            incarnation = self._register(msg)
            self._reply(peer, msg.reply(Op.OK, {**self.status(), "incarnation": incarnation}))
        elif msg.op == Op.CLUSTER_STATUS:
            report = bodies.ClusterStatus.of(msg)
            node = report.node
            if report.role == "server" and node is not None:
                self.last_seen[node] = self.now()
                if report.load is not None:
                    self.slices.on_load(node, report.load)
                behind = report.registered is not None and report.registered < sum(self.incarnations.values())
                if report.poll and not behind and not self.slices.commands(node) and not self.finished:
                    # Long poll: answer when there is a move for this server, or in a moment anyway.
                    self._polls[node] = (peer, msg, time.monotonic() + _POLL_S)
                    return
                # A poll answered for news it missed is held again at once (the job's end, a move for
                # it, come as the answer of a held poll).
                self._answer_server(node, peer, msg, early=bool(report.poll and behind))
                return
            self._reply(peer, msg.reply(Op.OK, self.status()))
        elif msg.op == Op.CREATE_TABLE:
            create = bodies.CreateTable.of(msg)
            spec = create.spec
            if msg.table not in self.tables:
                parsed = TableSpec.from_dict(spec)
                if parsed.name != msg.table:
                    raise ProtocolError(f"CREATE_TABLE for {msg.table!r} carries a spec named {parsed.name!r}")
                # As a server does: every status carries the table's layout, and servers build it.
                check_limits(parsed, self.codec.limits, self.num_nodes)
                if create.plan:  # where its slices would go; registered once the servers built it
                    body = self.slices.plan(parsed) or {}
                    body["servers"] = self.status()["servers"]
                    self._reply(peer, msg.reply(Op.OK, body))
                    return
                self.slices.add_table(parsed, create.layout)
            self.tables.setdefault(msg.table, spec)
            self._creators.setdefault(msg.table, set()).add(msg.sender)  # a worker (roles.py)
            if not msg.flags & Flag.NO_REPLY:  # the reply carries where the slices are now
                body = self.slices.describe(msg.table) if msg.table in self.slices.layouts else {}
                body["servers"] = self.status()["servers"]
                self._reply(peer, msg.reply(Op.OK, body))
        elif msg.op == Op.LAYOUT:
            body = self.slices.describe(msg.table)
            body["servers"] = self.status()["servers"]
            self._reply(peer, msg.reply(Op.OK, body))
        elif msg.op == Op.MOVE_SLICE:
            move = bodies.MoveSlice.of(msg)
            self.slices.request_move(msg.table, move.shard, move.to, self._answer_when_done(peer, msg))
        elif msg.op == Op.MOVE_DONE:
            done = bodies.MoveDone.of(msg)
            if msg.sender == server_sender(done.to):  # the new owner: it has every row
                self.slices.taken(msg.table, done.shard, done.to, done.epoch)
            else:
                self.slices.move_done(msg.table, done.shard, done.to, done.epoch, done.ok)
            # What was decided, so that an old owner that saw the move fail does not serve again a
            # slice its new owner took.
            self._reply(peer, msg.reply(Op.OK, self.slices.describe(msg.table)))
        elif msg.op == Op.DRAIN:
            self.slices.drain(bodies.Drain.of(msg).node, self._answer_when_done(peer, msg))
        elif msg.op == Op.BARRIER:
            self._barrier(peer, msg)
        elif msg.op == Op.LEAVE:
            leaving = bodies.Leave.of(msg)
            handled = _handled(leaving.handled)
            if not msg.flags & Flag.NO_REPLY:
                self._reply(peer, msg.reply(Op.OK))
            if leaving.role == "server" and leaving.node is not None:
                self.gone[leaving.node] = handled
            elif leaving.role == "worker" and leaving.rank is not None:
                self._replay.retire(msg.sender)
                self._workers_left({leaving.rank})
        elif msg.op == Op.SHUTDOWN:
            self.shutdown_requested = True
            self._reply(peer, msg.reply(Op.OK))
        elif msg.op == Op.PING:
            self._reply(peer, msg.reply(Op.OK))
        else:
            error = ProtocolError(f"rendezvous does not serve {msg.op.name}")
            self._reply(peer, bodies.Error.about(error).reply_to(msg))

    def _answer_server(self, node: int, peer: bytes, msg: Message, early: bool = False) -> None:
        self._polls.pop(node, None)
        status = self.status()
        status["moves"] = self.slices.commands(node)
        status["poll_again"] = early  # answered before its time for news of all: the next poll at once
        if status["finished"]:
            self._told_finished.add(node)
        self._reply(peer, msg.reply(Op.OK, status))

    def _answer_polls(self, every: bool = False) -> None:
        """Servers waiting on a long poll: answer those with a move to make, or whose wait is over
        (``every``: all of them, the servers they know having changed)."""
        if not self._polls:
            return
        now = time.monotonic()
        for node, (peer, msg, deadline) in list(self._polls.items()):
            if now >= deadline or self.finished or self.slices.commands(node):
                self._answer_server(node, peer, msg)
            elif every:
                self._answer_server(node, peer, msg, early=True)

    def _answer_when_done(self, peer: bytes, msg: Message) -> Callable[[ClusterError | None], None]:
        def done(error: ClusterError | None) -> None:
            if error is None:
                self._reply(peer, msg.reply(Op.OK))
            else:
                self._reply(peer, bodies.Error.about(error).reply_to(msg))
        return done

    def _register(self, msg: Message) -> int:
        """Add a member; returns how many times its node (a server) or rank (a worker) has registered,
        its incarnation: a restarted process must not be mistaken for its earlier self."""
        b = bodies.Register.of(msg)
        member = Member(b.role, b.node, b.rank, b.address, b.pid, b.metrics)
        if member.role == "server" and member.node >= self.num_nodes:
            if member.node != self.num_nodes:
                raise ClusterError(f"a joining server takes node {self.num_nodes}, the next free one, "
                                   f"not {member.node}")
            self.num_nodes += 1  # a server joining a running cluster: it gets slices to serve
            self.roles.num_nodes = self.num_nodes
            log.info("server %d joined at %s", member.node, member.address)
        if member.role == "server":
            self.slices.server_joined(member.node)
            if member.node in self.servers and self.servers[member.node].address != member.address:
                log.info("server of node %d re-registered at %s", member.node, member.address)
            self.servers[member.node] = member
            self.incarnations[member.node] = self.incarnations.get(member.node, 0) + 1
            self.last_seen[member.node] = self.now()
            self.exited.discard(member.node)
            self.gone.pop(member.node, None)
            # Servers whose heartbeats wait here learn its address now: what they have for it (a
            # replica's gossip, placement messages) would otherwise wait for their next heartbeat.
            self._answer_polls(every=True)
            return self.incarnations[member.node]
        if member.rank in self.workers:  # a restarted worker: drop what its old self left waiting
            for waiting in self._barriers.values():
                waiting[:] = [(p, m, b) for p, m, b in waiting if b.rank != member.rank]
        self.workers[member.rank] = member
        self.left.discard(member.rank)
        self._exited_workers.discard(member.rank)
        self.worker_incarnations[member.rank] = self.worker_incarnations.get(member.rank, 0) + 1
        return self.worker_incarnations[member.rank]

    def _barrier(self, peer: bytes, msg: Message) -> None:
        barrier = bodies.Barrier.of(msg)
        gen = barrier.generation
        waiting = self._barriers.setdefault(gen, [])
        waiting.append((peer, msg, barrier))
        arrived = {b.rank for _, _, b in waiting}
        if self._fail_if_unreachable(gen):
            return
        if len(arrived) >= self.num_workers:
            # What ranks said on arrival (an outcome rank 0 decided, say) goes back to everyone.
            notes = {str(b.rank): b.note for _, _, b in waiting if BarrierNote.from_body(b.note) is not None}
            for p, m, _ in self._barriers.pop(gen):
                self._reply(p, m.reply(Op.OK, {"notes": notes}))
            self._warn_of_unshared_tables()

    def _warn_of_unshared_tables(self) -> None:
        """Every worker is meant to create the same tables. Once all have met (at a barrier, or at the
        end), a table only some created is most likely a misspelt name, with which those workers train
        a model of their own: say so, once per table."""
        everyone = set(range(self.num_workers))
        for name, creators in sorted(self._creators.items()):
            if creators == everyone or name in self._warned_tables:
                continue
            self._warned_tables.add(name)
            others = sorted(t for t, c in self._creators.items() if c != everyone and c & (everyone - creators))
            log.warning("table %r was created by worker(s) %s only, not by %s%s: each worker must create the "
                        "same tables, or the workers that differ train separate models", name, sorted(creators),
                        sorted(everyone - creators),
                        f" (they created {', '.join(map(repr, others))})" if others else "")

    def _workers_left(self, ranks: set[int]) -> None:
        """Workers that said goodbye, or whose processes ended: the barriers they never reached fail."""
        self.left |= ranks
        for gen in list(self._barriers):
            self._fail_if_unreachable(gen)
        if len(self.left) >= self.num_workers:
            self._warn_of_unshared_tables()

    def _fail_if_unreachable(self, gen: int) -> bool:
        """A barrier that a finished worker has not reached can never complete: fail every rank waiting
        in it now, naming the finished ranks, instead of after the barrier timeout."""
        waiting = self._barriers.get(gen, [])
        arrived = {b.rank for _, _, b in waiting}
        gone = sorted(self.left - arrived)
        if not gone:
            return False
        error = ClusterError(f"barrier {gen} cannot complete: rank(s) {gone} finished (called shutdown, or "
                             f"their processes ended) without reaching it; arrived rank(s) {sorted(arrived)}")
        for p, m, _ in self._barriers.pop(gen):
            self._reply(p, bodies.Error.about(error, "rendezvous").reply_to(m))
        return True


def _handled(entries: list[list[int]] | None) -> list[list[int]]:
    """A leaving server's ``[rank, incarnation, seq]`` per worker stream, checked."""
    entries = entries or []
    if not all(isinstance(e, list) and len(e) == 3 and all(is_int64(v) and v >= 0 for v in e) for e in entries):
        raise ProtocolError(f"a server's goodbye names [rank, incarnation, seq] per worker, got {entries!r}")
    return entries
