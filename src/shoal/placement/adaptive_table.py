"""One node's state of an adaptive table, and the effects its decisions produce (DESIGN.md §6).

Every node keeps a row for every key in shared memory, with its presence
(absent, owned, replica) and where the node believes absent keys live.
Co-located workers read and update present rows themselves. The decisions
(``placement.machine``) change this state and return ``Send`` and ``Answer``
records; the server carries them out.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shoal.api.config import TableSpec
from shoal.api.errors import ConfigError
from shoal.api.ids import ADAPTIVE_SHARD
from shoal.placement.intent import NodeIntents, OwnerInterest
from shoal.placement.messages import PlacementMessage
from shoal.placement.ownership import Directory, LocationCache
from shoal.storage.kernels import OWNED
from shoal.storage.shard import ShardStore

MAX_NODES = 63  # interest and replica sets are bits of an int64
_PART_BITS = 40  # a part of a sync: its node's number, then this many bits of its number there


@dataclass
class SyncInFlight:
    """The answers one replica sync waits for. An owner that holds only some of its keys adds those and
    passes the rest on as parts of their own (on, until they reach their owners); each part is answered
    by the node that adds it, saying how many it passed on in turn, and the answers arrive in any order
    (each from its own node)."""

    part: int  # the sync's own part, the one sent
    left: np.ndarray  # its keys whose part has not been answered yet (sorted)
    changes: bool  # whether it carries a change (else it only refreshes replicas)
    answered: bool = False  # whether ``part`` is
    #: per part answered, its parts passed on whose answers are still due (negative: those came first)
    due: dict[int, int] = field(default_factory=dict)

    def answer(self, part: int, parent: int, parts: int) -> bool:
        """Count the answer to ``part``; True once every part of the sync has been answered."""
        if part == self.part:
            self.answered = True
        else:
            self._add(parent, -1)
        self._add(part, parts)
        return self.answered and not self.due

    def answered_keys(self, keys: np.ndarray, done: bool) -> np.ndarray:
        """The keys an answer naming ``keys`` settles: those among them still left, or every key left
        once the whole sync is answered (a part lost on the way names none)."""
        if done:
            settled, self.left = self.left, self.left[:0]
            return settled
        mask = np.isin(self.left, keys, assume_unique=False)
        settled, self.left = self.left[mask], self.left[~mask]
        return settled

    def _add(self, part: int, count: int) -> None:
        left = self.due.get(part, 0) + count
        if left:
            self.due[part] = left
        else:
            self.due.pop(part, None)


@dataclass(eq=False)
class WaitingState:
    """Rows (``State``'s fields) that came to be owned here while a sync of this node's replica of
    them was on its way: they may lack that sync's change (the old owner passes it on to here), so
    they are taken once every such sync has been answered, and the replica here, which holds the
    change, is read meanwhile. Changes that other replicas sync to them meanwhile go into
    ``values``."""

    keys: np.ndarray
    values: np.ndarray
    interest: np.ndarray
    generations: np.ndarray
    replicas: np.ndarray
    epochs: np.ndarray
    steps: np.ndarray

    def split(self, keep: np.ndarray) -> WaitingState:
        """The part of ``keep`` (a mask); this keeps the rest."""
        fields = ("keys", "values", "interest", "generations", "replicas", "epochs", "steps")
        taken = WaitingState(*(getattr(self, name)[keep] for name in fields))
        for name in fields:
            setattr(self, name, getattr(self, name)[~keep])
        return taken

    def positions(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where ``keys`` are in this state's keys, and which of them are."""
        order = np.argsort(self.keys, kind="stable")
        at = np.minimum(np.searchsorted(self.keys, keys, sorter=order), self.keys.shape[0] - 1)
        where = order[at]
        return where, self.keys[where] == keys


@dataclass(frozen=True, eq=False)
class Send:
    """A placement message about ``table`` to the server of ``node``."""

    table: str
    node: int
    message: PlacementMessage


@dataclass(frozen=True, eq=False)
class Answer:
    """The answer to a worker request that ``ticket`` stands for: rows (a pull) or None (a push),
    and for keys not here, their positions in the request and where they are believed to be."""

    ticket: Any
    values: np.ndarray | None
    moved: np.ndarray
    owners: np.ndarray


@dataclass
class Effects:
    """What one event asks the server to do."""

    sends: list[Send] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)

    def extend(self, other: Effects) -> None:
        self.sends += other.sends
        self.answers += other.answers


@dataclass(eq=False)  # compared by identity: field equality would compare arrays (and raise)
class Held:
    """A worker request waiting for keys on their way here."""

    ticket: Any
    keys: np.ndarray
    grads: np.ndarray | None  # None for a pull
    waiting_for: np.ndarray
    #: for a push held in part: where the held keys sat in the original request
    positions: np.ndarray | None
    since: float  # when it began to wait


#: this table's fields of each key's record at a node (beside the directory's and the interest's)
_FIELDS = (("epoch", "i8"), ("step", "i8"), ("replica_owner", "i8"), ("sent_to", "i1"), ("dropping", "?"),
           ("incoming", "?"))


class AdaptiveTable:
    """One node's view of an adaptive table."""

    def __init__(self, spec: TableSpec, node: int, num_nodes: int, cluster_id: str, incarnation: int = 1) -> None:
        if num_nodes > MAX_NODES:
            raise ConfigError(f"adaptive tables support at most {MAX_NODES} nodes")
        self.spec = spec
        self.node = node
        self.num_nodes = num_nodes
        keys = np.arange(spec.num_keys, dtype=np.int64)
        self.store = ShardStore.create(spec, ADAPTIVE_SHARD, keys, cluster_id)
        assert self.store.presence is not None and self.store.base is not None
        assert self.store.location is not None
        self.presence = self.store.presence
        self.presence[node::num_nodes] = OWNED  # keys start at home
        # What this server alone keeps of each key, one record per key: a batch of keys scattered over the
        # table (a relocation's, a round's announcements) is taken field after field, and with an array
        # per field each field of each key was a cache miss of its own (a relocation's events at the old
        # and the new owner: 214 and 185 us against 243 and 201, ``placement.md``). The arrays its
        # kernels take stay arrays of their own.
        records = np.zeros(spec.num_keys, dtype=np.dtype(
            [*_FIELDS, *Directory.FIELDS, *OwnerInterest.fields(num_nodes)], align=True))
        self.directory = Directory(spec.num_keys, num_nodes, node, records)
        # In shared memory: this node's workers read where the keys that left went.
        self.hints = LocationCache(spec.num_keys, num_nodes, shared=self.store.location)
        self.incoming: np.ndarray = records["incoming"]
        #: where this node last sent each key's rows (-1: never): a handover for a key that left follows
        #: it there, behind its rows on the same channel (the location cache may say otherwise by then)
        self.sent_to: np.ndarray = records["sent_to"]
        self.sent_to[:] = -1
        #: the version (``placement.ownership.Directory``) of each key this node owns, as it came
        self.epoch: np.ndarray = records["epoch"]
        self.step: np.ndarray = records["step"]
        self.held: list[Held] = []
        #: handovers (keys, epochs, to) of keys on their way here: carried out when the keys arrive
        self.deferred_handovers: list[tuple[np.ndarray, np.ndarray, int]] = []
        #: keys to give away that a worker here held in place: (keys, the handover's epochs or None for
        #: a move on intent, to); given once their holds end
        self.held_back: list[tuple[np.ndarray, np.ndarray | None, int]] = []
        self.next_hold_check = 0.0  # when to look next for holds of processes that died
        self.interest = OwnerInterest(spec.num_keys, num_nodes, records)
        self.intents = NodeIntents(spec.num_keys, incarnation)
        self.replica_owner: np.ndarray = records["replica_owner"]
        self.replica_owner[:] = -1
        self.dropping: np.ndarray = records["dropping"]
        #: per owner: this node's sync to it, until every part of it is answered
        self.syncs_in_flight: dict[int, SyncInFlight] = {}
        #: per key: syncs of this node's replica carrying its change whose part has not been answered
        self.unanswered = np.zeros(spec.num_keys, dtype=np.int32)
        #: rows that came while such a sync was on its way (``WaitingState``), and their keys
        self.waiting_states: list[WaitingState] = []
        self.state_waits = np.zeros(spec.num_keys, dtype=np.bool_)
        #: per owner: its syncs sent from here, which say whose turn it is to be refreshed
        self.refresh_turns = np.zeros(num_nodes, dtype=np.int64)
        #: parts of replicas' syncs (keys, changes, drop, origin, target, hops, part, parent) for keys on
        #: their way here: added when the keys arrive
        self.deferred_syncs: list[tuple[np.ndarray, np.ndarray, np.ndarray, int, int, int, int, int]] = []
        #: announcements (keys, active, node, number, hops) for keys on their way here: taken when the
        #: keys arrive
        self.deferred_announcements: list[tuple[np.ndarray, bool, int, int, int]] = []
        self.parts_made = 0  # parts of syncs named here (``new_part``)
        self.next_sync = 0.0  # when replicas sync at the latest
        self.synced_at = 0.0  # when they last did
        self.synced_clock = -1  # the node clock they last did at
        #: replicas were here at the last sync or came since: the loop wakes for syncs by the node's clock
        self.holds_replicas = False
        self.window = 1  # clocks ahead that intents are acted on
        self.acted_at = -1  # the node clock the window was last estimated at
        self.window_estimate = 1.0
        self.next_action = 0  # the node clock from which intents are acted on again (urgent ones at once)
        self.next_action_s = 0.0  # ... or the time, whichever comes first (a clock may stand still)
        self.stats: Counter[str] = Counter()

    @property
    def scale(self) -> float:
        assert self.store.rule.scale is not None  # adaptive tables have additive rules
        return self.store.rule.scale

    def new_part(self) -> int:
        """A name for a part of a replica's sync made here, unique in the cluster: this node's number,
        then how many it made before."""
        self.parts_made += 1
        return self.node << _PART_BITS | self.parts_made

    def where(self, keys: np.ndarray) -> np.ndarray:
        """Best knowledge of each key's owner: the directory for home keys, else the hint."""
        owners = self.hints.hint[keys].astype(np.int64)
        home = self.directory.is_home(keys)
        owners[home] = self.directory.owner[keys[home]]
        return owners

    def close(self) -> None:
        self.store.close()
