"""How a worker answers a server's fence on one static table.

A server that took over a slice, or refused a push of ours because its slice
moved, counts this worker's clock only up to the worker's settled clock until
the worker confirms two things: that it routes by the move, and that every push
it started before has landed (where the slice is now). Later clocks then cover
those pushes, so a bounded read at the new owner never misses them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from shoal.api.errors import ShoalError
from shoal.client.context import WorkerContext
from shoal.wire import bodies
from shoal.wire.message import Message

log = logging.getLogger(__name__)


@dataclass
class Fence:
    """A server's wait for this worker's confirmation."""

    epoch: int
    shard: int  # the move that brought the server's layout to ``epoch``: this slice ...
    owner: int  # ... to this server (-1, -1: the rendezvous knows it)
    upto: int | None = None  # the pushes to land first: those started up to this one


class Fenced(Protocol):
    """The table access whose fences these are (``StaticAccess``)."""

    name: str
    worker: WorkerContext
    #: pushes started so far: each push call's index
    pushes_started: int

    def learn_move(self, shard: int, node: int, epoch: int) -> bool: ...

    def pushes_open(self, upto: int) -> bool: ...


class Fences:
    """The fences servers put up for one table, by server, and their answers."""

    def __init__(self, access: Fenced) -> None:
        self.access = access
        self.waiting: dict[int, Fence] = {}

    def on_fence(self, server: int, msg: Message) -> None:
        known = self.waiting.get(server)
        fence = bodies.Fence.of(msg)
        if known is None or fence.epoch > known.epoch:
            self.waiting[server] = Fence(fence.epoch, fence.shard, fence.owner)

    def answer(self) -> None:
        """Confirm every fence whose pushes have landed (the layout is learnt first, once)."""
        access, worker = self.access, self.access.worker
        for server, fence in list(self.waiting.items()):
            if fence.upto is None:
                try:
                    if not access.learn_move(fence.shard, fence.owner, fence.epoch):
                        continue  # the rendezvous does not know the moves before it yet: again shortly
                except ShoalError as exc:
                    log.warning("worker %d: cannot refresh the layout of %r: %s", worker.rank, access.name, exc)
                    continue
                fence.upto = access.pushes_started  # pushes started from now on route by the move
            if self.waiting.get(server) is not fence:
                continue  # a newer fence came while the layout was fetched: it is answered on its own
            if access.pushes_open(fence.upto) or not worker.server_alive(server):
                continue
            del self.waiting[server]
            worker.send_ordered(server, bodies.Confirm(worker.rank, fence.epoch).to_message(table=access.name,
                                                                                            clock=worker.clock),
                                f"CONFIRM {access.name!r} at epoch {fence.epoch} to server {server}", background=True)
