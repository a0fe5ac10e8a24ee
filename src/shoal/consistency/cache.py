"""A worker's process cache of remote rows, each with the clock it is known current at."""

from __future__ import annotations

import numpy as np


class RowCache:
    """Cached rows of one table, for keys that live on other nodes.

    ``version[k]`` is the slowest clock ``m`` of the server when row ``k`` was
    read: the row holds every update of iterations before ``m``. Under ESSP a
    server also announces a new ``m`` for all rows of a shard that a worker has
    cached (``bump``): rows it did not resend did not change.
    """

    def __init__(self, num_keys: int, dim: int, dtype: np.dtype, num_shards: int) -> None:
        self.values = np.zeros((num_keys, dim), dtype=dtype)
        self.version = np.full(num_keys, -1, dtype=np.int64)
        self.shard_version = np.full(num_shards, -1, dtype=np.int64)

    def versions(self, keys: np.ndarray, shard: np.ndarray) -> np.ndarray:
        """Clock each key's cached row is current at (-1: not cached)."""
        own = self.version[keys]
        return np.where(own >= 0, np.maximum(own, self.shard_version[shard]), -1)

    def store(self, keys: np.ndarray, rows: np.ndarray, version: int) -> None:
        """Keep ``rows`` unless the cache already holds a newer version of a key."""
        newer = self.version[keys] <= version
        if not newer.all():
            keys, rows = keys[newer], rows[newer]
        self.values[keys] = rows
        self.version[keys] = version

    def bump(self, shards: list[int], version: int) -> None:
        for s in shards:
            self.shard_version[s] = max(self.shard_version[s], version)

    def read(self, keys: np.ndarray) -> np.ndarray:
        return self.values[keys]
