"""What each op's body carries: one frozen dataclass per op, declared once.

``wire.schema`` derives from these declarations the check every decoded message
passes before any handler runs: a field without a default must be there, one
that defaults to None may be left out, and each has its declared type. A sender
builds a message from its body (``Clock(rank=3).to_message(clock=c)``), a handler
reads it typed once the check has passed (``Clock.of(msg)``). Several table kinds
share an op (a pull of a static table names its place in the worker's stream,
one of a replicated table its shard), so an op's declaration holds what any kind
sends with it. ``stream`` is an ordered request's place in its worker's stream
to a server (``client.streams`` stamps it, ``server.streams`` reads it). The
kinds of placement message between nodes (``Op.PLACEMENT``) are declared the
same way in ``placement.messages``; replies' bodies (statistics, layouts, the
cluster's status) are not declared.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Self

from shoal.api.errors import ShoalError
from shoal.wire.message import Message
from shoal.wire.ops import Op

_TYPES: dict[str, type] = {"int": int, "str": str, "bool": bool, "list": list, "dict": dict}


@dataclass(frozen=True)
class BodyFields:
    """The fields of a declaration, with the types a value may have."""

    required: Mapping[str, type]
    optional: Mapping[str, type]
    names: tuple[str, ...]


@dataclass(frozen=True)
class Body:
    """A declaration: its op, and its fields as dataclass fields."""

    op: ClassVar[Op]

    def to_body(self) -> dict[str, Any]:
        """The body as it travels: fields left at None are left out."""
        return {name: value for name in fields_of(type(self)).names if (value := getattr(self, name)) is not None}

    def to_message(self, **header: Any) -> Message:
        """A message of this op carrying this body (``header``: table, clock, arrays, ...)."""
        return Message(self.op, body=self.to_body(), **header)

    def reply_to(self, request: Message) -> Message:
        """The answer to ``request`` carrying this body."""
        return request.reply(self.op, self.to_body())

    @classmethod
    def of(cls, msg: Message) -> Self:
        """The body of ``msg``, which ``wire.schema`` checked against this declaration on decoding."""
        body = msg.body
        return cls(**{name: body[name] for name in fields_of(cls).names if name in body})


def _fields(cls: type[Body]) -> BodyFields:
    required: dict[str, type] = {}
    optional: dict[str, type] = {}
    fields = dataclasses.fields(cls)
    for f in fields:
        spec = str(f.type)
        base = spec.removesuffix(" | None")
        kind = _TYPES[base.split("[", 1)[0]]
        (optional if base != spec else required)[f.name] = kind
    return BodyFields(MappingProxyType(required), MappingProxyType(optional), tuple(f.name for f in fields))


# --------------------------------------------------------------- replies


@dataclass(frozen=True)
class Error(Body):
    """A request failed: the error's class (``ShoalError.code``) and what happened."""

    op = Op.ERROR
    code: str
    message: str

    @classmethod
    def about(cls, error: ShoalError, where: str = "") -> Error:
        """What carries ``error`` back (``where``: who answers, named before what happened)."""
        return cls(error.code, f"{where}: {error}" if where else str(error))


# ------------------------------------------------- membership (rendezvous)


@dataclass(frozen=True)
class Register(Body):
    """A worker or server joins: who it is, where it listens, its process."""

    op = Op.REGISTER
    role: str
    node: int
    rank: int
    address: str
    pid: int
    metrics: str | None = None  # where its Prometheus endpoint listens


@dataclass(frozen=True)
class ClusterStatus(Body):
    """A look at the job; from a server, also its heartbeat, its slices' load and a long poll."""

    op = Op.CLUSTER_STATUS
    role: str | None = None
    node: int | None = None
    load: dict[str, Any] | None = None
    queue: int | None = None
    poll: bool | None = None
    #: server registrations counted by the last status the sender read: a long poll from a server
    #: that missed one is answered at once (it would not know that server's address for the hold)
    registered: int | None = None


@dataclass(frozen=True)
class Barrier(Body):
    """Worker ``rank`` reached barrier ``generation``, with an optional note (``schema.BarrierNote``)."""

    op = Op.BARRIER
    rank: int
    generation: int
    note: dict[str, Any] | None = None


@dataclass(frozen=True)
class Leave(Body):
    """A member leaves: a worker (``rank``), or a server (``node``) that handed all its slices over.

    A server names, for each worker stream it served, the last request it handled (``handled``:
    ``[rank, incarnation, seq]`` each): it stopped reading before it said so, so what a worker sent
    it after that was never served, and goes where its keys are now (``client.worker``).
    """

    op = Op.LEAVE
    role: str
    rank: int | None = None
    node: int | None = None
    handled: list[list[int]] | None = None


@dataclass(frozen=True)
class CreateTable(Body):
    """A table's spec, and (a static table) its layout as the rendezvous planned it: over the
    servers live then, which need not be those the job started with. To the rendezvous, ``plan``
    asks for that layout without registering the table (the servers build it first)."""

    op = Op.CREATE_TABLE
    spec: dict[str, Any]  # ``TableSpec.to_dict``
    layout: dict[str, Any] | None = None  # ``{"owners": [...], "epoch": e}``
    plan: bool | None = None


@dataclass(frozen=True)
class Ping(Body):
    """Are you there? With ``lane``: and where is your lane (``server.lane``)? The answer's body
    names it (``lane``: its address), or says nothing where the server has none."""

    op = Op.PING
    lane: bool | None = None


# ------------------------------------------------------ rows and clocks


@dataclass(frozen=True)
class Pull(Body):
    """Static tables: the request's place in the worker's stream (``client.streams``), and the
    model the reader holds these rows to if not the table's (``consistency.schemes``); replicated
    tables: the replica's shard, whether to answer with the per-origin totals too, and (ESSP)
    whether the replica is to push these rows to the reader from now on."""

    op = Op.PULL
    stream: list[int] | None = None
    consistency: dict[str, Any] | None = None
    shard: int | None = None
    totals: bool | None = None
    subscribe: bool | None = None


@dataclass(frozen=True)
class Push(Body):
    """Static tables: the place in the worker's stream; replicated tables: the shard, and the
    push's number and the worker's incarnation (the same on every replica and resend), and ``floor``:
    the lowest of the worker's numbers still open when it was sent (not yet acknowledged by a write
    quorum, nor failed): a replica never gives up a push at or above it (it is still on its way)."""

    op = Op.PUSH
    stream: list[int] | None = None
    shard: int | None = None
    seq: int | None = None
    inc: int | None = None
    floor: int | None = None


@dataclass(frozen=True)
class PushPull(Body):
    op = Op.PUSH_PULL
    stream: list[int] | None = None
    consistency: dict[str, Any] | None = None


@dataclass(frozen=True)
class Clock(Body):
    """Worker ``rank`` reached the message's clock; ``final`` when it leaves. ``pushed``: per replicated
    table read under a bound, how many pushes it has numbered to each shard (``replication.bounds``).
    ``intents``: how many intent messages it had sent its node's server by then
    (``consistency.reached``). The answer's body says ``bounded`` where the server serves a table
    read under a bound (``client.ticks``)."""

    op = Op.CLOCK
    rank: int
    final: bool | None = None
    stream: list[int] | None = None
    pushed: dict[str, Any] | None = None
    intents: int | None = None


@dataclass(frozen=True)
class Rows(Body):
    """Rows a server pushes unasked (ESSP): the slices whose other rows did not change, numbered in
    a series per worker and table, and the last request of the worker it had handled. A replica of
    a replicated table names its one shard, the clock before which its rows hold every push
    (``covers``) and its version vector (``vv``, ``[origin, seq]`` pairs)."""

    op = Op.ROWS
    shards: list[int]
    seq: int | None = None
    series: str | None = None
    seen: int | None = None
    covers: int | None = None
    vv: list[Any] | None = None


@dataclass(frozen=True)
class Gossip(Body):
    """A replica's changes for another (``replication.gossip.GossipPayload``)."""

    op = Op.GOSSIP
    shard: int
    vv: list[Any]
    stage: int
    deltas: list[Any]
    states: list[Any]


@dataclass(frozen=True)
class ReplicaStats(Body):
    op = Op.REPLICA_STATS
    shard: int


# ------------------------------------------------------- adaptive keys


@dataclass(frozen=True)
class Intent(Body):
    """The keys of the i-th array sent will be used in clocks ``[starts[i], ends[i])``, in table
    ``tables[i]`` (the message's own table when left out): what a worker declared for every table
    since its last clock, in one message; ``number``: its place among the worker's intent messages
    (1, 2, ...), so that its node's server knows how many it has read (``consistency.reached``)."""

    op = Op.INTENT
    starts: list[int]
    ends: list[int]
    tables: list[str] | None = None
    number: int | None = None


@dataclass(frozen=True)
class Placement(Body):
    """A message between nodes about an adaptive table's keys; its kind's own fields are declared in
    ``placement.messages``. The fields after ``kind`` are its place in its sender's channel to the
    receiver and what the sender heard of the receiver's (``cluster.links.Header``; ``channel``, as
    ``stream`` names a worker's ordered requests)."""

    op = Op.PLACEMENT
    kind: str
    channel: int
    seq: int
    base: int
    acks: int
    acked: int
    held: int | None = None


# -------------------------------------------------------------- slices


@dataclass(frozen=True)
class MoveSlice(Body):
    op = Op.MOVE_SLICE
    shard: int
    to: int


@dataclass(frozen=True)
class SliceState(Body):
    """One chunk of a slice moving between servers: its rows from ``first_row``, the arrays named
    ``names``, then one row set per ESSP subscriber (``subscribers``: their ranks)."""

    op = Op.SLICE_STATE
    shard: int
    epoch: int
    first_row: int
    num_rows: int
    names: list[str]
    last: bool
    subscribers: list[int] | None = None
    #: with the last chunk: every worker's clock as the old owner learnt it, and its settled clock
    clocks: list[int] | None = None
    settled: list[int] | None = None


@dataclass(frozen=True)
class MoveDone(Body):
    op = Op.MOVE_DONE
    shard: int
    to: int
    epoch: int
    ok: bool


@dataclass(frozen=True)
class Drain(Body):
    op = Op.DRAIN
    node: int


@dataclass(frozen=True)
class Fence(Body):
    """A server counts this worker's clock only up to its settled clock until the worker confirms that
    it routes by a layout of at least ``epoch`` (the server's), and that its pushes routed before
    have landed. The move that brought the server's layout to ``epoch``: slice ``shard`` to server
    ``owner`` (-1, -1: one the rendezvous knows)."""

    op = Op.FENCE
    epoch: int
    shard: int
    owner: int


@dataclass(frozen=True)
class Confirm(Body):
    op = Op.CONFIRM
    rank: int
    epoch: int
    stream: list[int] | None = None


# --------------------------------------------------------- checkpoints


@dataclass(frozen=True)
class Checkpoint(Body):
    op = Op.CHECKPOINT
    staging: str
    tables: list[str]


@dataclass(frozen=True)
class Restore(Body):
    op = Op.RESTORE
    path: str
    commit: bool


@dataclass(frozen=True)
class GossipPeriod(Body):
    """Gossip a replicated table's replicas every ``micros`` microseconds (jittered) from now on."""

    op = Op.GOSSIP_PERIOD
    micros: int


@dataclass(frozen=True)
class Settle(Body):
    op = Op.SETTLE
    tables: list[str]


#: the declaration of each op with a body (the others carry none)
BODIES: dict[Op, type[Body]] = {cls.op: cls for cls in Body.__subclasses__()}

# Asked for with every message, so worked out once per declaration (``dataclasses.fields`` builds a
# new tuple at each call).
_FIELDS: dict[type[Body], BodyFields] = {cls: _fields(cls) for cls in BODIES.values()}


def fields_of(cls: type[Body]) -> BodyFields:
    return _FIELDS[cls]
