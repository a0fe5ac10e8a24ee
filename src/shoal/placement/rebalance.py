"""Planning slice moves: which slices to move where so that servers carry similar load.

Pure functions over numbers the rendezvous collects, so they are tested alone.
The planner moves a slice from the busiest server to the least busy one while
that lowers the busiest server's load, preferring slices that carry the most
load per byte moved (moving state costs bytes; moving load is the point).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SliceInfo:
    table: str
    shard: int
    owner: int
    load: float  # bytes/s served, or bytes held when balancing storage
    nbytes: int  # what moving it costs


@dataclass(frozen=True)
class Move:
    table: str
    shard: int
    source: int
    target: int


def imbalance(loads: dict[int, float]) -> float:
    """Max over mean load (1.0: perfectly even)."""
    if not loads:
        return 1.0
    mean = sum(loads.values()) / len(loads)
    return max(loads.values()) / mean if mean > 0 else 1.0


def plan_moves(slices: list[SliceInfo], servers: list[int], threshold: float = 1.1,
               max_moves: int = 64) -> list[Move]:
    """Moves that bring ``max/mean`` load at or under ``threshold`` (or as close as whole slices allow)."""
    if len(servers) < 2:
        return []
    loads = {s: 0.0 for s in servers}
    owner = {}
    for info in slices:
        if info.owner in loads:
            loads[info.owner] += info.load
        owner[(info.table, info.shard)] = info.owner
    moves: list[Move] = []
    while len(moves) < max_moves and imbalance(loads) > threshold:
        source = max(loads, key=lambda s: loads[s])
        target = min(loads, key=lambda s: loads[s])
        gap = loads[source] - loads[target]
        # A move helps only if the slice's load is under the gap: then both ends end below the old maximum.
        candidates = [i for i in slices if owner[(i.table, i.shard)] == source and 0 < i.load < gap]
        if not candidates:
            break
        best = max(candidates, key=lambda i: (min(i.load, gap - i.load) / max(i.nbytes, 1), i.load))
        owner[(best.table, best.shard)] = target
        loads[source] -= best.load
        loads[target] += best.load
        moves.append(Move(best.table, best.shard, source, target))
    return moves


def plan_drain(slices: list[SliceInfo], leaving: int, servers: list[int]) -> list[Move]:
    """Every slice of ``leaving`` goes to the remaining server holding the fewest bytes, largest first."""
    remaining = [s for s in servers if s != leaving]
    if not remaining:
        return []
    held = {s: 0.0 for s in remaining}
    for info in slices:
        if info.owner in held:
            held[info.owner] += info.nbytes
    moves = []
    for info in sorted((i for i in slices if i.owner == leaving), key=lambda i: -i.nbytes):
        target = min(held, key=lambda s: held[s])
        held[target] += info.nbytes
        moves.append(Move(info.table, info.shard, leaving, target))
    return moves
