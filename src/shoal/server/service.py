"""What the request loop and the checkpoint service ask of each kind of table: ``TableService``.

A server serves three kinds of table, each through one service holding all its
tables of that kind: ``StaticService`` (slices at this server until moved),
``ReplicationService`` (replicas of shards, kept in sync by gossip) and
``AdaptiveService`` (keys that relocate and replicate). ``ParameterServer`` keeps
one registry from table name to the service that serves it; it and the
checkpoint service know nothing else of the kinds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from shoal.api.config import TableSpec
from shoal.wire.message import Message


class TableService(Protocol):
    """One kind of table on one server."""

    #: whether this server's rows of such a table survive its restart (replicas regain theirs by gossip)
    keeps_rows_across_restart: bool
    #: whether a server that joins a running cluster holds such tables (static ones: the slices moved to it)
    served_by_joined_servers: bool

    def build(self, spec: TableSpec, current: dict[str, Any] | None = None) -> Any:
        """Allocate and initialise this server's part of the table (``current``: its layout now, if slices
        moved since it was made). Touches nothing the request loop reads: it may run on another thread."""
        ...

    def install(self, spec: TableSpec, built: Any) -> None:
        """Start serving a table ``build`` made (on the request loop's thread)."""
        ...

    def bytes_here(self, spec: TableSpec) -> int:
        """The memory a new table of this kind takes on this server (checked against its budget first)."""
        ...

    def spec(self, name: str) -> TableSpec: ...

    def shards(self, name: str) -> list[int]:
        """The shards of the table this server holds."""
        ...

    def handle(self, peer: bytes, msg: Message) -> Message | None:
        """Serve a request on one of this service's tables; None: no reply now."""
        ...

    def share(self, name: str, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """Descriptors of the table's shared memory here, for a co-located worker."""
        ...

    def settle(self, name: str) -> tuple[list[str], list[list[Any]] | None]:
        """Before a checkpoint: start what makes this server's rows final; what still keeps them from
        being final, and (replicated tables) the version vector of each shard."""
        ...

    def write(self, name: str, staging: Path, index: int) -> list[dict[str, Any]]:
        """Write this server's rows of the table into a checkpoint; the parts' manifest entries."""
        ...

    def restore(self, name: str, path: Path, entry: dict[str, Any], write: bool) -> int:
        """Load (``write`` False: only check) the rows this server holds from the checkpoint's parts."""
        ...
