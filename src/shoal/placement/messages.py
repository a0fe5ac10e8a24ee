"""The messages between nodes about an adaptive table's keys: one typed declaration per kind.

Each kind is a frozen dataclass. Its int and bool fields travel in the message
body; its array fields travel as arrays, in field order, each declared with
its dtype kind and rank (metadata ``INTS``, ``INT_ROWS``, ``ROWS``, ``BYTES``).
``wire.schema`` derives the check of each kind from these declarations, the
server encodes and decodes them with ``to_parts`` and ``from_parts``, and
``placement.machine`` takes and returns them. Node fields (``NODE``) name a node
of the table; the machine checks them, counts (hops, parts), part names
(``PART``) and numbers (``NUMBER``) when a message arrives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

import numpy as np

#: field metadata: an array of ints, of int rows, of float rows, of bytes (dtype kind and rank); an int
#: naming a node
INTS = {"array": ("i", 1)}
INT_ROWS = {"array": ("i", 2)}
ROWS = {"array": ("f", 2)}
BYTES = {"array": ("u", 1)}
NODE = {"node": True}
#: an int naming a part of a replica's sync (``PartId``): the node that made it, then its number there
PART = {"part": True}
#: an int numbering a node's announcements of a table's keys (``NodeIntents.stamp``), 0 to 2**62
NUMBER = {"number": True}


@dataclass(frozen=True, eq=False)  # compared by identity: field equality would compare arrays
class PlacementMessage:
    """What every kind has: the keys it is about, its first array."""

    kind: ClassVar[str]
    keys: np.ndarray = field(metadata=INTS)


@dataclass(frozen=True, eq=False)
class Relocate(PlacementMessage):
    """Requester -> home: move ``keys`` to node ``to``."""

    kind = "relocate"
    to: int = field(metadata=NODE)


@dataclass(frozen=True, eq=False)
class Handover(PlacementMessage):
    """Home -> owner (and on, following hints): give ``keys`` to ``to``, unless a move newer than the
    home's decision ``epochs`` brought them there."""

    kind = "handover"
    epochs: np.ndarray = field(metadata=INTS)
    to: int = field(metadata=NODE)
    hops: int = 0


@dataclass(frozen=True, eq=False)
class State(PlacementMessage):
    """Old owner -> new owner: the keys' rows, the interest in them, and their version."""

    kind = "state"
    rows: np.ndarray = field(metadata=ROWS)
    interest: np.ndarray = field(metadata=INTS)  # per key: a bit per node that announced interest
    generations: np.ndarray = field(metadata=INT_ROWS)  # per key and node: its last announcement taken
    replicas: np.ndarray = field(metadata=INTS)  # per key: a bit per node that holds a replica
    epochs: np.ndarray = field(metadata=INTS)
    steps: np.ndarray = field(metadata=INTS)


@dataclass(frozen=True, eq=False)
class Owner(PlacementMessage):
    """Owner -> home, or new owner -> replica holders: ``keys`` now belong to ``owner``, at this version."""

    kind = "owner"
    epochs: np.ndarray = field(metadata=INTS)
    steps: np.ndarray = field(metadata=INTS)
    owner: int = field(metadata=NODE)


@dataclass(frozen=True, eq=False)
class Announce(PlacementMessage):
    """Node -> owner: ``node``'s workers will use ``keys`` (``active``) or no longer do. ``generation``
    numbers it among ``node``'s announcements: an older one arriving later (by another route) is not
    taken."""

    kind = "announce"
    active: bool
    node: int = field(metadata=NODE)
    generation: int = field(metadata=NUMBER)
    hops: int = 0


@dataclass(frozen=True, eq=False)
class Replicate(PlacementMessage):
    """Owner -> node: a replica of ``keys``."""

    kind = "replicate"
    rows: np.ndarray = field(metadata=ROWS)


@dataclass(frozen=True, eq=False)
class Sync(PlacementMessage):
    """Replica -> owner: the replica's change since its last sync; ``drop``: the replica then goes.
    A node that owns only some of the keys passes the rest on as parts of their own: ``part`` names
    this one, ``parent`` the part it was passed on from (itself for the sync the replica sent)."""

    kind = "sync"
    rows: np.ndarray = field(metadata=ROWS)
    drop: np.ndarray = field(metadata=BYTES)
    origin: int = field(metadata=NODE)
    target: int = field(metadata=NODE)
    hops: int = 0
    part: int = field(default=0, metadata=PART)
    parent: int = field(default=0, metadata=PART)


@dataclass(frozen=True, eq=False)
class Synced(PlacementMessage):
    """Owner -> replica: the rows after adding part ``part`` (passed on from ``parent``) of its change;
    ``parts`` counts the parts of it passed on in turn, which answer too."""

    kind = "synced"
    rows: np.ndarray = field(metadata=ROWS)
    drop: np.ndarray = field(metadata=BYTES)
    target: int = field(metadata=NODE)
    parts: int = 0
    part: int = field(default=0, metadata=PART)
    parent: int = field(default=0, metadata=PART)


KINDS: dict[str, type[PlacementMessage]] = {
    cls.kind: cls for cls in (Relocate, Handover, State, Owner, Announce, Replicate, Sync, Synced)}


@dataclass(frozen=True)
class _Fields:
    body: Mapping[str, type]  # travel in the body: name -> int or bool
    arrays: tuple[tuple[str, str, int], ...]  # travel as arrays, in order: (name, dtype kind, rank)
    #: the body fields a receiver checks, in order, each with what it holds: a node, a part of a sync,
    #: a number of a node's messages, or a count (an int field of none of these: hops, parts)
    checked: tuple[tuple[str, str], ...]


def _holds(f: dataclasses.Field[Any]) -> str | None:
    """What a body field's value must be: ``node``, ``part``, ``number`` or ``count`` (a bool: nothing)."""
    for what in ("node", "part", "number"):
        if f.metadata.get(what):
            return what
    return "count" if str(f.type) == "int" else None


def _fields_of(cls: type[PlacementMessage]) -> _Fields:
    types = {"int": int, "bool": bool}
    fields = dataclasses.fields(cls)
    body = [f for f in fields if "array" not in f.metadata]
    return _Fields(MappingProxyType({f.name: types[str(f.type)] for f in body}),
                   tuple((f.name, *f.metadata["array"]) for f in fields if "array" in f.metadata),
                   tuple((f.name, what) for f in body if (what := _holds(f)) is not None))


# Asked for with every message a kind sends or receives, so worked out once per kind here
# (``dataclasses.fields`` builds a new tuple at each call: a tenth of a busy server's loop).
_FIELDS = {cls: _fields_of(cls) for cls in KINDS.values()}


def body_fields(cls: type[PlacementMessage]) -> Mapping[str, type]:
    """The fields of a kind that travel in the body, with their types (int or bool)."""
    return _FIELDS[cls].body


def array_fields(cls: type[PlacementMessage]) -> tuple[tuple[str, str, int], ...]:
    """The array fields of a kind in the order they travel: (name, dtype kind, rank)."""
    return _FIELDS[cls].arrays


def array_bytes(message: PlacementMessage) -> int:
    """The bytes of a message's arrays: what it costs to move, copy and check (rows, mostly)."""
    return sum(getattr(message, name).nbytes for name, _, _ in _FIELDS[type(message)].arrays)


def checked_fields(cls: type[PlacementMessage]) -> tuple[tuple[str, str], ...]:
    """The body fields of a kind a receiver checks, each with what it holds (``node``, ``part``,
    ``number`` or ``count``)."""
    return _FIELDS[cls].checked


#: several messages to one node in one: body ``{"kind": BATCH, "messages": [each one's body]}``, the
#: arrays of each in turn; ``"tables"``, each one's table, when they are not all the message's own
BATCH = "batch"
MAX_BATCH = 64  # messages in one batch: one event asks for a few per node
#: a message that only acknowledges what its sender received (``cluster.links``): no arrays
ACK = "ack"


def to_parts(messages: list[PlacementMessage], tables: list[str] | None = None
             ) -> tuple[dict[str, Any], list[np.ndarray]]:
    """The body (its kind included) and arrays ``messages``, all for one node, travel as: one message
    alone, several as a batch (in order: what one node sends another arrives in the order sent).
    ``tables``: each message's table, where they are not all of the table the message names (the
    first one's): the tables' syncs of one timer pass to a node go as one message."""
    bodies, arrays = [], []
    for message in messages:
        cls = type(message)
        bodies.append({"kind": cls.kind, **{name: getattr(message, name) for name in body_fields(cls)}})
        arrays += [getattr(message, name) for name, _, _ in array_fields(cls)]
    if len(bodies) == 1:
        return bodies[0], arrays
    batch: dict[str, Any] = {"kind": BATCH, "messages": bodies}
    if tables is not None and any(t != tables[0] for t in tables):
        batch["tables"] = tables
    return batch, arrays


def tables_of(body: dict[str, Any], table: str) -> list[str]:
    """The table of each message a body stands for (``table``: the one its message names)."""
    if body["kind"] != BATCH:
        return [table]
    return body.get("tables") or [table] * len(body["messages"])


def from_parts(body: dict[str, Any], arrays: list[np.ndarray]) -> list[PlacementMessage]:
    """The messages a body and arrays stand for, once the wire checked them against their kinds' schemas."""
    messages = []
    at = 0
    for part in body["messages"] if body["kind"] == BATCH else [body]:
        cls = KINDS[part["kind"]]
        names = [name for name, _, _ in array_fields(cls)]
        messages.append(cls(**{name: part[name] for name in body_fields(cls)},
                            **dict(zip(names, arrays[at:at + len(names)], strict=True))))
        at += len(names)
    return messages
