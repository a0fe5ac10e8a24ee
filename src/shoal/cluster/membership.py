"""Talking to the rendezvous: registering, waiting for peers, barriers.

Every wait here has a deadline, and its error names what was missing.
"""

from __future__ import annotations

import os
import time
from typing import Any

from shoal.api.errors import ClusterError, RequestTimeoutError
from shoal.api.ids import RENDEZVOUS
from shoal.cluster.requests import RequestTracker
from shoal.wire import bodies
from shoal.wire.message import Message
from shoal.wire.ops import Op
from shoal.wire.schema import BarrierNote


def call(tracker: RequestTracker, peer: int, msg: Message, timeout: float, what: str = "") -> Message:
    """One request, one reply, within ``timeout`` seconds."""
    replies: list[Message] = []
    req = tracker.request(peer, msg, replies.append, what)
    tracker.wait({req}, timeout)
    error = tracker.take_error(req)
    if error is not None:
        raise error
    return replies[0]


def _rendezvous_call(tracker: RequestTracker, msg: Message, timeout: float) -> dict[str, Any]:
    try:
        return call(tracker, RENDEZVOUS, msg, timeout, f"{msg.op.name} to the rendezvous").body
    except RequestTimeoutError as exc:
        raise ClusterError(
            f"the rendezvous at {tracker.address_of(RENDEZVOUS)} did not answer within {timeout:.1f}s "
            "(is the launcher running, and is the rendezvous address right?)"
        ) from exc


def register(
    tracker: RequestTracker, role: str, node: int, rank: int, address: str, timeout: float,
    metrics: str | None = None,
) -> dict[str, Any]:
    body = bodies.Register(role, node, rank, address, os.getpid(), metrics or None)
    return _rendezvous_call(tracker, body.to_message(), timeout)


def status(tracker: RequestTracker, timeout: float) -> dict[str, Any]:
    return _rendezvous_call(tracker, Message(Op.CLUSTER_STATUS), timeout)


def wait_for_servers(tracker: RequestTracker, num_nodes: int, timeout: float) -> list[str | None]:
    """Addresses of all servers (None for one that has left), once every one has registered."""
    deadline = time.monotonic() + timeout
    delay = 0.002  # forked at once, the servers register within milliseconds of the workers' first look
    while True:
        remaining = deadline - time.monotonic()
        st = status(tracker, max(remaining, 1.0))
        servers = st["servers"]
        if st["ready"]:
            return [str(a) if a else None for a in servers]
        if time.monotonic() >= deadline:
            present = [n for n, a in enumerate(servers) if a]
            missing = [n for n, a in enumerate(servers) if not a]
            raise ClusterError(
                f"waited {timeout:.1f}s for {num_nodes} server(s): registered node(s) {present}, "
                f"missing node(s) {missing} (did their server processes start? see their output)"
            )
        time.sleep(min(delay, max(remaining, 0)))
        delay = min(delay * 2, 0.25)


def barrier(tracker: RequestTracker, rank: int, generation: int, timeout: float,
            note: BarrierNote | None = None) -> dict[int, BarrierNote]:
    """Block until every worker reaches barrier ``generation``; returns each rank's ``note``, if it gave one."""
    body = bodies.Barrier(rank, generation, None if note is None else note.to_body())
    try:
        reply = call(tracker, RENDEZVOUS, body.to_message(), timeout, f"barrier {generation}")
        notes = reply.body.get("notes") if isinstance(reply.body, dict) else None
        return {int(r): n for r, value in (notes or {}).items() if (n := BarrierNote.from_body(value)) is not None}
    except RequestTimeoutError as exc:
        try:
            st = status(tracker, 5.0)
            arrived = st["barriers"].get(str(generation), [])
            everyone = range(int(st["num_workers"]))
            missing = [r for r in everyone if r not in arrived]
            detail = f"arrived rank(s) {arrived}, missing rank(s) {missing}, finished {st['left']}"
        except ClusterError:
            detail = "the rendezvous no longer answers"
        raise RequestTimeoutError(f"barrier {generation} not complete after {timeout:.1f}s: {detail}") from exc


def leave(tracker: RequestTracker, rank: int, timeout: float) -> None:
    call(tracker, RENDEZVOUS, bodies.Leave("worker", rank=rank).to_message(), timeout)
