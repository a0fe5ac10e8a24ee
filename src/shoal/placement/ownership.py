"""Who owns a key of an adaptive table, as each party knows it (Lapse, DESIGN.md §6).

Every key has a *home* node (``key % num_nodes``) that decides where it moves
when a node asks for it, and learns where its owners move it on their own.
Everyone else keeps a location cache of hints that may be stale: a
request sent on a stale hint is answered "moved, try there", and after two such
hops it goes to the home node, which knows best.
"""

from __future__ import annotations

import numpy as np

MAX_HOPS = 2


def home_of(keys: np.ndarray, num_nodes: int) -> np.ndarray:
    return keys % num_nodes


class Directory:
    """At a home node: the owner of each of its home keys, and the version of that knowledge.

    A key's version is ``(epoch, step)``: ``epoch`` counts the moves this home
    decided (each handover carries its epoch, so that an older one still on its
    way cannot move the key back), ``step`` the moves its owners made on their
    own since (reported to the home in any order: the newest report wins).
    """

    #: its fields of each key's record (``placement.adaptive_table``): owner, epoch, step
    FIELDS = (("home_owner", "i8"), ("home_epoch", "i8"), ("home_step", "i8"))

    def __init__(self, num_keys: int, num_nodes: int, node: int, records: np.ndarray | None = None) -> None:
        """``records``: one per key, with ``FIELDS`` among theirs, zero (of their own if None)."""
        self.node = node
        self.num_nodes = num_nodes
        if records is None:
            records = np.zeros(num_keys, dtype=np.dtype(list(self.FIELDS)))
        self.owner = records["home_owner"]
        self.owner[:] = -1
        self.owner[node::num_nodes] = node  # initially every key lives at home
        self.epoch = records["home_epoch"]
        self.step = records["home_step"]

    def is_home(self, keys: np.ndarray) -> np.ndarray:
        return home_of(keys, self.num_nodes) == self.node

    def owners(self, keys: np.ndarray) -> np.ndarray:
        return self.owner[keys]

    def move(self, keys: np.ndarray, to: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Decide that ``keys`` now belong to ``to``: per owner known until now, the keys it must hand
        over and the epoch of this decision for each. An owner known to be ``to`` already is asked too:
        the key may have moved on meanwhile, and its holder must send it back."""
        keys = keys[self.is_home(keys)]
        previous = self.owner[keys].copy()
        self.owner[keys] = to
        self.epoch[keys] += 1
        self.step[keys] = 0
        return {int(o): (keys[previous == o], self.epoch[keys[previous == o]]) for o in np.unique(previous)}

    def record(self, keys: np.ndarray, owner: int, epochs: np.ndarray, steps: np.ndarray) -> np.ndarray:
        """An owner moved keys on its own and says where, at which version; the home keys this report
        is the newest news of (the others: an older report, or a move decided here since)."""
        home = self.is_home(keys)
        keys, epochs, steps = keys[home], epochs[home], steps[home]
        newer = (epochs > self.epoch[keys]) | ((epochs == self.epoch[keys]) & (steps > self.step[keys]))
        keys = keys[newer]
        self.owner[keys] = owner
        self.epoch[keys] = epochs[newer]
        self.step[keys] = steps[newer]
        return keys


class LocationCache:
    """Hints of where keys live; start at home, learn from answers.

    Given ``shared`` (an array in shared memory), the cache lives there: a node's
    server keeps its own that way so that its workers can read it.
    """

    def __init__(self, num_keys: int, num_nodes: int, shared: np.ndarray | None = None) -> None:
        self.num_nodes = num_nodes
        self.hint = np.empty(num_keys, dtype=np.int64) if shared is None else shared
        self.hint[...] = home_of(np.arange(num_keys, dtype=np.int64), num_nodes)

    def learn(self, keys: np.ndarray, owners: np.ndarray | int) -> None:
        self.hint[keys] = owners

    def route(self, keys: np.ndarray, hops: int) -> np.ndarray:
        """Where to send a request for ``keys`` that has already bounced ``hops`` times.

        Two hops on hints, then the home (which knows the owner), then the
        owner the home named, and so on: a key in flight is found once it lands.
        """
        if hops % (MAX_HOPS + 1) == MAX_HOPS:
            return home_of(keys, self.num_nodes)
        return self.hint[keys]
