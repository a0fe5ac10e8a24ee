"""A worker's access to a replicated table: write and read quorums, failover, read-your-writes.

A push goes to ``write_quorum`` live replicas of each shard it touches and
completes when all of them acknowledge. A pull reads ``R`` live replicas of
each shard, fixed or chosen by the probabilistic model (``shoal.Dynamic``),
and merges their per-origin sums; it widens ``R`` until the merged version
covers this worker's own last acknowledged push (read-your-writes) and, under
a bound, every push the bound requires (the replicas name it,
``replication.bounds``), and reads again while gossip brings what the live
replicas still lack. A replica that does not answer within
``Timeouts.replica_s`` is treated as down for a while and the request goes to
another one, so training goes on through a server failure; a bounded read,
which a replica holds until the slowest worker catches up, is waited for
while the replica lives. Under ESSP the first replica a read asks pushes the
rows read to this worker from then on, and a read its bound allows is served
from them without a message (``client.replica_cache``).
"""

from __future__ import annotations

import functools
import random
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shoal.api.errors import (
    CheckpointError,
    ClusterError,
    ConfigError,
    PeerRestartedError,
    ProtocolError,
    RequestTimeoutError,
    WriteQuorumError,
)
from shoal.api.ids import worker_origin
from shoal.api.replication import Dynamic
from shoal.client.access import TableAccess
from shoal.client.calls import Rows
from shoal.client.context import TableView
from shoal.client.replica_cache import ReplicaCache
from shoal.client.replica_view import ReplicaView
from shoal.cluster.requests import Future
from shoal.consistency.schemes import EAGER_WAIT_S
from shoal.lattice.sum_lattice import merged_value
from shoal.placement.layout import TableLayout
from shoal.replication.delays import DelaySamples
from shoal.replication.pbs import ShardModel, choose_read_quorum
from shoal.storage import kernels
from shoal.storage.initialize import fill_initial
from shoal.wire import bodies
from shoal.wire.bodies import Body, GossipPeriod, Pull, Push, ReplicaStats
from shoal.wire.message import Message
from shoal.wire.ops import Op

QUORUM_EVERY_S = 2.0
UNMEASURED_EVERY_S = 0.2  # while the model has nothing to go on, every replica is read and it is asked again soon


@dataclass
class _Sent:
    """Requests in flight to replicas, and the replies collected so far."""

    at: float
    reqs: dict[int, tuple[Any, int]] = field(default_factory=dict)
    replies: dict[Any, Message] = field(default_factory=dict)


@dataclass
class _Shard:
    """What this worker knows of one shard of the table."""

    nodes: list[int]
    next_seq: int = 1  # numbering of this worker's pushes to the shard
    #: our pushes not yet acknowledged by a write quorum: seq -> replicas that took it
    open: dict[int, set[int]] = field(default_factory=dict)
    #: those of them that failed their quorum: sent again ahead of the next push (replicas hold every
    #: later push of ours until they have these), until a quorum took them
    failed: dict[int, tuple[np.ndarray, np.ndarray, Push]] = field(default_factory=dict)
    own: dict[int, int] = field(default_factory=dict)  # origin -> seq of our last acknowledged push
    holders: set[int] = field(default_factory=set)  # replicas that acknowledged our last push
    read_quorum: int = 1
    predicted: dict[int, float] = field(default_factory=dict)
    model_at: float = -1e9
    measured: bool = False  # whether the last choice had measurements to go on


class ReplicatedAccess(TableAccess):
    """Pull and push for one replicated table."""

    def __init__(self, table: TableView, layout: TableLayout) -> None:
        super().__init__(table.name, layout)
        self.spec = table.spec
        self.worker = table.worker
        self.view: ReplicaView = self.worker.replica_view
        self.shards = [_Shard(layout.replica_nodes(s)) for s in range(layout.num_shards)]
        fixed = self.spec.read_quorum
        for shard in self.shards:
            shard.read_quorum = fixed if isinstance(fixed, int) else len(shard.nodes)
        self.rng = random.Random(self.worker.rank)
        #: reads wait for the slowest worker (a replica holds them): a slow answer is not a dead replica
        self.bounded = self.spec.consistency.bound is not None
        #: ESSP: the rows read, kept current by the replicas they were read from
        self.cache = ReplicaCache(self.spec, [len(layout.mapping.keys_of(s)) for s in range(layout.num_shards)],
                                  lambda: worker_origin(self.worker.rank, self.worker.streams.incarnation),
                                  table.counters) if self.spec.consistency.eager else None
        self.read_latency: dict[int, DelaySamples] = defaultdict(lambda: DelaySamples(1024))
        self.counters: Counter[str] = table.counters
        #: with ``record`` on, per read (shard, quorum size, issue time, seconds, merged version), per
        #: acknowledged push (shard, origin, seq, accept time) and per dynamic choice (time, shard, R,
        #: predicted probability per R): what benchmarks check the model against
        self.record = False
        self.reads: list[tuple[int, int, float, float, dict[int, int]]] = []
        self.acks: list[tuple[int, int, int, float]] = []
        self.choices: list[tuple[float, int, int, dict[int, float]]] = []

    # ---------------------------------------------------------------- pushes

    def push(self, keys: np.ndarray, values: np.ndarray) -> Future[None]:
        """Send every shard's part to its write quorum at once; waiting completes the push (shards
        short of acknowledgements fail over to other replicas)."""
        self.view.refresh()
        parts = [(shard_id, keys[pos], values[pos]) for shard_id, pos in self._by_shard(keys)]
        numbered = {shard_id: self._numbered_push(shard_id) for shard_id, _, _ in parts}
        if self.cache is not None:
            for shard_id, k, v in parts:
                seq = numbered[shard_id].seq
                assert seq is not None
                self.cache.own_push(shard_id, self._rows(k, shard_id), v, seq)
        batch, again = [], []
        for shard_id, k, v in parts:
            shard = self.shards[shard_id]
            targets = self._write_targets(shard, set())
            again += self._failed_before(shard_id, numbered[shard_id], targets)
            for node in targets:
                batch.append(((shard_id, node), node, self._message(numbered[shard_id], [k, v])))
        # Each acknowledgement is noted as it arrives, not when the push is waited for: a read after an
        # acknowledged push_async, before its wait, must find a replica that holds it.
        resent = self._send_all(again, self._noted)
        sent = self._send_all(batch, self._noted)

        def finish() -> None:
            self._gather(resent)  # acknowledged or not, noted: a push short of its quorum stays failed
            self._finish_push(parts, numbered, self._gather(sent))

        return Future.running(finish, lambda: self._answered(resent)() and self._answered(sent)())

    def _finish_push(self, parts: list[tuple[int, np.ndarray, np.ndarray]], numbered: dict[int, Push],
                     replies: dict[Any, Message]) -> None:
        failures: list[WriteQuorumError] = []
        for shard_id, k, v in parts:  # every shard, also after one failed: each failure is kept
            acked = {node for (s, node) in replies if s == shard_id}
            if len(acked) < self.spec.write_quorum:
                try:
                    self._complete_push(shard_id, k, v, numbered[shard_id], acked)
                except WriteQuorumError as exc:
                    failures.append(exc)
        if len(failures) == 1:
            raise failures[0]
        if failures:
            raise WriteQuorumError(f"{failures[0]} (and {len(failures) - 1} other shard(s) of this push)",
                                   failures[0].applied_at, lambda: _retry_each(failures))

    def _numbered_push(self, shard_id: int) -> Push:
        """The push's number: the same on every replica it goes to, and when it is sent again."""
        shard = self.shards[shard_id]
        seq = shard.next_seq
        shard.open[seq] = set()
        body = Push(shard=shard_id, seq=seq, inc=self.worker.streams.incarnation, floor=min(shard.open))
        shard.next_seq += 1
        return body

    def _write_targets(self, shard: _Shard, exclude: set[int]) -> list[int]:
        """Live replicas to write: this node's first (cheapest), then the others rotated by rank."""
        nodes = shard.nodes
        start = self.worker.rank % len(nodes)
        order = nodes[start:] + nodes[:start]
        if self.worker.node in order:
            order.remove(self.worker.node)
            order.insert(0, self.worker.node)
        live = self.view.reachable(nodes)
        return [n for n in order if n in live and n not in exclude][: self.spec.write_quorum]

    def _noted(self, key: tuple[int, int], reply: Message) -> None:
        """``_note_ack`` for a reply to a push sent under ``(shard, node)``."""
        self._note_ack(key[0], reply, key[1])

    def _note_ack(self, shard_id: int, reply: Message, node: int) -> None:
        """Replica ``node`` acknowledged a push to ``shard_id``: the worker's own writes there reach at
        least that far, and the replicas that hold the newest of them are the ones to read first."""
        origin, seq = int(reply.body["origin"]), int(reply.body["seq"])
        shard = self.shards[shard_id]
        taken = shard.open.get(seq)
        if taken is not None:
            taken.add(node)
            if len(taken) >= self.spec.write_quorum:
                del shard.open[seq]
                shard.failed.pop(seq, None)
        newest = shard.own.get(origin, 0)
        if seq > newest:
            shard.holders = {node}
        elif seq == newest:
            shard.holders.add(node)
        shard.own[origin] = max(newest, seq)
        if self.record:
            self.acks.append((shard_id, origin, seq, float(reply.body["at"])))

    def _complete_push(self, shard_id: int, keys: np.ndarray, values: np.ndarray, body: Push,
                       acked: set[int]) -> None:
        """Keep sending to other live replicas until ``write_quorum`` of them acknowledged."""
        shard = self.shards[shard_id]
        assert body.seq is not None
        if body.seq not in shard.open:
            return  # a quorum took it meanwhile (sent again ahead of a later push)
        acked = acked | shard.open[body.seq]
        tried = set(acked)
        deadline = time.monotonic() + self.worker.cluster.timeouts.request_s
        while len(acked) < self.spec.write_quorum:
            self.counters["push_failovers"] += 1
            need = self.spec.write_quorum - len(acked)
            targets = self._write_targets(shard, tried)[:need]
            if len(targets) < need:
                self.view.refresh(force=True)
                alive = [n for n in shard.nodes if self.view.alive[n]]
                # Fewer replicas alive (by the rendezvous' heartbeats) than the quorum: nothing to wait for.
                if time.monotonic() > deadline or len(alive) < self.spec.write_quorum:
                    # Kept, not given up: replicas hold this worker's later pushes until they have it.
                    shard.failed[body.seq] = (keys, values, body)
                    raise WriteQuorumError(
                        f"push to shard {shard_id} of {self.spec.name!r} needs {self.spec.write_quorum} replica(s); "
                        f"acknowledged by {sorted(acked)}, no other live replica among {shard.nodes} (alive: "
                        f"{alive}). It is sent again ahead of this worker's next push to the shard, or by this "
                        "error's retry(); replicas apply it once, whatever they get (do not push the same values "
                        "again)", sorted(acked),
                        functools.partial(self._complete_push, shard_id, keys, values, body, set(acked)))
                time.sleep(0.05)
                tried = set(acked)
                continue
            tried.update(targets)
            resent = self._send_all(self._failed_before(shard_id, body, targets), self._noted)
            batch = [(node, node, self._message(body, [keys, values])) for node in targets]
            for node, reply in self._ask_all(batch).items():
                acked.add(node)
                self._note_ack(shard_id, reply, node)
            self._gather(resent)

    def _failed_before(self, shard_id: int, body: Push, targets: list[int]) -> list[tuple[Any, int, Message]]:
        """The worker's pushes to the shard before ``body`` that failed their quorum, to each target
        that has not taken them: a replica holds ``body`` until it has them."""
        shard = self.shards[shard_id]
        assert body.seq is not None
        return [((shard_id, node), node, self._message(earlier, [keys, values]))
                for seq, (keys, values, earlier) in sorted(shard.failed.items()) if seq < body.seq
                for node in targets if node not in shard.open.get(seq, ())]

    # ----------------------------------------------------------------- pulls

    def pull(self, keys: np.ndarray, out: np.ndarray | None) -> Future[np.ndarray]:
        """Ask every shard's read quorum at once; waiting merges the replies into the rows (a shard
        that needs more replicas asks again). Under ESSP a shard whose cached rows the bound allows
        is read from them."""
        self.view.refresh()
        result = Rows(keys.shape[0], self.spec.dim, np.dtype(self.spec.dtype), out)
        start = time.monotonic()
        issued = time.time()
        parts = self._cached(keys, result.array(), self._by_shard(keys))
        plan: dict[int, list[int]] = {}
        batch = []
        for shard_id, pos in parts:
            chosen = plan[shard_id] = self._read_targets(shard_id)
            body = Pull(shard=shard_id, totals=len(chosen) > 1)
            for node in chosen:
                if self.cache is not None and node == chosen[0]:  # the home: it pushes these rows from now on
                    ask = Pull(shard=shard_id, totals=body.totals, subscribe=True)
                    batch.append(((shard_id, node), node, self._message(ask, [keys[pos]])))
                else:
                    batch.append(((shard_id, node), node, self._message(body, [keys[pos]])))
        sent = self._send_all(batch)

        def finish() -> np.ndarray:
            self._finish_pull(keys, result.array(), parts, plan, self._gather(sent, self.bounded), start, issued)
            return result.get()

        return Future.running(finish, self._answered(sent))

    def _cached(self, keys: np.ndarray, out: np.ndarray, parts: list[tuple[int, np.ndarray]]
                ) -> list[tuple[int, np.ndarray]]:
        """Place the shards the cache can serve at this worker's clock; the parts left to read."""
        if self.cache is None:
            return parts
        assert self.spec.consistency.bound is not None
        clock = self.worker.clock - self.spec.consistency.bound
        self.worker.tracker.pump(0)  # take in the rows pushed since the last call
        remote = []
        for shard_id, pos in parts:
            at = self._rows(keys[pos], shard_id)
            rows = self.cache.serve(shard_id, at, clock)
            if rows is None and self.cache.follows(shard_id, at) and \
                    self.cache.home_of(shard_id) in self.view.live(self.shards[shard_id].nodes):
                rows = self._await_pushed(shard_id, at, clock)
            if rows is None:
                remote.append((shard_id, pos))
            elif pos.shape[0] == keys.shape[0]:
                out[...] = rows
            else:
                kernels.place_rows(out, pos, rows)
        return remote

    def _await_pushed(self, shard_id: int, rows: np.ndarray, clock: int) -> np.ndarray | None:
        """The cached rows follow their home's messages: wait for the one covering ``clock`` (sent when
        the slowest worker gets there) instead of asking. None if it does not come in time (the
        rows are read instead; the read finds out whether the home is gone)."""
        assert self.cache is not None
        deadline = time.monotonic() + min(self.worker.cluster.timeouts.request_s, EAGER_WAIT_S)
        self.counters["reads_awaiting_push"] += 1
        while (remaining := deadline - time.monotonic()) > 0 and self.cache.follows(shard_id, rows):
            self.worker.tracker.pump(min(remaining, 0.5))
            got = self.cache.serve(shard_id, rows, clock)
            if got is not None:
                return got
        return None

    def _finish_pull(self, keys: np.ndarray, out: np.ndarray, parts: list[tuple[int, np.ndarray]],
                     plan: dict[int, list[int]], replies: dict[Any, Message], start: float, issued: float) -> None:
        for shard_id, pos in parts:
            got = {node: replies[(shard_id, node)] for node in plan[shard_id] if (shard_id, node) in replies}
            rows, version = self._finish_read(shard_id, keys[pos], plan[shard_id], got, start, issued)
            if pos.shape[0] == keys.shape[0]:
                out[...] = rows
            else:
                kernels.place_rows(out, pos, rows)
            home = plan[shard_id][0]
            if self.cache is not None and home in got:
                self._keep(shard_id, home, got[home], keys[pos], rows, version)

    def _keep(self, shard_id: int, home: int, reply: Message, keys: np.ndarray, rows: np.ndarray,
              version: dict[int, int]) -> None:
        """Cache rows read from ``home`` (subscribed to them by this read) with the clock they cover."""
        assert self.cache is not None and self.spec.consistency.bound is not None
        rows_seq, series = reply.body.get("rows_seq"), reply.body.get("series")
        if not isinstance(rows_seq, int) or isinstance(rows_seq, bool) or not isinstance(series, str):
            raise ProtocolError(f"replica {home} did not say where its rows of {self.spec.name!r} stand "
                                f"(rows_seq {rows_seq!r}, series {series!r})")
        self.cache.keep(shard_id, home, series, rows_seq, self._rows(keys, shard_id), rows,
                        self.worker.clock - self.spec.consistency.bound, version)

    def on_server_message(self, server: int, msg: Message) -> bool:
        if msg.op != Op.ROWS or self.cache is None:
            return False
        body = bodies.Rows.of(msg)
        if len(body.shards) != 1 or not isinstance(body.covers, int) or not isinstance(body.vv, list) \
                or not isinstance(body.seq, int) or not isinstance(body.series, str):
            raise ProtocolError(f"rows of replicated {self.spec.name!r} name one shard, the clock they cover, a "
                                "version vector and their place in a series")
        shard_id = body.shards[0]
        if not 0 <= shard_id < self.layout.num_shards:
            raise ProtocolError(f"rows of {self.spec.name!r} for shard {shard_id}, which it does not have")
        keys, values = msg.arrays
        rows = self.layout.mapping.rows_in(keys, shard_id) if keys.shape[0] else keys
        if rows is None or values.shape != (keys.shape[0], self.spec.dim):
            raise ProtocolError(f"rows of {self.spec.name!r} that do not fit shard {shard_id}")
        version = {int(o): int(s) for o, s in body.vv}
        self.cache.on_rows(server, shard_id, body.seq, body.series, body.covers, version, rows, values)
        return True

    def forget_cached(self) -> None:
        if self.cache is not None:
            self.cache.forget()

    def _rows(self, keys: np.ndarray, shard_id: int) -> np.ndarray:
        rows = self.layout.mapping.rows_in(keys, shard_id)
        assert rows is not None  # keys were split by shard
        return rows

    def _read_targets(self, shard_id: int) -> list[int]:
        """``R`` live replicas: one holding our last push first (read-your-writes without
        widening; under ESSP the home of the rows cached, while it lives), the rest at random (the
        model assumes random quorums)."""
        shard = self.shards[shard_id]
        if isinstance(self.spec.read_quorum, Dynamic):
            self._refresh_quorum(shard_id, shard)
        live = self.view.live(shard.nodes)
        if not live:
            self.view.refresh(force=True)
            live = self.view.live(shard.nodes) or list(shard.nodes)
        size = min(shard.read_quorum, len(live))
        home = self.cache.home_of(shard_id) if self.cache is not None else None
        holders = [n for n in live if n in shard.holders]
        if home in live:  # ESSP: the replica that pushes this worker the rows it read there
            first = [home]
        else:
            first = [self.rng.choice(holders)] if holders else []
        rest = [n for n in live if n not in first]
        return first + self.rng.sample(rest, size - len(first))

    def set_gossip_ms(self, gossip_ms: float) -> None:
        if isinstance(gossip_ms, bool) or not isinstance(gossip_ms, (int, float)) or not 1 <= gossip_ms <= 60_000:
            raise ConfigError(f"gossip_ms must lie in [1, 60000], got {gossip_ms!r}")
        self.view.refresh(force=True)
        nodes = self.view.live(sorted({n for shard in self.shards for n in shard.nodes}))
        period = GossipPeriod(round(gossip_ms * 1000))
        self.worker.tracker.gather(nodes, lambda node: period.to_message(table=self.spec.name),
                                   f"gossip period of {self.spec.name!r}", self.worker.cluster.timeouts.request_s)
        self.counters["gossip_period_changes"] += 1

    def pushes_numbered(self) -> list[int] | None:
        if not self.bounded:
            return None
        return [shard.next_seq - 1 for shard in self.shards]

    def _finish_read(self, shard_id: int, keys: np.ndarray, chosen: list[int], replies: dict[int, Message],
                     start: float, issued: float) -> tuple[np.ndarray, dict[int, int]]:
        """Merge; replace replicas that did not answer, widen until our own last push and what the
        bound requires are covered, read again while gossip brings what the bound requires."""
        shard = self.shards[shard_id]
        deadline = time.monotonic() + self.worker.cluster.timeouts.request_s
        self._forget_writes_of_dead(shard)
        while True:
            if time.monotonic() > deadline:
                raise RequestTimeoutError(f"read of shard {shard_id} of {self.spec.name!r} found no answering "
                                          f"replica within {self.worker.cluster.timeouts.request_s:.0f}s")
            if not replies:
                self.view.refresh(force=True)
                remaining = [n for n in self.view.live(shard.nodes) if n not in chosen] \
                    or [n for n in shard.nodes if self.view.alive[n]]  # slow is not dead: ask again
                if not remaining:
                    raise ClusterError(f"no replica of shard {shard_id} of {self.spec.name!r} is alive "
                                       f"(replicas {shard.nodes})")
                chosen = remaining[: max(len(chosen), 1)]
                replies = self._read(shard_id, chosen, keys, totals=len(chosen) > 1)
                continue
            value, version = self._merge(keys, replies)
            required = _required(replies)
            bound_met = self._covers(version, required)
            if bound_met and self._covers(version, shard.own):
                break
            others = [n for n in self.view.live(shard.nodes) if n not in chosen]
            if others:
                self.counters["read_your_writes_widened" if bound_met else "bounded_reads_widened"] += 1
                chosen = chosen + [others[0]]  # widen R until what this read must hold is covered
            elif not bound_met:  # on its way by gossip (or pushes sent again): read again shortly
                if time.monotonic() > deadline:
                    lacking = {o: s for o, s in required.items() if version.get(o, 0) < s}
                    raise RequestTimeoutError(
                        f"read of shard {shard_id} of {self.spec.name!r} at clock {self.worker.clock}: the live "
                        f"replicas {sorted(chosen)} still lack pushes its bound requires (origin: seq {lacking}) "
                        f"after {self.worker.cluster.timeouts.request_s:.0f}s; a replica that alone held them "
                        "died (write_quorum=1), or their worker stopped before sending them")
                self.counters["bounded_reads_again"] += 1
                time.sleep(min(self.spec.gossip_ms / 4000.0, 0.01))
            else:
                self.counters["read_your_writes_unmet"] += 1
                break
            replies = self._read(shard_id, chosen, keys, totals=len(chosen) > 1)
        self.counters[f"reads_r{len(chosen)}"] += 1
        if self.record:
            self.reads.append((shard_id, len(chosen), issued, time.monotonic() - start, version))
        return value.astype(self.spec.dtype), version

    def _message(self, body: Body, arrays: list[np.ndarray]) -> Message:
        return body.to_message(table=self.spec.name, clock=self.worker.clock, arrays=arrays)

    def _read(self, shard_id: int, nodes: list[int], keys: np.ndarray, totals: bool) -> dict[int, Message]:
        body = Pull(shard=shard_id, totals=totals)
        return self._ask_all([(node, node, self._message(body, [keys])) for node in nodes], self.bounded)

    def _merge(self, keys: np.ndarray, replies: dict[int, Message]) -> tuple[np.ndarray, dict[int, int]]:
        if len(replies) == 1:
            reply = next(iter(replies.values()))
            if reply.op == Op.VALUES:
                return reply.arrays[0], {int(o): int(s) for o, s in reply.body.get("vv", [])}
        base = np.empty((keys.shape[0], self.spec.dim), dtype=np.float64)
        fill_initial(self.spec, keys, base)
        per_replica = []
        for reply in replies.values():
            origins, seqs, gaps, totals = reply.arrays
            per_replica.append({int(o): (int(s), int(g), totals[i])
                                for i, (o, s, g) in enumerate(zip(origins, seqs, gaps, strict=True))})
        return merged_value(base, per_replica)

    def _forget_writes_of_dead(self, shard: _Shard) -> None:
        """A push acknowledged only by replicas that died before gossiping it is gone with them:
        do not widen every later read looking for it."""
        if shard.own and shard.holders and not shard.holders & set(self.view.live(shard.nodes)):
            shard.own.clear()
            self.counters["own_writes_lost_with_replica"] += 1

    @staticmethod
    def _covers(version: dict[int, int], own: dict[int, int]) -> bool:
        return all(version.get(o, 0) >= s for o, s in own.items())

    def replica_values(self, node: int, keys: np.ndarray) -> tuple[np.ndarray, dict[int, int]]:
        """Rows of ``keys`` as one replica holds them, and its version vector (to check convergence)."""
        out = np.empty((keys.shape[0], self.spec.dim), dtype=self.spec.dtype)
        version: dict[int, int] = {}
        for shard_id, pos in self._by_shard(keys):
            if node not in self.shards[shard_id].nodes:
                raise ClusterError(f"server {node} holds no replica of shard {shard_id} of {self.spec.name!r}")
            replies = self._read(shard_id, [node], keys[pos], totals=False)
            if node not in replies:
                raise ClusterError(f"replica {node} of shard {shard_id} did not answer")
            rows, vv = self._merge(keys[pos], replies)
            kernels.place_rows(out, pos, rows.astype(self.spec.dtype))
            for o, s in vv.items():
                version[o] = max(version.get(o, 0), s)
        return out, version

    # --------------------------------------------------------- checkpoints

    @property
    def survives_a_server(self) -> bool:
        return True  # the live replicas of each shard hold its rows

    @property
    def settles(self) -> bool:
        return True  # gossip under way: replicas must hold the same updates

    def rows_held(self, servers: list[int]) -> int:
        """Each shard's rows once per replica among ``servers`` (a dead server's are not loaded)."""
        live = set(servers)
        keys = self.layout.mapping.locate(np.arange(self.spec.num_keys))[0]
        sizes = np.bincount(keys, minlength=self.layout.num_shards)
        held = [len(live.intersection(shard.nodes)) for shard in self.shards]
        lost = [s for s, copies in enumerate(held) if not copies and sizes[s]]
        if lost:
            raise CheckpointError(f"no server left holds a replica of shard(s) {lost} of {self.spec.name!r}")
        return int(np.dot(sizes, held))

    def check_checkpoint(self, parts: list[dict[str, Any]], staging: Path) -> None:
        """Every shard written by at least one replica, and its replicas at one version."""
        versions: dict[int, set[tuple[tuple[int, ...], ...]]] = defaultdict(set)
        for p in parts:  # [origin, seq, gaps counted, gaps..., fills...] each (``state_version``)
            versions[int(p["shard"])].add(tuple(tuple(int(n) for n in entry) for entry in p["version"]))
        missing = [s for s in range(self.layout.num_shards) if s not in versions]
        differ = sorted(s for s, seen in versions.items() if len(seen) > 1)
        if missing or differ:
            raise CheckpointError(f"replicated {self.name!r}: shards {missing} written by no replica, the replicas "
                                  f"of shards {differ} differ (an update arrived during the checkpoint)")

    # ------------------------------------------------------- dynamic quorums

    def _refresh_quorum(self, shard_id: int, shard: _Shard) -> None:
        now = self.worker.now()
        if now - shard.model_at < (QUORUM_EVERY_S if shard.measured else UNMEASURED_EVERY_S):
            return
        shard.model_at = now
        policy = self.spec.read_quorum
        assert isinstance(policy, Dynamic)
        live = self.view.live(shard.nodes)
        if not live:
            return
        model = self.model(shard_id, live)
        shard.measured = model.measured()
        if shard.measured:
            shard.read_quorum, shard.predicted = choose_read_quorum(model, live, policy)
        else:  # no pushes or no delays seen yet: a prediction would promise everything
            shard.read_quorum, shard.predicted = len(live), {}
            self.counters["quorum_unmeasured"] += 1
        self.counters[f"quorum_choice_r{shard.read_quorum}"] += 1
        if self.record:
            self.choices.append((time.time(), shard_id, shard.read_quorum, dict(shard.predicted)))

    def model(self, shard_id: int, live: list[int]) -> ShardModel:
        """Fit the probabilistic model of one shard from its replicas' measurements and ours."""
        batch = [(node, node, ReplicaStats(shard_id).to_message(table=self.spec.name))
                 for node in live]
        model = ShardModel(replicas=list(live))
        for node, reply in self._ask_all(batch).items():
            model.rates[node] = float(reply.body.get("rate", 0.0))
            for source, samples in reply.body.get("delays", []):
                d = model.delays.setdefault((int(source), node), DelaySamples())
                d.extend([float(x) for x in samples])
            model.read_latency[node] = self.read_latency[node]
        return model

    # ------------------------------------------------------------ plumbing

    def _by_shard(self, keys: np.ndarray) -> list[tuple[int, np.ndarray]]:
        shard, _ = self.layout.mapping.locate(keys)
        order, starts = kernels.partition_by_owner(shard, self.layout.num_shards)
        return [(s, order[starts[s] : starts[s + 1]]) for s in range(self.layout.num_shards)
                if starts[s + 1] > starts[s]]

    def _ask_all(self, batch: list[tuple[Any, int, Message]], patient: bool = False) -> dict[Any, Message]:
        return self._gather(self._send_all(batch), patient)

    def _send_all(self, batch: list[tuple[Any, int, Message]],
                  on_reply: Callable[[Any, Message], None] | None = None) -> _Sent:
        """Send every ``(key, node, message)`` at once; ``on_reply(key, reply)`` as each reply comes."""
        sent = _Sent(time.monotonic())
        for key, node, msg in batch:
            what = f"{msg.op.name} to replica {node}"
            req = self.worker.tracker.request(node, msg, _collect(sent.replies, key, on_reply), what)
            sent.reqs[req] = (key, node)
        return sent

    def _answered(self, sent: _Sent) -> Callable[[], bool]:
        """Whether every request of ``sent`` has its answer (what ``Future.done`` asks)."""
        return lambda: self.worker.tracker.answered(set(sent.reqs))

    def _gather(self, sent: _Sent, patient: bool = False) -> dict[Any, Message]:
        """The replies that came within the replica timeout, by key.

        A node that does not answer in time is marked down; its reply, if it
        comes later, is dropped. A ``patient`` read (under a bound, which a
        replica holds it to until the slowest worker has reached its clock) is
        waited for while the rendezvous calls its replicas alive, up to the
        request timeout.
        """
        tracker = self.worker.tracker
        replies, reqs, sent_at = sent.replies, sent.reqs, sent.at
        timeouts = self.worker.cluster.timeouts
        # At least the replica timeout, longer while these replicas answer slowly (a loaded machine):
        # their round trips, as timed for resends.
        trips = [tracker.round_trips[n] for _, n in reqs.values() if n in tracker.round_trips]
        wait = max([timeouts.replica_s, *(t.timeout(timeouts.request_s) for t in trips)])
        deadline = sent_at + timeouts.request_s
        check_at = sent_at + wait
        pending = set(reqs)
        def answered_or_due(until: float) -> Callable[[], bool]:
            return lambda: tracker.done(pending) or time.monotonic() >= until

        while not tracker.done(pending):
            # Returns by ``check_at`` at the latest: the waiting decides, not the tracker's timeout.
            tracker.wait_until(answered_or_due(check_at), lambda: pending, max(0.0, check_at - time.monotonic()) + 1.0)
            if tracker.done(pending):
                break
            if patient and time.monotonic() < deadline and self._silent_alive(reqs, replies):
                self.counters["bounded_reads_waited"] += 1
                check_at = min(time.monotonic() + wait, deadline)
                continue
            for req in pending:
                tracker.forget(req)  # whoever did not answer is handled below; a late reply is dropped
            break
        elapsed = time.monotonic() - sent_at
        silent: set[int] = set()
        for req, (key, node) in reqs.items():
            error = tracker.take_error(req)
            if error is not None and not isinstance(error, PeerRestartedError):
                raise error  # the replica answered, with a typed error: bad input, not a failure
            if key not in replies:  # silent, or started again before it answered: go elsewhere
                silent.add(node)
            elif not patient:  # a bounded read's time includes its wait for the slowest worker
                self.read_latency[node].add(elapsed / 2)
        for node in silent:
            self.view.mark_down(node)
            self.counters["replica_timeouts"] += 1
        return replies


    def _silent_alive(self, reqs: dict[int, tuple[Any, int]], replies: dict[Any, Message]) -> bool:
        """Whether every replica yet to answer lives, as the rendezvous knows it now."""
        self.view.refresh(force=True)
        silent = {node for key, node in reqs.values() if key not in replies}
        return all(self.view.alive[n] and n not in self.view.exited for n in silent)


def _retry_each(failures: list[WriteQuorumError]) -> None:
    """Send every shard's failed part again; raise the first that fails again, after trying all."""
    again = []
    for failure in failures:
        try:
            failure.retry()
        except WriteQuorumError as exc:
            again.append(exc)
    if again:
        raise again[0]


def _required(replies: dict[int, Message]) -> dict[int, int]:
    """What the bound requires a read to cover, as the replicas answering it name it (the largest)."""
    required: dict[int, int] = {}
    for reply in replies.values():
        for origin, seq in reply.body.get("need", ()):
            required[int(origin)] = max(required.get(int(origin), 0), int(seq))
    return required


def _collect(replies: dict[Any, Message], key: Any,
             then: Callable[[Any, Message], None] | None = None) -> Callable[[Message], None]:
    def on_reply(msg: Message) -> None:
        replies[key] = msg
        if then is not None:
            then(key, msg)

    return on_reply

