"""One replica of one shard: accepts pushes, serves reads, absorbs gossip.

The pushing worker is the origin of every push, whatever the write quorum: it
numbers its pushes to each shard, so every replica that gets a push applies it
as the same update, and a push sent again (to the same replica or, after a
failover, to another) is recognised and applied once. A replica applies one
origin's pushes in order; a push that arrives before an earlier one waits for
it (gossip brings it), unless the earlier one can only be at a replica that died:
then it is given up (``skip_gaps``). A restarted worker is a new origin (its
incarnation is part of it), so it never reuses its earlier self's numbers.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from shoal.api.config import TableSpec
from shoal.api.ids import RESTORED
from shoal.api.optim import SGD, Adagrad, Adam, Sum
from shoal.lattice.sum_lattice import Delta, Filled, Gaps, SumLattice, Update, covers, rank, replaces
from shoal.replication.delays import DelaySamples
from shoal.replication.gossip import DIGEST, GossipPayload
from shoal.storage.checkpoint import place_saved
from shoal.storage.initialize import fill_initial

_LOG_BYTES = 64 * 1024 * 1024  # logged updates kept per origin for deltas; older peers get whole states
#: updates sent to a peer are not sent to it again while its digests show it taking in what was sent, and
#: for this long after they last did: they are on their way (answering every digest with all the peer
#: lacks sent each update again and again while the peer's queue was backed up, which backed it up
#: further). Lost ones go again after it: measured from each answer, the window never closed while
#: pushes went on, and a peer that missed one answer stayed behind for good (every later delta began
#: past what it held).
_IN_FLIGHT_S = 0.5


@dataclass
class HeldPush:
    """A push that arrived before an earlier one of its origin; answered once the gap fills.

    Every retry of it that arrives meanwhile adds a token: each gets an answer.
    """

    rows: np.ndarray
    delta: np.ndarray
    tokens: list[Any]


class ShardReplica:
    """A replica of shard ``shard`` of a replicated table, held by server ``node``."""

    def __init__(self, spec: TableSpec, shard: int, keys: np.ndarray, node: int,
                 now: Callable[[], float] = time.time) -> None:
        self.spec = spec
        self.shard = shard
        self.node = node
        self.now = now
        base = np.empty((keys.shape[0], spec.dim), dtype=np.float64)
        fill_initial(spec, keys, base)
        self.lattice = SumLattice(base)
        self.num_rows = int(keys.shape[0])
        # Non-additive optimiser state stays with its origin (this replica).
        self._first = np.zeros((self.num_rows, spec.dim)) if isinstance(spec.optimizer, (Adagrad, Adam)) else None
        self._second = np.zeros((self.num_rows, spec.dim)) if isinstance(spec.optimizer, Adam) else None
        self._steps = np.zeros(self.num_rows) if isinstance(spec.optimizer, Adam) else None
        if isinstance(spec.optimizer, Adagrad):
            self._first[...] = spec.optimizer.initial_accumulator  # type: ignore[index]
        self.held: dict[int, dict[int, HeldPush]] = defaultdict(dict)
        #: per origin, the lowest of its pushes it still had open when it sent its latest (``note_floor``)
        self.floors: dict[int, int] = {}
        self.peer_versions: dict[int, dict[int, int]] = {}
        self.peer_gaps: dict[int, dict[int, Gaps]] = {}  # per peer, its gaps as its last digest said
        #: per peer, per origin: up to which update we sent it, and when
        #: per peer and origin: the last update sent, when the peer last showed progress on it (or it went
        #: first), and the peer's version of the origin then
        self._sent: dict[int, dict[int, tuple[int, float, int]]] = defaultdict(dict)
        self.delays: dict[int, DelaySamples] = defaultdict(DelaySamples)  # accepting replica -> delays to here
        self.accept_times: deque[float] = deque(maxlen=4096)
        #: changes counted, and per row the count at its last change: eager pushes (ESSP) send the rows
        #: changed since the count they last went out at
        self.changes = 0
        self.changed_at = np.zeros(self.num_rows, dtype=np.int64)

    def _changed(self, rows: np.ndarray | None) -> None:
        """``rows`` (None: every row) changed just now."""
        self.changes += 1
        if rows is None:
            self.changed_at[:] = self.changes
        else:
            self.changed_at[rows] = self.changes

    # ----------------------------------------------------------------- pushes

    def _delta(self, rows: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Distinct rows and the additive change the table's rule makes to them."""
        rows = np.asarray(rows, dtype=np.int64)
        grads = np.asarray(grads, dtype=np.float64)
        if rows.size > 1 and not (np.diff(rows) > 0).all():
            rows, inverse = np.unique(rows, return_inverse=True)
            summed = np.zeros((rows.shape[0], grads.shape[1]))
            np.add.at(summed, inverse, grads)
            grads = summed
        opt = self.spec.optimizer
        if isinstance(opt, Sum):
            return rows, grads
        if isinstance(opt, SGD):
            return rows, -opt.lr * grads
        if isinstance(opt, Adagrad):
            assert self._first is not None
            self._first[rows] += grads * grads
            return rows, -opt.lr * grads / (np.sqrt(self._first[rows]) + opt.eps)
        assert isinstance(opt, Adam) and self._first is not None and self._second is not None
        assert self._steps is not None
        self._steps[rows] += 1
        t = self._steps[rows][:, None]
        self._first[rows] = opt.beta1 * self._first[rows] + (1 - opt.beta1) * grads
        self._second[rows] = opt.beta2 * self._second[rows] + (1 - opt.beta2) * grads * grads
        denom = np.sqrt(self._second[rows]) / np.sqrt(1 - opt.beta2**t) + opt.eps
        return rows, -(opt.lr / (1 - opt.beta1**t)) * self._first[rows] / denom

    def push(self, rows: np.ndarray, grads: np.ndarray, origin: int, seq: int,
             token: Any = None) -> tuple[int, int, float] | None:
        """Accept push ``seq`` of ``origin``; returns ``(origin, seq, accepted_at)``, or None if it waits for
        an earlier push. A push this replica holds already (sent again) is answered, not applied again."""
        if seq <= self.lattice.seq(origin):
            return origin, seq, self.now()  # sent again: already applied
        rows, delta = self._delta(rows, grads)
        now = self.now()
        if seq > self.lattice.seq(origin) + 1:
            held = self.held[origin].get(seq)
            if held is None:
                self.held[origin][seq] = HeldPush(rows, delta, [token])
            else:
                held.tokens.append(token)
            return None
        self.lattice.accept(origin, rows, delta, now, seq=seq, accepted_by=self.node)
        self._changed(rows)
        self.accept_times.append(now)
        return origin, seq, now

    def release_held(self) -> list[tuple[Any, int, int, float]]:
        """Held pushes that can be answered: those whose predecessors arrived (applied now) and those
        gossip already brought (applied elsewhere); ``(token, origin, seq, accepted_at)`` each."""
        done = []
        now = self.now()
        for origin, waiting in self.held.items():
            have = self.lattice.seq(origin)
            for seq in [s for s in waiting if s <= have]:
                done += [(t, origin, seq, now) for t in waiting.pop(seq).tokens]
            while (seq := self.lattice.seq(origin) + 1) in waiting:
                push = waiting.pop(seq)
                self.lattice.accept(origin, push.rows, push.delta, now, seq=seq, accepted_by=self.node)
                self._changed(push.rows)
                done += [(t, origin, seq, now) for t in push.tokens]
        return done

    def waiting(self) -> bool:
        """Whether a push waits here for an earlier one of its origin."""
        return any(self.held.values())

    def note_floor(self, origin: int, floor: int) -> None:
        """``origin``'s pushes from ``floor`` on were still on their way when it sent one: never given up."""
        if floor > self.floors.get(origin, 0):
            self.floors[origin] = floor

    def skip_gaps(self) -> list[tuple[Any, int, int, float]]:
        """Give up the pushes that held ones wait for (they can only be at a replica that died: the
        caller checks), apply the held ones, and answer them as ``release_held`` does. Not those its
        worker still had open (its ``floor``): sent again, they would be answered as applied and
        never be (a W=2 push lost on its way to both its replicas once any replica had died)."""
        now = self.now()
        for origin, waiting in self.held.items():
            if waiting and self.lattice.seq(origin) + 1 < min(waiting) <= self.floors.get(origin, 0):
                first = min(waiting)
                push = waiting[first]
                self.lattice.accept(origin, push.rows, push.delta, now, seq=first, accepted_by=self.node,
                                    skip=True)
                self._changed(push.rows)
        return self.release_held()

    # ------------------------------------------------------------ checkpoints

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Values (float64, as the lattice holds them) and this replica's own optimiser state, per row."""
        arrays = {"values": self.lattice.value()}
        for name, array in (("first", self._first), ("second", self._second), ("steps", self._steps)):
            if array is not None:
                arrays[name] = array.copy()
        return arrays

    def load(self, rows: np.ndarray, arrays: dict[str, np.ndarray], pick: np.ndarray, write: bool = True) -> None:
        """Restore: ``rows`` start from the saved values and optimiser state (``arrays[name][pick]``).
        Only before any update. The values count as one origin's update (``RESTORED``, over the
        initial rows), not as the lattice's base: a reader merging replicas adds their origins to the
        initial rows it makes itself (it read the initializer's values, the restored ones lost), and a
        replica started again regains them by gossip. Every replica that loads the same values
        agrees. ``write`` False only checks that the arrays fit."""
        assert not any(s for o, s in self.version().items() if o != RESTORED), \
            "restore into a replica that has taken updates"
        values = self.lattice.base.copy()  # the saved rows, over the initial ones
        targets = {"values": values, "first": self._first, "second": self._second, "steps": self._steps}
        place_saved({name: t for name, t in targets.items() if t is not None}, rows, arrays, pick, self.spec.name,
                    write)
        if write:
            restored = self.lattice.origin_state(RESTORED)
            restored.total[rows] = values[rows] - self.lattice.base[rows]
            restored.seq = 1

    # ------------------------------------------------------------------ reads

    def read(self, rows: np.ndarray) -> np.ndarray:
        return self.lattice.value(rows).astype(self.spec.dtype)

    def version(self) -> dict[int, int]:
        return self.lattice.version()

    def totals(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(origins, seqs, gaps, totals)`` of ``rows`` (gaps counted), for a reader merging several
        replicas."""
        per = self.lattice.totals(rows)
        origins = np.array(sorted(per), dtype=np.int64)
        seqs = np.array([per[o][0] for o in origins], dtype=np.int64)
        gaps = np.array([per[o][1] for o in origins], dtype=np.int64)
        totals = (np.stack([per[o][2] for o in origins]) if origins.size
                  else np.zeros((0, rows.shape[0], self.spec.dim)))
        return origins, seqs, gaps, totals

    # ----------------------------------------------------------------- gossip

    def digest(self) -> GossipPayload:
        return GossipPayload(self.shard, self.version(), DIGEST, gaps=self.lattice.gaps(),
                             filled=self.lattice.filled())

    def answer(self, peer: int, digest: GossipPayload, stage: int, budget: int = 1 << 62) -> GossipPayload:
        """What ``peer`` lacks by what it sent (``digest``: its version, gaps and fills), as deltas
        where the log reaches back, else whole states, up to ``budget`` bytes of rows (the rest goes
        in later rounds); one state or update larger than the budget goes alone. Where the peer and
        this replica each hold an update the other gave up, or took fills, ``_mend`` decides."""
        self.peer_versions[peer] = peer_version = digest.version
        self.peer_gaps[peer] = peer_gaps = digest.gaps
        peer_filled = digest.filled
        payload = GossipPayload(self.shard, self.version(), stage, gaps=self.lattice.gaps(),
                                filled=self.lattice.filled())
        used = 0
        now = self.now()
        sent = self._sent[peer]
        for origin, state in self.lattice.origins.items():
            held, their_gaps = peer_version.get(origin, 0), peer_gaps.get(origin, ())
            their_filled = peer_filled.get(origin, ())
            if state.gaps or their_gaps or state.filled or their_filled:
                if state.seq == held or not covers(state.seq, state.gaps, held, their_gaps):
                    used = self._mend(payload, origin, (held, their_gaps, their_filled), used, budget)
                    continue
            upto, since, seen = sent.get(origin, (0, 0.0, 0))
            if held > seen:
                since = now  # the peer took some in: what follows is on its way
            theirs = held
            if upto > held and now - since < _IN_FLIGHT_S:
                theirs = upto  # on their way to the peer
            else:
                since = now  # what goes now starts a window of its own
            if state.seq <= theirs or used >= budget:
                if upto > held:
                    sent[origin] = (upto, since, held)
                continue
            delta = self.lattice.delta_since(origin, theirs)
            if delta is None:
                if used and used + state.total.nbytes > budget:
                    continue  # the next round's (checked against the budget alone, it went over the limit)
                payload.states.append((origin, state.seq, state.total, state.gaps, state.filled))
                used += state.total.nbytes
                sent[origin] = (state.seq, since, held)
                continue
            taken: list[Update] = []
            for update in delta.updates:  # a prefix is fine: the receiver replays in order
                size = update.values.nbytes + update.rows.nbytes
                if (taken or used) and used + size > budget:
                    break
                taken.append(update)
                used += size
            if taken:
                payload.deltas.append(Delta(origin, delta.from_seq, tuple(taken)))
                sent[origin] = (taken[-1].seq, since, held)
        return payload

    def _mend(self, payload: GossipPayload, origin: int, theirs: tuple[int, Gaps, Filled], used: int,
              budget: int) -> int:
        """One origin where the peer's state (``theirs``: seq, gaps, fills) and ours are at one seq, or
        each holds an update the other lacks; returns the bytes used now. Our state goes whole where
        it ``replaces`` the peer's, or ranks higher (the peer takes it only once it cannot fill ours).
        The updates the peer lacks go as fills where its state ranks higher: filled, it covers ours,
        and comes back whole, so both end with the same bits."""
        state = self.lattice.origins[origin]
        ours = (state.seq, state.gaps, state.filled)
        held, their_gaps, _ = theirs
        if ours == theirs or replaces(*theirs, *ours):
            return used  # nothing it lacks (it sends us what we lack)
        if replaces(*ours, *theirs) or rank(state.seq, state.gaps) > rank(held, their_gaps):
            if used >= budget or used and used + state.total.nbytes > budget:
                return used  # the next round's
            payload.states.append((origin, state.seq, state.total, state.gaps, state.filled))
            return used + int(state.total.nbytes)
        for update in self.lattice.logged(origin, tuple(g for g in their_gaps if state.holds(g))):
            size = update.values.nbytes + update.rows.nbytes
            if used and used + size > budget:
                break
            payload.fills.append((origin, update))
            used += size
        return used

    def forget_sent(self, peer: int) -> None:
        """What was last sent to ``peer`` did not leave: answer its next digest in full."""
        self._sent.pop(peer, None)

    def absorb(self, payload: GossipPayload) -> int:
        """Merge what a peer sent; returns the number of updates new here."""
        now = self.now()
        new = 0
        for delta in payload.deltas:
            have = self.lattice.seq(delta.origin)
            applied = self.lattice.apply(delta)
            if applied:
                for update in delta.updates[have - delta.from_seq:]:
                    self._changed(update.rows)
                    if 0 <= update.accepted_by != self.node:
                        self.delays[update.accepted_by].add(now - update.accepted_at)
                new += applied
        for origin, update in payload.fills:
            if self.lattice.fill(origin, update):
                self._changed(update.rows)
                new += 1
        for origin, seq, total, gaps, filled in payload.states:
            before = self.lattice.seq(origin)
            # A state that lacks some update ours holds is taken only if we cannot fill it (the update
            # is no longer in our log): then nothing can, and the replicas agree on the fuller state.
            ours = self.lattice.origin_state(origin)
            lacking = tuple(g for g in gaps if ours.holds(g))
            unfillable = (bool(lacking) and rank(seq, gaps) > rank(ours.seq, ours.gaps)
                          and not self.lattice.logged(origin, lacking))
            if self.lattice.merge_state(origin, seq, total, gaps, filled, force=unfillable):
                self._changed(None)
                new += max(1, seq - before)
        return new

    def trim_log(self, live_peers: set[int]) -> None:
        """Drop logged updates every live peer holds, and keep at most ``_LOG_BYTES`` per origin.

        A dead peer's last known version does not pin the log; if it comes back
        it gets whole states instead of deltas.
        """
        versions = [v for p, v in self.peer_versions.items() if p in live_peers]
        gaps = [g for p, g in self.peer_gaps.items() if p in live_peers]
        for origin, entries in self.lattice.log.items():
            if not entries:
                continue
            wanted = set().union(*(g.get(origin, ()) for g in gaps))  # to fill a peer's gaps
            held_by_all = min((v.get(origin, 0) for v in versions), default=0) if versions else 0
            kept, upto = 0, held_by_all
            for update in reversed(entries):
                kept += update.values.nbytes + update.rows.nbytes
                if kept > _LOG_BYTES:
                    upto = max(upto, update.seq)
                    break
            if entries[0].seq <= upto:
                self.lattice.truncate_log(origin, upto, wanted)

    def accept_rate(self, window_s: float = 5.0) -> float:
        """Pushes per second accepted here over the last ``window_s``."""
        now = self.now()
        recent = [t for t in self.accept_times if now - t <= window_s]
        if len(recent) < 2:
            return 0.0
        return len(recent) / max(now - recent[0], 1e-3)


def delta_count(payload: GossipPayload) -> int:
    return sum(len(d.updates) for d in payload.deltas) + len(payload.states)


__all__ = ["Delta", "HeldPush", "ShardReplica", "delta_count"]
