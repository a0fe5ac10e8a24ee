"""How a table is replicated (DESIGN.md §5)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from shoal.api.errors import ConfigError


@dataclass(frozen=True)
class Dynamic:
    """Choose the read quorum per shard from the probabilistic consistency model.

    Every few seconds, the smallest ``R`` whose predicted probability of
    missing at most ``k`` acknowledged pushes is at least ``p`` and whose p99
    read latency fits ``latency_ms``; if none fits, the smallest ``R`` that meets
    ``p`` (``prefer="consistency"``) or that meets the latency (``prefer="latency"``).
    """

    p: float = 0.95
    k: int = 0
    latency_ms: float = 50.0
    prefer: str = "consistency"

    def __post_init__(self) -> None:
        if not (isinstance(self.p, (int, float)) and 0.0 < self.p <= 1.0):
            raise ConfigError(f"Dynamic.p must lie in (0, 1], got {self.p!r}")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 0:
            raise ConfigError(f"Dynamic.k must be an int >= 0, got {self.k!r}")
        if not (isinstance(self.latency_ms, (int, float)) and math.isfinite(self.latency_ms) and self.latency_ms > 0):
            raise ConfigError(f"Dynamic.latency_ms must be > 0, got {self.latency_ms!r}")
        if self.prefer not in ("consistency", "latency"):
            raise ConfigError(f"Dynamic.prefer must be 'consistency' or 'latency', got {self.prefer!r}")


ReadQuorum = int | Dynamic


def read_quorum_to_wire(q: ReadQuorum) -> Any:
    if isinstance(q, Dynamic):
        return {"p": q.p, "k": q.k, "latency_ms": q.latency_ms, "prefer": q.prefer}
    return q


def read_quorum_from_wire(data: Any) -> ReadQuorum:
    if isinstance(data, dict):
        try:
            return Dynamic(**data)
        except TypeError as exc:
            raise ConfigError(f"bad dynamic read quorum {data!r}: {exc}") from exc
    if isinstance(data, bool) or not isinstance(data, int):
        raise ConfigError(f"read_quorum must be an int or shoal.Dynamic(...), got {data!r}")
    return data
