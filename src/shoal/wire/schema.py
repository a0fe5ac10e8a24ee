"""What each op (and each kind of placement message) must carry. Checked on every decoded message,
before any handler runs; and the typed bodies that ride on several ops: the notes ranks pass at a
barrier, and a server's "moved" answer for keys it does not hold."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shoal.api.errors import ProtocolError, ShapeError
from shoal.placement import messages
from shoal.wire.bodies import BODIES, fields_of
from shoal.wire.message import Message
from shoal.wire.ops import OP_NAMES, Op


@dataclass(frozen=True)
class ArrayRule:
    """An array frame's dtype kind (``"i"`` int, ``"f"`` float, ``"u"`` bytes) and rank."""

    kind: str
    ndim: int


@dataclass(frozen=True)
class OpSchema:
    #: body fields that must be there, and those that may (None counts as absent), with their types
    body: Mapping[str, type] = field(default_factory=dict)
    optional: Mapping[str, type] = field(default_factory=dict)
    arrays: tuple[ArrayRule, ...] = ()
    #: all arrays describe the same rows, so their first dimensions must agree
    same_rows: bool = False
    needs_table: bool = False
    #: any number of arrays; the handler checks them
    variadic: bool = False


KEYS = ArrayRule("i", 1)
ROWS = ArrayRule("f", 2)
PER_KEY = ArrayRule("i", 1)  # an integer per key (interest bits, replica bits)
MARKS = ArrayRule("u", 1)  # a byte per key (0 or 1)


def _schema(op: Op, arrays: tuple[ArrayRule, ...] = (), same_rows: bool = False, needs_table: bool = False,
            variadic: bool = False) -> OpSchema:
    """``op``'s check: its body as ``wire.bodies`` declares it, its arrays as given here."""
    declared = BODIES.get(op)
    fields = fields_of(declared) if declared is not None else None
    return OpSchema(body=fields.required if fields else {}, optional=fields.optional if fields else {},
                    arrays=arrays, same_rows=same_rows, needs_table=needs_table, variadic=variadic)


SCHEMAS: dict[Op, OpSchema] = {
    Op.OK: _schema(Op.OK),
    Op.VALUES: _schema(Op.VALUES, arrays=(ROWS,)),
    Op.ERROR: _schema(Op.ERROR),
    Op.REGISTER: _schema(Op.REGISTER),
    Op.CLUSTER_STATUS: _schema(Op.CLUSTER_STATUS),
    Op.BARRIER: _schema(Op.BARRIER),
    Op.LEAVE: _schema(Op.LEAVE),
    Op.PING: _schema(Op.PING),
    Op.SHUTDOWN: _schema(Op.SHUTDOWN),
    Op.CREATE_TABLE: _schema(Op.CREATE_TABLE, needs_table=True),
    Op.PULL: _schema(Op.PULL, arrays=(KEYS,), needs_table=True),
    Op.PUSH: _schema(Op.PUSH, arrays=(KEYS, ROWS), same_rows=True, needs_table=True),
    Op.PUSH_PULL: _schema(Op.PUSH_PULL, arrays=(KEYS, ROWS), same_rows=True, needs_table=True),
    Op.CLOCK: _schema(Op.CLOCK),
    Op.STATS: _schema(Op.STATS),
    Op.ROWS: _schema(Op.ROWS, arrays=(KEYS, ROWS), same_rows=True, needs_table=True),
    Op.GOSSIP: _schema(Op.GOSSIP, needs_table=True, variadic=True),
    # per origin: its number, seq, gaps counted, and running sums of the rows asked for
    Op.TOTALS: _schema(Op.TOTALS, arrays=(ArrayRule("i", 1), ArrayRule("i", 1), ArrayRule("i", 1), ArrayRule("f", 3)),
                       same_rows=True),
    Op.REPLICA_STATS: _schema(Op.REPLICA_STATS, needs_table=True),
    Op.LOCALIZE: _schema(Op.LOCALIZE, arrays=(KEYS,), needs_table=True),
    Op.INTENT: _schema(Op.INTENT, needs_table=True, variadic=True),
    Op.PLACEMENT: _schema(Op.PLACEMENT, needs_table=True, variadic=True),
    Op.LAYOUT: _schema(Op.LAYOUT, needs_table=True),
    Op.MOVE_SLICE: _schema(Op.MOVE_SLICE, needs_table=True),
    Op.SLICE_STATE: _schema(Op.SLICE_STATE, needs_table=True, variadic=True),
    Op.MOVE_DONE: _schema(Op.MOVE_DONE, needs_table=True),
    Op.DRAIN: _schema(Op.DRAIN),
    Op.CHECKPOINT: _schema(Op.CHECKPOINT),
    Op.RESTORE: _schema(Op.RESTORE),
    Op.SETTLE: _schema(Op.SETTLE),
    Op.GOSSIP_PERIOD: _schema(Op.GOSSIP_PERIOD, needs_table=True),
    Op.FENCE: _schema(Op.FENCE, needs_table=True),
    Op.CONFIRM: _schema(Op.CONFIRM, needs_table=True),
}

#: what each kind of PLACEMENT message (server to server, adaptive tables) carries, as its declaration
#: in ``placement.messages`` says
PLACEMENT_KINDS: dict[str, OpSchema] = {
    kind: OpSchema(body=messages.body_fields(cls),
                   arrays=tuple(ArrayRule(k, ndim) for _, k, ndim in messages.array_fields(cls)), same_rows=True)
    for kind, cls in messages.KINDS.items()}


@dataclass(frozen=True)
class BarrierNote:
    """What one rank tells every other at a barrier (``BARRIER``'s optional ``note``): whether its
    part went well (rank 0 writing a checkpoint, say), and the detail (the path, or what failed)."""

    ok: bool
    detail: str = ""

    def to_body(self) -> dict[str, Any]:
        return {"ok": self.ok, "detail": self.detail}

    @classmethod
    def from_body(cls, value: Any) -> BarrierNote | None:
        """The note ``value`` stands for; None if it is not one."""
        if isinstance(value, dict) and type(value.get("ok")) is bool and type(value.get("detail")) is str:
            return cls(value["ok"], value["detail"])
        return None


@dataclass(frozen=True)
class Moved:
    """Keys of a pull or push that the server asked does not hold (they moved, or the asker's map
    of where keys live is old), carried in the body of its ``OK`` or ``VALUES`` answer: their
    positions in the request, and where that server believes each is now (-1: it does not know;
    a static table's worker then asks the rendezvous). Nothing was applied or read at those
    positions (a ``VALUES`` row there is filler); every other position was served.
    """

    positions: np.ndarray
    owners: np.ndarray
    #: a ``PUSH_PULL`` whose push was applied, and only its read refused: the worker reads again
    #: where the keys are, and does not push again
    pushed: bool = False

    @classmethod
    def every(cls, count: int, pushed: bool = False) -> Moved:
        """Nothing of a request of ``count`` keys was served here (but its push, if ``pushed``), and
        where they went is not known."""
        return cls(np.arange(count, dtype=np.int64), np.full(count, -1, dtype=np.int64), pushed)

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"moved": self.positions.tolist(), "owners": self.owners.tolist()}
        if self.pushed:
            body["pushed"] = True
        return body

    @classmethod
    def in_reply(cls, reply: Message, count: int) -> Moved | None:
        """What ``reply`` to a request of ``count`` keys says moved; None if every key was served."""
        positions, owners = reply.body.get("moved"), reply.body.get("owners")
        if positions is None and owners is None:
            return None
        if not (isinstance(positions, list) and isinstance(owners, list) and len(positions) == len(owners)
                and all(is_int64(p) and 0 <= p < count for p in positions) and len(set(positions)) == len(positions)
                and all(is_int64(o) for o in owners)):
            raise ProtocolError(f"a 'moved' answer needs equally long lists of distinct positions below {count} "
                                f"and owners, got {positions!r} and {owners!r}")
        pushed = reply.body.get("pushed", False)
        if type(pushed) is not bool:
            raise ProtocolError(f"a 'moved' answer's 'pushed' must be true or false, got {pushed!r}")
        return cls(np.asarray(positions, dtype=np.int64), np.asarray(owners, dtype=np.int64), pushed)


#: intents one INTENT message carries at most: a worker's tables each declared a few since its last clock
MAX_INTENTS = 1024


def intents_of(msg: Message) -> list[tuple[str, np.ndarray, int, int]]:
    """The intents an ``INTENT`` message carries, as ``(table, keys, start, end)``: one per array, its
    clocks at the same place in ``starts`` and ``ends``, its table in ``tables`` (the message's own
    table when left out).

    Raises:
        ProtocolError: lists that do not match the arrays, clocks that are not int64, a table that is
            no name, an array that is not of ints.
    """
    starts, ends, tables = msg.body["starts"], msg.body["ends"], msg.body.get("tables")
    count = len(msg.arrays)
    if not (1 <= count <= MAX_INTENTS and len(starts) == len(ends) == count):
        raise ProtocolError(f"an INTENT carries 1 to {MAX_INTENTS} arrays of keys and one start and end clock each, "
                            f"got {count} array(s), {len(starts)} start(s), {len(ends)} end(s)")
    if not all(is_int64(c) for c in (*starts, *ends)):
        raise ProtocolError("an INTENT's start and end clocks must be ints that fit in 64 signed bits")
    if tables is None:
        tables = [msg.table] * count
    elif len(tables) != count or not all(isinstance(t, str) and t for t in tables):
        raise ProtocolError(f"an INTENT's tables must name one table per array of keys, got {tables!r}")
    for i, keys in enumerate(msg.arrays):
        if keys.dtype.kind != KEYS.kind or keys.ndim != KEYS.ndim:
            raise ProtocolError(f"INTENT array {i} must be keys (a 1-d array of ints), got {keys.dtype} {keys.shape}")
    return list(zip(tables, msg.arrays, starts, ends, strict=True))


def is_int64(value: object) -> bool:
    """An int that fits in 64 signed bits: ids, clocks and body ints end up in int64 arrays."""
    return isinstance(value, int) and not isinstance(value, bool) and -(1 << 63) <= value < 1 << 63


def check_schema(msg: Message) -> None:
    """Raise ``ProtocolError`` (or ``ShapeError``) if ``msg`` does not fit its op (and sub-kind)."""
    schema = SCHEMAS[msg.op]
    _check(msg, schema, OP_NAMES[msg.op])
    if msg.op == Op.PLACEMENT:
        if msg.body["kind"] == messages.BATCH:
            _check_batch(msg)
        elif msg.body["kind"] == messages.ACK:
            if msg.arrays:
                raise ProtocolError(f"a placement acknowledgement carries no arrays, got {len(msg.arrays)}")
        else:
            _check(msg, _placement_schema(msg.body["kind"]), f"placement {msg.body['kind']!r}")


def _placement_schema(kind: Any) -> OpSchema:
    sub = PLACEMENT_KINDS.get(kind)
    if sub is None:
        raise ProtocolError(f"unknown placement message {kind!r}; the kinds are {sorted(PLACEMENT_KINDS)}")
    return sub


def _check_batch(msg: Message) -> None:
    """Each message of a batch against its kind, with its share of the arrays; none left over."""
    parts = msg.body.get("messages")
    if not isinstance(parts, list) or not 1 <= len(parts) <= messages.MAX_BATCH:
        raise ProtocolError(f"a placement batch needs a list of 1 to {messages.MAX_BATCH} messages")
    at = 0
    for part in parts:
        if not isinstance(part, dict):
            raise ProtocolError(f"a placement batch holds message bodies, got {type(part).__name__}")
        sub = _placement_schema(part.get("kind"))
        count = len(sub.arrays)
        _check(Message(Op.PLACEMENT, table=msg.table, body=part, arrays=msg.arrays[at:at + count]), sub,
               f"placement {part['kind']!r} in a batch")
        at += count
    if at != len(msg.arrays):
        raise ProtocolError(f"a placement batch carries {len(msg.arrays)} array(s), its messages {at}")
    tables = msg.body.get("tables")
    if tables is not None and not (isinstance(tables, list) and len(tables) == len(parts)
                                   and all(isinstance(t, str) and t for t in tables)):
        raise ProtocolError(f"a placement batch's tables must name one table per message, got {tables!r}")


def _check(msg: Message, schema: OpSchema, what: str) -> None:
    body = msg.body
    for name, kind in schema.body.items():
        _check_field(body.get(name), name, kind, what)
    if body:  # the optional fields present: a body carries few of the many its op allows
        optional = schema.optional
        for name, value in body.items():
            allowed = optional.get(name)
            if allowed is not None and value is not None:
                _check_field(value, name, allowed, what)
    if schema.needs_table and not msg.table:
        raise ProtocolError(f"{what} needs a table name")
    if schema.variadic:
        return
    arrays, rules = msg.arrays, schema.arrays
    if len(arrays) != len(rules):
        raise ProtocolError(f"{what} carries {len(rules)} array(s), got {len(arrays)}")
    for i in range(len(arrays)):
        arr, rule = arrays[i], rules[i]
        if arr.dtype.kind != rule.kind:
            raise ProtocolError(f"{what} array {i} must be of kind {rule.kind!r}, got dtype {arr.dtype}")
        if arr.ndim != rule.ndim:
            raise ShapeError(f"{what} array {i} must have {rule.ndim} dimension(s), got shape {arr.shape}")
    if schema.same_rows and len(arrays) > 1 and len({a.shape[0] for a in arrays}) > 1:
        raise ShapeError(
            f"{what}: arrays disagree on the number of rows: {[a.shape for a in msg.arrays]}"
        )


def _check_field(value: Any, name: str, kind: type, what: str) -> None:
    if not isinstance(value, kind) or (kind is int and not is_int64(value)):
        raise ProtocolError(f"{what} needs body field {name!r} of type {kind.__name__}, got {value!r}")


def int64_keys(arr: np.ndarray) -> np.ndarray:
    """Keys as int64, the only key type handlers work with."""
    return arr if arr.dtype == np.int64 else arr.astype(np.int64)
