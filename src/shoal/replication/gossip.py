"""Gossip payloads as plain data, and the jittered schedule.

One round between replicas A and B of a shard is push-pull, three messages:

1. ``DIGEST``: A sends its version vector;
2. ``ANSWER``: B sends the updates A lacks, and its own version vector;
3. ``FINAL``: A sends the updates B lacks. Nothing answers it, so a round never
   turns into a ping-pong however fast pushes arrive.

Updates travel as deltas (the accepted updates themselves, replayed in order)
when the sender's log reaches back far enough, else as an origin's whole
running sum; an update a peer gave up (one of its gaps) travels alone, as a
fill. Every update carries when and by which replica it was accepted, so the
receiver measures propagation delay per pair of replicas.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shoal.lattice.sum_lattice import Delta, Filled, Gaps, Update
from shoal.storage.kernels import any_nonfinite

DIGEST, ANSWER, FINAL = 0, 1, 2
_DELTA_LISTS = ("nrows", "times", "nodes")  # per update: rows, accept time, accepting replica


@dataclass
class GossipPayload:
    """What one gossip message carries (the server wraps it in a message)."""

    shard: int
    version: dict[int, int]
    stage: int
    deltas: list[Delta] = field(default_factory=list)
    #: whole states: (origin, seq, total, gaps, filled)
    states: list[tuple[int, int, np.ndarray, Gaps, Filled]] = field(default_factory=list)
    #: per origin whose state lacks updates it counts (``SumLattice`` gaps), their numbers
    gaps: dict[int, Gaps] = field(default_factory=dict)
    #: per origin whose state took fills, which and when (``SumLattice`` filled)
    filled: dict[int, Filled] = field(default_factory=dict)
    #: updates the peer gave up, each ``(origin, update)``
    fills: list[tuple[int, Update]] = field(default_factory=list)

    def to_wire(self, dim: int) -> tuple[dict[str, Any], list[np.ndarray]]:
        rows: list[np.ndarray] = []
        values: list[np.ndarray] = []
        deltas = []
        for d in self.deltas:
            deltas.append({"origin": d.origin, "from": d.from_seq, "nrows": [int(u.rows.shape[0]) for u in d.updates],
                           "times": [u.accepted_at for u in d.updates], "nodes": [u.accepted_by for u in d.updates]})
            rows += [u.rows for u in d.updates]
            values += [u.values for u in d.updates]
        body: dict[str, Any] = {
            "shard": self.shard, "stage": self.stage, "deltas": deltas,
            "vv": [_entry_of(o, s, self.gaps.get(o, ()), self.filled.get(o, ()))
                   for o, s in sorted(self.version.items())],
            "states": [_entry_of(o, s, g, f) for o, s, _, g, f in self.states]}
        if self.fills:  # their rows and values follow the deltas'
            body["fills"] = [[o, u.seq, int(u.rows.shape[0]), u.accepted_at, u.accepted_by] for o, u in self.fills]
            rows += [u.rows for _, u in self.fills]
            values += [u.values for _, u in self.fills]
        arrays = [np.concatenate(rows) if rows else np.empty(0, np.int64),
                  np.concatenate(values) if values else np.empty((0, dim), np.float64)]
        arrays += [np.ascontiguousarray(t, dtype=np.float64) for _, _, t, _, _ in self.states]
        return body, arrays

    @classmethod
    def from_wire(cls, body: dict[str, Any], arrays: list[np.ndarray], num_rows: int, dim: int) -> GossipPayload:
        """Parse and check; raises ``ValueError`` on anything inconsistent."""
        try:
            shard = _int(body["shard"])
            entries = [_entry(e) for e in body["vv"]]
            version = {o: s for o, s, _, _ in entries}
            gaps = {o: g for o, _, g, _ in entries if g}
            filled = {o: f for o, _, _, f in entries if f}
            stage = _int(body["stage"])
            if stage not in (DIGEST, ANSWER, FINAL):
                raise ValueError(f"unknown gossip stage {stage}")
            states_meta = [_entry(e) for e in body["states"]]
            deltas_meta = body["deltas"]
            fills_meta = [_fill(f) for f in body.get("fills", [])]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed gossip header: {exc!r}") from None
        if len(arrays) != 2 + len(states_meta):
            raise ValueError(f"gossip carries {len(arrays)} arrays for {len(states_meta)} state(s)")
        all_rows = arrays[0].astype(np.int64, copy=False)
        all_values = arrays[1].astype(np.float64, copy=False)
        if all_rows.ndim != 1 or all_values.shape != (all_rows.shape[0], dim):
            raise ValueError(f"gossip rows {all_rows.shape} and values {all_values.shape} do not match dim {dim}")
        if all_rows.size and (all_rows.min() < 0 or all_rows.max() >= num_rows):
            raise ValueError("gossip names rows outside the shard")
        if any_nonfinite(all_values):  # pushes are checked where they enter: a peer sending these is broken
            raise ValueError("gossip carries NaN/Inf values")
        deltas, at = [], 0
        for meta in deltas_meta:
            if not isinstance(meta, dict) or not all(isinstance(meta.get(k), list) for k in _DELTA_LISTS):
                raise ValueError(f"malformed gossip delta {meta!r}")
            origin, start = _int(meta.get("origin")), _int(meta.get("from"))
            counts, times, nodes = meta["nrows"], meta["times"], meta["nodes"]
            if not len(counts) == len(times) == len(nodes) or not all(isinstance(t, (int, float)) for t in times):
                raise ValueError("gossip delta counts, times and nodes disagree")
            updates = []
            for i, (n, t, node) in enumerate(zip(counts, times, nodes, strict=True)):
                n = _int(n)
                if n < 0 or at + n > all_rows.shape[0]:
                    raise ValueError("gossip delta overruns its rows")
                updates.append(Update(start + i + 1, all_rows[at : at + n], all_values[at : at + n], float(t),
                                      _int(node)))
                at += n
            deltas.append(Delta(origin, start, tuple(updates)))
        fills = []
        for origin, seq, n, t, node in fills_meta:
            if at + n > all_rows.shape[0]:
                raise ValueError("gossip fill overruns its rows")
            fills.append((origin, Update(seq, all_rows[at : at + n], all_values[at : at + n], t, node)))
            at += n
        if at != all_rows.shape[0]:
            raise ValueError("gossip carries rows no delta accounts for")
        states = []
        for (origin, seq, gaps_of, filled_of), total in zip(states_meta, arrays[2:], strict=True):
            if total.shape != (num_rows, dim):
                raise ValueError(f"gossip state of shape {total.shape}, expected {(num_rows, dim)}")
            if any_nonfinite(total):
                raise ValueError("gossip state carries NaN/Inf values")
            states.append((origin, seq, total.astype(np.float64, copy=False), gaps_of, filled_of))
        return cls(shard, version, stage, deltas, states, gaps, filled, fills)


def _entry_of(origin: int, seq: int, gaps: Gaps, filled: Filled) -> list[Any]:
    """An origin's state on the wire: ``[origin, seq]``, its gaps third and its fills fourth where it has any."""
    if filled:
        return [origin, seq, list(gaps), [list(f) for f in filled]]
    return [origin, seq, list(gaps)] if gaps else [origin, seq]


def _entry(entry: Any) -> tuple[int, int, Gaps, Filled]:
    """``[origin, seq(, gaps(, filled))]``, checked: gaps ascend within ``[1, seq)``; each fill is
    ``[number, seq then]`` with the number below the seq then, which is at most ``seq``."""
    if not isinstance(entry, list) or not 2 <= len(entry) <= 4:
        raise ValueError(f"expected [origin, seq(, gaps(, filled))], got {entry!r}")
    origin, seq = _int(entry[0]), _int(entry[1])
    gaps: Gaps = ()
    filled: Filled = ()
    if len(entry) >= 3:
        if not isinstance(entry[2], list) or not entry[2] and len(entry) == 3:
            raise ValueError(f"gaps must be a list of update numbers, got {entry[2]!r}")
        gaps = tuple(_int(g) for g in entry[2])
        if gaps and not (1 <= gaps[0] and gaps[-1] < seq and all(a < b for a, b in zip(gaps, gaps[1:], strict=False))):
            raise ValueError(f"gaps {list(gaps)} at seq {seq} do not ascend within [1, {seq})")
    if len(entry) == 4:
        if not isinstance(entry[3], list) or not entry[3] or not all(
                isinstance(f, list) and len(f) == 2 for f in entry[3]):
            raise ValueError(f"fills must be a list of [number, seq then], got {entry[3]!r}")
        filled = tuple((_int(f[0]), _int(f[1])) for f in entry[3])
        if not all(1 <= number < then <= seq for number, then in filled):
            raise ValueError(f"fills {entry[3]!r} at seq {seq} lie outside it")
    return origin, seq, gaps, filled


def _fill(entry: Any) -> tuple[int, int, int, float, int]:
    """``[origin, seq, rows, accepted_at, accepted_by]``, checked."""
    if not isinstance(entry, list) or len(entry) != 5 or not isinstance(entry[3], (int, float)):
        raise ValueError(f"expected [origin, seq, rows, time, node], got {entry!r}")
    origin, seq, n, node = _int(entry[0]), _int(entry[1]), _int(entry[2]), _int(entry[4])
    if seq < 1 or n < 0:
        raise ValueError(f"fill of update {seq} with {n} rows")
    return origin, seq, n, float(entry[3]), node


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not -(1 << 63) <= value < 1 << 63:
        raise ValueError(f"expected a 64-bit int, got {value!r}")
    return value


class GossipSchedule:
    """When the next round is due: every ``period_s``, jittered by +-50% so replicas do not march in step."""

    def __init__(self, period_s: float, rng: random.Random | None = None,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.period_s = period_s
        self.rng = rng or random.Random()
        self.now = now
        self.next_at = now() + self._gap()

    def _gap(self) -> float:
        return self.period_s * self.rng.uniform(0.5, 1.5)

    def change(self, period_s: float) -> None:
        """Gossip every ``period_s`` from now on (the next round comes within the new period)."""
        self.period_s = period_s
        self.next_at = min(self.next_at, self.now() + self._gap())

    def due(self) -> bool:
        t = self.now()
        if t < self.next_at:
            return False
        self.next_at = t + self._gap()
        return True
