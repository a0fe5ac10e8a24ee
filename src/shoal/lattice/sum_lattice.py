"""SumLattice: replicated additive state that never double-counts (DESIGN.md §5).

Plain "add on merge" counts an update twice when it is delivered twice. Here
the state is a map ``origin -> (seq, total)``: ``total`` is the running sum of
every update accepted at that origin, ``seq`` how many there were. Merging keeps,
per origin, the entry with the larger ``seq``, so merge is associative,
commutative and idempotent, and re-delivery is harmless. The value is
``base + sum of totals`` added in ascending origin order in float64, so two
replicas holding the same entries hold bit-identical values.

Deltas carry the accepted updates themselves (``from_seq -> to_seq``), and a
receiver replays them in order: replaying the same float64 additions in the
same order yields the same bits as the origin's own total.

An origin's state may lack updates it counts (``gaps``): a replica that gave up
updates only a dead peer had accepts the next one as number ``seq`` all the
same. Of two states at one ``seq`` the one with fewer gaps wins a merge, so a
peer that comes back with the updates given up brings them to every replica.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Update:
    """One update as accepted at its origin: distinct ascending rows and their float64 deltas, when
    and by which replica (-1: unknown) it was accepted."""

    seq: int
    rows: np.ndarray
    values: np.ndarray
    accepted_at: float = 0.0
    accepted_by: int = -1


@dataclass(frozen=True)
class Delta:
    """Updates ``from_seq + 1 .. to_seq`` of one origin."""

    origin: int
    from_seq: int
    updates: tuple[Update, ...]

    @property
    def to_seq(self) -> int:
        return self.from_seq + len(self.updates)


@dataclass
class OriginState:
    seq: int
    total: np.ndarray
    gaps: int = 0  # updates up to ``seq`` given up, not in ``total``

    def behind(self, seq: int, gaps: int) -> bool:
        """Whether a state at ``seq`` with ``gaps`` holds more than this one (it wins a merge)."""
        return seq > self.seq or (seq == self.seq and gaps < self.gaps)


@dataclass
class SumLattice:
    """``base + sum(origin totals)`` over ``num_rows x dim`` float64 values."""

    base: np.ndarray
    origins: dict[int, OriginState] = field(default_factory=dict)
    #: recent updates per origin, oldest first, for building deltas
    log: dict[int, list[Update]] = field(default_factory=dict)

    @classmethod
    def zeros(cls, num_rows: int, dim: int) -> SumLattice:
        return cls(np.zeros((num_rows, dim), dtype=np.float64))

    @property
    def shape(self) -> tuple[int, int]:
        return self.base.shape  # type: ignore[return-value]

    def version(self) -> dict[int, int]:
        """The version vector: ``origin -> seq``."""
        return {o: s.seq for o, s in self.origins.items()}

    def seq(self, origin: int) -> int:
        state = self.origins.get(origin)
        return state.seq if state else 0

    def gaps(self) -> dict[int, int]:
        """Per origin whose state lacks updates it counts, how many."""
        return {o: s.gaps for o, s in self.origins.items() if s.gaps}

    def origin_state(self, origin: int) -> OriginState:
        """``origin``'s running sum (made, at seq 0, if it has none yet)."""
        state = self.origins.get(origin)
        if state is None:
            state = self.origins[origin] = OriginState(0, np.zeros(self.base.shape, dtype=np.float64))
        return state

    # ---------------------------------------------------------------- writes

    def accept(self, origin: int, rows: np.ndarray, values: np.ndarray, accepted_at: float = 0.0,
               seq: int | None = None, accepted_by: int = -1, skip: bool = False) -> Update | None:
        """Accept an update at ``origin`` (as its next update, or as number ``seq``).

        Returns the update, or None if ``seq`` is one this lattice already holds
        (a retry: nothing changes). Raises ``ValueError`` for a gap, unless ``skip``:
        then the updates before ``seq`` that never arrived are given up (their origin's
        log starts afresh, so peers that lack them get the whole running sum).
        """
        state = self.origin_state(origin)
        if seq is not None and seq <= state.seq:
            return None
        gap = seq is not None and seq != state.seq + 1
        if gap and not skip:
            raise ValueError(f"origin {origin}: update {seq} arrived before {state.seq + 1}")
        rows, values = _canonical(rows, values)
        prior = state.seq
        update = Update(state.seq + 1 if seq is None else seq, rows, values, accepted_at, accepted_by)
        self._replay(origin, state, update)
        if gap:
            state.gaps += update.seq - 1 - prior
            self.log[origin] = [update]  # the log no longer leads up to this state
        return update

    def apply(self, delta: Delta) -> int:
        """Replay the part of ``delta`` this lattice lacks; returns how many updates were new.

        A delta that starts after what we hold cannot be applied (a gap): it
        is ignored, and anti-entropy sends the missing part later.
        """
        state = self.origin_state(delta.origin)
        if delta.to_seq <= state.seq or delta.from_seq > state.seq:
            return 0
        fresh = delta.updates[state.seq - delta.from_seq :]
        for update in fresh:
            self._replay(delta.origin, state, update)
        return len(fresh)

    def _replay(self, origin: int, state: OriginState, update: Update) -> None:
        state.total[update.rows] += update.values
        state.seq = update.seq
        self.log.setdefault(origin, []).append(update)

    def merge_state(self, origin: int, seq: int, total: np.ndarray, gaps: int = 0) -> bool:
        """State-based merge of one origin: keep the larger ``seq``, at one ``seq`` the fewer gaps.
        True if it changed."""
        state = self.origin_state(origin)
        if not state.behind(seq, gaps):
            return False
        state.seq, state.gaps = seq, gaps
        state.total = np.array(total, dtype=np.float64, copy=True)
        self.log[origin] = []  # the log no longer leads up to this state
        return True

    def merge(self, other: SumLattice) -> None:
        """Join with another replica's whole state."""
        for origin, state in other.origins.items():
            self.merge_state(origin, state.seq, state.total, state.gaps)

    # ---------------------------------------------------------------- deltas

    def delta_since(self, origin: int, seq: int) -> Delta | None:
        """Updates after ``seq`` from the log, or None if the log no longer reaches back that far."""
        state = self.origins.get(origin)
        if state is None or state.seq <= seq:
            return Delta(origin, seq, ())
        entries = self.log.get(origin, [])
        if not entries or entries[0].seq > seq + 1:
            return None
        start = seq + 1 - entries[0].seq
        return Delta(origin, seq, tuple(entries[start:]))

    def truncate_log(self, origin: int, upto_seq: int) -> None:
        """Forget logged updates every peer already holds."""
        entries = self.log.get(origin)
        if entries:
            keep = [u for u in entries if u.seq > upto_seq]
            self.log[origin] = keep

    # ----------------------------------------------------------------- reads

    def value(self, rows: np.ndarray | None = None) -> np.ndarray:
        """``base + sum of totals`` in ascending origin order, float64."""
        if rows is None:
            out = self.base.copy()
            for origin in sorted(self.origins):
                out += self.origins[origin].total
            return out
        out = self.base[rows]
        for origin in sorted(self.origins):
            out += self.origins[origin].total[rows]
        return out

    def totals(self, rows: np.ndarray) -> dict[int, tuple[int, np.ndarray]]:
        """Per origin, ``(seq, total rows)``: what a reader merging several replicas needs."""
        return {o: (s.seq, s.total[rows]) for o, s in self.origins.items()}


def _canonical(rows: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct ascending rows with their deltas summed in float64, as every replica will replay them."""
    rows = np.asarray(rows, dtype=np.int64)
    values = np.asarray(values, dtype=np.float64)
    if rows.size > 1 and not (np.diff(rows) > 0).all():
        unique, inverse = np.unique(rows, return_inverse=True)
        summed = np.zeros((unique.shape[0], values.shape[1]), dtype=np.float64)
        np.add.at(summed, inverse, values)
        return unique, summed
    return rows, values


def merged_value(base: np.ndarray, replies: list[dict[int, tuple[int, np.ndarray]]]
                 ) -> tuple[np.ndarray, dict[int, int]]:
    """Join per-origin totals read from several replicas: per origin the largest seq wins.

    Returns the value (float64) and the merged version vector.
    """
    best: dict[int, tuple[int, np.ndarray]] = {}
    for reply in replies:
        for origin, (seq, total) in reply.items():
            if origin not in best or seq > best[origin][0]:
                best[origin] = (seq, total)
    out = np.array(base, dtype=np.float64, copy=True)
    for origin in sorted(best):
        out += best[origin][1]
    return out, {o: s for o, (s, _) in best.items()}
