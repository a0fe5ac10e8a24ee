"""Writing this server's rows into a checkpoint, and loading the rows it holds from one.

The worker that coordinates a checkpoint stops every worker at a barrier first,
so what a server writes is a snapshot at a clock boundary. Each table's service
(``server.service``) writes the rows it holds (values and optimiser state, by
global key) and, on restore, loads from every part of a table the rows it holds
under its own layout, whatever the number of servers that wrote them:

* static tables: the slices here;
* adaptive tables are settled first (``SETTLE``: replicas' changes reach their
  owners); each server writes the keys it owns and loads its home keys, and the
  coordinator checks that every key was written exactly once;
* replicated tables are settled by gossip with every peer replica until the
  replicas of each shard hold the same version vector; every replica writes its
  rows with its own optimiser state, and on restore loads its keys, its own
  node's optimiser state where that node wrote one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shoal.api.errors import CheckpointError, TableError
from shoal.server.service import TableService
from shoal.storage import checkpoint
from shoal.wire import bodies
from shoal.wire.message import Message
from shoal.wire.ops import Op


class CheckpointService:
    def __init__(self, node: int, services: dict[str, TableService], lost: dict[str, str]) -> None:
        self.node = node
        #: the service of each table, by name (the server's registry)
        self.services = services
        #: tables whose rows here were lost; a restore brings them back
        self.lost = lost

    def _service(self, name: str) -> TableService:
        service = self.services.get(name)
        if service is None:
            raise TableError(f"server {self.node} has no table {name!r} to checkpoint")
        return service

    def settle(self, msg: Message) -> Message:
        """Start what makes the named tables' rows here final (replica changes sent to owners, gossip);
        reply with what is still unsettled and the replicated tables' version vectors per shard."""
        unsettled: dict[str, list[str]] = {}
        versions: dict[str, list[list[Any]]] = {}
        for name in map(str, bodies.Settle.of(msg).tables):
            unsettled[name], version = self._service(name).settle(name)
            if version is not None:
                versions[name] = version
        return msg.reply(Op.OK, {"unsettled": unsettled, "versions": versions})

    def write(self, msg: Message) -> Message:
        """Write the rows this server holds of the named tables; reply with the parts' entries."""
        asked = bodies.Checkpoint.of(msg)
        staging = checkpoint.check_staging(asked.staging)
        parts: dict[str, list[dict[str, Any]]] = {}
        for index, name in enumerate(map(str, asked.tables)):
            if name in self.lost:
                raise CheckpointError(self.lost[name])
            parts[name] = self._service(name).write(name, staging, index)
        return msg.reply(Op.OK, {"parts": parts})

    def restore(self, msg: Message) -> Message:
        """Load the rows this server holds of every table the checkpoint and this server share.

        A restore runs twice: first with ``commit`` false, which reads and checks every part (size,
        SHA-256, keys, arrays fitting the table) and counts the rows it would load, writing nothing;
        the coordinator sends ``commit`` true only once every server has checked, so a damaged
        checkpoint loads nothing anywhere.
        """
        asked = bodies.Restore.of(msg)
        path, write = Path(asked.path), asked.commit
        manifest = checkpoint.read_manifest(path)
        loaded: dict[str, int] = {}
        for name, entry in manifest["tables"].items():
            service = self.services.get(name)
            if service is None:
                continue
            checkpoint.check_saved_spec(name, entry, service.spec(name))
            loaded[name] = service.restore(name, path, entry, write)
        if write:
            for name in loaded:
                self.lost.pop(name, None)
        return msg.reply(Op.OK, {"rows": loaded})
