"""Which shard a key lives in, and at which row of that shard.

A mapping is a pure, deterministic function of its parameters, so every worker
and server computes the same answer without asking anyone. Elastic slicing and
relocation build on this by versioning the mapping (epochs) and overriding
owners; they do not change how one mapping locates keys.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from shoal.api.errors import ConfigError
from shoal.placement import kernels

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class KeyMapping(ABC):
    """Maps keys ``0..num_keys-1`` onto ``num_shards`` shards with dense rows.

    ``locate`` takes contiguous int64 keys already checked to lie in range.
    """

    rule: str = ""

    def __init__(self, num_keys: int, num_shards: int) -> None:
        if num_keys < 1 or num_shards < 1:
            raise ConfigError(f"mapping needs num_keys >= 1 and num_shards >= 1, got {num_keys}, {num_shards}")
        self.num_keys = num_keys
        self.num_shards = num_shards

    @abstractmethod
    def locate(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(shard, row)`` for each key, as int64 arrays."""

    @abstractmethod
    def keys_of(self, shard: int) -> np.ndarray:
        """The keys held by ``shard``, in row order."""

    def rows_in(self, keys: np.ndarray, shard: int) -> np.ndarray | None:
        """Rows of ``keys`` if all of them lie in ``shard`` (one pass), else None."""
        located_shard, row = self.locate(keys)
        return row if (located_shard == shard).all() else None

    def shard_size(self, shard: int) -> int:
        return int(self.keys_of(shard).shape[0])

    def to_dict(self) -> dict[str, Any]:
        return {"rule": self.rule, "num_keys": self.num_keys, "num_shards": self.num_shards}


class RangeMapping(KeyMapping):
    """Contiguous key ranges of near-equal size; row = key - first key of the shard."""

    rule = "range"

    def __init__(self, num_keys: int, num_shards: int) -> None:
        super().__init__(num_keys, num_shards)
        self.bounds = np.linspace(0, num_keys, num_shards + 1).round().astype(np.int64)

    def locate(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        shard = np.empty(keys.shape[0], dtype=np.int64)
        row = np.empty(keys.shape[0], dtype=np.int64)
        kernels.range_locate(keys, self.bounds, shard, row)
        return shard, row

    def rows_in(self, keys: np.ndarray, shard: int) -> np.ndarray | None:
        rows = np.empty(keys.shape[0], dtype=np.int64)
        ok = kernels.rows_in_range(keys, int(self.bounds[shard]), int(self.bounds[shard + 1]), rows)
        return rows if ok else None

    def keys_of(self, shard: int) -> np.ndarray:
        return np.arange(self.bounds[shard], self.bounds[shard + 1], dtype=np.int64)


class RoundRobinMapping(KeyMapping):
    """``shard = key % S``, ``row = key // S``: neighbouring keys land on different shards."""

    rule = "round_robin"

    def locate(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return keys % self.num_shards, keys // self.num_shards

    def rows_in(self, keys: np.ndarray, shard: int) -> np.ndarray | None:
        rows = np.empty(keys.shape[0], dtype=np.int64)
        return rows if kernels.rows_in_stride(keys, shard, self.num_shards, rows) else None

    def keys_of(self, shard: int) -> np.ndarray:
        return np.arange(shard, self.num_keys, self.num_shards, dtype=np.int64)


class HashMapping(KeyMapping):
    """Multiplicative hashing of keys onto shards; rows are ranks within the shard.

    Spreads any pattern of hot keys evenly. The key -> row table costs 8 bytes
    per key and is built once per process.
    """

    rule = "hash"

    def __init__(self, num_keys: int, num_shards: int) -> None:
        super().__init__(num_keys, num_shards)
        all_keys = np.arange(num_keys, dtype=np.int64)
        self._shard_of = self._hash(all_keys)
        order = np.argsort(self._shard_of, kind="stable")
        counts = np.bincount(self._shard_of, minlength=num_shards)
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._keys_by_shard = order.astype(np.int64)
        self._row_of = np.empty(num_keys, dtype=np.int64)
        self._row_of[order] = np.arange(num_keys) - np.repeat(self._starts[:-1], counts)

    def _hash(self, keys: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            h = keys.astype(np.uint64) * _GOLDEN
        return ((h >> np.uint64(32)) % np.uint64(self.num_shards)).astype(np.int64)

    def locate(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        shard = np.empty(keys.shape[0], dtype=np.int64)
        row = np.empty(keys.shape[0], dtype=np.int64)
        kernels.lookup_locate(keys, self._shard_of, self._row_of, shard, row)
        return shard, row

    def rows_in(self, keys: np.ndarray, shard: int) -> np.ndarray | None:
        rows = np.empty(keys.shape[0], dtype=np.int64)
        return rows if kernels.rows_in_lookup(keys, shard, self._shard_of, self._row_of, rows) else None

    def keys_of(self, shard: int) -> np.ndarray:
        return self._keys_by_shard[self._starts[shard] : self._starts[shard + 1]]


MAPPINGS: dict[str, type[KeyMapping]] = {
    RangeMapping.rule: RangeMapping,
    RoundRobinMapping.rule: RoundRobinMapping,
    HashMapping.rule: HashMapping,
}


def make_mapping(rule: str, num_keys: int, num_shards: int) -> KeyMapping:
    cls = MAPPINGS.get(rule)
    if cls is None:
        raise ConfigError(f"unknown mapping rule {rule!r}; expected one of {sorted(MAPPINGS)}")
    return cls(num_keys, num_shards)
