"""A transport wrapper that delays, drops, duplicates and reorders what arrives.

This kernel has no ``netem``; network faults are injected here instead, on the
receiving side (in the receiver's own thread, so no socket is touched from
another thread). Every decision comes from a seeded generator, so a scenario
replays the same way.
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shoal.api.errors import ConfigError
from shoal.transport.base import Connection, Frames, Listener, Poller, Transport


@dataclass(frozen=True)
class Faults:
    """What happens to each arriving message: ``delay_s`` plus up to ``jitter_s`` (so messages
    reorder), lost with probability ``loss``, delivered twice with probability ``duplicate``."""

    delay_s: float = 0.0
    jitter_s: float = 0.0
    loss: float = 0.0
    duplicate: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("delay_s", "jitter_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"Faults.{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("loss", "duplicate"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"Faults.{name} must lie in [0, 1), got {getattr(self, name)!r}")

    @classmethod
    def parse(cls, text: str) -> Faults:
        """``delay_ms=2,jitter_ms=1,loss=0.01,duplicate=0.01,seed=3`` (the ``SHOAL_FAULTS`` format)."""
        fields: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, _, value = part.partition("=")
            try:
                fields[name.strip()] = float(value)
            except ValueError:
                raise ConfigError(f"bad fault setting {part!r} in {text!r}") from None
        unknown = set(fields) - {"delay_ms", "jitter_ms", "loss", "duplicate", "seed"}
        if unknown:
            raise ConfigError(f"unknown fault settings {sorted(unknown)} in {text!r}")
        return cls(fields.get("delay_ms", 0) / 1000, fields.get("jitter_ms", 0) / 1000, fields.get("loss", 0),
                   fields.get("duplicate", 0), int(fields.get("seed", 0)))


class _Delayed:
    """Arrivals held until they are due, in due order."""

    def __init__(self, faults: Faults, rng: random.Random) -> None:
        self.faults = faults
        self.rng = rng
        self.heap: list[tuple[float, int, Any]] = []
        self._seq = itertools.count()
        self.stats = {"delivered": 0, "lost": 0, "duplicated": 0}

    def admit(self, item: Any) -> None:
        f = self.faults
        if f.loss and self.rng.random() < f.loss:
            self.stats["lost"] += 1
            return
        copies = 2 if f.duplicate and self.rng.random() < f.duplicate else 1
        if copies == 2:
            self.stats["duplicated"] += 1
        for _ in range(copies):
            due = time.monotonic() + f.delay_s + (self.rng.random() * f.jitter_s if f.jitter_s else 0.0)
            heapq.heappush(self.heap, (due, next(self._seq), item))

    def next_due(self) -> float | None:
        return self.heap[0][0] if self.heap else None

    def pop_due(self) -> Any | None:
        if self.heap and self.heap[0][0] <= time.monotonic():
            self.stats["delivered"] += 1
            return heapq.heappop(self.heap)[2]
        return None


def _wait_for(delayed: _Delayed, receive: Any, timeout: float | None) -> Any | None:
    """Receive through the delay queue: admit arrivals, hand out what is due, within ``timeout``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        item = delayed.pop_due()
        if item is not None:
            return item
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return None
        waits = [t - now for t in (deadline, delayed.next_due()) if t is not None]
        arrived = receive(max(0.0, min(waits)) if waits else None)
        while arrived is not None:
            delayed.admit(arrived)
            arrived = receive(0)


class FaultyListener(Listener):
    def __init__(self, inner: Listener, faults: Faults, rng: random.Random) -> None:
        self.inner = inner
        self.address = inner.address
        self.delayed = _Delayed(faults, rng)

    def recv(self, timeout: float | None) -> tuple[bytes, Frames] | None:
        return _wait_for(self.delayed, self.inner.recv, timeout)  # type: ignore[no-any-return]

    def send(self, peer: bytes, frames: Sequence[Any]) -> bool:
        return self.inner.send(peer, frames)

    def close(self) -> None:
        self.inner.close()


class FaultyConnection(Connection):
    def __init__(self, inner: Connection, faults: Faults, rng: random.Random) -> None:
        self.inner = inner
        self.address = inner.address
        self.delayed = _Delayed(faults, rng)

    def send(self, frames: Sequence[Any], block: bool = True) -> bool:
        return self.inner.send(frames, block)

    def recv(self, timeout: float | None) -> Frames | None:
        return _wait_for(self.delayed, self.inner.recv, timeout)  # type: ignore[no-any-return]

    def close(self) -> None:
        self.inner.close()


class FaultyPoller(Poller):
    def __init__(self, inner: Poller) -> None:
        self.inner = inner
        self.conns: dict[int, FaultyConnection] = {}

    def register(self, conn: Connection) -> None:
        assert isinstance(conn, FaultyConnection)
        self.conns[id(conn.inner)] = conn
        self.inner.register(conn.inner)

    def unregister(self, conn: Connection) -> None:
        assert isinstance(conn, FaultyConnection)
        self.conns.pop(id(conn.inner), None)
        self.inner.unregister(conn.inner)

    def poll(self, timeout: float | None) -> list[Connection]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            now = time.monotonic()
            ready: list[Connection] = [c for c in self.conns.values()
                                       if (due := c.delayed.next_due()) is not None and due <= now]
            if ready:
                return ready
            dues = [d for c in self.conns.values() if (d := c.delayed.next_due()) is not None]
            waits = [t - now for t in ([deadline] if deadline is not None else []) + dues]
            wait = max(0.0, min(waits)) if waits else None
            for inner in self.inner.poll(wait):
                conn = self.conns.get(id(inner))
                if conn is not None:
                    while (arrived := inner.recv(0)) is not None:
                        conn.delayed.admit(arrived)
            if deadline is not None and time.monotonic() >= deadline:
                return [c for c in self.conns.values()
                        if (due := c.delayed.next_due()) is not None and due <= time.monotonic()]


class FaultyTransport(Transport):
    """Wraps ``inner``; every listener and connection it makes suffers ``faults``."""

    def __init__(self, inner: Transport, faults: Faults) -> None:
        self.inner = inner
        self.faults = faults
        self.rng = random.Random(faults.seed)

    def listen(self, address: str, max_frame_bytes: int | None = None) -> Listener:
        return FaultyListener(self.inner.listen(address, max_frame_bytes), self.faults,
                              random.Random(self.rng.random()))

    def connect(self, address: str) -> Connection:
        return FaultyConnection(self.inner.connect(address), self.faults, random.Random(self.rng.random()))

    def poller(self) -> Poller:
        return FaultyPoller(self.inner.poller())

    def close(self) -> None:
        self.inner.close()
