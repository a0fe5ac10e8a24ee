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

An origin's state may lack updates it counts (``gaps``, their numbers): a
replica that gave up updates only a dead peer had accepts the next one as number
``seq`` all the same. A state *covers* another when it holds every update the
other holds; a merge takes a state only if it covers ours. Two states that each
hold an update the other lacks (two replicas that each gave up a push only the
other had, across a partition) are joined by *fills*: the lacking updates
themselves, kept in the log, sent to the state that ``ranks`` higher, which then
covers the other and goes to it whole. A fill adds its update out of order, so a
state records its fills (``filled``); of two states holding the same updates
added in different orders, a merge takes the one a fixed order prefers. So every
replica ends with the same bits and every update the replicas held between them,
once.
"""

from __future__ import annotations

import bisect
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


Gaps = tuple[int, ...]  # the numbers of the updates up to a state's seq it lacks, ascending


def covers(seq: int, gaps: Gaps, other_seq: int, other_gaps: Gaps) -> bool:
    """Whether a state at ``seq`` lacking ``gaps`` holds every update one at ``other_seq`` lacking
    ``other_gaps`` holds."""
    return seq >= other_seq and set(g for g in gaps if g <= other_seq).issubset(other_gaps)


Filled = tuple[tuple[int, int], ...]  # updates added out of order: (number, the state's seq then), in order


def replaces(seq: int, gaps: Gaps, filled: Filled, other_seq: int, other_gaps: Gaps, other_filled: Filled) -> bool:
    """Whether a merge takes a state at ``seq`` lacking ``gaps`` with ``filled`` over the other: it holds
    every update the other holds and more, or the same ones added in an order preferred (the fewest
    fills first), so that replicas holding the same updates end with the same bits."""
    if (seq, gaps) != (other_seq, other_gaps):
        return covers(seq, gaps, other_seq, other_gaps)
    return filled < other_filled


def rank(seq: int, gaps: Gaps) -> tuple[int, int, Gaps]:
    """An order of states in which one that covers another (and differs) ranks higher; between two
    that each hold what the other lacks it picks the one that is filled (any fixed choice would do)."""
    return seq, -len(gaps), gaps


@dataclass
class OriginState:
    seq: int
    total: np.ndarray
    gaps: Gaps = ()  # updates up to ``seq`` given up, not in ``total``
    filled: Filled = ()  # gaps filled since: in ``total``, added out of order

    def holds(self, seq: int) -> bool:
        return seq <= self.seq and seq not in self.gaps

    def replaced_by(self, seq: int, gaps: Gaps, filled: Filled) -> bool:
        """Whether a merge takes a state at ``seq`` lacking ``gaps`` with ``filled`` over this one."""
        return replaces(seq, gaps, filled, self.seq, self.gaps, self.filled)


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

    def gaps(self) -> dict[int, Gaps]:
        """Per origin whose state lacks updates it counts, their numbers."""
        return {o: s.gaps for o, s in self.origins.items() if s.gaps}

    def filled(self) -> dict[int, Filled]:
        """Per origin whose state took fills, which and when."""
        return {o: s.filled for o, s in self.origins.items() if s.filled}

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
        then the updates before ``seq`` that never arrived are given up (the log
        keeps a hole there: no delta spans it, and a peer that holds them fills it).
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
            state.gaps += tuple(range(prior + 1, update.seq))
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

    def fill(self, origin: int, update: Update) -> bool:
        """Add an update this lattice gave up (a gap), from a peer that holds it. True if it was one."""
        state = self.origins.get(origin)
        if state is None or update.seq not in state.gaps:
            return False
        state.total[update.rows] += update.values
        state.gaps = tuple(g for g in state.gaps if g != update.seq)
        state.filled += ((update.seq, state.seq),)
        entries = self.log.setdefault(origin, [])
        at = bisect.bisect_left([u.seq for u in entries], update.seq)
        if at == len(entries) or entries[at].seq != update.seq:
            entries.insert(at, update)
        return True

    def logged(self, origin: int, seqs: Gaps) -> list[Update]:
        """The updates of ``seqs`` still in the log."""
        wanted = set(seqs)
        return [u for u in self.log.get(origin, []) if u.seq in wanted]

    def merge_state(self, origin: int, seq: int, total: np.ndarray, gaps: Gaps = (), filled: Filled = (),
                    force: bool = False) -> bool:
        """State-based merge of one origin: take the other state if it ``replaces`` ours (or ``force``:
        one that lacks updates ours holds, which nothing can fill any more), and fill its gaps from our
        log. True if it changed.

        The log stays: its updates are the same wherever they are held (a delta from it is right
        for any peer), and they fill gaps, ours and the peers'."""
        state = self.origin_state(origin)
        if not (state.replaced_by(seq, gaps, filled) or force and (seq, gaps) != (state.seq, state.gaps)):
            return False
        state.seq, state.gaps, state.filled = seq, gaps, filled
        state.total = np.array(total, dtype=np.float64, copy=True)
        for update in self.logged(origin, gaps):
            self.fill(origin, update)
        return True

    def merge(self, other: SumLattice) -> None:
        """Join with another replica's whole state."""
        for origin, state in other.origins.items():
            self.merge_state(origin, state.seq, state.total, state.gaps, state.filled)

    # ---------------------------------------------------------------- deltas

    def delta_since(self, origin: int, seq: int) -> Delta | None:
        """Updates after ``seq`` from the log, or None if the log no longer reaches back that far or
        has a hole (a gap) after it."""
        state = self.origins.get(origin)
        if state is None or state.seq <= seq:
            return Delta(origin, seq, ())
        entries = self.log.get(origin, [])
        start = bisect.bisect([u.seq for u in entries], seq)
        after = entries[start:]
        if not after or after[0].seq != seq + 1 or after[-1].seq - after[0].seq != len(after) - 1:
            return None
        return Delta(origin, seq, tuple(after))

    def truncate_log(self, origin: int, upto_seq: int, wanted: set[int] | frozenset[int] = frozenset()) -> None:
        """Forget logged updates every peer already holds (up to ``upto_seq``, but those ``wanted``:
        gaps of a peer, to fill them)."""
        entries = self.log.get(origin)
        if entries:
            keep = [u for u in entries if u.seq > upto_seq or u.seq in wanted]
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

    def totals(self, rows: np.ndarray) -> dict[int, tuple[int, int, np.ndarray]]:
        """Per origin, ``(seq, gaps, total rows)`` (gaps counted): what a reader merging several
        replicas needs."""
        return {o: (s.seq, len(s.gaps), s.total[rows]) for o, s in self.origins.items()}


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


def merged_value(base: np.ndarray, replies: list[dict[int, tuple[int, int, np.ndarray]]]
                 ) -> tuple[np.ndarray, dict[int, int]]:
    """Join per-origin ``(seq, gaps, total)`` read from several replicas: per origin the largest seq
    wins, and of two at one seq the one lacking fewer updates.

    Returns the value (float64) and the merged version vector.
    """
    best: dict[int, tuple[int, int, np.ndarray]] = {}
    for reply in replies:
        for origin, (seq, gaps, total) in reply.items():
            if origin not in best or (seq, -gaps) > (best[origin][0], -best[origin][1]):
                best[origin] = (seq, gaps, total)
    out = np.array(base, dtype=np.float64, copy=True)
    for origin in sorted(best):
        out += best[origin][2]
    return out, {o: s for o, (s, _, _) in best.items()}
