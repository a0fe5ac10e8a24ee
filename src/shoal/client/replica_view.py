"""Which servers a worker believes alive, and following those that were started again."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from shoal.api.config import ClusterSpec
from shoal.api.errors import ShoalError
from shoal.api.ids import RENDEZVOUS
from shoal.cluster import membership
from shoal.cluster.requests import RequestTracker
from shoal.wire.message import Message
from shoal.wire.ops import Op

DOWN_FOR_S = 3.0  # how long a replica that failed to answer is left alone
WATCH_AFTER_S = 0.5  # a wait longer than this asks whether the servers it waits for are still there
_STATUS_EVERY_S = 1.0


class Servers(Protocol):
    """What the view uses of its worker."""

    cluster: ClusterSpec
    tracker: RequestTracker
    servers: list[str | None]
    now: Callable[[], float]

    @property
    def num_nodes(self) -> int: ...

    def follow_servers(self, addresses: list[str | None]) -> None: ...


class ReplicaView:
    """Which servers a worker believes alive: the rendezvous' heartbeats, and its own timeouts.

    ``exited`` are those whose process is known to have ended (its launcher saw it): a server that
    merely went silent (stopped, or starved of CPU) is routed around but may still answer.
    """

    def __init__(self, worker: Servers) -> None:
        self.worker = worker
        self.alive = [True] * worker.num_nodes
        self.exited: set[int] = set()
        #: servers that left and stopped reading, with the last request of each worker they handled
        self.gone: dict[int, list[list[int]]] = {}
        self.down_until: dict[int, float] = {}
        self.checked_at = -1e9
        self._asking = False  # a status asked for in the background, not answered yet

    def refresh(self, force: bool = False) -> None:
        now = self.worker.now()
        if not force and now - self.checked_at < _STATUS_EVERY_S:
            return
        self.checked_at = now
        try:
            status = membership.status(self.worker.tracker, self.worker.cluster.timeouts.replica_s)
        except ShoalError:
            return  # the rendezvous is slow or gone: keep what we know
        self._take(status)

    def refresh_in_background(self) -> None:
        """``refresh`` without waiting: the status is asked for (at most once a period, one at a time)
        and taken whenever its answer comes in."""
        now = self.worker.now()
        if self._asking or now - self.checked_at < _STATUS_EVERY_S:
            return
        self.checked_at = now
        self._asking = True

        def over() -> None:
            self._asking = False

        def failed(exc: ShoalError) -> None:
            """The rendezvous is slow or gone: keep what we know."""

        self.worker.tracker.request(RENDEZVOUS, Message(Op.CLUSTER_STATUS), lambda reply: self._take(reply.body),
                                    "CLUSTER_STATUS", background=True, on_error=failed, on_end=over)

    def _take(self, status: dict[str, Any]) -> None:
        self.alive = [bool(a) for a in status.get("alive", self.alive)]
        self.exited = {int(n) for n in status.get("exited", ())}
        self.gone = {int(n): handled for n, handled in (status.get("gone") or {}).items()}
        addresses: list[str | None] = list(status.get("servers") or [])
        known = self.worker.servers
        for n, address in enumerate(addresses):
            if address and (n >= len(known) or known[n] != address):  # restarted, or joined since
                self.down_until.pop(n, None)
        if addresses:
            self.worker.follow_servers(addresses)

    def handled_by(self, node: int, rank: int, incarnation: int) -> int | None:
        """The last request of worker ``rank`` (this ``incarnation`` of it) that server ``node``
        handled before it left; None while it has not said goodbye."""
        handled = self.gone.get(node)
        if handled is None:
            return None
        return next((seq for r, inc, seq in handled if r == rank and inc == incarnation), 0)

    def live(self, nodes: list[int]) -> list[int]:
        now = self.worker.now()
        return [n for n in nodes if self.alive[n] and self.down_until.get(n, 0.0) <= now]

    def reachable(self, nodes: list[int]) -> list[int]:
        """``live`` ones, else those the rendezvous' heartbeats call alive: a replica that was slow to
        answer (an overloaded machine) is tried again before anything is given up for lost."""
        return self.live(nodes) or [n for n in nodes if self.alive[n]]

    def mark_down(self, node: int) -> None:
        self.down_until[node] = self.worker.now() + DOWN_FOR_S
        address = self.worker.servers[node]
        if address is not None:  # a fresh socket drops the requests queued for it
            self.worker.tracker.disconnect(node)
            self.worker.tracker.connect(node, address)
