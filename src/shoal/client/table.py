"""A worker's handle on one table: pull, push and push_pull, sync and async.

The table's kind picks, once, how its rows are reached (``client.access``):
``StaticAccess`` (slices at fixed servers, shared memory for this node's),
``ReplicatedAccess`` (quorums of replicas) or ``AdaptiveAccess`` (rows that move
and replicate). This class checks the caller's input and hands it on.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from typing import Any

import numpy as np

from shoal.api.config import TableSpec
from shoal.api.consistency import Consistency
from shoal.api.errors import ConfigError, ShapeError, TableError
from shoal.client.access import TableAccess
from shoal.client.adaptive import AdaptiveAccess
from shoal.client.context import WorkerContext
from shoal.client.in_place import InPlace, OpenHolds
from shoal.client.replicated import ReplicatedAccess
from shoal.client.sampling import Sampler, make_sampler
from shoal.client.static import StaticAccess
from shoal.cluster.requests import Future
from shoal.consistency.cache import RowCache
from shoal.consistency.staleness import StalenessHistogram
from shoal.placement.layout import TableLayout
from shoal.storage.shard import ShardStore
from shoal.storage.validate import as_keys, as_rows, drop_nonfinite


class Table:
    """Rows ``0..num_keys-1`` of ``dim`` values, wherever they live."""

    def __init__(self, worker: WorkerContext, spec: TableSpec, current: Mapping[str, Any]) -> None:
        """``current``: the rendezvous's answer to the table's creation (where its slices are now)."""
        self.worker = worker
        self.spec = spec
        self.dtype = np.dtype(spec.dtype)
        self.bound = spec.consistency.bound
        #: how stale each read row was: reader's clock minus the clock its row is current at
        self.staleness = StalenessHistogram()
        self.counters: Counter[str] = Counter()
        self.access = self._access_for(current)
        self._sampler: Sampler | None = None
        #: how many of this table's holds of rows in place are open (no pull, push or other hold while one is)
        self._holds = OpenHolds()

    def _access_for(self, current: Mapping[str, Any]) -> TableAccess:
        """The one place that looks at the table's kind."""
        worker, spec = self.worker, self.spec
        layout = TableLayout.initial(spec, worker.num_nodes)
        if spec.replicated:
            return ReplicatedAccess(self, layout)
        if spec.adaptive:  # one store: this node's rows, present or not
            local = worker.attach(spec) if worker.local_access else {}
            return AdaptiveAccess(self, layout, next(iter(local.values()), None))
        layout = layout.at(current["owners"], int(current["epoch"]))  # slices may have moved since it was made
        return StaticAccess(self, layout, worker.local_slices(spec, layout, {}) if worker.local_access else {})

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def num_keys(self) -> int:
        return self.spec.num_keys

    @property
    def dim(self) -> int:
        return self.spec.dim

    @property
    def layout(self) -> TableLayout:
        return self.access.layout

    @property
    def local(self) -> dict[int, ShardStore]:
        """This node's slices of a static table, mapped from shared memory."""
        return self.access.local

    @property
    def cache(self) -> RowCache | None:
        return self.access.row_cache

    def __repr__(self) -> str:
        return f"Table({self.name!r}, num_keys={self.num_keys}, dim={self.dim}, dtype={self.spec.dtype})"

    # ------------------------------------------------------------ public API

    def pull(self, keys: Any, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``keys`` in the caller's order, as a ``(len(keys), dim)`` array."""
        return self.pull_async(keys, out).wait()

    def push(self, keys: Any, values: Any) -> None:
        """Apply the table's update rule with ``values`` (gradients or deltas) at ``keys``."""
        self.push_async(keys, values).wait()

    def push_pull(self, keys: Any, values: Any, out: np.ndarray | None = None) -> np.ndarray:
        """Push, then return the updated rows of the same keys, in one round trip."""
        return self.push_pull_async(keys, values, out).wait()

    def pull_async(self, keys: Any, out: np.ndarray | None = None) -> Future[np.ndarray]:
        self._check_not_held()
        keys = as_keys(keys, self.spec)
        return self.access.pull(keys, self._checked_out(keys.shape[0], out))

    def push_async(self, keys: Any, values: Any) -> Future[None]:
        """Start a push. ``values`` must not be modified until the future is done."""
        self._check_not_held()
        keys = as_keys(keys, self.spec)
        values = as_rows(values, keys.shape[0], self.spec)
        keys, values, _ = drop_nonfinite(keys, values, self.spec)  # the policy applies before any row lands
        return self.access.push(keys, values)

    def push_pull_async(self, keys: Any, values: Any, out: np.ndarray | None = None) -> Future[np.ndarray]:
        self._check_not_held()
        keys = as_keys(keys, self.spec)
        values = as_rows(values, keys.shape[0], self.spec)
        out = self._checked_out(keys.shape[0], out)
        finite_keys, finite_values, skipped = drop_nonfinite(keys, values, self.spec)
        if skipped:  # rare: the push shrinks but every key still wants its row back
            self.access.push(finite_keys, finite_values).wait()
            return self.access.pull(keys, out)
        return self.access.push_pull(keys, values, out)

    # ------------------------------------------------------------ consistency

    def set_consistency(self, model: Consistency, slices: Any = None) -> None:
        """Read ``slices`` (slice numbers; all: None) under ``model`` (BSP, SSP or ESSP) from now on.

        A static table read under a bounded model can hold its slices to different
        models, and change them during training: hot slices under a tight bound,
        cold ones under a loose one. The model is this worker's promise to itself:
        its reads of those slices, from its cache, this node's shared memory or a
        server, are held to it from this call on; call it on every worker at the
        same point of training for the whole job to read a slice alike. Requests
        in flight finish first.
        """
        self.access.set_consistency(model, slices)

    def consistency_of(self, slice_number: int) -> Consistency:
        """The model this worker reads slice ``slice_number`` under."""
        if isinstance(slice_number, bool) or not isinstance(slice_number, (int, np.integer)) or \
                not 0 <= slice_number < self.layout.num_shards:
            raise ConfigError(f"slices of table {self.name!r} are 0..{self.layout.num_shards - 1}, "
                              f"got {slice_number!r}")
        chosen = self.access.consistency_of(int(slice_number))
        return self.spec.consistency if chosen is None else chosen

    # ------------------------------------------------------------- replication

    def set_gossip_ms(self, gossip_ms: float) -> None:
        """Gossip between a replicated table's replicas every ``gossip_ms`` (jittered) from now on:
        staler replicas for less traffic, or the reverse. Waits for every live replica server."""
        self.access.set_gossip_ms(gossip_ms)

    # ----------------------------------------------------- adaptive placement

    def localize(self, keys: Any) -> None:
        """Ask for ``keys`` to move to this worker's node (adaptive tables; asynchronous)."""
        self.access.localize(as_keys(keys, self.spec))

    def intent(self, keys: Any, start: int, end: int | None = None) -> None:
        """Declare that ``keys`` will be used in clocks ``[start, end)`` (default: just clock ``start``).

        The node's server acts on it ahead of time (relocate or replicate); it
        never blocks the caller. Static tables ignore intents.
        """
        first = _clock(start, "start")
        self.access.intent(as_keys(keys, self.spec), first, first + 1 if end is None else _clock(end, "end"))

    def wait_local(self, keys: Any, timeout: float = 30.0) -> int:
        """Wait until ``keys`` are on this worker's node (owned or replicated here), as the intents
        declared for them bring them; returns how many are still elsewhere when ``timeout`` seconds
        pass (0: every one is here). For a start where every row a worker declared is local from
        its first batch on, instead of its first batches asking other nodes while rows move. Keys
        no intent brings here (a technique that cannot, another node's intent) are not waited for
        any better than ``timeout``. Adaptive tables only.
        """
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < math.inf:
            raise ConfigError(f"timeout must be a finite number of seconds >= 0, got {timeout!r}")
        return self.access.wait_local(as_keys(keys, self.spec), float(timeout))

    def in_place(self, keys: Any) -> InPlace:
        """This node's rows of ``keys``, for a compiled kernel to read and update where they lie.

        ``with table.in_place(keys) as rows:`` gives ``rows.values`` (the node's
        rows, zero-copy) and ``rows.slots`` (each key's row in it, -1 for keys
        on other nodes, whose positions are ``rows.absent``: pull and push those
        after the block). During the block none of the rows moves away or
        changes under the kernel, and what it writes to a replica reaches the
        key's owner. An adaptive table's rows are held without a lock: the
        node's server goes on serving, and what others write to them meanwhile
        goes in after the block. A static slice's rows are locked: keep the
        block to one small batch (the node's server waits for them). Writes in
        place bypass the update rule and the NaN/Inf policy. The rows of an
        adaptive table present here (owned or replicated, and not held by
        another block), or of a static table's slice on this node (one slice
        per node, ``locking="exact"``; a stateful rule's per-row state is in
        ``rows.state``, for the kernel to update too).
        """
        self._check_not_held()
        hold = self.access.in_place(as_keys(keys, self.spec))
        hold.table_holds = self._holds  # two made before either is entered must not both be open
        return hold

    # ------------------------------------------------------------- sampling

    def register_sampling(self, weights: Any = None, scheme: str = "naive", reuse: int = 4,
                          pool_size: int = 4096, seed: int | None = None) -> None:
        """Register the distribution samples come from (uniform if ``weights`` is None) and the scheme:
        ``naive``, ``preloc`` (keys brought here by intent before the clock they are prepared for),
        ``pool`` (each pooled key reused ``reuse`` times) or ``local`` (keys present here)."""
        self._sampler = make_sampler(self, weights, scheme, reuse, pool_size,
                                     self.worker.rank if seed is None else seed)

    def prepare_sample(self, n: int, clock: int | None = None) -> int:
        """Draw ``n`` keys for use at ``clock`` (default: now); returns a handle for ``pull_sample``."""
        if self._sampler is None:
            raise TableError(f"register_sampling() on table {self.name!r} first")
        return self._sampler.prepare(_count(n), None if clock is None else _clock(clock, "clock"))

    def sample_keys(self, n: int) -> np.ndarray:
        """Draw ``n`` keys under the table's scheme (``preloc`` draws as ``naive``) without their rows,
        for a caller that pulls them together with other keys (one gather, one request per server)."""
        if self._sampler is None:
            raise TableError(f"register_sampling() on table {self.name!r} first")
        return self._sampler.draw(_count(n))

    def pull_sample(self, handle: int) -> tuple[np.ndarray, np.ndarray]:
        """The keys of a prepared sample and their rows."""
        if self._sampler is None:
            raise TableError(f"register_sampling() on table {self.name!r} first")
        return self._sampler.pull(handle)

    # ------------------------------------------------------------- internals

    def _check_not_held(self) -> None:
        # The block holds the rows' locks, which a pull or push of this table would wait for forever.
        if self._holds.count:
            raise TableError(f"rows of {self.name!r} are held in place: end the with block before a pull, push "
                             "or another hold of that table")

    def _checked_out(self, n: int, out: np.ndarray | None) -> np.ndarray | None:
        if out is not None and (not isinstance(out, np.ndarray) or out.shape != (n, self.dim)
                                or out.dtype != self.dtype or not out.flags.c_contiguous or not out.flags.writeable):
            got = f"{out.shape} {out.dtype}" if isinstance(out, np.ndarray) else type(out).__name__
            raise ShapeError(f"out must be a writable C-contiguous ({n}, {self.dim}) {self.dtype} array, got {got}")
        return out

    def forget_cached(self) -> None:
        """Drop cached remote rows (their values changed under us: a restore)."""
        self.access.forget_cached()

    def refresh_layout(self) -> None:
        """Fetch a static table's slice owners from the rendezvous; map the slices now on this node."""
        self.access.refresh_layout()

    def close(self) -> None:
        self.access.close()



#: clocks travel as int64 (an intent's start and end among them): one past it was refused on arrival,
#: and with it every table's intents of that clock, sent together
_CLOCK_END = 1 << 62


def _clock(value: Any, what: str) -> int:
    """A clock given by the caller, as an int, or ``ConfigError``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < _CLOCK_END:
        raise ConfigError(f"{what} must be a clock (an int from 0 to 2**62), got {value!r}")
    return int(value)


def _count(value: Any) -> int:
    """A number of samples given by the caller, as an int, or ``ConfigError``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ConfigError(f"a sample's size must be an int >= 0, got {value!r}")
    return int(value)
