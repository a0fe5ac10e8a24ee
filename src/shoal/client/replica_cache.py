"""A worker's cache of a replicated table's rows under ESSP, kept current by its home replicas.

Per shard, the replica a worker reads first is its home (``replication.eager``):
the rows read there are cached with the clock before which they hold every
push (``covers``), and the home pushes the ones that change each time it holds
what a later clock requires. A read at clock ``c`` under bound ``s`` is served
here when each of its rows covers ``c - s``: no message. A message's rows
replace the cached ones and every cached row of the shard then covers its
clock (the rows it leaves out did not change), which holds only while every
earlier message of the series has arrived: a gap, a new home or a restarted
one drops the shard's rows, and the next reads fetch them again.

The worker's own pushes change its cached rows at once, so a read holds them
(read-my-writes): an additive rule adds the change, and keeps it in a log until
the home's rows include the push (its version vector says so) to add it back to
rows that arrive without it; another rule drops the rows it touched.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from shoal.api.config import TableSpec
from shoal.api.optim import SGD, Sum

_HISTORY = 16  # messages remembered per home: a read answered before them must not miss what they changed
_OWN_LOG_BYTES = 32 << 20  # own pushes kept per shard for the home to catch up with; beyond, it starts again


@dataclass
class _Heard:
    """The messages of one home's series for one shard, as they arrived."""

    series: str
    last: int = 0
    recent: deque[tuple[int, np.ndarray]] = field(default_factory=lambda: deque(maxlen=_HISTORY))


@dataclass
class _ShardRows:
    values: np.ndarray
    present: np.ndarray
    covers: np.ndarray
    home: int = -1
    series: str = ""
    expected: int | None = None  # the number of the next message the cached rows are current up to
    own: list[tuple[int, np.ndarray, np.ndarray]] = field(default_factory=list)  # (seq, rows, change)
    own_bytes: int = 0
    logged_from: int = 1  # every own push from this number on is in ``own`` until the home has it

    def drop(self) -> None:
        self.present[:] = False
        self.expected = None


class ReplicaCache:
    """The rows of one replicated table this worker reads, per shard (``num_rows[shard]`` rows each)."""

    def __init__(self, spec: TableSpec, num_rows: list[int], own_origin: Callable[[], int],
                 counters: Counter[str]) -> None:
        self.spec = spec
        self.dtype = np.dtype(spec.dtype)
        self.num_rows = num_rows
        self.own_origin = own_origin
        self.counters = counters
        opt = spec.optimizer
        #: the change a push of ``grads`` makes, where the rule is additive
        self._change: Callable[[np.ndarray], np.ndarray] | None = (
            (lambda g: g) if isinstance(opt, Sum) else (lambda g: -opt.lr * g) if isinstance(opt, SGD) else None)
        self._shards: dict[int, _ShardRows] = {}
        self._heard: dict[tuple[int, int], _Heard] = {}

    def _shard(self, shard: int) -> _ShardRows:
        cached = self._shards.get(shard)
        if cached is None:
            n = self.num_rows[shard]
            cached = self._shards[shard] = _ShardRows(np.zeros((n, self.spec.dim), dtype=self.dtype),
                                                      np.zeros(n, dtype=np.bool_), np.zeros(n, dtype=np.int64))
        return cached

    # ----------------------------------------------------------------- reads

    def follows(self, shard: int, rows: np.ndarray) -> bool:
        """Whether every one of ``rows`` is cached and kept current by its home's messages."""
        cached = self._shards.get(shard)
        return cached is not None and cached.expected is not None and bool(cached.present[rows].all())

    def home_of(self, shard: int) -> int | None:
        """The replica whose messages keep the shard's cached rows current, if there is one."""
        cached = self._shards.get(shard)
        return cached.home if cached is not None and cached.home >= 0 else None

    def serve(self, shard: int, rows: np.ndarray, clock: int) -> np.ndarray | None:
        """The cached ``rows`` if every one covers ``clock``; None if one does not (read it remotely)."""
        cached = self._shards.get(shard)
        if cached is None or not cached.present[rows].all() or (cached.covers[rows] < clock).any():
            return None
        self.counters["eager_reads_served"] += 1
        return cached.values[rows]

    def keep(self, shard: int, home: int, series: str, rows_seq: int, rows: np.ndarray, values: np.ndarray,
             covers: int, version: dict[int, int]) -> None:
        """Cache rows a read merged, ``home`` among the replicas it read and subscribing it to them; its
        answer came after message ``rows_seq`` of ``series``. Rows a later message (already here)
        changed are left out: their values predate it."""
        heard = self._heard.get((shard, home))
        same = heard is not None and heard.series == series
        after = [r for s, r in heard.recent if s > rows_seq] if same else []  # type: ignore[union-attr]
        last = max(heard.last, rows_seq) if same else rows_seq  # type: ignore[union-attr]
        cached = self._shard(shard)
        included = version.get(self.own_origin(), 0)
        if len(after) < last - rows_seq or cached.logged_from > included + 1:
            # More came meanwhile than are remembered, or own pushes the rows lack are no longer logged.
            self.counters["eager_reads_not_kept"] += 1
            return
        if cached.home != home or cached.series != series or cached.expected != last + 1:
            cached.drop()  # its rows were current by messages this worker no longer follows
            cached.home, cached.series, cached.expected = home, series, last + 1
        if after:
            fresh = ~np.isin(rows, np.concatenate(after))
            rows, values = rows[fresh], values[fresh]
        cached.values[rows] = values
        cached.present[rows] = True
        cached.covers[rows] = covers
        self._add_own(cached, rows, included)

    # ------------------------------------------------------------ messages

    def on_rows(self, node: int, shard: int, seq: int, series: str, covers: int, version: dict[int, int],
                rows: np.ndarray, values: np.ndarray) -> None:
        """A message of replica ``node``'s series for ``shard``: its ``rows`` changed, the rest did not, and
        every row covers ``covers``."""
        heard = self._heard.get((shard, node))
        if heard is None or heard.series != series:
            heard = self._heard[(shard, node)] = _Heard(series)
        heard.last = max(heard.last, seq)
        heard.recent.append((seq, rows))
        cached = self._shards.get(shard)
        if cached is None or cached.home != node or cached.series != series:
            return
        if cached.expected is not None and seq < cached.expected:
            return  # delivered twice
        if cached.expected != seq:  # one was lost (or the home forgot this worker): start again
            if cached.expected is not None:
                self.counters["eager_gaps"] += 1
            cached.drop()
            return
        cached.expected = seq + 1
        self.counters["eager_messages"] += 1
        kept = cached.present[rows]
        rows, values = rows[kept], values[kept]
        cached.values[rows] = values
        self.counters["eager_rows"] += int(rows.shape[0])
        own_seq = version.get(self.own_origin(), 0)
        self._add_own(cached, rows, own_seq)
        np.maximum(cached.covers, covers, out=cached.covers, where=cached.present)
        cached.own = [entry for entry in cached.own if entry[0] > own_seq]  # the home has the rest
        cached.own_bytes = sum(r.nbytes + c.nbytes for _, r, c in cached.own)

    # -------------------------------------------------------------- pushes

    def own_push(self, shard: int, rows: np.ndarray, grads: np.ndarray, seq: int) -> None:
        """This worker's push number ``seq`` to ``shard``, sent now (every one, from the first)."""
        cached = self._shard(shard)
        if self._change is None:
            cached.present[rows] = False
            cached.logged_from = seq + 1  # a row read later holds it, or is not kept
            return
        change = self._change(np.asarray(grads, dtype=np.float64))
        cached.own.append((seq, rows, change))
        cached.own_bytes += rows.nbytes + change.nbytes
        if cached.own_bytes > _OWN_LOG_BYTES:  # the home has not caught up for this long: read afresh
            cached.drop()
            cached.own, cached.own_bytes, cached.logged_from = [], 0, seq + 1
            return
        held = cached.present[rows]
        if held.any():
            np.add.at(cached.values, rows[held], change[held].astype(self.dtype))

    def _add_own(self, cached: _ShardRows, rows: np.ndarray, included: int) -> None:
        """Add to ``rows`` (just stored) this worker's pushes after number ``included``."""
        for seq, pushed, change in cached.own:
            if seq <= included:
                continue
            hit = np.isin(pushed, rows)
            if hit.any():
                np.add.at(cached.values, pushed[hit], change[hit].astype(self.dtype))

    def forget(self) -> None:
        """Values changed under the cache (a restore): drop everything."""
        self._shards.clear()
