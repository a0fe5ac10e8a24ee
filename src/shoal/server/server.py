"""A node's parameter server: one request loop over its shards.

Every request is decoded and checked before it touches state; every failure
becomes a typed error reply and the loop goes on. Co-located workers get the
shards' shared-memory descriptors from the fd-share socket and read and write
local rows themselves; the loop only serves remote peers.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from shoal.api.config import ClusterSpec, TableSpec
from shoal.api.errors import (
    AuthError,
    BudgetError,
    ClusterError,
    ConfigError,
    ProtocolError,
    ReplayError,
    RequestTimeoutError,
    ServerError,
    ShoalError,
    TableError,
)
from shoal.api.ids import RENDEZVOUS, server_sender
from shoal.cluster import membership
from shoal.cluster.fdshare import FdShareServer, socket_name
from shoal.cluster.metrics import CpuAccount, LatencyHistogram, metrics_token
from shoal.cluster.metrics_endpoint import MetricsEndpoint
from shoal.cluster.replay import ReplayGuard, Verdict
from shoal.cluster.requests import RequestTracker
from shoal.cluster.roles import SERVER_OPS, Roles
from shoal.cluster.throttle import ThrottledWarnings
from shoal.consistency.clocks import ClockTable
from shoal.consistency.reached import ReachedClocks
from shoal.placement.layout import check_limits
from shoal.server.adaptive import AdaptiveService
from shoal.server.builds import TableBuilds
from shoal.server.checkpoints import CheckpointService
from shoal.server.lane import ServerLane
from shoal.server.metrics import server_families
from shoal.server.peers import PeerDirectory
from shoal.server.replicated import ReplicationService
from shoal.server.service import TableService
from shoal.server.slicing import SliceService
from shoal.server.static import StaticService
from shoal.server.streams import StaleRequestError, StreamOrder
from shoal.server.sync import Synchroniser
from shoal.server.tables import ServedTable, SliceMoving, read_after_push
from shoal.storage.segment import Segment
from shoal.transport.base import Transport, is_loopback, loopback_host
from shoal.wire import bodies
from shoal.wire.codec import Codec, frames_nbytes
from shoal.wire.message import Message
from shoal.wire.ops import OP_NAMES, Flag, Op

log = logging.getLogger(__name__)

_HEARTBEAT_S = 0.5
_PEER_WAIT_S = 0.02  # heartbeat period while something waits for a peer's address
_BURST_S = 0.01  # longest stretch of message handling between timer runs
_TIMERS_EVERY_S = 0.002  # while requests keep coming, timers run at most this often
# ... and only when one has something to do (``_timers_due``), but at least this often: what a timer's
# own test would miss waits no longer than an idle loop's longest sleep
_TIMERS_AT_LEAST_S = 0.05
# How often the loop looks for a table built off it, while one is: at 10 ms, a job's set-up waited
# 5-10 ms per table for it.
_BUILD_POLL_S = 0.001
#: requests served again when repeated after their reply was too large to keep
_IDEMPOTENT = frozenset({Op.PULL, Op.STATS, Op.PING, Op.CLOCK, Op.REPLICA_STATS})
#: requests whose repeat is served again when its reply was not kept (a push_pull's read alone)
_REDOABLE = _IDEMPOTENT | {Op.PUSH_PULL}
#: requests that read or write a table's rows (refused for a table whose rows here were lost)
_DATA_OPS = frozenset({Op.PULL, Op.PUSH, Op.PUSH_PULL, Op.LOCALIZE, Op.INTENT})
#: requests a table's service serves (each kind serves those it knows)
_TABLE_OPS = _DATA_OPS | {Op.GOSSIP, Op.REPLICA_STATS, Op.PLACEMENT, Op.GOSSIP_PERIOD}
_OP_COUNTERS = {op: f"op_{name.lower()}" for op, name in OP_NAMES.items()}


def _registrations(status: dict[str, Any]) -> int:
    """How many times servers have registered, by a status of the rendezvous."""
    return sum(int(n) for n in status.get("incarnations") or [])


class ParameterServer:
    """Serves the shards of node ``node`` of ``cluster``."""

    def __init__(
        self,
        node: int,
        cluster: ClusterSpec,
        transport: Transport,
        bind: str = "tcp://127.0.0.1:0",
        share_memory: bool = True,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        now: Callable[[], float] = time.monotonic,
        lane: bool = False,
    ) -> None:
        """``now``: the clock the synchroniser and static tables (held pulls, fences, lazy pulls), the
        replication service (deaths, waiting pushes) and the adaptive service (replica syncs, held
        requests) read; tests pass one they move by hand. The loop's own waits, heartbeats and gossip
        rounds are in real time. ``lane``: answer small pulls of static tables on a lane of their own
        (``server.lane``), where the job has a secret, the wire is this machine's and the transport
        has native sockets (launched servers do; servers a test makes in its threads keep every
        pull on the general path their tests are about, unless they ask)."""
        self.node = node
        self.cluster = cluster
        self.transport = transport
        if not is_loopback(bind) and cluster.secret is None:
            raise ConfigError(f"server {node} would bind {bind!r}, which is not loopback: that needs a shared secret")
        self._unsigned = Codec(cluster.limits)  # only for telling a peer its tag was wrong
        self.roles = Roles(cluster.num_workers, cluster.num_nodes)
        # libzmq drops a peer that sends a frame past this hard cap; messages between
        # the soft limit and the cap get a typed error reply instead.
        hard_cap = cluster.limits.max_message_bytes * 2 + (1 << 20)
        self.listener = transport.listen(bind, max_frame_bytes=hard_cap)
        self.address = self.listener.address
        # For the wire the listener is on: judged by the address bound, not the one asked for.
        self.codec = Codec(cluster.limits, cluster.secret, local=is_loopback(self.address))
        self.tables: dict[str, ServedTable] = {}
        #: tables whose rows here were lost (with this node's previous process), and why: refused until restored
        self.lost: dict[str, str] = {}
        self.stats: Counter[str] = Counter()
        # Worker clocks live in shared memory so co-located workers check bounds without asking;
        # beside them, the clocks those workers reached, written by themselves, and when this server
        # last took each (``consistency.reached``).
        self._clock_segment = Segment.create(f"shoal-{cluster.cluster_id}-clocks-n{node}",
                                             3 * 8 * max(cluster.num_workers, 1))
        self.clocks = ClockTable(self._clock_segment.array(0, (cluster.num_workers,), np.int64))
        self._reached_at, self._seen_at = 8 * cluster.num_workers, 16 * cluster.num_workers
        self.reached = ReachedClocks(self._clock_segment.array(self._reached_at, (cluster.num_workers,), np.int64),
                                     self._clock_segment.array(self._seen_at, (cluster.num_workers,), np.float64))
        #: each worker's requests handled in the order it sent them
        self.order = StreamOrder(cluster.num_workers)
        self.sync = Synchroniser(self.clocks, self.tables, lambda peer, msg: self._send(peer, msg, self.codec),
                                 max_hold_s=cluster.timeouts.request_s, seen=self.order.seen, now=now)
        #: the other servers: one tracker and address book for gossip, placement and slice moves
        self.peers = PeerDirectory(node, transport, self.codec, cluster.timeouts.resend_s, now)
        self.replication = ReplicationService(node, cluster, self.peers,
                                              lambda peer, msg: self._send(peer, msg, self.codec), self.clocks,
                                              now=now)
        self.adaptive = AdaptiveService(node, cluster, self.peers,
                                        lambda peer, msg: self._send(peer, msg, self.codec), self.clocks,
                                        self.reached, now)
        self.static = StaticService(node, cluster.num_nodes, cluster.cluster_id, self.tables, self.clocks, self.sync)
        #: the service of each table, by name: the one place that knows a table's kind
        self.services: dict[str, TableService] = {}
        #: a table here is read under a bound: its reads wait on every worker's clock, also on that of a
        #: worker that never made it (whose tables are all ASP, and that ticks rarely unless told so in
        #: the answer to its tick: ``client.ticks``)
        self._bounded_reads = False
        self._stop = threading.Event()
        self._rendezvous = RequestTracker(transport, self.codec, sender=server_sender(node),
                                          resend_s=cluster.timeouts.resend_s, now=now)
        self._heartbeat_req: int | None = None
        self._last_heartbeat = time.monotonic()  # last answer from the rendezvous
        self._next_heartbeat = 0.0  # the first one right away: peers' addresses come with it
        self._heartbeat_sent = 0.0
        self._registered_seen: int | None = None  # server registrations the last status counted
        self.slicing = SliceService(node, cluster, self.peers, self.tables, self.sync, self._rendezvous,
                                    self._serve_held)
        self.sync.hold_for_move = self.slicing.hold
        self.checkpoints = CheckpointService(node, self.services, self.lost)
        self.builds = TableBuilds(node)  # tables being allocated off the request loop
        self._backlog = 0  # most messages handled in one burst since the last heartbeat: a queue length
        self.queue_length = 0  # the same, as last reported
        self.latency = LatencyHistogram()
        #: the loop thread's CPU by what it did: each op's messages (decoded, served, answered), each timer
        self.cpu = CpuAccount()
        self._loop_clock: int | None = None  # the loop thread's CPU clock, read by ``describe``
        self._timers: list[tuple[str, Callable[[], None]]] = [
            ("timer builds", self.install_built), ("timer out of order", self._expire_out_of_order),
            ("timer sync", self.sync.tick), ("timer replication", self.replication.tick),
            ("timer adaptive", self.adaptive.tick), ("timer slicing", self.slicing.tick)]
        self.replay = ReplayGuard()  # a request sent again is answered again, never served twice
        self._warnings = ThrottledWarnings(log)  # bad messages may come by the thousand
        #: Prometheus metrics (``metrics_port`` 0: any free port), guarded by a token derived from the job's secret
        self.metrics = None if metrics_port is None else MetricsEndpoint(
            lambda: server_families(self), {"node": self.node}, metrics_host, metrics_port,
            metrics_token(cluster.secret) if cluster.secret else None)
        self._fdshare = FdShareServer(socket_name(cluster.cluster_id, node), self._share) if share_memory else None
        self.lane = self._open_lane() if lane else None
        self._lane_awaited = False  # the loop's wait covers the lane's socket (``_tell_lane``)

    def _open_lane(self) -> ServerLane | None:
        ctx = self.transport.native_context()
        host = loopback_host(self.address)
        if ctx is None or host is None or self.cluster.secret is None:
            return None
        return ServerLane(self.node, ctx, host, self.cluster.secret, self.clocks.clocks, self.order,
                          self.cluster.timeouts.resend_s)

    def _tell_lane(self) -> str:
        """The lane's address, for a worker: its kernels readied, and its socket in the loop's wait
        from now on. Not before: no request can come on it until a worker knows where it is, and
        each socket a wait covers costs it system calls (``server_cpu.md``); a job whose workers
        never use the lane (all its tables adaptive) waits on two sockets, not three."""
        assert self.lane is not None
        self.lane.warm()
        if not self._lane_awaited:
            self._lane_awaited = True
            self.listener.wake_on_native(self.lane.socket)
        return self.lane.address

    # ------------------------------------------------------------------ loop

    def run(self, register: bool = True) -> None:
        """Serve until asked to stop, the cluster finishes, or the rendezvous is lost."""
        if register:
            self._rendezvous.connect(RENDEZVOUS, self.cluster.rendezvous)
            # The rendezvous's answers (the job finished, a slice moved) wake the loop: read at once,
            # not after the wait for requests (up to 50 ms: every job's end waited that long).
            self.listener.wake_on(self._rendezvous.connection(RENDEZVOUS))
            status = membership.register(
                self._rendezvous, "server", self.node, self.node, self.address, self.cluster.timeouts.connect_s,
                metrics=self.metrics.url if self.metrics is not None else None)
            self._rejoin(status)
            log.info("server %d serving at %s", self.node, self.address)
        wait, timers_at, timers_by = 0.0, 0.0, 0.0
        self._loop_clock = time.pthread_getcpuclockid(threading.get_ident())
        try:
            while not self._stop.is_set():
                waited_from = time.monotonic()
                first = item = self.listener.recv(wait)
                laned = self._pump_lane(look=self.listener.woke_others())
                burst_until = time.monotonic() + _BURST_S
                burst = 0
                while item is not None:
                    burst += 1
                    try:
                        self.handle(*item)
                    except Exception:  # never let one message end the loop
                        log.exception("server %d: unexpected failure handling a message", self.node)
                    if time.monotonic() > burst_until:
                        break  # timers (heartbeat, gossip, lazy pulls) must run under sustained load too
                    item = self.listener.recv(0)
                if burst > 1 or (burst and self.lane is not None and self.lane.holding):
                    self._pump_lane()  # what came on the lane during the burst, and what waited for it
                self._backlog = max(self._backlog, burst)
                now = time.monotonic()
                if (first is not None or laned) and now < timers_at:
                    # Requests one at a time: the timers wait for a pause or their period, not run
                    # after each request (they cost as much as serving a small one).
                    wait = timers_at - now
                    continue
                # Woken with no message before the wait ran out: by the rendezvous's answer (ZeroMQ
                # waits whole milliseconds, rounded up: a wait that ran out took at least its length).
                woken = first is None and not laned and now - waited_from < wait
                if woken or now >= timers_by or self._timers_due(register):
                    self._run_timers(register)
                    now = time.monotonic()
                    timers_at, timers_by = now + _TIMERS_EVERY_S, now + _TIMERS_AT_LEAST_S
                wait = self._wait_s()
            if self.slicing.leave_requested:
                self._say_goodbye()
        finally:
            self.close()

    def _pump_lane(self, look: bool = True) -> bool:
        """Serve the lane's queued requests (``server.lane``), charged to their own activity, and the
        requests of the workers whose pushes it applied that waited for them; whether there were any.
        ``look``: whether its socket may have some (False: the loop's wait has just seen it empty)."""
        lane = self.lane
        if lane is None or not self._lane_awaited or not (lane.holding or (look and lane.socket.readable())):
            return False
        started = time.thread_time()
        try:
            applied = lane.pump(self.tables, self.lost, self.sync.refusing)
        except Exception:  # never let the lane end the loop
            log.exception("server %d: unexpected failure serving the lane", self.node)
            return True
        for _, table in applied:
            served = self.tables.get(table)
            if served is not None:
                served.controller.on_push()
        self.cpu.charge("lane", time.thread_time() - started)
        if applied:
            for peer, msg in self.order.take_lane_copies():
                self._acknowledge_lane_copy(peer, msg)
            for worker in {worker for worker, _ in applied}:
                ready = self.order.next_ready(worker)
                if ready is not None:
                    self._serve_in_turn(*ready)
            self._answer_given_up()
        return True

    def _acknowledge_lane_copy(self, peer: bytes, msg: Message) -> None:
        """The general copy of a push the lane applied (sent again when the lane's answer was late):
        answered as applied, not applied twice."""
        self.stats["lane_push_copies"] += 1
        self._send(peer, msg.reply(Op.OK), self.codec)

    def _run_timers(self, register: bool) -> None:
        # One CPU clock read between two timers ends one and starts the next (a read is a system
        # call, ~0.7 us: two per timer were a sixth of a pass with nothing to do).
        started = time.thread_time()
        for name, timer in self._timers:
            try:
                timer()
            except Exception:  # timers must not end the loop either
                log.exception("server %d: unexpected failure in a timer", self.node)
            ended = time.thread_time()
            self.cpu.charge(name, ended - started)
            started = ended
        if register:
            self._heartbeat()
            self.cpu.charge("timer heartbeat", time.thread_time() - started)

    def _timers_due(self, register: bool) -> bool:
        """Whether a pass of the timers would find anything to do: each timer's own test of what its
        pass looks at. In a busy job most passes after a message found nothing, and cost the server
        about as much as the message (``server_cpu.md``)."""
        order = self.order
        return bool(self.builds.pending or order.waiting_count() or order.has_given_up()
                    or self.sync.fences or self.sync.held_count() or self.replication.tables
                    or self.slicing.outgoing or self.adaptive.due()
                    or (register and self._heartbeat_due()))

    def _heartbeat_due(self) -> bool:
        """Whether ``_heartbeat`` has something to do (its answers wake the loop, which then runs the
        timers): a heartbeat to send, or a rendezvous silent for too long."""
        if self.slicing.heartbeat_now:
            return True
        now = time.monotonic()
        if self._heartbeat_req is not None:  # answered (read by another pump), or silent too long
            return (self._rendezvous.done({self._heartbeat_req})
                    or now - self._last_heartbeat > self.cluster.timeouts.connect_s)
        return now >= self._next_heartbeat or (now >= self._heartbeat_sent + _PEER_WAIT_S and bool(
            self.replication.missing_peers() or self.adaptive.missing_peers()))

    def _say_goodbye(self) -> None:
        """Drained, and no longer reading: tell the rendezvous the last request of each worker handled
        here, so that workers send what came after it where its keys are now instead of waiting for
        an answer that will not come."""
        goodbye = bodies.Leave("server", node=self.node, handled=self.order.handled())
        try:
            membership.call(self._rendezvous, RENDEZVOUS, goodbye.to_message(), self.cluster.timeouts.request_s,
                            "goodbye")
        except ShoalError as exc:  # workers then wait for their requests' timeouts, as for a server that died
            log.warning("server %d: the rendezvous did not take its goodbye: %s", self.node, exc)

    def stop(self) -> None:
        self._stop.set()

    def _wait_s(self) -> float:
        """How long the loop may block: until the next lazy-pull deadline, gossip round or held lane
        request's limit, at most 50 ms."""
        held_until = self.lane.waiting_until() if self.lane is not None else None
        deadlines = [d for d in (self.sync.next_deadline(), self.replication.next_round(), self.adaptive.next_timer(),
                                 held_until) if d is not None]
        if self.builds.pending:
            deadlines.append(time.monotonic() + _BUILD_POLL_S)
        if not deadlines:
            return 0.05
        return min(0.05, max(0.0, min(deadlines) - time.monotonic()))

    def _rejoin(self, status: dict[str, Any]) -> None:
        """After (re)registering: peers, and the tables workers created before we started. A server
        started again (its node registered before) recreates them, but only replicated tables get
        their rows back (by gossip): the rows of the others went with its previous process."""
        self.roles.num_nodes = max(self.roles.num_nodes, len(status.get("servers") or []))
        self._registered_seen = _registrations(status)
        self.peers.on_status(status)
        self.replication.on_status(status)
        incarnations = status.get("incarnations") or []
        restarted = self.node < len(incarnations) and int(incarnations[self.node]) > 1
        self.adaptive.incarnation = int(status.get("incarnation") or 1)  # before any table is built
        for name in self._adopt_tables(status, "after a restart"):
            if restarted and not self.services[name].keeps_rows_across_restart:
                self.lost[name] = (f"the rows of table {name!r} on server {self.node} were lost with its previous "
                                   "process (it was started again); restore a checkpoint to go on with them")

    def _adopt_tables(self, status: dict[str, Any], why: str) -> list[str]:
        """Create the tables the rendezvous knows and this server lacks, at their current layouts;
        returns their names."""
        layouts = status.get("layouts") or {}
        created = []
        for spec in status.get("tables") or []:
            try:
                parsed = TableSpec.from_dict(spec)
                if parsed.name in self.services or parsed.name in self.builds.pending:
                    continue
                if self.node >= self.cluster.num_nodes and not self._service_for(parsed).served_by_joined_servers:
                    continue  # a server that joined later holds only what slices are moved to it
                self._check_fits(parsed)  # as a CREATE_TABLE sent here is: the rendezvous checks no budget
                self._add_table(parsed, layouts.get(parsed.name))
            except ShoalError as exc:  # throttled: every heartbeat brings the table again
                name = spec.get("name") if isinstance(spec, dict) else None
                self._warnings.warn(("adopt", str(name)), "server %d: cannot create table %r: %s", self.node, name, exc)
                continue
            created.append(parsed.name)
            log.info("server %d: created table %r %s", self.node, parsed.name, why)
        return created

    def _heartbeat(self) -> None:
        """Ask the rendezvous how the cluster is; leave when it is finished or gone."""
        tracker = self._rendezvous
        tracker.pump(0)  # answers may be in, or a late one that woke the loop (it must not stay unread)
        if self._heartbeat_req is not None and tracker.done({self._heartbeat_req}):
            tracker.take_error(self._heartbeat_req)
            self._heartbeat_req = None
        now = time.monotonic()
        if self.slicing.heartbeat_now:
            self.slicing.heartbeat_now = False
            self._next_heartbeat = now
        # Replicas or placement messages waiting for a peer's address ask often, and are answered at
        # once, not held as a long poll (a peer that registered since the last answer is in the next).
        hurry = (self._heartbeat_req is None and now >= self._heartbeat_sent + _PEER_WAIT_S
                 and (self.replication.missing_peers() or self.adaptive.missing_peers()))
        if self._heartbeat_req is None and (hurry or now >= self._next_heartbeat):
            self._heartbeat_sent, self._next_heartbeat = now, now + _HEARTBEAT_S
            if self.lane is not None:
                self.lane.take_load(self.tables)
            body = bodies.ClusterStatus("server", self.node, self.slicing.take_load(), self._backlog,
                                        poll=not hurry, registered=self._registered_seen)
            self.queue_length, self._backlog = self._backlog, 0
            self._heartbeat_req = tracker.request(RENDEZVOUS, body.to_message(), self._on_status, "heartbeat")
        elif self._heartbeat_req is not None and now - self._last_heartbeat > self.cluster.timeouts.connect_s:
            log.error("server %d: rendezvous silent for %.0fs; shutting down", self.node, now - self._last_heartbeat)
            self.stop()

    def _on_status(self, msg: Message) -> None:
        self._last_heartbeat = time.monotonic()
        self._registered_seen = _registrations(msg.body)
        if msg.body.get("poll_again"):  # a poll cut short (a server registered): hold the next one now
            self._next_heartbeat = self._last_heartbeat
        self.roles.num_nodes = max(self.roles.num_nodes, len(msg.body.get("servers") or []))  # servers joined
        self.peers.on_status(msg.body)
        self.replication.on_status(msg.body)
        self._adopt_tables(msg.body, "created before it joined")
        self.slicing.on_status(msg.body)
        if msg.body.get("finished"):
            log.info("server %d: all workers finished; shutting down", self.node)
            self.stop()
        elif self.slicing.leave_requested:
            log.info("server %d: every slice handed over; leaving the cluster", self.node)
            self.stop()

    # -------------------------------------------------------------- handling

    def handle(self, peer: bytes, frames: list[Any]) -> None:
        """Decode, check and serve one request; every failure becomes an error reply. Its CPU is
        charged to its op."""
        started = time.thread_time()
        activity = self._handle(peer, frames)
        self.cpu.charge(activity, time.thread_time() - started)

    def _handle(self, peer: bytes, frames: list[Any]) -> str:
        """``handle``; returns what the message was (its op's name)."""
        self.stats["messages"] += 1
        self.stats["bytes_in"] += frames_nbytes(frames)
        try:
            msg = self.codec.decode(frames)
        except AuthError as exc:
            self.stats["dropped_unauthenticated"] += 1
            self._warnings.warn("unauthenticated", "server %d: dropped an unauthenticated message: %s", self.node, exc)
            self._reply_error(peer, exc, self._unsigned)
            return "unauthenticated"
        except ShoalError as exc:
            self.stats["rejected_malformed"] += 1
            self._warnings.warn("malformed", "server %d: rejected a malformed message: %s", self.node, exc)
            self._reply_error(peer, exc, self.codec)
            return "malformed"
        self.stats[_OP_COUNTERS[msg.op]] += 1
        self._check_and_serve(peer, msg)
        return OP_NAMES[msg.op]

    def _check_and_serve(self, peer: bytes, msg: Message) -> None:
        """Serve a decoded message unless it repeats one, comes from a sender out of its role or
        out of its stream's order (then it waits for those before it)."""
        try:
            if self._repeated(peer, msg):
                return
            self.roles.check(msg, SERVER_OPS)
            if msg.op == Op.PUSH and self.order.handled_on_lane(msg):
                self._acknowledge_lane_copy(peer, msg)
                return
            in_turn = self.order.admit(peer, msg)
        except ShoalError as exc:  # a replay, a sender out of its role, a stream out of order
            self.stats[f"error_{exc.code}"] += 1
            if not msg.flags & Flag.NO_REPLY:
                self._send(peer, bodies.Error.about(exc, f"server {self.node}").reply_to(msg), self.codec)
            return
        if in_turn:
            self._serve_in_turn(peer, msg)
        else:
            self.stats["requests_out_of_order"] += 1
            # Its floor may have skipped requests its worker no longer awaits, up to one already waiting.
            ready = self.order.next_ready(msg.sender)
            if ready is not None:
                self._serve_in_turn(*ready)
        self._answer_given_up()

    def _serve_in_turn(self, peer: bytes, msg: Message) -> None:
        """Serve ``msg``, then the requests of its worker that waited for it, in their order."""
        item: tuple[bytes, Message] | None = (peer, msg)
        while item is not None:
            if not self._serve(*item):
                self.order.park(item[1])  # held for a slice move: its worker's later requests wait
                return
            self.order.finished(item[1])
            item = self.order.next_ready(msg.sender) if "stream" in msg.body else None

    def _serve_held(self, peer: bytes, msg: Message) -> None:
        """A request that waited for a slice's move to end."""
        if self.order.unpark(msg):
            self._serve_in_turn(peer, msg)
        else:
            self._serve(peer, msg)  # a read released by its bound while the slice moved

    def _repeated(self, peer: bytes, msg: Message) -> bool:
        """Whether ``msg`` repeats a request already here (then answered as a repeat); raises
        ``ReplayError`` for one older than what is remembered of its sender's stream."""
        verdict, reply = self.replay.admit(msg.sender, msg.incarnation, msg.req, bool(msg.flags & Flag.NO_REPLY),
                                           redoable=msg.op in _REDOABLE)
        if verdict is Verdict.NEW:
            return False
        self.stats[f"repeats_{verdict.name.lower()}"] += 1
        if verdict is Verdict.STALE:
            self._warnings.warn("replayed", "server %d: refused a replayed %s from sender %s", self.node,
                                msg.op.name, msg.sender)
            raise ReplayError(f"request {msg.req} of sender {msg.sender} was served already, or is older than "
                              f"server {self.node} remembers")
        if msg.flags & Flag.NO_REPLY:
            return True
        if reply is not None:  # sent again by a requester that did not hear back
            self.listener.send(peer, reply)
        elif verdict is Verdict.ANSWERED and msg.op in _IDEMPOTENT:
            self._serve(peer, msg)  # a read whose (large) reply was not kept: read again
        elif verdict is Verdict.ANSWERED and msg.op == Op.PUSH_PULL:  # the push is in: only read
            self._serve(peer, read_after_push(msg))
        return True

    def _serve(self, peer: bytes, msg: Message) -> bool:
        """Serve a decoded request; False if it is held until a slice's move ends."""
        started = time.perf_counter()
        try:
            self.sync.observe(peer, msg)
            reply = self.dispatch(msg, peer)
        except SliceMoving:
            self.slicing.hold(peer, msg)
            return False
        except ShoalError as exc:
            self.stats[f"error_{exc.code}"] += 1
            reply = bodies.Error.about(exc).reply_to(msg)
        except Exception as exc:  # a bug: report it, keep serving
            log.exception("server %d: failure serving %s", self.node, msg.op.name)
            self.stats["error_ServerError"] += 1
            err = ServerError(f"server {self.node} failed serving {msg.op.name}: {exc!r}")
            reply = bodies.Error.about(err).reply_to(msg)
        if reply is not None and not msg.flags & Flag.NO_REPLY:
            self._send(peer, reply, self.codec)
        self.latency.observe(OP_NAMES[msg.op], time.perf_counter() - started)
        return True

    def _expire_out_of_order(self) -> None:
        """Requests that waited a request timeout for an earlier one of their worker that never came
        (its worker died, say), or that their worker gave up on: answered with an error instead of
        kept (the replay guard keeps a request it saw as being served until it is answered)."""
        for peer, msg in self.order.expire(self.cluster.timeouts.request_s):
            error = RequestTimeoutError(f"server {self.node}: request {msg.body['stream'][1]} of worker "
                                        f"{msg.sender} waited {self.cluster.timeouts.request_s:.0f}s for its "
                                        "earlier requests, which never came")
            self.stats["out_of_order_expired"] += 1
            self._send(peer, bodies.Error.about(error).reply_to(msg), self.codec)
        self._answer_given_up()

    def _answer_given_up(self) -> None:
        """Answer the requests dropped unhandled because their worker no longer waits on them."""
        for peer, msg in self.order.take_given_up():
            gone = StaleRequestError(f"server {self.node}: request {msg.body['stream'][1]} of worker {msg.sender} "
                                     "was given up by its worker before its turn came")
            self.stats["out_of_order_given_up"] += 1
            if not msg.flags & Flag.NO_REPLY:
                self._send(peer, bodies.Error.about(gone).reply_to(msg), self.codec)

    def _reply_error(self, peer: bytes, exc: ShoalError, codec: Codec) -> None:
        if getattr(exc, "flags", 0) & Flag.NO_REPLY:
            return
        req = getattr(exc, "req", None)
        reply = bodies.Error.about(exc, f"server {self.node}").to_message(req=req if isinstance(req, int) else 0)
        self._send(peer, reply, codec)

    def _send(self, peer: bytes, reply: Message, codec: Codec) -> None:
        reply.sender = self.node
        try:
            frames = codec.encode(reply)
        except ShoalError as exc:  # e.g. a pull whose reply would exceed the size limit
            self.stats[f"error_{exc.code}"] += 1
            error = bodies.Error.about(exc, f"server {self.node}: reply refused").to_message(req=reply.req,
                                                                                             sender=self.node)
            frames = codec.encode(error)
        try:
            self.listener.send(peer, frames)
        finally:
            # Kept once it has gone, off the requester's wait: nothing else is handled in between (one
            # thread), so a repeat of the request still finds it answered.
            size = frames_nbytes(frames)
            self.stats["bytes_out"] += size
            if reply.req:  # every answer: a repeat of its request is answered again, never taken as in progress
                self.replay.answered(reply.incarnation, reply.req, frames, size)

    def dispatch(self, msg: Message, peer: bytes = b"") -> Message | None:
        """Serve one checked request; None means no reply now (a held pull, or none at all)."""
        op = msg.op
        if op in _TABLE_OPS:
            if msg.table in self.lost and op in _DATA_OPS:
                raise ClusterError(self.lost[msg.table])
            return self._service(msg.table).handle(peer, msg)
        if op == Op.CLOCK:
            self.replication.on_clock(msg)
            self.reached.tick_read(msg.sender, bodies.Clock.of(msg).intents, msg.incarnation)
            return msg.reply(Op.OK, {"bounded": True} if self._bounded_reads else None)
        if op == Op.CONFIRM:
            self.sync.confirm(msg.sender, msg.table, bodies.Confirm.of(msg).epoch)
            return msg.reply(Op.OK)
        if op == Op.CREATE_TABLE:
            return self._create_table(peer, msg)
        if op == Op.SLICE_STATE:
            return self.slicing.receive(msg)
        if op == Op.CHECKPOINT:
            return self.checkpoints.write(msg)
        if op == Op.RESTORE:
            return self.checkpoints.restore(msg)
        if op == Op.SETTLE:
            return self.checkpoints.settle(msg)
        if op == Op.STATS:
            return msg.reply(Op.OK, self.describe())
        if op == Op.PING:  # with the lane's address, for a worker that would use it
            if self.lane is None or not bodies.Ping.of(msg).lane:
                return msg.reply(Op.OK)
            return msg.reply(Op.OK, {"lane": self._tell_lane()})
        if op == Op.SHUTDOWN:
            self.stop()
            return msg.reply(Op.OK)
        raise ProtocolError(f"server does not serve {op.name}")

    def _service(self, name: str) -> TableService:
        service = self.services.get(name)
        if service is None:
            raise TableError(f"server {self.node} has no table {name!r}")
        return service

    def _create_table(self, peer: bytes, msg: Message) -> Message | None:
        """Answered at once for a table held here; else once it is built, off the request loop."""
        create = bodies.CreateTable.of(msg)
        spec = TableSpec.from_dict(create.spec)
        if spec.name != msg.table:
            raise ProtocolError(f"CREATE_TABLE for {msg.table!r} carries a spec named {spec.name!r}")
        existing = self.services.get(spec.name)
        held = existing.spec(spec.name) if existing is not None else self.builds.spec(spec.name)
        if held is not None:
            if held != spec:
                raise TableError(f"table {spec.name!r} already exists with a different spec: "
                                 f"{held.differences(spec, 'there', 'asked here')}")
            if existing is None:
                self.builds.join(spec.name, peer, msg)
                return None
        else:
            self._check_fits(spec)
            self.builds.start(spec, self._service_for(spec), peer, msg, create.layout)
            return None
        return msg.reply(Op.OK, {"shards": self.services[spec.name].shards(spec.name)})

    def install_built(self, wait: bool = False) -> None:
        """Serve the tables built since the last call, and answer the requests that made them
        (``wait``: wait for the ones still being built)."""
        for build in self.builds.finished(wait):
            spec = build.spec
            try:
                build.service.install(spec, build.future.result())
            except ShoalError as exc:
                replies = [bodies.Error.about(exc, f"server {self.node}").reply_to(m) for _, m in build.waiting]
            except Exception as exc:  # a bug: report it, keep serving
                log.exception("server %d: failure building table %r", self.node, spec.name)
                err = ServerError(f"server {self.node} failed building table {spec.name!r}: {exc!r}")
                replies = [bodies.Error.about(err).reply_to(m) for _, m in build.waiting]
            else:
                self._start_serving(spec, build.service)
                log.info("server %d: created table %r (%d keys x %d)", self.node, spec.name, spec.num_keys, spec.dim)
                shards = build.service.shards(spec.name)
                replies = [m.reply(Op.OK, {"shards": shards}) for _, m in build.waiting]
            for (peer, _), reply in zip(build.waiting, replies, strict=True):
                self._send(peer, reply, self.codec)

    def _check_fits(self, spec: TableSpec) -> None:
        """Refuse a table over the limits or this server's budget before allocating anything of it."""
        check_limits(spec, self.cluster.limits, self.cluster.num_nodes)
        self._check_budget(spec)

    def _check_budget(self, spec: TableSpec) -> None:
        """Refuse a table this server cannot hold before allocating anything of it."""
        budget = self.cluster.limits.server_budget
        held = sum(self.services[name].bytes_here(self.services[name].spec(name)) for name in self.services)
        held += self.builds.pending_bytes()
        needed = self._service_for(spec).bytes_here(spec)
        if held + needed > budget:
            raise BudgetError(f"table {spec.name!r} needs {needed / 2**20:.0f} MiB on server {self.node}, which "
                              f"holds {held / 2**20:.0f} MiB of tables already; its budget is {budget / 2**20:.0f} "
                              "MiB (Limits.server_memory_bytes, SHOAL_SERVER_MEMORY)")

    def _add_table(self, spec: TableSpec, current: dict[str, Any] | None = None) -> None:
        """Create ``spec`` in the service of its kind (``current``: its layout now, if known)."""
        service = self._service_for(spec)
        service.install(spec, service.build(spec, current))
        self._start_serving(spec, service)

    def _start_serving(self, spec: TableSpec, service: TableService) -> None:
        """Serve table ``spec``, installed in ``service``."""
        self.services[spec.name] = service
        self._bounded_reads = self._bounded_reads or spec.consistency.bound is not None

    def _service_for(self, spec: TableSpec) -> TableService:
        """The one place that looks at a table's kind."""
        if spec.replicated:
            return self.replication
        if spec.adaptive:
            return self.adaptive
        return self.static

    def describe(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "address": self.address,
            "pid": os.getpid(),
            "cpu_s": time.process_time(),  # this server's CPU time so far, every thread
            "cpu": self.cpu_use(),
            "metrics": self.metrics.url if self.metrics is not None else None,
            "queue": self.queue_length,
            "held": self.sync.held_count(),
            "out_of_order": self.order.waiting_count(),
            "clocks": [int(c) for c in self.clocks.clocks],
            "slowest_clock": self.clocks.slowest,
            "stats": dict(self.stats + self.sync.stats + self.replication.stats + self.adaptive.stats
                          + self.slicing.stats + Counter(self.lane.stats() if self.lane is not None else {})),
            **self.static.describe(),
            "replicated": self.replication.describe(),
            "adaptive": self.adaptive.describe(),
        }

    def cpu_use(self) -> dict[str, Any]:
        """Where the request loop's CPU went: ``loop_s`` in all (the rest of it: waiting for and
        reading messages), each op's messages and each timer (``[times, seconds]``), the part of the
        PLACEMENT messages' each kind of placement message took, and the adaptive timer's passes by
        whether they sent anything."""
        try:
            loop_s = time.clock_gettime(self._loop_clock) if self._loop_clock is not None else 0.0
        except OSError:  # the loop has ended: its thread's clock with it
            loop_s = 0.0
        return {"loop_s": loop_s, "activities": self.cpu.describe(), "placement": self.adaptive.cpu.describe(),
                "adaptive_passes": self.adaptive.passes.describe()}

    # --------------------------------------------------- shared-memory access

    def _share(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """Descriptors of a table's local shards (or of the clock table), for a co-located worker."""
        if request.get("clocks"):  # with this process's id: co-located workers watch it for its end
            return {"num_workers": self.cluster.num_workers, "label": self._clock_segment.label,
                    "reached_at": self._reached_at, "seen_at": self._seen_at, "pid": os.getpid()}, \
                [self._clock_segment.fd]
        name = str(request.get("table"))
        return self._service(name).share(name, request)

    # --------------------------------------------------------------- closing

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self._fdshare is not None:
            self._fdshare.close()
            self._fdshare = None
        self.install_built(wait=True)  # then closed with the others
        self.builds.close()
        self._rendezvous.close()
        self.slicing.close()
        self.peers.close()
        self.adaptive.close()
        if self.lane is not None:
            self.lane.close()
            self.lane = None  # with it, its view of the clocks, which must go before their memory
        self.listener.close()
        self.static.close()
        del self.clocks
        self._clock_segment.close()

