"""A worker's process cache of remote rows, each with the clock it is known current at."""

from __future__ import annotations

import numpy as np

from shoal.storage import kernels


class RowCache:
    """Cached rows of one table, for keys that live on other nodes.

    ``version[k]`` is the slowest clock ``m`` of the server when row ``k`` was
    read: the row holds every update of iterations before ``m``. Under ESSP a
    server also announces a new ``m`` for all rows of a shard that a worker has
    cached (``bump``): rows it did not resend did not change.

    Each row also remembers how recent its data is: the serving server's layout
    epoch (a slice's owners serve it at increasing epochs) and how far that
    server had got in this worker's stream (``seen``, increasing per server).
    Data older than what the cache holds (a reply of a slice's previous owner,
    a reply sent again) is never stored over it, and data at least as recent
    keeps the larger of the two versions: it holds every update the older did.
    """

    def __init__(self, num_keys: int, dim: int, dtype: np.dtype, num_shards: int) -> None:
        self.values = np.zeros((num_keys, dim), dtype=dtype)
        self.version = np.full(num_keys, -1, dtype=np.int64)
        self.shard_version = np.full(num_shards, -1, dtype=np.int64)
        self.epoch = np.full(num_keys, -1, dtype=np.int64)
        self.seen = np.full(num_keys, -1, dtype=np.int64)

    def versions(self, keys: np.ndarray, shard: np.ndarray) -> np.ndarray:
        """Clock each key's cached row is current at (-1: not cached)."""
        own = self.version[keys]
        return np.where(own >= 0, np.maximum(own, self.shard_version[shard]), -1)

    def store(self, keys: np.ndarray, rows: np.ndarray, version: int, epoch: int, seen: int,
              pushed: bool = False) -> np.ndarray:
        """Keep the rows more recent than the cached ones; returns the keys kept. Rows a server
        ``pushed`` (ESSP) are kept when as recent: the bump that follows them relies on them."""
        held_epoch, held_seen = self.epoch[keys], self.seen[keys]
        newer = (epoch > held_epoch) | ((epoch == held_epoch) & ((seen >= held_seen) if pushed else (seen > held_seen)))
        if not newer.all():
            keys, rows = keys[newer], rows[newer]
        self.values[keys] = rows
        self.version[keys] = np.maximum(self.version[keys], version)
        self.epoch[keys] = epoch
        self.seen[keys] = seen
        return keys

    def add(self, keys: np.ndarray, values: np.ndarray, scale: float) -> None:
        """``row += scale * value`` for each key (repeated keys add up): this worker's own push,
        under an additive rule, as the server will apply it."""
        kernels.add_rows(self.values, keys, np.ascontiguousarray(values, dtype=self.values.dtype), scale)

    def drop(self, keys: np.ndarray) -> None:
        """Forget ``keys``: the next read of them asks their server."""
        self.version[keys] = -1

    def forget_slice(self, shard: int, keys: np.ndarray) -> None:
        """Forget the rows of slice ``shard`` (its ``keys``) and what the slice's server vouched for."""
        self.version[keys] = -1
        self.shard_version[shard] = -1

    def bump(self, shards: list[int], version: int) -> None:
        for s in shards:
            self.shard_version[s] = max(self.shard_version[s], version)

    def read(self, keys: np.ndarray) -> np.ndarray:
        return self.values[keys]
