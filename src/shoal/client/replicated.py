"""A worker's access to a replicated table: write and read quorums, failover, read-your-writes.

A push goes to ``write_quorum`` live replicas of each shard it touches and
completes when all of them acknowledge. A pull reads ``R`` live replicas of
each shard, fixed or chosen by the probabilistic model (``shoal.Dynamic``),
and merges their per-origin sums; it widens ``R`` until the merged version
covers this worker's own last acknowledged push (read-your-writes). A replica
that does not answer within ``Timeouts.replica_s`` is treated as down for a
while and the request goes to another one, so training goes on through a
server failure.
"""

from __future__ import annotations

import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from shoal.api.errors import ClusterError, RequestTimeoutError, ShoalError
from shoal.api.replication import Dynamic
from shoal.cluster import membership
from shoal.lattice.sum_lattice import merged_value
from shoal.replication.delays import DelaySamples
from shoal.replication.pbs import ShardModel, choose_read_quorum
from shoal.replication.replica import WORKER_ORIGINS
from shoal.storage import kernels
from shoal.storage.initialize import fill_initial
from shoal.wire.message import Message
from shoal.wire.ops import Op

if TYPE_CHECKING:
    from shoal.client.table import Table

_DOWN_FOR_S = 3.0  # how long a replica that failed to answer is left alone
_STATUS_EVERY_S = 1.0
_QUORUM_EVERY_S = 2.0


@dataclass
class _Shard:
    """What this worker knows of one shard of the table."""

    nodes: list[int]
    next_seq: int = 1  # numbering of this worker's pushes (write_quorum > 1)
    own: dict[int, int] = field(default_factory=dict)  # origin -> seq of our last acknowledged push
    read_quorum: int = 1
    predicted: dict[int, float] = field(default_factory=dict)
    model_at: float = -1e9


class ReplicaView:
    """Which servers a worker believes alive: the rendezvous' heartbeats, and its own timeouts."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.alive = [True] * worker.num_nodes
        self.down_until: dict[int, float] = {}
        self.checked_at = -1e9

    def refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.checked_at < _STATUS_EVERY_S:
            return
        self.checked_at = now
        try:
            status = membership.status(self.worker.tracker, self.worker.cluster.timeouts.replica_s)
        except ShoalError:
            return  # the rendezvous is slow or gone: keep what we know
        self.alive = [bool(a) for a in status.get("alive", self.alive)]
        for n, address in enumerate(status.get("servers", [])):
            if address and self.worker.servers[n] != address:  # a restarted server
                self.worker.servers[n] = address
                self.worker.tracker.connect(n, address)
                self.down_until.pop(n, None)

    def live(self, nodes: list[int]) -> list[int]:
        now = time.monotonic()
        return [n for n in nodes if self.alive[n] and self.down_until.get(n, 0.0) <= now]

    def mark_down(self, node: int) -> None:
        self.down_until[node] = time.monotonic() + _DOWN_FOR_S
        self.worker.tracker.disconnect(node)
        self.worker.tracker.connect(node, self.worker.servers[node])  # a fresh socket drops queued requests


class ReplicatedAccess:
    """Pull and push for one replicated table."""

    def __init__(self, table: Table) -> None:
        self.table = table
        self.spec = table.spec
        self.worker = table.worker
        self.view: ReplicaView = self.worker.replica_view
        self.shards = [_Shard(table.layout.replica_nodes(s)) for s in range(table.layout.num_shards)]
        fixed = self.spec.read_quorum
        for shard in self.shards:
            shard.read_quorum = fixed if isinstance(fixed, int) else len(shard.nodes)
        self.rng = random.Random(self.worker.rank)
        self.read_latency: dict[int, DelaySamples] = defaultdict(lambda: DelaySamples(1024))
        self.counters: Counter[str] = table.counters
        #: per read: (quorum size, seconds, merged version) for benchmarks
        self.reads: list[tuple[int, float, dict[int, int]]] = []
        self.keep_reads = False

    # ---------------------------------------------------------------- pushes

    def push(self, keys: np.ndarray, values: np.ndarray) -> None:
        self.view.refresh()
        for shard_id, pos in self._by_shard(keys):
            self._push_shard(shard_id, keys[pos], values[pos])

    def _push_shard(self, shard_id: int, keys: np.ndarray, values: np.ndarray) -> None:
        shard = self.shards[shard_id]
        body: dict[str, Any] = {"shard": shard_id}
        if self.spec.write_quorum > 1:
            body["seq"] = shard.next_seq
            shard.next_seq += 1
        preferred = self._write_order(shard)
        tried: set[int] = set()
        acked: set[int] = set()
        deadline = time.monotonic() + self.worker.cluster.timeouts.request_s
        while len(acked) < self.spec.write_quorum:
            live = self.view.live(shard.nodes)
            candidates = [n for n in preferred if n not in tried and n not in acked and n in live]
            need = self.spec.write_quorum - len(acked)
            if len(candidates) < need:
                self.view.refresh(force=True)
                if time.monotonic() > deadline:
                    raise ClusterError(
                        f"push to shard {shard_id} of {self.spec.name!r} needs {self.spec.write_quorum} replica(s); "
                        f"acknowledged by {sorted(acked)}, no live replica left among {shard.nodes}")
                time.sleep(0.05)
                tried.clear()
                continue
            targets = candidates[:need]
            tried.update(targets)
            replies = self._ask(targets, Message(Op.PUSH, table=self.spec.name, clock=self.worker.clock, body=body,
                                                 arrays=[keys, values]))
            for node, reply in replies.items():
                acked.add(node)
                origin, seq = int(reply.body["origin"]), int(reply.body["seq"])
                shard.own[origin] = max(shard.own.get(origin, 0), seq)
            if len(replies) < len(targets):
                self.counters["push_failovers"] += len(targets) - len(replies)

    def _write_order(self, shard: _Shard) -> list[int]:
        """This node's replica first (cheapest), then the others rotated by rank to spread load."""
        nodes = shard.nodes
        start = self.worker.rank % len(nodes)
        rotated = nodes[start:] + nodes[:start]
        if self.worker.node in rotated:
            rotated.remove(self.worker.node)
            rotated.insert(0, self.worker.node)
        return rotated

    # ----------------------------------------------------------------- pulls

    def pull(self, keys: np.ndarray, out: np.ndarray) -> None:
        self.view.refresh()
        for shard_id, pos in self._by_shard(keys):
            rows = self._pull_shard(shard_id, keys[pos])
            if pos.shape[0] == keys.shape[0]:
                out[...] = rows
            else:
                kernels.place_rows(out, pos, rows)

    def _pull_shard(self, shard_id: int, keys: np.ndarray) -> np.ndarray:
        shard = self.shards[shard_id]
        if isinstance(self.spec.read_quorum, Dynamic):
            self._refresh_quorum(shard_id, shard)
        live = self.view.live(shard.nodes)
        if not live:
            self.view.refresh(force=True)
            live = self.view.live(shard.nodes) or list(shard.nodes)
        size = min(shard.read_quorum, len(live))
        chosen = self.rng.sample(live, size)
        start = time.monotonic()
        while True:
            replies = self._read(shard_id, chosen, keys, totals=len(chosen) > 1)
            if not replies:
                self.view.refresh(force=True)
                remaining = [n for n in self.view.live(shard.nodes) if n not in chosen]
                if not remaining:
                    raise ClusterError(f"no replica of shard {shard_id} of {self.spec.name!r} answered "
                                       f"(replicas {shard.nodes})")
                chosen = remaining[:size]
                continue
            value, version = self._merge(keys, replies)
            if self._covers(version, shard.own):
                break
            others = [n for n in self.view.live(shard.nodes) if n not in chosen]
            if not others:
                self.counters["read_your_writes_unmet"] += 1
                break
            self.counters["read_your_writes_widened"] += 1
            chosen = chosen + [others[0]]  # widen R until our own last push is covered
        self.counters[f"reads_r{len(chosen)}"] += 1
        if self.keep_reads:
            self.reads.append((len(chosen), time.monotonic() - start, version))
        return value.astype(self.spec.dtype)

    def _read(self, shard_id: int, nodes: list[int], keys: np.ndarray, totals: bool) -> dict[int, Message]:
        msg = Message(Op.PULL, table=self.spec.name, clock=self.worker.clock,
                      body={"shard": shard_id, "totals": totals}, arrays=[keys])
        return self._ask(nodes, msg)

    def _merge(self, keys: np.ndarray, replies: dict[int, Message]) -> tuple[np.ndarray, dict[int, int]]:
        if len(replies) == 1:
            reply = next(iter(replies.values()))
            if reply.op == Op.VALUES:
                return reply.arrays[0], {int(o): int(s) for o, s in reply.body.get("vv", [])}
        base = np.empty((keys.shape[0], self.spec.dim), dtype=np.float64)
        fill_initial(self.spec, keys, base)
        per_replica = []
        for reply in replies.values():
            origins, seqs, totals = reply.arrays
            pairs = zip(origins, seqs, strict=True)
            per_replica.append({int(o): (int(s), totals[i]) for i, (o, s) in enumerate(pairs)})
        return merged_value(base, per_replica)

    @staticmethod
    def _covers(version: dict[int, int], own: dict[int, int]) -> bool:
        return all(version.get(o, 0) >= s for o, s in own.items())

    # ------------------------------------------------------- dynamic quorums

    def _refresh_quorum(self, shard_id: int, shard: _Shard) -> None:
        now = time.monotonic()
        if now - shard.model_at < _QUORUM_EVERY_S:
            return
        shard.model_at = now
        policy = self.spec.read_quorum
        assert isinstance(policy, Dynamic)
        live = self.view.live(shard.nodes)
        if not live:
            return
        model = self.model(shard_id, live)
        shard.read_quorum, shard.predicted = choose_read_quorum(model, live, policy)
        self.counters[f"quorum_choice_r{shard.read_quorum}"] += 1

    def model(self, shard_id: int, live: list[int]) -> ShardModel:
        """Fit the probabilistic model of one shard from its replicas' measurements and ours."""
        msg = Message(Op.REPLICA_STATS, table=self.spec.name, body={"shard": shard_id})
        model = ShardModel(replicas=list(live))
        for node, reply in self._ask(live, msg).items():
            model.rates[node] = float(reply.body.get("rate", 0.0))
            for origin_node, samples in reply.body.get("delays", []):
                d = model.delays.setdefault((int(origin_node), node), DelaySamples())
                d.extend([float(x) for x in samples])
            model.read_latency[node] = self.read_latency[node]
        return model

    # ------------------------------------------------------------ plumbing

    def _by_shard(self, keys: np.ndarray) -> list[tuple[int, np.ndarray]]:
        shard, _ = self.table.layout.mapping.locate(keys)
        order, starts = kernels.partition_by_owner(shard, self.table.layout.num_shards)
        return [(s, order[starts[s] : starts[s + 1]]) for s in range(self.table.layout.num_shards)
                if starts[s + 1] > starts[s]]

    def _ask(self, nodes: list[int], msg: Message) -> dict[int, Message]:
        """Send ``msg`` to each node; collect the replies that come within the replica timeout.

        A node that does not answer in time is marked down; its reply, if it
        comes later, is dropped.
        """
        tracker = self.worker.tracker
        replies: dict[int, Message] = {}
        sent_at = time.monotonic()
        reqs: dict[int, int] = {}
        for node in nodes:
            copy = Message(msg.op, table=msg.table, clock=msg.clock, body=msg.body, arrays=msg.arrays)
            reqs[tracker.request(node, copy, _collect(replies, node), f"{msg.op.name} to replica {node}")] = node
        try:
            tracker.wait(set(reqs), self.worker.cluster.timeouts.replica_s)
        except RequestTimeoutError:
            pass  # whoever did not answer is handled below
        elapsed = time.monotonic() - sent_at
        for req, node in reqs.items():
            error = tracker.take_error(req)
            if error is not None:
                raise error  # the replica answered, with a typed error: bad input, not a failure
            if node in replies:
                self.read_latency[node].add(elapsed / 2)
            else:
                self.view.mark_down(node)
                self.counters["replica_timeouts"] += 1
        return replies


def _collect(replies: dict[int, Message], node: int):  # type: ignore[no-untyped-def]
    def on_reply(msg: Message) -> None:
        replies[node] = msg

    return on_reply


def worker_origin(rank: int) -> int:
    return WORKER_ORIGINS + rank
