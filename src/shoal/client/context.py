"""What the parts of a worker see of the worker and of a table: ``WorkerContext``, ``TableView``.

A table's access, its cache and fences, checkpoints, sampling and metrics need
some of the worker's state (its clock, request tracker, streams, what is local)
and a few of its services (a table's layout, whether a server is alive). They
reach them through these protocols, which ``Worker`` and ``Table`` satisfy, so
they import nothing above themselves: ``worker`` imports ``table``, ``table``
imports the accesses, and no import goes back up.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from shoal.api.config import ClusterSpec, TableSpec
from shoal.client.access import TableAccess
from shoal.client.lane import WorkerLane
from shoal.client.replica_view import ReplicaView
from shoal.client.streams import Streams
from shoal.cluster.requests import Future, RequestTracker
from shoal.consistency.staleness import StalenessHistogram
from shoal.placement.layout import TableLayout
from shoal.storage.shard import ShardStore
from shoal.wire.message import Message
from shoal.wire.schema import BarrierNote


class WorkerContext(Protocol):
    """A worker, as its parts use it."""

    rank: int
    node: int
    clock: int
    cluster: ClusterSpec
    tracker: RequestTracker
    streams: Streams
    replica_view: ReplicaView
    local_access: bool
    #: the local server's clock table in shared memory (None: no local server)
    local_clocks: np.ndarray | None
    servers: list[str | None]
    #: the clock of the worker's timers (``Worker.now``)
    now: Callable[[], float]
    #: a table has intents its next clock sends the node's server (``Worker.send_intents``)
    intents_declared: bool

    @property
    def num_nodes(self) -> int: ...

    @property
    def num_workers(self) -> int: ...

    @property
    def tables(self) -> Mapping[str, TableView]: ...

    def check_local_server(self, what: str) -> None: ...

    def server_alive(self, node: int) -> bool: ...

    def lane(self, node: int) -> WorkerLane | None: ...

    def lane_failed(self, node: int, failed: WorkerLane) -> None: ...

    def follow_departures(self) -> None: ...

    def follow_servers(self, addresses: list[str | None]) -> None: ...

    def live_servers(self) -> list[int]: ...

    def send_ordered(self, server: int, msg: Message, what: str, on_reply: Callable[[Message], None] | None = None,
                     background: bool = False) -> int: ...

    def settled_clock(self) -> int: ...

    def wait_all(self) -> None: ...

    def send_intents(self) -> None: ...

    def fetch_layout(self, table: str) -> dict[str, Any]: ...

    def attach(self, spec: TableSpec, shards: list[int] | None = None) -> dict[int, ShardStore]: ...

    def local_slices(self, spec: TableSpec, layout: TableLayout, mapped: dict[int, ShardStore]
                     ) -> dict[int, ShardStore]: ...

    def follow_restarted(self, node: int, address: str) -> None: ...

    def barrier(self, note: BarrierNote | None = None) -> dict[int, BarrierNote]: ...

    def resume_clock(self, clock: int) -> None: ...


class TableView(Protocol):
    """A table, as its access, sampler, checkpoints and metrics use it."""

    spec: TableSpec
    dtype: np.dtype
    counters: Counter[str]
    staleness: StalenessHistogram

    @property
    def worker(self) -> WorkerContext: ...

    @property
    def access(self) -> TableAccess: ...

    @property
    def name(self) -> str: ...

    @property
    def num_keys(self) -> int: ...

    @property
    def dim(self) -> int: ...

    @property
    def layout(self) -> TableLayout: ...

    @property
    def local(self) -> dict[int, ShardStore]: ...

    def pull(self, keys: Any, out: np.ndarray | None = None) -> np.ndarray: ...

    def pull_async(self, keys: Any, out: np.ndarray | None = None) -> Future[np.ndarray]: ...

    def push_async(self, keys: Any, values: Any) -> Future[None]: ...

    def intent(self, keys: Any, start: int, end: int | None = None) -> None: ...
