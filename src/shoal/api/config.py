"""Frozen settings objects. Each validates itself and quotes the bad value."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields, replace
from typing import Any

from shoal.api.consistency import ASP, Consistency, consistency_from_dict, consistency_to_dict, is_consistency
from shoal.api.errors import ConfigError
from shoal.api.initializers import (
    Constant,
    Initializer,
    Normal,
    Uniform,
    initializer_from_dict,
    initializer_to_dict,
)
from shoal.api.optim import SGD, Adagrad, Adam, Optimizer, Sum, optimizer_from_dict, optimizer_to_dict
from shoal.api.replication import Dynamic, ReadQuorum, read_quorum_from_wire, read_quorum_to_wire

MAPPING_RULES = ("range", "hash", "round_robin", "bounded")
PLACEMENTS = ("spread", "whole")
NONFINITE_POLICIES = ("reject", "skip")
LOCKING_MODES = ("exact", "hogwild")
TECHNIQUES = ("static", "relocation", "replication", "auto")
VALUE_DTYPES = ("float32", "float64")
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


def _int_at_least(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {value!r}")
    if value < low:
        raise ConfigError(f"{name} must be >= {low}, got {value!r}")
    return value


def _one_of(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {choices}, got {value!r}")
    return str(value)


@dataclass(frozen=True)
class TableSpec:
    """Everything a server needs to create a table; identical on every worker.

    ``consistency`` bounds how stale a read may be (``shoal.ASP`` by default);
    ``mapping`` picks how keys spread over slices (``range``, ``hash``,
    ``round_robin``, or ``bounded``: ranges of at most ``slice_bytes``);
    ``slices`` how many slices (default one per server), ``placement`` whether
    they ``spread`` over the servers or start ``whole`` on one; ``nonfinite`` what a push
    with NaN/Inf does ("reject" the whole push, or "skip" the bad rows);
    ``locking`` whether co-located writers exclude each other ("exact") or
    not ("hogwild").
    """

    name: str
    num_keys: int
    dim: int
    dtype: str = "float32"
    init: Initializer = field(default_factory=Constant)
    optimizer: Optimizer = field(default_factory=Sum)
    consistency: Consistency = field(default_factory=ASP)
    mapping: str = "range"
    nonfinite: str = "reject"
    locking: str = "exact"
    seed: int = 0
    replicas: int = 1
    write_quorum: int = 1
    read_quorum: ReadQuorum = 1
    gossip_ms: float = 50.0
    techniques: str = "static"
    #: how often a replica sends its change to the key's owner and reads the owner's row: a period in
    #: ms, or None: at every clock of the node's workers, at most every 10 ms and at least every 50
    sync_ms: float | None = None
    #: how often a node's server acts on the intents its workers declared for the table, at most (ms;
    #: sooner when one not acted on is about to start): each round costs the servers per message more
    #: than per key, and a longer one reaches further ahead (``placement.intent.ACT_EVERY_S``: 50)
    act_ms: float | None = None
    slices: int = 0
    slice_bytes: int = 4 << 20
    placement: str = "spread"
    #: a dense table's tensor shape (``Worker.dense``: its values in order, ``dim`` to a row); None for
    #: other tables. In the spec, so that no worker or checkpoint takes the rows for another shape.
    shape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ConfigError(
                f"table name must be 1-128 characters of letters, digits, '_.:-', got {self.name!r}"
            )
        _int_at_least("num_keys", self.num_keys, 1)
        _int_at_least("dim", self.dim, 1)
        _one_of("dtype", self.dtype, VALUE_DTYPES)
        _one_of("mapping", self.mapping, MAPPING_RULES)
        _one_of("nonfinite", self.nonfinite, NONFINITE_POLICIES)
        _one_of("locking", self.locking, LOCKING_MODES)
        _int_at_least("seed", self.seed, 0)
        if self.seed >= 1 << 31:
            raise ConfigError(f"seed must be below 2**31, got {self.seed!r}")
        self._check_replication()
        self._check_adaptivity()
        self._check_slicing()
        self._check_shape()
        if not isinstance(self.init, (Constant, Uniform, Normal)):
            raise ConfigError(f"init must be shoal.Constant, Uniform or Normal, got {self.init!r}")
        if not isinstance(self.optimizer, (Sum, SGD, Adagrad, Adam)):
            raise ConfigError(f"optimizer must be one of shoal.optim.Sum/SGD/Adagrad/Adam, got {self.optimizer!r}")
        if not is_consistency(self.consistency):
            raise ConfigError(f"consistency must be shoal.ASP(), BSP(), SSP(s) or ESSP(s), got {self.consistency!r}")
        if self.consistency.eager and self.locking != "exact":
            # Eager pushes need to know exactly which rows changed; lock-free writers cannot tell them.
            raise ConfigError("ESSP tables need locking='exact'")

    @property
    def replicated(self) -> bool:
        return self.replicas > 1

    @property
    def adaptive(self) -> bool:
        """Keys move (relocation) or gain replicas on other nodes at run time."""
        return self.techniques != "static"

    def _check_adaptivity(self) -> None:
        _one_of("techniques", self.techniques, TECHNIQUES)
        if self.sync_ms is not None and (isinstance(self.sync_ms, bool) or not isinstance(self.sync_ms, (int, float))
                                         or not 1 <= self.sync_ms <= 60_000):
            raise ConfigError(f"sync_ms must be None or lie in [1, 60000], got {self.sync_ms!r}")
        if self.act_ms is not None and (isinstance(self.act_ms, bool) or not isinstance(self.act_ms, (int, float))
                                        or not 1 <= self.act_ms <= 60_000):
            raise ConfigError(f"act_ms must be None or lie in [1, 60000], got {self.act_ms!r}")
        if not self.adaptive:
            return
        if not isinstance(self.optimizer, (Sum, SGD)):
            # Replicas add their changes into the owner's row: only additive rules compose that way.
            raise ConfigError("adaptive tables need an additive update rule (Sum or SGD); keep optimiser "
                              "state such as Adagrad accumulators in the row itself")
        if self.replicated or not isinstance(self.consistency, ASP) or self.locking != "exact":
            raise ConfigError("adaptive tables are unreplicated, read under ASP, with locking='exact'")

    def _check_slicing(self) -> None:
        _int_at_least("slices", self.slices, 0)
        _int_at_least("slice_bytes", self.slice_bytes, 1)
        _one_of("placement", self.placement, PLACEMENTS)
        sliced = self.slices or self.mapping == "bounded" or self.placement != "spread"
        if sliced and (self.replicated or self.adaptive):
            # Replica sets and key homes are laid out one shard per server.
            raise ConfigError("slices, mapping='bounded' and placement='whole' are for static, unreplicated tables")

    def _check_replication(self) -> None:
        _int_at_least("replicas", self.replicas, 1)
        _int_at_least("write_quorum", self.write_quorum, 1)
        if self.write_quorum > self.replicas:
            raise ConfigError(f"write_quorum={self.write_quorum} exceeds replicas={self.replicas}")
        if isinstance(self.read_quorum, int) and not isinstance(self.read_quorum, bool):
            if not 1 <= self.read_quorum <= self.replicas:
                raise ConfigError(f"read_quorum must lie in [1, replicas={self.replicas}], got {self.read_quorum}")
        elif not isinstance(self.read_quorum, Dynamic):
            raise ConfigError(f"read_quorum must be an int or shoal.Dynamic(...), got {self.read_quorum!r}")
        if not isinstance(self.gossip_ms, (int, float)) or not 1 <= self.gossip_ms <= 60_000:
            raise ConfigError(f"gossip_ms must lie in [1, 60000], got {self.gossip_ms!r}")
        if not self.replicated:
            return
        if self.consistency.lazy is not None:
            # The lazy buffer holds reads at a server for the pushes a fast worker would pull again;
            # a replicated read is answered by whichever replicas it asks.
            raise ConfigError("replicated tables are read under ASP, BSP, SSP or ESSP, without a lazy pull buffer")
        if self.write_quorum > 1 and not isinstance(self.optimizer, (Sum, SGD)):
            # With W > 1 a push's origin is the worker: every replica must compute the same delta.
            raise ConfigError("write_quorum > 1 needs an additive update rule (Sum or SGD)")

    def _check_shape(self) -> None:
        if self.shape is None:
            return
        if not isinstance(self.shape, tuple) or not all(type(n) is int and n >= 0 for n in self.shape):
            raise ConfigError(f"shape must be None or a tuple of sizes (ints >= 0), got {self.shape!r}")
        rows = dense_rows(self.shape, self.dim)
        if rows != self.num_keys:
            raise ConfigError(f"a dense table of shape {self.shape} in rows of {self.dim} values has {rows} rows, "
                              f"not num_keys={self.num_keys}")

    def differences(self, other: TableSpec, mine: str = "here", theirs: str = "asked") -> str:
        """The fields in which ``other`` differs, e.g. ``dim 16 here, 8 asked``: what a mismatch
        error names instead of two whole specs."""
        return "; ".join(f"{f.name} {getattr(self, f.name)!r} {mine}, {getattr(other, f.name)!r} {theirs}"
                         for f in fields(self) if getattr(self, f.name) != getattr(other, f.name))

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_keys": self.num_keys,
            "dim": self.dim,
            "dtype": self.dtype,
            "init": initializer_to_dict(self.init),
            "optimizer": optimizer_to_dict(self.optimizer),
            "consistency": consistency_to_dict(self.consistency),
            "mapping": self.mapping,
            "nonfinite": self.nonfinite,
            "locking": self.locking,
            "seed": self.seed,
            "replicas": self.replicas,
            "write_quorum": self.write_quorum,
            "read_quorum": read_quorum_to_wire(self.read_quorum),
            "gossip_ms": self.gossip_ms,
            "techniques": self.techniques,
            "sync_ms": self.sync_ms,
            "act_ms": self.act_ms,
            "slices": self.slices,
            "slice_bytes": self.slice_bytes,
            "placement": self.placement,
            "shape": None if self.shape is None else list(self.shape),
        }

    @classmethod
    def from_dict(cls, data: Any) -> TableSpec:
        if not isinstance(data, dict):
            raise ConfigError(f"table spec must be a dict, got {type(data).__name__}")
        fields = dict(data)
        try:
            fields["init"] = initializer_from_dict(fields["init"])
            fields["optimizer"] = optimizer_from_dict(fields["optimizer"])
            fields["consistency"] = consistency_from_dict(fields.get("consistency", {"kind": "asp"}))
            if "read_quorum" in fields:
                fields["read_quorum"] = read_quorum_from_wire(fields["read_quorum"])
            if isinstance(fields.get("shape"), list):
                fields["shape"] = tuple(fields["shape"])
            return cls(**fields)
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"bad table spec {data!r}: {exc}") from exc


def dense_rows(shape: tuple[int, ...], width: int) -> int:
    """The rows of ``width`` values that a dense tensor of ``shape`` takes (one at least)."""
    size = 1
    for n in shape:
        size *= n
    return max(1, -(-size // width))


@dataclass(frozen=True)
class Limits:
    """Bounds every peer enforces on what it receives."""

    max_message_bytes: int = 256 * 1024 * 1024
    #: largest table (values and optimiser state, all shards) a CREATE_TABLE may ask for
    max_table_bytes: int = 64 * 1024**3
    #: most slices one table may be cut into: each is a shared-memory segment (a descriptor in the
    #: server and in every co-located worker)
    max_slices: int = 4096
    #: memory one server may give the tables it holds, checked before a table is allocated;
    #: 0: half of the machine's memory
    server_memory_bytes: int = 0

    def __post_init__(self) -> None:
        _int_at_least("max_message_bytes", self.max_message_bytes, 4096)
        _int_at_least("max_table_bytes", self.max_table_bytes, 4096)
        _int_at_least("max_slices", self.max_slices, 1)
        _int_at_least("server_memory_bytes", self.server_memory_bytes, 0)

    @property
    def payload_bytes(self) -> int:
        """The bytes one message's arrays may take: the limit less room for its header (64 KiB, or an
        eighth of a small limit, which would otherwise leave no room at all)."""
        return self.max_message_bytes - min(64 * 1024, self.max_message_bytes // 8)

    @property
    def server_budget(self) -> int:
        """``server_memory_bytes``, with 0 read as half of this machine's memory."""
        if self.server_memory_bytes:
            return self.server_memory_bytes
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


@dataclass(frozen=True)
class Timeouts:
    """How long each kind of wait may take before it fails with a named cause."""

    connect_s: float = 60.0
    request_s: float = 120.0
    barrier_s: float = 600.0
    #: a replica that does not answer within this is treated as down and the request goes elsewhere
    replica_s: float = 2.0
    #: a request without a reply is sent again after at most this, then after twice as long (up to
    #: 8 s); sooner once a peer's round trips are timed (smoothed RTT + 4 deviations, at least 50 ms
    #: and the time a large request and its reply take at 50 MB/s).
    #: The receiver answers a repeat without serving it twice
    resend_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("connect_s", "request_s", "barrier_s", "replica_s", "resend_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"Timeouts.{name} must be > 0 seconds, got {value!r}")


@dataclass(frozen=True)
class RebalancePolicy:
    """When the rendezvous moves slices on its own.

    Every ``window_s`` it sums the bytes each server served; when the busiest
    server carries more than ``threshold`` times the mean for ``windows``
    windows in a row, it moves up to ``max_moves`` slices (those that carry
    the most load per byte moved), then waits ``windows`` windows before
    judging again. Windows with less than ``min_bytes_per_s`` in all are idle
    and do not count. A server that joins is given slices holding its share of
    the bytes when ``balance_on_join``.
    """

    threshold: float = 1.25
    windows: int = 3
    window_s: float = 1.0
    max_moves: int = 16
    min_bytes_per_s: float = 1 << 20
    balance_on_join: bool = True
    enabled: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.threshold, (int, float)) or not self.threshold > 1.0:
            raise ConfigError(f"rebalance threshold must be > 1.0 (max/mean load), got {self.threshold!r}")
        _int_at_least("windows", self.windows, 1)
        _int_at_least("max_moves", self.max_moves, 1)
        if not isinstance(self.window_s, (int, float)) or not self.window_s > 0:
            raise ConfigError(f"window_s must be > 0, got {self.window_s!r}")


@dataclass(frozen=True)
class ClusterSpec:
    """Shape and identity of one cluster, as the launcher decided it."""

    cluster_id: str
    num_nodes: int
    workers_per_node: int
    rendezvous: str
    secret: bytes | None = None
    limits: Limits = field(default_factory=Limits)
    timeouts: Timeouts = field(default_factory=Timeouts)

    def __post_init__(self) -> None:
        if not isinstance(self.cluster_id, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", self.cluster_id):
            raise ConfigError(f"cluster_id must be 1-64 letters, digits, '_-', got {self.cluster_id!r}")
        _int_at_least("num_nodes", self.num_nodes, 1)
        _int_at_least("workers_per_node", self.workers_per_node, 0)
        if not isinstance(self.rendezvous, str) or "://" not in self.rendezvous:
            raise ConfigError(f"rendezvous must be an address like tcp://host:port, got {self.rendezvous!r}")
        if self.secret is not None and (not isinstance(self.secret, bytes) or len(self.secret) < 16):
            raise ConfigError("secret must be at least 16 bytes")

    @property
    def num_workers(self) -> int:
        return self.num_nodes * self.workers_per_node

    def with_changes(self, **changes: Any) -> ClusterSpec:
        return replace(self, **changes)
