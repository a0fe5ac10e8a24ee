"""What each op (and each kind of placement message) must carry. Checked on every decoded message,
before any handler runs; and the typed notes ranks pass at a barrier."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shoal.api.errors import ProtocolError, ShapeError
from shoal.placement import messages
from shoal.wire.message import Message
from shoal.wire.ops import Op


@dataclass(frozen=True)
class ArrayRule:
    """An array frame's dtype kind (``"i"`` int, ``"f"`` float, ``"u"`` bytes) and rank."""

    kind: str
    ndim: int


@dataclass(frozen=True)
class OpSchema:
    body: dict[str, tuple[type, ...]] = field(default_factory=dict)
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
_INT = (int,)
_STR = (str,)
_BOOL = (bool,)

SCHEMAS: dict[Op, OpSchema] = {
    Op.OK: OpSchema(),
    Op.VALUES: OpSchema(arrays=(ROWS,)),
    Op.ERROR: OpSchema(body={"code": _STR, "message": _STR}),
    Op.REGISTER: OpSchema(body={"role": _STR, "node": _INT, "rank": _INT, "address": _STR, "pid": _INT}),
    Op.CLUSTER_STATUS: OpSchema(),
    Op.BARRIER: OpSchema(body={"rank": _INT, "generation": _INT}),
    Op.LEAVE: OpSchema(body={"rank": _INT, "role": _STR}),
    Op.PING: OpSchema(),
    Op.SHUTDOWN: OpSchema(),
    Op.CREATE_TABLE: OpSchema(body={"spec": (dict,)}, needs_table=True),
    Op.PULL: OpSchema(arrays=(KEYS,), needs_table=True),
    Op.PUSH: OpSchema(arrays=(KEYS, ROWS), same_rows=True, needs_table=True),
    Op.PUSH_PULL: OpSchema(arrays=(KEYS, ROWS), same_rows=True, needs_table=True),
    Op.CLOCK: OpSchema(body={"rank": _INT}),
    Op.STATS: OpSchema(),
    Op.ROWS: OpSchema(body={"shards": (list,)}, arrays=(KEYS, ROWS), same_rows=True, needs_table=True),
    Op.GOSSIP: OpSchema(body={"shard": _INT, "vv": (list,), "stage": _INT, "deltas": (list,), "states": (list,)},
                        needs_table=True, variadic=True),
    Op.TOTALS: OpSchema(arrays=(ArrayRule("i", 1), ArrayRule("i", 1), ArrayRule("f", 3))),
    Op.REPLICA_STATS: OpSchema(body={"shard": _INT}, needs_table=True),
    Op.LOCALIZE: OpSchema(arrays=(KEYS,), needs_table=True),
    Op.INTENT: OpSchema(body={"start": _INT, "end": _INT}, arrays=(KEYS,), needs_table=True),
    Op.PLACEMENT: OpSchema(body={"kind": _STR}, needs_table=True, variadic=True),
    Op.LAYOUT: OpSchema(needs_table=True),
    Op.MOVE_SLICE: OpSchema(body={"shard": _INT, "to": _INT}, needs_table=True),
    Op.SLICE_STATE: OpSchema(body={"shard": _INT, "epoch": _INT, "first_row": _INT, "num_rows": _INT,
                                   "names": (list,), "last": (bool,)},
                             needs_table=True, variadic=True),
    Op.MOVE_DONE: OpSchema(body={"shard": _INT, "to": _INT, "epoch": _INT, "ok": (bool,)}, needs_table=True),
    Op.DRAIN: OpSchema(body={"node": _INT}),
    Op.CHECKPOINT: OpSchema(body={"staging": _STR, "tables": (list,)}),
    Op.RESTORE: OpSchema(body={"path": _STR, "commit": (bool,)}),
    Op.SETTLE: OpSchema(body={"tables": (list,)}),
    Op.FENCE: OpSchema(body={"epoch": _INT, "shard": _INT}, needs_table=True),
    Op.CONFIRM: OpSchema(body={"rank": _INT, "epoch": _INT}, needs_table=True),
}

#: what each kind of PLACEMENT message (server to server, adaptive tables) carries, as its declaration
#: in ``placement.messages`` says
PLACEMENT_KINDS: dict[str, OpSchema] = {
    kind: OpSchema(body={name: (t,) for name, t in messages.body_fields(cls).items()},
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


def is_int64(value: object) -> bool:
    """An int that fits in 64 signed bits: ids, clocks and body ints end up in int64 arrays."""
    return isinstance(value, int) and not isinstance(value, bool) and -(1 << 63) <= value < 1 << 63


def check_schema(msg: Message) -> None:
    """Raise ``ProtocolError`` (or ``ShapeError``) if ``msg`` does not fit its op (and sub-kind)."""
    schema = SCHEMAS[msg.op]
    _check(msg, schema, msg.op.name)
    if msg.op == Op.PLACEMENT:
        if msg.body["kind"] == messages.BATCH:
            _check_batch(msg)
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


def _check(msg: Message, schema: OpSchema, what: str) -> None:
    for name, types in schema.body.items():
        value = msg.body.get(name)
        if not isinstance(value, types) or (types == _INT and not is_int64(value)):
            raise ProtocolError(
                f"{what} needs body field {name!r} of type "
                f"{'/'.join(t.__name__ for t in types)}, got {value!r}"
            )
    if schema.needs_table and not msg.table:
        raise ProtocolError(f"{what} needs a table name")
    if schema.variadic:
        return
    if len(msg.arrays) != len(schema.arrays):
        raise ProtocolError(f"{what} carries {len(schema.arrays)} array(s), got {len(msg.arrays)}")
    for i, (arr, rule) in enumerate(zip(msg.arrays, schema.arrays, strict=True)):
        if arr.dtype.kind != rule.kind:
            raise ProtocolError(f"{what} array {i} must be of kind {rule.kind!r}, got dtype {arr.dtype}")
        if arr.ndim != rule.ndim:
            raise ShapeError(f"{what} array {i} must have {rule.ndim} dimension(s), got shape {arr.shape}")
    if schema.same_rows and len({a.shape[0] for a in msg.arrays}) > 1:
        raise ShapeError(
            f"{what}: arrays disagree on the number of rows: {[a.shape for a in msg.arrays]}"
        )


def int64_keys(arr: np.ndarray) -> np.ndarray:
    """Keys as int64, the only key type handlers work with."""
    return arr if arr.dtype == np.int64 else arr.astype(np.int64)
