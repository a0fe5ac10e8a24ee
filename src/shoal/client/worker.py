"""The worker's handle on the cluster: tables, clock, barrier, shutdown."""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from shoal.api.config import ClusterSpec, TableSpec, dense_rows
from shoal.api.errors import (
    ClosedError,
    ClusterError,
    ConfigError,
    PeerRestartedError,
    RequestTimeoutError,
    ShoalError,
    TableError,
)
from shoal.api.ids import RENDEZVOUS
from shoal.api.initializers import Constant, Initializer
from shoal.api.optim import Optimizer, Sum
from shoal.client import checkpoints
from shoal.client.dense import DEFAULT_SLICE, DenseTable
from shoal.client.lane import WorkerLane
from shoal.client.metrics import worker_families
from shoal.client.replica_view import WATCH_AFTER_S
from shoal.client.replicated import ReplicaView
from shoal.client.streams import Streams
from shoal.client.table import Table
from shoal.client.ticks import TickSchedule
from shoal.cluster import membership
from shoal.cluster.fdshare import fetch_fds, socket_name
from shoal.cluster.liveness import ProcessExit
from shoal.cluster.metrics import metrics_token
from shoal.cluster.metrics_endpoint import MetricsEndpoint
from shoal.cluster.requests import RequestTracker
from shoal.consistency.reached import packed
from shoal.placement.layout import TableLayout
from shoal.storage import kernels
from shoal.storage.segment import Segment
from shoal.storage.shard import ShardStore
from shoal.transport.base import Transport, is_loopback, loopback_host
from shoal.wire import bodies
from shoal.wire.codec import Codec
from shoal.wire.message import Message
from shoal.wire.ops import Op
from shoal.wire.schema import MAX_INTENTS, BarrierNote

log = logging.getLogger(__name__)

_RUN_LOG_ENTRIES = 100_000  # ps.log(...) keeps the newest this many in memory for the run report
_FINAL_CLOCK_S = 5.0  # how long a leaving worker waits for servers to acknowledge its last clock
_FINAL_CLOCK_LOOK_S = 0.5  # ... before it asks the rendezvous which of them are dead
#: resend timeouts the general path carries a server's pulls alone after its lane went unanswered,
#: before a new lane is asked for (doubled at each failure): a server busy once keeps its lane
LANE_RETRY_RESENDS = 4


class Worker:
    """Joins a cluster through its rendezvous; ``rank`` is unique among workers, ``node`` names the machine slot.

    With ``local_access`` (the default) the worker maps its node's shards and
    serves their keys itself; without it every key goes through a server
    (the classic parameter-server mode).
    """

    def __init__(
        self,
        cluster: ClusterSpec,
        rank: int,
        node: int,
        transport: Transport,
        local_access: bool = True,
        owns_transport: bool = False,
        metrics_port: int | None = None,
        run_dir: str | None = None,
        metrics_host: str = "127.0.0.1",
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cluster = cluster
        #: the clock of this worker's timers: resends, how long a replica counts as down, when a dynamic
        #: read quorum is chosen again (tests move it by hand); waits keep real time
        self.now = now
        self.rank = rank
        self.node = node
        self.local_access = local_access
        self.transport = transport
        self._owns_transport = owns_transport
        self.tracker = RequestTracker(transport, Codec(cluster.limits, cluster.secret), sender=rank,
                                      resend_s=cluster.timeouts.resend_s, now=now)
        self.clock = 0
        self.tables: dict[str, Table] = {}
        #: where shutdown writes what this worker logged, for the run report (see ``log``)
        self.run_dir = run_dir
        self.run_log: deque[dict[str, Any]] = deque(maxlen=_RUN_LOG_ENTRIES)
        self._barrier_generation = 0
        self._ticks = TickSchedule()  # when servers are told the clock while no read waits on it
        self._tick_due = False  # a clock they have not been told yet
        self._reads_never_wait = True  # every table is read under ASP (kept as tables come, asked at each clock)
        self._ticks_unanswered = 0  # of the last ticks sent (their answers may say a bounded read waits on us)
        #: a table has intents to send the node's server (most clocks have none: nothing to gather)
        self.intents_declared = False
        self._closed = False
        self._after_restore: list[Callable[[], None]] = []  # ``after_restore``
        timeout = cluster.timeouts.connect_s
        #: Prometheus metrics (``metrics_port`` 0: any free port), guarded by a token derived from the job's secret
        self.metrics = None if metrics_port is None else MetricsEndpoint(
            lambda: worker_families(self), {"rank": self.rank, "node": self.node}, metrics_host,
            metrics_port, metrics_token(cluster.secret) if cluster.secret else None)
        self.tracker.connect(RENDEZVOUS, cluster.rendezvous)
        registered = membership.register(self.tracker, "worker", node, rank, "", timeout,
                                         metrics=self.metrics.url if self.metrics else None)
        #: this worker's numbered requests to each server, handled there in order (static tables, clocks)
        self.streams = Streams(int(registered.get("incarnation", 1)))
        self.servers: list[str | None] = []  # by node; None once a server has left
        #: servers that left while requests to them were in flight: connected until those are over
        self._departing: set[int] = set()
        #: each server's lane (``client.lane``) once asked for: None where it has none or it failed
        self._lanes: dict[int, WorkerLane | None] = {}
        self._lane_asks: dict[int, object] = {}  # the question for each server's lane in flight
        #: per server whose lane went unanswered: when to ask for one again, and the wait before that
        self._lane_retry: dict[int, tuple[float, float]] = {}
        self.follow_servers(membership.wait_for_servers(self.tracker, cluster.num_nodes, timeout))
        self.tracker.on_unsolicited = self._on_server_message
        self.tracker.after_receive = self._after_receive
        self.tracker.while_waiting = self._while_waiting
        self.replica_view = ReplicaView(self)
        #: the local server's clock table in shared memory: local reads check bounds here
        self.local_clocks: np.ndarray | None = None
        #: this worker's slot beside them: the clock it reached, with its intent messages sent by then
        self._reached: np.ndarray | None = None
        #: ... and when the node's server last took the clock there (``consistency.reached``)
        self._seen: np.ndarray | None = None
        self._noted_at = 0.0  # when the clock in the slot was written (after the write)
        self._intents_sent = 0
        self._clock_segment: Segment | None = None
        self._server_exit: ProcessExit | None = None  # tells when the local server's process has ended
        if local_access:
            self._attach_clocks()
        if self.streams.incarnation > 1:
            # Started again: until a server hears this process, it counts the clock the earlier one
            # reached, and bounded reads there would pass without the pushes this one is about to make.
            self._tick(time.monotonic())
            self.wait_all()

    @property
    def num_workers(self) -> int:
        return self.cluster.num_workers

    @property
    def num_nodes(self) -> int:
        return self.cluster.num_nodes

    # ---------------------------------------------------------------- tables

    def table(
        self,
        name: str,
        num_keys: int,
        dim: int,
        dtype: str = "float32",
        init: Initializer | None = None,
        optimizer: Optimizer | None = None,
        **options: Any,
    ) -> Table:
        """Create (or join) a table; every worker must pass the same spec.

        ``options`` are the other ``TableSpec`` fields: ``mapping``,
        ``nonfinite``, ``locking``, ``seed``.
        """
        self._check_open()
        spec = TableSpec(name=name, num_keys=num_keys, dim=dim, dtype=dtype,
                         init=init or Constant(), optimizer=optimizer or Sum(), **options)
        return self.create_table(spec)

    def dense(
        self,
        name: str,
        shape: tuple[int, ...] | int,
        dtype: str = "float32",
        init: Initializer | None = None,
        optimizer: Optimizer | None = None,
        slice_size: int = DEFAULT_SLICE,
        **options: Any,
    ) -> DenseTable:
        """A dense parameter (weight tensor) of ``shape``, split into rows of at most ``slice_size``
        values that spread over the servers (round-robin unless ``mapping`` says otherwise)."""
        shape = _dense_shape(shape)
        if isinstance(slice_size, bool) or not isinstance(slice_size, (int, np.integer)) or slice_size < 1:
            raise ConfigError(f"slice_size must be an int >= 1, got {slice_size!r}")
        size = 1
        for n in shape:
            size *= n
        width = max(1, min(int(slice_size), size))
        options.setdefault("mapping", "round_robin")
        table = self.table(name, dense_rows(shape, width), width, dtype=dtype, init=init, optimizer=optimizer,
                           shape=shape, **options)
        return DenseTable(table, shape, width)

    def create_table(self, spec: TableSpec) -> Table:
        existing = self.tables.get(spec.name)
        if existing is not None:
            if existing.spec != spec:
                raise TableError(f"table {spec.name!r} was already created by this worker with a different spec: "
                                 f"{existing.spec.differences(spec, 'before', 'now')}")
            return existing
        # Setting up, not serving: servers allocate, fill and compile for the table meanwhile, which
        # on a busy machine can outlast a request timeout chosen to notice a stalled peer.
        timeout = max(self.cluster.timeouts.request_s, self.cluster.timeouts.connect_s)
        warming = kernels.warm_up_meanwhile(spec.dtype)  # while the servers build it; not on the first batches
        # The rendezvous lays a new static table out over the servers live now (the plan, or the
        # layout of a table it knows); the servers build that; then the rendezvous keeps the spec, so
        # that a restarted server can recreate it (not before: a table the servers refused, over
        # their memory budget, say, is no table), and answers with the current layout (slices may
        # have moved since the table was made).
        plan = bodies.CreateTable(spec.to_dict(), plan=True).to_message(table=spec.name)
        planned = membership.call(self.tracker, RENDEZVOUS, plan, timeout,
                                  f"CREATE_TABLE {spec.name!r} at the rendezvous").body
        self.follow_servers(planned.get("servers") or [])
        layout = {"owners": planned["owners"], "epoch": planned["epoch"]} if "owners" in planned else None
        create = bodies.CreateTable(spec.to_dict(), layout)
        self.tracker.gather(self.live_servers(),
                            lambda n: create.to_message(table=spec.name),
                            f"CREATE_TABLE {spec.name!r}", timeout)
        current = membership.call(self.tracker, RENDEZVOUS, create.to_message(table=spec.name), timeout,
                                  f"CREATE_TABLE {spec.name!r} at the rendezvous").body
        table = Table(self, spec, current)
        self.tables[spec.name] = table
        self._reads_never_wait = self._reads_never_wait and spec.consistency.bound is None
        if spec.consistency.bound is not None and self._tick_due:
            # The clock ticks owed while every table was ASP go now: a bounded read elsewhere may wait
            # for it, as this worker's own reads may soon wait for that reader.
            self._tick(time.monotonic())
        warming.join()
        return table

    def _attach_clocks(self) -> None:
        reply, fds = fetch_fds(socket_name(self.cluster.cluster_id, self.node), {"clocks": True},
                               self.cluster.timeouts.connect_s)
        self._clock_segment = Segment.attach(fds[0], str(reply["label"]))
        self.local_clocks = self._clock_segment.array(0, (int(reply["num_workers"]),), np.int64)
        self._reached = self._clock_segment.array(int(reply["reached_at"]) + 8 * self.rank, (1,), np.int64)
        self._seen = self._clock_segment.array(int(reply["seen_at"]) + 8 * self.rank, (1,), np.float64)
        self._note_reached()
        self._server_exit = ProcessExit.watch(int(reply.get("pid", 0)))

    def _note_reached(self) -> None:
        """Write the clock reached into this worker's slot, for its node's server to read at once
        (``consistency.reached``): a tick can wait in the server's queue behind another node's
        placement message that is decided by this node's clock."""
        if self._reached is not None:
            self._reached[0] = packed(self.clock, self._intents_sent)
            self._noted_at = time.monotonic()

    def _server_saw_clock(self) -> float | None:
        """When the node's server last took the clock now in this worker's slot (None: not since it
        was written, or not shared)."""
        if self._seen is None:
            return None
        seen = float(self._seen[0])
        return seen if seen >= self._noted_at else None

    def check_local_server(self, what: str) -> None:
        """Raise ``ClusterError`` if this node's server has died: its shared memory is nobody's now, so
        a read of it is stale and a write into it is lost, and neither may be acknowledged."""
        if self._server_exit is not None and self._server_exit.happened():
            self.lose_local_server()
            raise ClusterError(f"server {self.node} (this worker's node) has died: {what} used its memory and "
                               "is not applied; its rows are gone with it")

    def lose_local_server(self) -> None:
        """This node's server is gone: every table goes through messages from now on (to a server
        started in its place, if any), none through the dead one's memory."""
        self.local_access = False
        self.local_clocks = None
        self._reached = self._seen = None
        self._server_exit = None
        for table in self.tables.values():
            table.access.lose_local()

    def _on_server_message(self, peer: int, msg: Message) -> None:
        """A message no request asked for: rows a server pushed eagerly (ESSP), or a fence."""
        table = self.tables.get(msg.table)
        try:
            # Any server known, those that joined the job included (their fences must be answered).
            if table is not None and 0 <= peer < len(self.servers) and table.access.on_server_message(peer, msg):
                return
        except ShoalError as exc:
            log.warning("worker %d: ignoring a bad %s from server %d: %s", self.rank, msg.op.name, peer, exc)
            return
        log.warning("worker %d: ignoring unexpected %s from server %d", self.rank, msg.op.name, peer)

    def _after_receive(self) -> None:
        """What replies could not do in place (parts refused by moved slices, fences to answer)."""
        for table in self.tables.values():
            table.access.after_receive()

    def _while_waiting(self) -> None:
        """However long a worker under a bound waits (at a barrier, for a read), servers that joined
        meanwhile learn its clock: it asks for the servers (at most once a period) and ticks any new
        one it hears of (``follow_servers``). A worker ahead that waited at a barrier knowing nothing
        of a joined server held back every read there for its clock, and the barrier for those reads."""
        if any(t.bound is not None for t in self.tables.values()):
            self.replica_view.refresh_in_background()

    def send_ordered(self, server: int, msg: Message, what: str, on_reply: Callable[[Message], None] | None = None,
                     background: bool = False) -> int:
        """A request in this worker's stream to ``server``: handled there after every earlier one."""
        with self.streams.stamped(server, msg, self.settled_clock()) as seq:

            def answered(reply: Message) -> None:
                self.streams.answered(server, seq)
                if on_reply is not None:
                    on_reply(reply)

            return self.tracker.request(server, msg, answered, what, background=background,
                                        on_end=lambda: self.streams.ended(server, seq))

    def settled_clock(self) -> int:
        """Every push this worker made to a bounded table in iterations before this clock is acknowledged."""
        oldest = [c for t in self.tables.values() if t.bound is not None
                  and (c := t.access.oldest_open_push()) is not None]
        return min(self.clock, *oldest) if oldest else self.clock  # asked per request: no min() in the usual case

    def local_slices(self, spec: TableSpec, layout: TableLayout, mapped: dict[int, ShardStore]
                     ) -> dict[int, ShardStore]:
        """The stores of every slice ``layout`` puts on this node, reusing ``mapped`` ones still here.

        All or nothing: if one cannot be mapped (it is still arriving, say), the
        table goes through the local server for now, never half-local. Stores of
        ``mapped`` left out are the caller's to close (a call may still hold them).
        """
        mine = set(layout.shards_of(self.node))
        keep = {s: st for s, st in mapped.items() if s in mine and not st.retired}
        missing = sorted(mine - set(keep))
        if missing:
            try:
                keep.update(self.attach(spec, missing))
            except ShoalError as exc:
                log.info("worker %d: slices %s of %r not mappable yet (%s); using the server", self.rank, missing,
                         spec.name, exc)
            if set(keep) != mine:
                for s, st in keep.items():
                    if mapped.get(s) is not st:
                        st.close()
                return {}
        return keep

    def fetch_layout(self, table: str) -> dict[str, Any]:
        """A static table's slice owners and epoch, and the live servers, from the rendezvous."""
        reply = membership.call(self.tracker, RENDEZVOUS, Message(Op.LAYOUT, table=table),
                                self.cluster.timeouts.request_s, f"LAYOUT of {table!r}")
        self.follow_servers(reply.body.get("servers") or [])
        return reply.body

    def follow_servers(self, addresses: list[str | None]) -> None:
        """Connect to servers that joined, drop those that left, follow those started again. A server
        that joined hears this worker's clock at once when a table is bounded: its bounded reads wait
        on every worker's clock, and it knew ours only as its slices' old owners did when they moved."""
        joined = []
        for n, address in enumerate(addresses):
            known = self.servers[n] if n < len(self.servers) else None
            if address == known:
                continue
            self._drop_lane(n)
            if known is not None and address is not None:
                self.follow_restarted(n, address)
                continue
            if known is not None and self.tracker.awaits(n):
                self._departing.add(n)  # answers to what it read are on their way (``follow_departures``)
            elif known is not None:
                self.tracker.disconnect(n)
            self.streams.reset(n)
            if address is not None:
                if n in self._departing:  # back at once: what was in flight to its earlier process is not
                    self._departing.discard(n)
                    self.tracker.fail_peer(n, ClusterError(f"server {n} left and joined again while requests "
                                                           "to it were in flight"))
                    self.tracker.disconnect(n)
                self.tracker.connect(n, address)
                if known is None:
                    joined.append(n)
        self.servers = list(addresses)
        if joined and self.clock and any(t.bound is not None for t in self.tables.values()):
            tick = bodies.Clock(self.rank, pushed=self._pushes_numbered(), intents=self._intents_sent)
            for n in joined:
                self.send_ordered(n, tick.to_message(clock=self.clock), f"CLOCK {self.clock} to server {n}",
                                  background=True)

    def follow_departures(self) -> None:
        """Requests in flight to servers that left: those a server never read (its goodbye says which,
        ``server.streams``) are sent where their keys are now, and ticks are over (one that died says
        no goodbye); once nothing is in flight to it, its connection closes."""
        for node in sorted(self._departing):
            handled = self.replica_view.handled_by(node, self.rank, self.streams.incarnation)
            if handled is not None:
                self.tracker.end_unserved(node, handled)
            self.tracker.end_background(node)
            if not self.tracker.awaits(node):
                self.tracker.disconnect(node)
                self._departing.discard(node)

    def follow_restarted(self, node: int, address: str) -> None:
        """Server ``node`` was started again at ``address``: what was in flight to its previous process
        is lost with it (failed here, not sent to the new one), and the new one numbers our
        requests afresh."""
        while len(self.servers) <= node:
            self.servers.append(None)
        self.servers[node] = address
        self._drop_lane(node)
        self.tracker.fail_peer(node, PeerRestartedError(f"server {node} was started again: what was in flight "
                                                        "to its previous process was lost with it"))
        self.streams.reset(node)
        self.tracker.connect(node, address)
        if node == self.node:
            self.lose_local_server()

    def lane(self, node: int) -> WorkerLane | None:
        """The lane to server ``node`` (``client.lane``), or None: not known yet (the first call asks
        the server for its address, and pulls take the general path until the answer is in), none
        for now (it went unanswered: asked for again after ``lane_failed``'s wait), or none at all
        (the job has no secret, the wire is not this machine's, the transport has no native
        sockets, the server has no lane)."""
        if node in self._lanes:
            opened = self._lanes[node]
            retry = self._lane_retry.get(node)
            if opened is not None or retry is None or self.now() < retry[0] or node in self._lane_asks:
                return opened
        self._lanes[node] = None
        ctx, secret = self.transport.native_context(), self.cluster.secret
        address = self.servers[node] if 0 <= node < len(self.servers) else None
        if ctx is None or secret is None or address is None or not is_loopback(address):
            return None
        asked = object()  # an answer for a server since started again or gone opens nothing
        self._lane_asks[node] = asked

        def answered(msg: Message) -> None:
            lane_address = msg.body.get("lane")
            if (self._lane_asks.get(node) is asked and not self._closed and isinstance(lane_address, str)
                    and loopback_host(lane_address) is not None):
                self._lanes[node] = WorkerLane(ctx, lane_address, secret, self.cluster.timeouts.resend_s)

        self.tracker.request(node, bodies.Ping(lane=True).to_message(), answered, f"the lane of server {node}",
                             background=True, on_error=lambda error: None)
        return None

    def lane_failed(self, node: int, failed: WorkerLane) -> None:
        """The lane ``failed`` to ``node`` went unanswered (its server busy, or stopped, for a resend
        timeout): its requests take the general path for a while, then ask for a lane again (a new
        socket: a late answer on the old one is never read). Each failure doubles the wait, from
        ``LANE_RETRY_RESENDS`` resend timeouts up to 16 times that. (Each request then in flight on
        it says so: the lane is given up once.)"""
        if self._lanes.get(node) is not failed:
            return
        self._drop_lane(node)
        self._lanes[node] = None
        first = LANE_RETRY_RESENDS * self.cluster.timeouts.resend_s
        wait = min(2 * self._lane_retry[node][1], 16 * first) if node in self._lane_retry else first
        self._lane_retry[node] = (self.now() + wait, wait)

    def _collect_lanes(self) -> None:
        """Take every answer on its way on the lanes (a push's ends its request; a read's rows wait in
        their call): what a wait for all requests waits for may have gone on a lane."""
        for opened in list(self._lanes.values()):
            if opened is not None and opened.pending:
                opened.collect(None, True)

    def _drop_lane(self, node: int) -> None:
        self._lane_asks.pop(node, None)
        opened = self._lanes.pop(node, None)
        if opened is not None:
            opened.close()

    def live_servers(self) -> list[int]:
        return [n for n, address in enumerate(self.servers) if address]

    def server_alive(self, node: int) -> bool:
        """False for a server that has left the cluster (or that this worker has not heard of)."""
        return 0 <= node < len(self.servers) and self.servers[node] is not None

    def attach(self, spec: TableSpec, shards: list[int] | None = None) -> dict[int, ShardStore]:
        """Map this node's shards of ``spec`` (or just ``shards``) from the local server's shared memory."""
        request: dict[str, Any] = {"table": spec.name}
        if shards is not None:
            request["shards"] = shards
        reply, fds = fetch_fds(socket_name(self.cluster.cluster_id, self.node), request,
                               self.cluster.timeouts.connect_s)
        stores: dict[int, ShardStore] = {}
        try:
            held = TableSpec.from_dict(reply["spec"])
            if held != spec:
                raise TableError(f"the local server holds table {spec.name!r} with a different spec: "
                                 f"{held.differences(spec, 'there', 'asked here')}")
            for info, fd in zip(reply["shards"], fds, strict=True):
                stores[int(info["shard"])] = ShardStore.attach(spec, int(info["shard"]), int(info["num_rows"]),
                                                               fd, str(info["label"]))
        except Exception:
            for fd in fds[len(stores):]:
                os.close(fd)
            raise
        return stores

    # ---------------------------------------------------------- clock, sync

    def advance_clock(self) -> int:
        """Finish an iteration: tell every server this worker's new clock (under ASP alone, when
        ``client.ticks`` says it is due)."""
        self._check_open()
        self.send_intents()
        seen = self._server_saw_clock()
        self.clock += 1
        self._note_reached()
        now = time.monotonic()  # real time, also where tests move the tracker's clock by hand
        self._ticks.advanced(now)
        if self.tables and self._reads_never_wait and self._ticks_unanswered:
            self.tracker.pump(0)  # answers to the last ticks (a worker that sends nothing else reads none)
        if self.tables and self._reads_never_wait:
            # No read waits on clocks: servers learn them from every request, the node's server
            # from the ticks its intents need (or its own look in shared memory); the last one goes
            # everywhere before any wait.
            if seen is not None:
                self._ticks.looked(self.clock - 1, seen)
            if not self._ticks.due(self.clock, now):
                self._tick_due = True
            else:
                self._tick(now, everywhere=self._ticks.everywhere(now))
            return self.clock
        # Bounded reads wait on every worker's clock at every server: a server that joined the job
        # hears ours only once we know it (a status, at most once a period, taken as it comes).
        self.replica_view.refresh_in_background()
        self._tick(now)
        return self.clock

    def send_intents(self) -> None:
        """Send the intents declared since the last clock to this node's server now: every table's in
        one message (one per table per clock was the most frequent message a server received)."""
        if not self.intents_declared:
            return
        self.intents_declared = False
        tables, keys, starts, ends = [], [], [], []
        for name, table in self.tables.items():
            for k, start, end in table.access.take_intents():
                tables.append(name)
                keys.append(k)
                starts.append(start)
                ends.append(end)
        for at in range(0, len(keys), MAX_INTENTS):
            part = slice(at, at + MAX_INTENTS)
            self._intents_sent += 1
            body = bodies.Intent(starts[part], ends[part], tables[part] if len(set(tables[part])) > 1 else None,
                                 self._intents_sent)
            self.tracker.notify(self.node, body.to_message(table=tables[at], arrays=keys[part]))
        self._ticks.note_intents(list(zip(tables, keys, starts, ends, strict=True)))

    def _tick(self, now: float, everywhere: bool = True) -> None:
        """Tell every server this worker's clock (or only its node's: the others stay a tick due)."""
        self._ticks.ticked(self.clock, now, everywhere)
        self._tick_due = not everywhere
        # A request, not a one-way message: a lost clock would hold back every bounded read for good.
        # Nobody waits for the acknowledgement. In this worker's stream to each server, so counted
        # there only after the pushes it follows; and sent again until answered, even once a newer
        # tick went: given up, a lost one leaves a hole in the stream that the server cannot skip
        # until a later request says so, and the requests sent meanwhile do not (their floor was
        # set while an earlier one was unanswered).
        tick = bodies.Clock(self.rank, pushed=self._pushes_numbered(), intents=self._intents_sent)
        told = self._running_servers() if everywhere else [n for n in self._running_servers() if n == self.node]
        self._ticks_unanswered = len(told)  # those of earlier ticks no longer looked for: these ask again
        for n in told:
            self.send_ordered(n, tick.to_message(clock=self.clock), f"CLOCK {self.clock} to server {n}",
                              on_reply=self._heard_tick, background=True)
        self.tracker.pump(0)

    def _heard_tick(self, reply: Message) -> None:
        """A server answered a tick. One that serves a table read under a bound says so: its readers wait
        on this worker's clock though its own tables are all ASP, and from now on it ticks every clock."""
        self._ticks_unanswered = max(0, self._ticks_unanswered - 1)
        if reply.body.get("bounded"):
            self._reads_never_wait = False

    def _running_servers(self) -> list[int]:
        """The live servers whose process is not known to have ended: those to tell this worker's clock.
        Ticks to one that ended only filled its socket's queue (nobody reads it, and a tick is sent
        again until answered), until a tick waited for room and failed the worker."""
        exited = self.replica_view.exited
        return [n for n in self.live_servers() if n not in exited]

    def _pushes_numbered(self) -> dict[str, list[int]] | None:
        """Per table whose bounded reads need it, the pushes numbered to each shard so far."""
        numbered = {name: n for name, t in self.tables.items() if (n := t.access.pushes_numbered()) is not None}
        return numbered or None

    def log(self, **values: float) -> None:
        """Record scalars (``loss=...``, ``rmse=...``) at this moment and clock, for the run report."""
        self.run_log.append({"t": time.time(), "clock": self.clock, "values": {k: float(v) for k, v in values.items()}})

    def _write_run_record(self) -> None:
        if self.run_dir is None:
            return
        record = {"rank": self.rank, "node": self.node, "clock": self.clock, "log": list(self.run_log),
                  "requests": dict(self.tracker.sent),
                  "tables": {n: {"staleness": t.staleness.as_dict(), "counters": dict(t.counters)}
                             for n, t in self.tables.items()}}
        try:
            path = Path(self.run_dir) / f"worker-{self.rank}.json"
            path.write_text(json.dumps(record))
        except OSError as exc:
            log.warning("worker %d: cannot write its run record to %s: %s", self.rank, self.run_dir, exc)

    def resume_clock(self, clock: int) -> None:
        """Continue from ``clock`` (after a restore): tell every server, forget cached rows."""
        self.clock = int(clock) - 1
        for table in self.tables.values():
            table.forget_cached()
        self.advance_clock()

    # ------------------------------------------------------------ checkpoints

    def checkpoint(self, root: str | os.PathLike[str], tables: Iterable[str] | None = None, keep: int = 3) -> Path:
        """Snapshot every static and adaptive table (values, optimiser state, clock) under ``root``; collective.

        Every worker calls it at the same point of its loop; returns the new
        checkpoint's directory. A kill at any moment leaves the previous one intact.
        """
        self._check_open()
        return checkpoints.save(self, root, tables, keep)

    def restore(self, root: str | os.PathLike[str]) -> int:
        """Load the newest checkpoint under ``root`` (or the checkpoint directory ``root``) into the
        tables created so far, onto any number of servers; collective. Returns the clock to go on from.

        Call it at the start of a job, right after creating the tables: worker clocks only move
        forward, so restoring an earlier clock in a running job would leave the bounds behind.
        """
        self._check_open()
        clock = checkpoints.restore(self, root)
        for reload in self._after_restore:
            reload()
        return clock

    def after_restore(self, reload: Callable[[], None]) -> None:
        """Call ``reload`` after each restore: for whoever keeps copies of rows it read before (a
        torch model's parameters, ``DenseSync``)."""
        self._after_restore.append(reload)

    def intent(self, table: str | Table, keys: Any, start: int, end: int | None = None) -> None:
        """``table.intent(keys, start, end)``: this worker will use ``keys`` in clocks ``[start, end)``."""
        self._own_table(table).intent(keys, start, end)

    def localize(self, table: str | Table, keys: Any) -> None:
        """``table.localize(keys)``: move ``keys`` to this worker's node."""
        self._own_table(table).localize(keys)

    def _own_table(self, table: str | Table) -> Table:
        """One of this worker's tables, given as itself or by name."""
        name = table if isinstance(table, str) else getattr(table, "name", None)
        found = self.tables.get(name) if isinstance(name, str) else None
        if found is None or (not isinstance(table, str) and found is not table):
            raise TableError(f"{table!r} is not a table of this worker (its tables: {sorted(self.tables)})")
        return found

    def wait_all(self) -> None:
        """Wait for every request still in flight (async pushes included); a clock not told yet goes first."""
        if self._tick_due and not self._closed:
            self._tick(time.monotonic())
        started = self.now()

        def watch() -> None:  # as a call's own wait does (``client.routed``): a server may have left
            self._collect_lanes()
            if self._departing or self.now() - started >= WATCH_AFTER_S:
                self.replica_view.refresh()
                self.follow_departures()

        self.tracker.wait_all(self.cluster.timeouts.request_s, watch)
        errors = [e for t in self.tables.values() if (e := t.access.take_unobserved_error()) is not None]
        if errors:
            raise errors[0]

    def barrier(self, note: BarrierNote | None = None) -> dict[int, BarrierNote]:
        """Wait until every worker reaches this barrier; own pushes are applied first.

        Returns the ``note`` each rank passed (by rank), so one rank can tell the
        others an outcome.
        """
        self._check_open()
        self.wait_all()
        self._barrier_generation += 1
        return membership.barrier(self.tracker, self.rank, self._barrier_generation,
                                  self.cluster.timeouts.barrier_s, note)

    def server_stats(self, timeout: float = 5.0) -> list[dict[str, Any]]:
        """What each server reports about itself (tables, clocks, counters).

        A server that does not answer within ``timeout`` is listed as
        ``{"node": n, "unreachable": True}``.
        """
        nodes = self.live_servers()
        replies = self.tracker.gather(nodes, lambda n: Message(Op.STATS), "STATS", timeout, partial=True)
        return [replies.get(n, {"node": n, "unreachable": True}) for n in nodes]

    # ------------------------------------------------ slices and servers

    def move_slice(self, table: str | Table, shard: int, to: int, timeout: float | None = None) -> None:
        """Move slice ``shard`` of a static table to server ``to`` while training goes on; returns once moved."""
        name = table if isinstance(table, str) else table.name
        self._admin(bodies.MoveSlice(int(shard), int(to)).to_message(table=name),
                    f"moving slice {shard} of {name!r} to server {to}", timeout)

    def remove_server(self, node: int, timeout: float | None = None) -> None:
        """Hand every slice of server ``node`` to the others, then let it leave (scale in)."""
        self._admin(bodies.Drain(int(node)).to_message(), f"draining server {node}", timeout)

    def cluster_status(self) -> dict[str, Any]:
        """The rendezvous's view: servers (None once departed), workers, layouts, barriers."""
        status = membership.status(self.tracker, self.cluster.timeouts.request_s)
        self.follow_servers(status.get("servers") or [])
        return status

    def _admin(self, msg: Message, what: str, timeout: float | None) -> None:
        self._check_open()
        membership.call(self.tracker, RENDEZVOUS, msg,
                        self.cluster.timeouts.request_s if timeout is None else timeout, what)
        self.cluster_status()
        for t in self.tables.values():
            t.refresh_layout()

    # -------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        """Flush, tell the rendezvous this worker is done, and close every connection."""
        if self._closed:
            return
        self._write_run_record()
        try:
            try:
                self.wait_all()
            except ShoalError as exc:  # an async call's failure must not keep this worker from leaving
                log.warning("worker %d: unclean shutdown: %s", self.rank, exc)
            # A worker that left must not hold back anyone's reads: this last clock is a request,
            # sent again until acknowledged (the earlier ones ride on every later message).
            last = bodies.Clock(self.rank, final=True, pushed=self._pushes_numbered())
            final = {self.send_ordered(n, last.to_message(clock=self.clock), f"final CLOCK to server {n}"): n
                     for n in self._running_servers()}
            self._wait_final(final, min(_FINAL_CLOCK_S, self.cluster.timeouts.connect_s))
            membership.leave(self.tracker, self.rank, self.cluster.timeouts.connect_s)
        except ShoalError as exc:
            log.warning("worker %d: unclean shutdown: %s", self.rank, exc)
        finally:
            self._closed = True
            for node in list(self._lanes):
                self._drop_lane(node)
            for table in self.tables.values():
                table.close()
            self.local_clocks = None
            self._reached = self._seen = None
            if self._clock_segment is not None:
                self._clock_segment.close()
            self.tracker.close()
            if self.metrics is not None:
                self.metrics.close()
            if self._owns_transport:
                self.transport.close()

    def _wait_final(self, final: dict[int, int], timeout: float) -> None:
        """Wait for the servers' acknowledgements of this worker's last clock (request -> server), at
        most ``timeout``: a server that is gone must not keep this worker from leaving, and one the
        rendezvous calls dead is not waited for once the others have had a moment."""
        deadline = time.monotonic() + timeout
        waiting = set(final)
        try:  # a look that gives nothing up (``wait`` forgets what it timed out on)
            self.tracker.wait_until(lambda: self.tracker.done(waiting), set, min(timeout, _FINAL_CLOCK_LOOK_S))
            return
        except RequestTimeoutError:
            pass
        try:
            alive = membership.status(self.tracker, self.cluster.timeouts.replica_s).get("alive") or []
        except ShoalError:
            alive = []
        for req, node in final.items():
            if node < len(alive) and not alive[node]:
                self.tracker.forget(req)
        try:
            self.tracker.wait(waiting, max(deadline - time.monotonic(), 0.0))  # those forgotten are over
        except RequestTimeoutError as exc:
            log.warning("worker %d: leaving without every server's acknowledgement: %s", self.rank, exc)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"worker {self.rank} has been shut down")

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _ignore(msg: Message) -> None:
    pass


def _dense_shape(shape: Any) -> tuple[int, ...]:
    """A dense tensor's shape as a tuple of sizes: an int, or a sequence of them (numpy's too)."""
    sizes = [shape] if isinstance(shape, (int, np.integer)) else shape
    try:
        checked = tuple(sizes)
    except TypeError:
        raise ConfigError(f"a dense shape must be an int or a sequence of ints, got {shape!r}") from None
    if not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 0 for n in checked):
        raise ConfigError(f"a dense shape must be an int or a sequence of ints >= 0, got {shape!r}")
    return tuple(int(n) for n in checked)
