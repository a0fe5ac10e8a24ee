"""A table's placement: its key mapping plus which server owns each shard."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shoal.api.config import TableSpec
from shoal.placement import kernels
from shoal.placement.mapping import KeyMapping, make_mapping


@dataclass
class TableLayout:
    """Key -> (shard, row) -> owning server, at one epoch of the placement."""

    spec: TableSpec
    mapping: KeyMapping
    owners: np.ndarray
    epoch: int = 0

    @classmethod
    def initial(cls, spec: TableSpec, num_servers: int) -> TableLayout:
        """One shard per server, shard ``s`` on server ``s``."""
        mapping = make_mapping(spec.mapping, spec.num_keys, num_servers)
        return cls(spec, mapping, np.arange(num_servers, dtype=np.int64))

    @property
    def num_shards(self) -> int:
        return self.mapping.num_shards

    @property
    def num_owners(self) -> int:
        return int(self.owners.max()) + 1

    def route(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(owner, shard, row)`` for each key, and the number of keys per owner."""
        shard, row = self.mapping.locate(keys)
        owner = np.empty(keys.shape[0], dtype=np.int64)
        counts = kernels.owners_of(shard, self.owners, owner, self.num_owners)
        return owner, shard, row, counts

    def replica_nodes(self, shard: int) -> list[int]:
        """Servers holding replicas of ``shard``: its owner, then the next ones round the ring."""
        num_nodes = int(self.owners.shape[0])
        owner = int(self.owners[shard])
        return [(owner + i) % num_nodes for i in range(min(self.spec.replicas, num_nodes))]

    def shards_of(self, server: int) -> list[int]:
        return [int(s) for s in np.flatnonzero(self.owners == server)]
