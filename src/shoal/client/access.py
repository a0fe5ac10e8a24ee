"""What differs between the kinds of table on a worker: how a call reaches the rows.

``Table`` checks the caller's input and hands every call to its access, chosen
once when the table is made: ``StaticAccess`` (slices at one server each until
moved, this node's in shared memory), ``ReplicatedAccess`` (quorums of
replicas) or ``AdaptiveAccess`` (rows that move and replicate). Every call
returns a ``Future`` whose ``done()`` tells whether requests are still in flight.
The hooks below do nothing for a kind that has no use for them; the worker calls
them for every table alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from shoal.api.consistency import Consistency
from shoal.api.errors import ConfigError, ShoalError, TableError
from shoal.client.in_place import InPlace
from shoal.cluster.requests import Future
from shoal.consistency.cache import RowCache
from shoal.placement.layout import TableLayout
from shoal.storage.shard import ShardStore
from shoal.wire.message import Message


class TableAccess:
    """Pull, push and push_pull of checked keys and values, and the worker's hooks."""

    def __init__(self, name: str, layout: TableLayout, local: dict[int, ShardStore] | None = None) -> None:
        self.name = name
        #: which server holds each slice (static tables: changes when slices move)
        self.layout = layout
        #: slices mapped from this node's shared memory, by shard
        self.local: dict[int, ShardStore] = local or {}

    def pull(self, keys: np.ndarray, out: np.ndarray | None) -> Future[np.ndarray]:
        """Rows of ``keys`` (int64, in range) in their order, into ``out`` if given."""
        raise NotImplementedError

    def push(self, keys: np.ndarray, values: np.ndarray) -> Future[None]:
        """Apply the update rule with ``values`` (finite, the table's dtype) at ``keys``."""
        raise NotImplementedError

    def push_pull(self, keys: np.ndarray, values: np.ndarray, out: np.ndarray | None) -> Future[np.ndarray]:
        """Push, then the updated rows of the same keys (one round trip where a kind can)."""
        self.push(keys, values).wait()
        return self.pull(keys, out)

    def take_unobserved_error(self) -> ShoalError | None:
        """The error of a call that failed since the last look with nobody asking its future (a push
        sent with ``push_async`` and left): ``Worker.wait_all`` raises it, so that it does not vanish."""
        return None

    # ------------------------------------------------ what a kind may hold

    @property
    def row_cache(self) -> RowCache | None:
        """The process cache of remote rows, if this kind keeps one."""
        return None

    @property
    def presence(self) -> np.ndarray | None:
        """Which keys are on this node now (kinds whose rows move), else None."""
        return None

    @property
    def relocates(self) -> bool:
        """Whether keys can be brought to this node (``localize``, intents)."""
        return False

    def set_consistency(self, model: Consistency, slices: list[int] | None) -> None:
        """Read ``slices`` (all: None) under ``model`` from now on."""
        raise ConfigError(f"table {self.name!r} has one model for all its rows: only static tables read "
                          "under BSP, SSP or ESSP choose one per slice")

    def set_gossip_ms(self, gossip_ms: float) -> None:
        """Gossip between this table's replicas every ``gossip_ms`` from now on."""
        raise ConfigError(f"table {self.name!r} is not replicated: it has no gossip to time")

    def consistency_of(self, shard: int) -> Consistency | None:
        """The model slice ``shard`` is read under, if this kind chooses one per slice."""
        return None

    def oldest_open_push(self) -> int | None:
        """The clock of the oldest push not yet acknowledged, if the bound depends on it."""
        return None

    # --------------------------------------------------------- checkpoints

    @property
    def survives_a_server(self) -> bool:
        """Whether every row outlives the death of one server (live replicas hold them)."""
        return False

    @property
    def settles(self) -> bool:
        """Whether servers must settle changes still on their way between nodes before a checkpoint."""
        return False

    def rows_held(self, servers: list[int]) -> int:
        """How many rows ``servers`` hold of the table, all together (a restore loads every one); raises
        ``CheckpointError`` if some key's rows are on none of them."""
        return self.layout.spec.num_keys

    def check_checkpoint(self, parts: list[dict[str, Any]], staging: Path) -> None:
        """Raise ``CheckpointError`` unless the servers' ``parts`` (written under ``staging``) hold
        each row of the table once."""
        raise NotImplementedError

    # --------------------------------------------------------------- hooks

    def localize(self, keys: np.ndarray) -> None:
        raise TableError(f"table {self.name!r} is not adaptive; create it with techniques='relocation' or 'auto'")

    def wait_local(self, keys: np.ndarray, timeout: float) -> int:
        raise TableError(f"table {self.name!r} is not adaptive: its keys do not move to where they are used")

    def in_place(self, keys: np.ndarray) -> InPlace:
        """The rows of ``keys`` on this node, to be held in place by a ``with`` block (``client.in_place``)."""
        raise TableError(f"rows of table {self.name!r} are read and written through quorums of replicas: they "
                         "cannot be held in place")

    def intent(self, keys: np.ndarray, start: int, end: int) -> None:
        """Keys to be used in clocks ``[start, end)``: kinds that do not move keys ignore it."""

    def take_intents(self) -> list[tuple[np.ndarray, int, int]]:
        """The intents (keys, start and end clocks) declared since the worker's last clock, for its
        node's server, which acts on them by clock; kinds that do not move keys have none."""
        return []

    def pushes_numbered(self) -> list[int] | None:
        """What a clock tick tells servers of this table: per shard, the pushes numbered so far, where
        bounded reads need it (replicated tables), else None."""
        return None

    def on_server_message(self, server: int, msg: Message) -> bool:
        """A message a server sent unasked (eager rows, a fence); False if this kind expects none."""
        return False

    def after_receive(self) -> None:
        """Work replies could not do in place (parts to send again), run after each receive."""

    def forget_cached(self) -> None:
        """Drop cached rows (their values changed under us: a restore)."""

    def refresh_layout(self) -> None:
        """Ask the rendezvous where the slices are now."""

    def lose_local(self) -> None:
        """This node's server died: reach every row through messages from now on."""

    def close(self) -> None:
        """Unmap what this access mapped."""
