"""A table's placement: its key mapping plus which server owns each slice, at an epoch.

A table is cut into *slices* (shards): one per server by default, more when
``TableSpec.slices`` asks or when ``mapping="bounded"`` caps each slice at
``slice_bytes``. With ``mapping="hash"`` and several slices per server this is
consistent hashing with virtual nodes in the fixed-partition form (Dynamo's
third strategy): keys hash onto equal slices, slices are dealt to servers, and a
server that joins or leaves takes or gives whole slices, so only its share of
the keys moves. Which server owns a slice starts from the table's placement
rule and changes at run time when slices move (live rebalancing, servers
joining or leaving); every change bumps the epoch.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np

from shoal.api.config import Limits, TableSpec
from shoal.api.errors import TableError
from shoal.placement import kernels
from shoal.placement.mapping import KeyMapping, make_mapping
from shoal.storage.state import state_of


def row_bytes(spec: TableSpec) -> int:
    """Bytes one row needs: values plus the update rule's per-row state."""
    itemsize = np.dtype(spec.dtype).itemsize
    per_row = spec.dim * itemsize
    for st in state_of(spec.optimizer):
        width = spec.dim if st.per_value else 1
        per_row += width * np.dtype(st.dtype or spec.dtype).itemsize
    return per_row


def slice_count(spec: TableSpec, num_servers: int) -> int:
    """How many slices ``spec`` is cut into on a cluster of ``num_servers``."""
    if spec.mapping == "bounded":
        total = row_bytes(spec) * spec.num_keys
        return max(1, min(spec.num_keys, -(-total // spec.slice_bytes)))
    return min(spec.num_keys, spec.slices or num_servers)


def check_limits(spec: TableSpec, limits: Limits, num_servers: int) -> None:
    """Refuse (``TableError``) a table larger than ``limits`` allow, or cut into more slices: the
    rendezvous and every server check before they allocate anything of it."""
    size = spec.num_keys * row_bytes(spec)
    if size > limits.max_table_bytes:
        raise TableError(f"table {spec.name!r} needs {size} bytes with its optimiser state; the limit is "
                         f"{limits.max_table_bytes}")
    slices = slice_count(spec, num_servers)
    if slices > limits.max_slices:
        raise TableError(f"table {spec.name!r} would be cut into {slices} slices; the limit is {limits.max_slices} "
                         "(fewer slices=, or a larger slice_bytes)")


def initial_owners(spec: TableSpec, num_slices: int, servers: list[int]) -> np.ndarray:
    """The server of each slice before anything moves."""
    n = len(servers)
    nodes = np.asarray(servers, dtype=np.int64)
    if spec.placement == "whole":
        # One server holds every slice: how MXNet and ps-lite place an array below their split size.
        return np.full(num_slices, nodes[zlib.crc32(spec.name.encode()) % n], dtype=np.int64)
    if spec.mapping in ("hash", "round_robin"):
        return nodes[np.arange(num_slices) % n]
    blocks = np.arange(num_slices) * n // num_slices  # contiguous ranges stay together
    if spec.mapping == "bounded":
        # Many tables of a few slices each (a model's layers): start each on a different server.
        blocks = (blocks + zlib.crc32(spec.name.encode())) % n
    return nodes[blocks]


@dataclass
class TableLayout:
    """Key -> (slice, row) -> owning server, at one epoch of the placement."""

    spec: TableSpec
    mapping: KeyMapping
    owners: np.ndarray
    epoch: int = 0
    #: servers the layout was made for; with owners, how long per-server counts are
    num_servers: int = 1
    #: length of per-owner counts (computed once: every request is routed with it)
    num_owners: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.num_owners = max(int(self.owners.max()) + 1, self.num_servers)

    @classmethod
    def initial(cls, spec: TableSpec, num_servers: int) -> TableLayout:
        num_slices = slice_count(spec, num_servers)
        rule = "range" if spec.mapping == "bounded" else spec.mapping
        mapping = make_mapping(rule, spec.num_keys, num_slices)
        return cls(spec, mapping, initial_owners(spec, num_slices, list(range(num_servers))), 0, num_servers)

    def at(self, owners: np.ndarray | list[int], epoch: int) -> TableLayout:
        """The same mapping with other owners (a later epoch)."""
        return TableLayout(self.spec, self.mapping, np.asarray(owners, dtype=np.int64), epoch, self.num_servers)

    @property
    def num_shards(self) -> int:
        return self.mapping.num_shards

    def route(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(owner, shard, row)`` for each key, and the number of keys per owner."""
        shard, row = self.mapping.locate(keys)
        owner = np.empty(keys.shape[0], dtype=np.int64)
        counts = kernels.owners_of(shard, self.owners, owner, self.num_owners)
        return owner, shard, row, counts

    def replica_nodes(self, shard: int) -> list[int]:
        """Servers holding replicas of ``shard``: its owner, then the next ones round the ring."""
        num_nodes = self.num_servers  # not the slices: a table of fewer keys than servers has fewer
        owner = int(self.owners[shard])
        return [(owner + i) % num_nodes for i in range(min(self.spec.replicas, num_nodes))]

    def shards_of(self, server: int) -> list[int]:
        return [int(s) for s in np.flatnonzero(self.owners == server)]

    def slice_bytes(self, shard: int) -> int:
        return row_bytes(self.spec) * self.mapping.shard_size(shard)
