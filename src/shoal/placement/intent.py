"""Intent signals and what they turn into (AdaPS, DESIGN.md §6).

A worker declares that it will access keys during clocks ``[start, end)``. Its
node's server turns intents into announcements when they enter the *action
window* (the next few clocks) and withdrawals when they expire, and sends them
to the keys' owners. An owner decides per key from the nodes that announced
interest: one other node and nobody else -> relocate the key there; several
nodes -> replicate it to them; no interest -> leave it. Pure bookkeeping: the
server carries the decisions out.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from shoal.api.errors import ClusterError
from shoal.api.ids import MAX_INCARNATIONS
from shoal.placement.kernels import distinct, take_in_intents, take_out_intents

#: about how long a relocation or replication takes here: the action window is this long in clocks
ACTION_S = 0.005
#: how often a server acts on its node's intents at most, unless one is about to start: each action
#: costs a few hundred µs per table and peer, whatever the number of keys (``server_cpu.md``)
ACT_EVERY_S = 0.05
#: a process numbers its announcements of a table within ``[incarnation, incarnation + 1) * 2**40``: a
#: thousand a second for 34 years (a server makes a few dozen), under 2**60 for every incarnation
ANNOUNCEMENTS_PER_PROCESS_BITS = 40


_NO_KEYS = np.empty(0, dtype=np.int64)


class Action(Enum):
    NOTHING = "nothing"
    RELOCATE = "relocate"
    REPLICATE = "replicate"


@dataclass
class NodeIntents:
    """At one node: its workers' intents, and which keys it has announced to their owners."""

    num_keys: int
    #: which process of its node this is (``api.ids``: the rendezvous counts each node's registrations)
    incarnation: int = 1
    until: np.ndarray = field(init=False)  # the last clock (exclusive) of interest per key
    announced: np.ndarray = field(init=False)
    _starting: list[tuple[int, int, np.ndarray, int]] = field(default_factory=list)  # (start, seq, keys, end)
    _ending: list[tuple[int, int]] = field(default_factory=list)  # (end, seq)
    _ending_keys: dict[int, np.ndarray] = field(default_factory=dict)
    _seq: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.until = np.zeros(self.num_keys, dtype=np.int64)
        self.announced = np.zeros(self.num_keys, dtype=np.bool_)
        # The announcements (and withdrawals) made here are numbered, so that an owner takes one only if
        # it is newer than the last it took from here (they take different routes, and an older one
        # may come last). Each process of a node numbers from its incarnation up, so a server started
        # again numbers past its earlier process, whose numbers owners hold, whatever its clock says.
        if not 1 <= self.incarnation < MAX_INCARNATIONS:
            raise ClusterError(f"incarnation {self.incarnation} out of [1, {MAX_INCARNATIONS})")
        self._generation = self.incarnation << ANNOUNCEMENTS_PER_PROCESS_BITS
        self._seen = np.zeros(self.num_keys, dtype=np.bool_)  # ``distinct``'s scratch flags, kept clear

    def add(self, keys: np.ndarray, start: int, end: int) -> None:
        if end > start and keys.size:
            heapq.heappush(self._starting, (start, next(self._seq), self._distinct(keys), end))

    def _distinct(self, keys: np.ndarray) -> np.ndarray:
        out = np.empty(keys.shape[0], dtype=np.int64)
        return out[:distinct(keys, self._seen, out)]

    def stamp(self) -> int:
        """The number of an announcement made now."""
        self._generation += 1
        return self._generation

    def end_all(self) -> None:
        """Every intent declared so far ends now: a worker of this node was started again, and the
        clocks they name were its earlier process's (the node clock goes back with the new one, and
        intents it had passed would start again or never end). The announced keys are withdrawn at
        the next ``due``; intents not started are dropped."""
        announced = np.flatnonzero(self.announced)
        self._starting.clear()
        self._ending.clear()
        self._ending_keys.clear()
        self.until[:] = 0
        if announced.size:
            seq = next(self._seq)
            heapq.heappush(self._ending, (0, seq))
            self._ending_keys[seq] = announced

    def any_due(self, clock: int, window: int) -> bool:
        return bool((self._starting and self._starting[0][0] <= clock + window)
                    or (self._ending and self._ending[0][0] <= clock))

    def starts_within(self, clock: int, window: int) -> bool:
        """Whether an intent not yet acted on starts within ``window`` clocks of ``clock``."""
        return bool(self._starting and self._starting[0][0] <= clock + window)

    def ended_among(self, keys: np.ndarray, clock: int, window: int) -> np.ndarray:
        """Those of ``keys`` (distinct) whose announced interest is over at node clock ``clock``, to
        withdraw now, ahead of ``due``: no longer counted as announced (``due`` passes them over).
        A key that an intent starting within ``window`` clocks carries on is not over: ``due`` would
        take that intent in before it withdraws, and the key would stay announced throughout."""
        over = keys[self.announced[keys] & (self.until[keys] <= clock)]
        if over.size:
            ahead = [k for start, _, k, end in self._starting if start <= clock + window and end > clock]
            if ahead:
                carried = np.concatenate(ahead)
                self._seen[carried] = True  # ``distinct``'s flags, cleared again below
                over = over[~self._seen[over]]
                self._seen[carried] = False
        self.announced[over] = False
        return over

    def due(self, clock: int, window: int) -> tuple[np.ndarray, np.ndarray]:
        """``(to_announce, to_withdraw)`` at node clock ``clock`` with an action window of ``window`` clocks.
        Each is distinct: a key is announced once, when the first intent holding it comes in, and
        withdrawn once, when the last intent holding it has ended."""
        starting: list[tuple[np.ndarray, int]] = []
        while self._starting and self._starting[0][0] <= clock + window:
            _, seq, keys, end = heapq.heappop(self._starting)
            if end <= clock:
                continue  # already over before it came into view
            starting.append((keys, end))
            heapq.heappush(self._ending, (end, seq))  # ends after ``clock``: not taken out below
            self._ending_keys[seq] = keys
        ending: list[np.ndarray] = []
        while self._ending and self._ending[0][0] <= clock:
            _, seq = heapq.heappop(self._ending)
            ending.append(self._ending_keys.pop(seq))
        fresh = over = _NO_KEYS
        if starting:
            keys = np.concatenate([k for k, _ in starting])
            bounds = np.zeros(len(starting) + 1, dtype=np.int64)  # intent i's keys: keys[bounds[i]:bounds[i + 1]]
            np.cumsum([k.shape[0] for k, _ in starting], out=bounds[1:])
            ends = np.array([end for _, end in starting], dtype=np.int64)
            fresh = np.empty(keys.shape[0], dtype=np.int64)
            fresh = fresh[:take_in_intents(keys, bounds, ends, self.until, self.announced, fresh)]
        if ending:
            keys = np.concatenate(ending)
            over = np.empty(keys.shape[0], dtype=np.int64)
            over = over[:take_out_intents(keys, clock, self.until, self.announced, over)]
        return fresh, over


class OwnerInterest:
    """At an owner: which nodes announced interest in each of its keys (a bit per node), and the
    number of the last announcement of each node taken for each key (they travel with the key)."""

    @staticmethod
    def fields(num_nodes: int) -> list[tuple[str, str] | tuple[str, str, tuple[int]]]:
        """Its fields of each key's record (``placement.adaptive_table``)."""
        return [("interest", "i8"), ("replicas", "i8"), ("generations", "i8", (num_nodes,))]

    def __init__(self, num_keys: int, num_nodes: int, records: np.ndarray | None = None) -> None:
        """``records``: one per key, with ``fields(num_nodes)`` among theirs, zero (of their own if None)."""
        self.num_keys = num_keys
        self.num_nodes = num_nodes
        if records is None:
            records = np.zeros(num_keys, dtype=np.dtype(self.fields(num_nodes)))
        self.interest: np.ndarray = records["interest"]
        self.replicas: np.ndarray = records["replicas"]  # nodes holding a replica (a bit per node)
        self._generations: np.ndarray = records["generations"]  # a row per key, a column per node

    def take(self, keys: np.ndarray, generation: int, node: int) -> np.ndarray:
        """Which of ``keys`` (distinct) an announcement of ``node`` numbered ``generation`` is newer
        for than the last of that node's taken here, now the last one; a mask over ``keys``."""
        taken = self._generations[:, node]
        newer = taken[keys] < generation
        taken[keys[newer]] = generation
        return newer

    def generations_of(self, keys: np.ndarray) -> np.ndarray:
        """The number of the last announcement of each node taken for each key (a row per key)."""
        return self._generations[keys]

    def took(self, keys: np.ndarray, generations: np.ndarray) -> None:
        """``keys`` came with ``generations`` (``generations_of`` where they were)."""
        self._generations[keys] = generations

    def announce(self, keys: np.ndarray, node: int) -> None:
        self.interest[keys] |= 1 << node

    def withdraw(self, keys: np.ndarray, node: int) -> None:
        self.interest[keys] &= ~(1 << node)

    def decide(self, technique: str, keys: np.ndarray, node: int, owner: int) -> dict[Action, np.ndarray]:
        """What to do now that ``node`` announced interest in ``keys`` owned by ``owner``."""
        if node == owner or technique == "static" or not keys.size:
            return {Action.NOTHING: keys}
        if technique == "replication":
            return {Action.REPLICATE: keys}
        others = self.interest[keys] & ~(1 << node)
        alone = (others == 0) & (self.replicas[keys] == 0)
        if technique == "relocation":
            # Only keys nobody else holds a replica of can move; a replica syncs with its owner.
            return {Action.RELOCATE: keys[self.replicas[keys] == 0], Action.NOTHING: keys[self.replicas[keys] != 0]}
        return {Action.RELOCATE: keys[alone], Action.REPLICATE: keys[~alone]}


def smoothed_window(action_s: float, clock_s: float, current: float) -> float:
    """How many clocks ahead to act, smoothed: enough for an action to complete before its clock
    comes. Kept fractional (callers act ``ceil`` of it ahead) so that small changes accumulate."""
    if clock_s <= 0:
        return max(current, 1.0)
    target = action_s / clock_s + 1.0
    return max(1.0, min(64.0, 0.8 * current + 0.2 * target))
