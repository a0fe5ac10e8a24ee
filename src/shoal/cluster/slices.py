"""Where each slice of each static table lives: the rendezvous keeps the authoritative layouts.

It orders moves (asked for by a worker, planned by the rebalancer, or needed
because a server joins or leaves), hands each one to the slice's owner in its
heartbeat reply, and bumps the table's epoch when the owner reports the move
done. One move per table is under way at a time, so epochs are a sequence.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shoal.api.config import RebalancePolicy, TableSpec
from shoal.api.errors import ClusterError, ProtocolError
from shoal.placement.layout import TableLayout, initial_owners
from shoal.placement.rebalance import Move, SliceInfo, imbalance, plan_drain, plan_moves

log = logging.getLogger(__name__)

#: called when a move ends: the error, or None when it succeeded
Done = Callable[[ClusterError | None], None]

#: how long the plan of a new table holds back the drain of a server it puts slices on: the worker
#: registers the table a round trip after its servers built it, and a drain that completed meanwhile
#: left those slices on no server; a worker that died in between holds a drain back this long at most
PLAN_HOLDS_DRAIN_S = 60.0


@dataclass
class _Move:
    move: Move
    epoch: int = 0
    done: list[Done] = field(default_factory=list)
    #: the new owner reported having every row: the move is done, whatever the old owner says
    taken: bool = False


class SliceAuthority:
    """Layouts, the queue of moves, and the load windows the rebalancer judges."""

    def __init__(self, num_nodes: int, policy: RebalancePolicy | None = None,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.initial_nodes = num_nodes
        self.policy = policy
        self.now = now
        self.layouts: dict[str, TableLayout] = {}
        self.queued: dict[str, deque[_Move]] = {}
        self.active: dict[str, _Move] = {}
        self.servers: set[int] = set(range(num_nodes))
        self.leaving: set[int] = set()
        self.departed: set[int] = set()
        self._drains: dict[int, list[Done]] = {}
        #: per table planned and not registered yet: the servers its slices go to, and when
        self._plans: dict[str, tuple[frozenset[int], float]] = {}
        #: per (table, slice): bytes served in the current window
        self._window: dict[tuple[str, int], float] = {}
        self._window_start = now()
        self._hot_windows = 0
        self._cooldown = 0
        self.history: list[dict[str, Any]] = []  # what the rebalancer saw and did, for reports
        self.moves_done = 0

    # ------------------------------------------------------------ tables

    def plan(self, spec: TableSpec) -> dict[str, Any] | None:
        """Where a new static table's slices go: over the servers live now (every node cuts it into
        as many slices as the job started with servers, so the mapping is the same everywhere)."""
        if spec.replicated or spec.adaptive:
            return None
        num_slices = TableLayout.initial(spec, self.initial_nodes).num_shards
        owners = [int(o) for o in initial_owners(spec, num_slices, self.live_servers())]
        self._plans[spec.name] = (frozenset(owners), self.now())
        return {"owners": owners, "epoch": 0}

    def add_table(self, spec: TableSpec, planned: dict[str, Any] | None = None) -> None:
        """Register a table at the layout its servers built (``planned``), else as ``plan`` lays it out."""
        if spec.name in self.layouts or spec.replicated or spec.adaptive:
            return
        layout = TableLayout.initial(spec, self.initial_nodes)
        owners = (planned or self.plan(spec) or {}).get("owners")
        if not isinstance(owners, list) or len(owners) != layout.num_shards or not all(
                type(o) is int and o in self.servers for o in owners):
            raise ProtocolError(f"a layout of table {spec.name!r} names a server for each of its "
                                f"{layout.num_shards} slices among {sorted(self.servers)}, got {owners!r:.200}")
        gone = sorted(set(owners) & self.departed)
        if gone:
            raise ClusterError(f"table {spec.name!r} was laid out over server(s) {gone}, which left before it "
                               "was registered; create it again")
        self._plans.pop(spec.name, None)
        self.layouts[spec.name] = layout.at(owners, 0)
        self._check_drains()  # its slices on a server that began to leave since the plan move off

    def describe(self, name: str) -> dict[str, Any]:
        layout = self.layouts.get(name)
        if layout is None:
            raise ClusterError(f"the rendezvous knows no static table {name!r}")
        return {"owners": [int(o) for o in layout.owners], "epoch": layout.epoch}

    def all_layouts(self) -> dict[str, dict[str, Any]]:
        return {name: self.describe(name) for name in self.layouts}

    def live_servers(self) -> list[int]:
        return sorted(self.servers - self.leaving - self.departed)

    # ------------------------------------------------------------- moves

    def request_move(self, table: str, shard: int, to: int, done: Done | None = None) -> None:
        layout = self.layouts.get(table)
        if layout is None:
            raise ClusterError(f"cannot move a slice of {table!r}: not a static table the rendezvous knows")
        if not 0 <= shard < layout.num_shards:
            raise ClusterError(f"table {table!r} has slices 0..{layout.num_shards - 1}, not {shard}")
        if to not in self.live_servers():
            raise ClusterError(f"cannot move a slice to server {to}: live servers are {self.live_servers()}")
        self._enqueue(Move(table, shard, -1, to), done)

    def _enqueue(self, move: Move, done: Done | None) -> None:
        queued = _Move(move, done=[done] if done else [])
        self.queued.setdefault(move.table, deque()).append(queued)
        self._start_next(move.table)

    def _start_next(self, table: str) -> None:
        """Make the next queued move of ``table`` active; moves to where a slice already is end at once."""
        layout = self.layouts[table]
        queue = self.queued.get(table)
        while table not in self.active and queue:
            item = queue.popleft()
            source = int(layout.owners[item.move.shard])
            if source == item.move.target:
                for done in item.done:
                    done(None)
                continue
            if item.move.target in self.departed or item.move.target in self.leaving:
                for done in item.done:
                    done(ClusterError(f"server {item.move.target} is leaving; slice {item.move.shard} of "
                                      f"{table!r} stays on {source}"))
                continue
            item.move = Move(table, item.move.shard, source, item.move.target)
            item.epoch = layout.epoch + 1
            self.active[table] = item

    def commands(self, node: int) -> list[dict[str, Any]]:
        """Moves this server should make now (repeated in every heartbeat reply until done)."""
        return [{"table": t, "shard": m.move.shard, "from": m.move.source, "to": m.move.target, "epoch": m.epoch}
                for t, m in self.active.items() if m.move.source == node]

    def taken(self, table: str, shard: int, to: int, epoch: int) -> None:
        """The new owner of an active move reports having every row of the slice and serving it."""
        item = self.active.get(table)
        if item is not None and item.move.shard == shard and item.epoch == epoch and item.move.target == to:
            item.taken = True

    def move_done(self, table: str, shard: int, to: int, epoch: int, ok: bool) -> None:
        item = self.active.get(table)
        if item is None or item.move.shard != shard or item.epoch != epoch or item.move.target != to:
            return  # a report of a move already settled
        ok = ok or item.taken  # the old owner saw it fail (an answer lost), the new owner took it
        del self.active[table]
        if ok:
            layout = self.layouts[table]
            owners = layout.owners.copy()
            owners[shard] = to
            self.layouts[table] = layout.at(owners, epoch)
            self.moves_done += 1
            log.info("slice %d of %r moved %d -> %d (epoch %d)", shard, table, item.move.source, to, epoch)
        error = None if ok else ClusterError(
            f"moving slice {shard} of {table!r} from server {item.move.source} to {to} failed; it stays put")
        for done in item.done:
            done(error)
        self._start_next(table)
        self._check_drains()

    def busy(self) -> bool:
        return bool(self.active) or any(self.queued.values())

    # ------------------------------------------------------ join, leave

    def server_joined(self, node: int) -> None:
        if node in self.servers and node not in self.departed:
            return
        self.servers.add(node)
        self.departed.discard(node)
        self.leaving.discard(node)
        if self.policy is not None and self.policy.balance_on_join:
            infos = [SliceInfo(i.table, i.shard, i.owner, float(i.nbytes), i.nbytes) for i in self._slices()]
            for move in plan_moves(infos, self.live_servers(), threshold=1.05, max_moves=1 << 16):
                self._enqueue(move, None)

    def drain(self, node: int, done: Done) -> None:
        """Move every slice off ``node``; ``done`` once it holds none and may leave."""
        if node not in self.live_servers():
            raise ClusterError(f"server {node} is not a live server ({self.live_servers()})")
        if len(self.live_servers()) < 2:
            raise ClusterError("cannot drain the last server")
        self.leaving.add(node)
        self._drains.setdefault(node, []).append(done)
        remaining = [s for s in self.live_servers() if s != node]
        for move in plan_drain(self._slices(), node, remaining + [node]):
            self._enqueue(move, None)
        self._check_drains()

    def _check_drains(self) -> None:
        for node in list(self._drains):
            holds = any((layout.owners == node).any() for layout in self.layouts.values())
            if holds:
                if not self._moving_from(node):
                    # A slice that was on its way here when the drain was planned (or a move off that
                    # failed, or a table planned before the drain) is on the leaving server: plan its
                    # way off again.
                    for move in plan_drain(self._slices(), node, self.live_servers() + [node]):
                        self._enqueue(move, None)
            elif not self._planned_on(node) and not any(m.move.source == node for m in self.active.values()):
                self.departed.add(node)
                for done in self._drains.pop(node):
                    done(None)

    def _planned_on(self, node: int) -> bool:
        """Whether a table planned with slices on ``node`` may still be registered (plans older than
        ``PLAN_HOLDS_DRAIN_S`` are dropped)."""
        now = self.now()
        self._plans = {name: plan for name, plan in self._plans.items() if now - plan[1] <= PLAN_HOLDS_DRAIN_S}
        return any(node in owners for owners, _ in self._plans.values())

    def _moving_from(self, node: int) -> bool:
        """Whether a move of a slice off ``node`` is active or queued."""
        if any(m.move.source == node for m in self.active.values()):
            return True
        return any(int(self.layouts[table].owners[m.move.shard]) == node
                   for table, queue in self.queued.items() for m in queue)

    def source_gone(self, node: int) -> None:
        """Server ``node`` is dead: its moves under way end, as done where the new owner reported
        having every row, else as failed (the slice stays where the layout has it, with its rows
        gone), so that the table's later moves are not held behind them."""
        for table, item in list(self.active.items()):
            if item.move.source == node:
                log.warning("slice %d of %r: its server %d died while moving it to %d; the move is %s",
                            item.move.shard, table, node, item.move.target,
                            "done (the new owner has every row)" if item.taken else "given up")
                self.move_done(table, item.move.shard, item.move.target, item.epoch, ok=item.taken)

    # ---------------------------------------------------------- rebalancer

    def _slices(self) -> list[SliceInfo]:
        infos = []
        for name, layout in self.layouts.items():
            for shard in range(layout.num_shards):
                nbytes = layout.slice_bytes(shard)
                infos.append(SliceInfo(name, shard, int(layout.owners[shard]),
                                       self._window.get((name, shard), 0.0), nbytes))
        return infos

    def on_load(self, node: int, load: dict[str, Any]) -> None:
        """A server's per-slice load since its last heartbeat: per table, ``[slice, bytes, ...]`` rows.
        Rows of slices of no table here are left out (the window holds real slices only).

        Raises:
            ProtocolError: a report of another form (nothing of it is counted).
        """
        counted = []
        for table, rows in load.items():
            if not isinstance(rows, list) or not all(_load_row(row) for row in rows):
                raise ProtocolError(f"a server's load of {table!r} must be rows of [slice, bytes, ...], got {rows!r}")
            layout = self.layouts.get(table)
            if layout is not None:
                counted += [((table, int(row[0])), float(row[1])) for row in rows
                            if float(row[0]).is_integer() and 0 <= row[0] < layout.num_shards]
        for key, nbytes in counted:
            self._window[key] = self._window.get(key, 0.0) + nbytes

    def tick(self) -> None:
        """Complete the drains whose held plans ran out; close a load window when it is due, and plan
        moves when the imbalance persisted."""
        if self._drains and self._plans:
            self._check_drains()
        policy = self.policy
        if policy is None or not policy.enabled:
            return
        elapsed = self.now() - self._window_start
        if elapsed < policy.window_s:
            return
        infos = self._slices()
        servers = self.live_servers()
        per_server = {s: 0.0 for s in servers}
        for info in infos:
            if info.owner in per_server:
                per_server[info.owner] += info.load / elapsed
        ratio = imbalance(per_server)
        total = sum(per_server.values())
        self._window = {}
        self._window_start = self.now()
        record: dict[str, Any] = {"t": self._window_start, "bytes_per_s": per_server, "imbalance": ratio,
                                  "moves": []}
        self.history.append(record)
        del self.history[:-1000]
        if self._cooldown > 0 or self.busy():
            self._cooldown = max(0, self._cooldown - 1)
            return
        if total < policy.min_bytes_per_s or ratio <= policy.threshold:
            self._hot_windows = 0
            return
        self._hot_windows += 1
        if self._hot_windows < policy.windows:
            return
        self._hot_windows = 0
        self._cooldown = policy.windows
        moves = plan_moves([SliceInfo(i.table, i.shard, i.owner, i.load / elapsed, i.nbytes) for i in infos],
                           servers, threshold=max(1.0 + (policy.threshold - 1.0) / 2, 1.01),
                           max_moves=policy.max_moves)
        for move in moves:
            self._enqueue(move, None)
        record["moves"] = [[m.table, m.shard, m.source, m.target] for m in moves]
        if moves:
            log.info("rebalancer: max/mean %.2f over %d windows; moving %d slice(s)", ratio, policy.windows,
                     len(moves))


def _load_row(row: Any) -> bool:
    """Whether ``row`` is a slice's load as a server reports it: ``[slice, bytes, ...]``, finite numbers."""
    return (isinstance(row, list) and len(row) >= 2
            and all(type(v) in (int, float) and math.isfinite(v) for v in row[:2]))
