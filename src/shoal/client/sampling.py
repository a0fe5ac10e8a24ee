"""Sampling access (NuPS): draw keys from a registered distribution and get their rows.

Negative sampling in embedding models draws keys at random, so a classic PS
sends a message for almost every sample. Schemes trade exactness for locality:

* ``naive``: draw from the distribution, pull the rows (prefetched when the
  sample is prepared);
* ``preloc``: draw when the sample is prepared for a later clock and declare
  intent for its keys at that clock, so the table's technique brings them here
  in time; pull when it is used (exact, and local if prepared early enough);
* ``pool``: draw a pool of keys once and hand each out ``reuse`` times before
  drawing a new pool; rows are pulled per sample (reused keys of a relocating
  table stay here), so they hold the worker's own pushes;
* ``local``: draw only among keys present on this node (owned or replicated),
  with their weights renormalised: no message at all, slightly biased. The
  list of present keys is made again once the keys drawn since it was made
  number a sixteenth of the table's (so making it costs less than the draws),
  and a drawn key that has left is drawn again; a static table's list follows
  its layout.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from shoal.api.errors import ConfigError, TableError
from shoal.client.context import TableView
from shoal.cluster.requests import Future
from shoal.storage.kernels import ABSENT, alias_draw, alias_table

SCHEMES = ("naive", "preloc", "pool", "local")
_LOCAL_REFRESH = 16  # the list of local keys is made again after num_keys / this keys were drawn


@dataclass
class SampleHandle:
    id: int
    keys: np.ndarray
    rows: Future[np.ndarray] | _Later


_MOST = 1 << 40  # reuse counts and pool sizes past this are mistakes (and overflow the counters)


def _weights(weights: Any, num_keys: int) -> np.ndarray:
    """``weights`` as float64, one finite non-negative number per key with a positive sum, scaled
    to a maximum of 1 (their sum of huge weights overflowed to inf, and every key was drawn alike)."""
    try:
        array = np.asarray(weights, dtype=np.float64)
    except (TypeError, ValueError):
        array = np.empty(0)
    if array.shape != (num_keys,) or not np.isfinite(array).all() or (array < 0).any() or not array.max() > 0:
        raise ConfigError(f"weights must be {num_keys} finite non-negative numbers with a positive sum")
    return array / array.max()


class Sampler:
    """Samples keys of one table under one scheme."""

    def __init__(self, table: TableView, weights: np.ndarray | None, scheme: str, reuse: int, pool_size: int,
                 seed: int) -> None:
        if scheme not in SCHEMES:
            raise ConfigError(f"sampling scheme must be one of {SCHEMES}, got {scheme!r}")
        if weights is not None:
            weights = _weights(weights, table.num_keys)
        for name, value in (("reuse", reuse), ("pool_size", pool_size)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MOST:
                raise ConfigError(f"{name} must be an int from 1 to 2**40, got {value!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ConfigError(f"seed must be an int >= 0, got {seed!r}")
        if scheme == "preloc" and not table.access.relocates:
            raise ConfigError(f"the preloc scheme brings sampled keys here before use: table {table.name!r} "
                              "needs techniques other than 'static'")
        self.table = table
        self.scheme = scheme
        self.reuse = reuse
        self.pool_size = pool_size
        self.rng = np.random.default_rng(seed)
        #: the distribution as an alias table (None: uniform)
        self._alias = None if weights is None else alias_table(weights)
        self.weights = weights
        #: with weights alike wherever they are above zero (uniform among some keys: a table's entities
        #: beside its relations), which keys may be drawn: those among the local keys are drawn as
        #: uniform draws, with no alias table made for each new list (5 ms for 120,000 keys here)
        self._alike = None if weights is None or (weights[weights > 0] != 1.0).any() else weights > 0
        self._ids = itertools.count()
        self._handles: dict[int, SampleHandle] = {}
        self._pool = np.empty(0, dtype=np.int64)
        self._pool_left = np.empty(0, dtype=np.int64)
        self._local: np.ndarray | None = None
        #: what draws among the list by the weights: its drawable keys (drawn alike) or its alias table
        self._local_choice: np.ndarray | tuple[np.ndarray, np.ndarray] | None = None
        self._local_drawn = 0  # keys drawn from the list since it was made
        self._local_made_for: tuple[object, tuple[int, ...]] | None = None  # a static table's layout and slices

    def _draw(self, n: int) -> np.ndarray:
        if self._alias is None:
            return self.rng.integers(0, self.table.num_keys, n)
        return alias_draw(*self._alias, self.rng.random(n))

    def prepare(self, n: int, clock: int | None = None) -> int:
        if self.scheme == "naive":
            keys = self._draw(n)
            handle = SampleHandle(next(self._ids), keys, self.table.pull_async(keys))
        elif self.scheme == "preloc":
            # Known ahead: intent brings the rows here by ``clock``; they are pulled when used.
            keys = self._draw(n)
            at = self.table.worker.clock if clock is None else clock
            self.table.intent(keys, at, at + 1)
            handle = SampleHandle(next(self._ids), keys, _Later(self.table, keys))
        elif self.scheme == "pool":
            keys = self._from_pool(n)
            handle = SampleHandle(next(self._ids), keys, self.table.pull_async(keys))
        else:
            keys = self._draw_local(n)
            handle = SampleHandle(next(self._ids), keys, self.table.pull_async(keys))
        self._handles[handle.id] = handle
        self.table.counters[f"samples_{self.scheme}"] += n
        return handle.id

    def draw(self, n: int) -> np.ndarray:
        """Keys only; the caller pulls them (``preloc`` draws as ``naive``: without a clock there is
        nothing to bring here ahead)."""
        if self.scheme == "local":
            keys = self._draw_local(n)
        elif self.scheme == "pool":
            keys = self._from_pool(n)
        else:
            keys = self._draw(n)
        self.table.counters[f"samples_{self.scheme}"] += n
        return keys

    def pull(self, handle_id: int) -> tuple[np.ndarray, np.ndarray]:
        handle = self._handles.pop(handle_id, None)
        if handle is None:
            raise TableError(f"no prepared sample {handle_id} (each handle is pulled once)")
        return handle.keys, handle.rows.wait()

    def _from_pool(self, n: int) -> np.ndarray:
        """Keys from the pool, each used at most ``reuse`` times."""
        if np.count_nonzero(self._pool_left) < n:  # a sample's keys are distinct: as many left as asked for
            size = max(self.pool_size, n)
            self._pool = self._draw(size)
            self._pool_left = np.full(size, self.reuse, dtype=np.int64)
            self.table.counters["sample_pools"] += 1
        available = np.flatnonzero(self._pool_left > 0)
        chosen = self.rng.choice(available, size=n, replace=False) if available.size >= n else available[:n]
        self._pool_left[chosen] -= 1
        return self._pool[chosen]

    def _draw_local(self, n: int) -> np.ndarray:
        presence = self.table.access.presence
        if presence is None:
            local = self._static_local_keys()
        elif self._local is None or self._local_drawn * _LOCAL_REFRESH >= self.table.num_keys:
            local = self._refresh_local(presence)
        else:
            local = self._local
        self._local_drawn += n
        if not self._drawable(local):
            return self._draw(n)  # nothing here yet (or nothing of weight): fall back to the true distribution
        keys = self._draw_among(local, n)
        if presence is None:
            return keys
        # Keys move while the list ages: a sample that left would cost a message for its row and
        # another for its update. Draw those again from a fresh list.
        gone = np.flatnonzero(presence[keys] == ABSENT)
        if gone.size:
            local = self._refresh_local(presence)
            if self._drawable(local):
                keys[gone] = self._draw_among(local, gone.size)
            self.table.counters["samples_redrawn"] += int(gone.size)
        return keys

    def _refresh_local(self, presence: np.ndarray) -> np.ndarray:
        local = np.flatnonzero(presence != ABSENT)
        if self._local is None or not np.array_equal(local, self._local):
            self._local, self._local_choice = local, None  # remade only for a changed list
        self._local_drawn = 0
        return self._local

    def _drawable(self, local: np.ndarray) -> bool:
        """Whether ``local`` holds a key the distribution can draw (one of weight above zero)."""
        return bool(local.size) and (self.weights is None or bool(self.weights[local].any()))

    def _draw_among(self, local: np.ndarray, n: int) -> np.ndarray:
        """``n`` keys of ``local``, by their weights renormalised (uniform without weights)."""
        if self.weights is None:
            return local[self.rng.integers(0, local.size, n)]
        if self._local_choice is None:
            alike = self._alike
            self._local_choice = alias_table(self.weights[local]) if alike is None else local[alike[local]]
        choice = self._local_choice
        if isinstance(choice, np.ndarray):
            return choice[self.rng.integers(0, choice.size, n)]
        prob, alias = choice
        return local[alias_draw(prob, alias, self.rng.random(n))]

    def _static_local_keys(self) -> np.ndarray:
        layout, slices = self.table.layout, tuple(self.table.local)
        made_for = self._local_made_for
        if self._local is None or made_for is None or made_for[0] is not layout or made_for[1] != slices:
            parts = [layout.mapping.keys_of(s) for s in slices]
            self._local = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
            self._local_choice = None
            self._local_made_for = (layout, slices)
        return self._local


class _Later:
    """Rows pulled when the sample is used, not when it is prepared."""

    def __init__(self, table: TableView, keys: np.ndarray) -> None:
        self.table, self.keys = table, keys

    def wait(self) -> np.ndarray:
        return self.table.pull(self.keys)


def make_sampler(table: TableView, weights: Any, scheme: str, reuse: int, pool_size: int, seed: int) -> Sampler:
    return Sampler(table, weights, scheme, reuse, pool_size, seed)
