"""Consistency models a table can be read under (DESIGN.md §4).

A worker's clock ``c`` counts the iterations it has completed. Under a bound
``s``, a read at clock ``c`` sees every update that any worker made in
iterations ``0 .. c - s - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shoal.api.errors import ConfigError


@dataclass(frozen=True)
class LazyPull:
    """Hold a pull whose answer is about to change (QuanPS/FluentPS lazy pull buffer).

    A pull that is already allowed under the table's bound, from a worker ahead
    of the slowest, is held until the iteration before the reader's is fully
    aggregated, or ``max_pushes`` more pushes arrive (0: no such limit), or
    ``timeout_ms`` passes; then it is answered with fresher rows.
    """

    max_pushes: int = 0
    timeout_ms: float = 20.0

    def __post_init__(self) -> None:
        if isinstance(self.max_pushes, bool) or not isinstance(self.max_pushes, int) or self.max_pushes < 0:
            raise ConfigError(f"LazyPull.max_pushes must be an int >= 0, got {self.max_pushes!r}")
        if not isinstance(self.timeout_ms, (int, float)) or not self.timeout_ms > 0:
            raise ConfigError(f"LazyPull.timeout_ms must be > 0, got {self.timeout_ms!r}")


#: clocks and bounds travel and are kept as 64-bit ints; a bound this large is no bound at all
MAX_STALENESS = 1 << 62


def _staleness(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_STALENESS:
        raise ConfigError(f"{name}.staleness must be an int from 0 to 2**62, got {value!r}")
    return value


@dataclass(frozen=True)
class ASP:
    """Asynchronous: reads never wait; no bound on staleness (so no lazy pull buffer either)."""

    bound = None
    eager = False
    lazy: LazyPull | None = None

    def __post_init__(self) -> None:
        if self.lazy is not None:  # it held ASP reads for its whole timeout: reads that never wait
            raise ConfigError("ASP reads never wait: a lazy pull buffer (lazy=...) needs BSP, SSP or ESSP")


@dataclass(frozen=True)
class BSP:
    """Bulk synchronous: a read at clock ``c`` sees every update of iterations before ``c``."""

    bound = 0
    eager = False
    lazy: LazyPull | None = None


@dataclass(frozen=True)
class SSP:
    """Stale synchronous parallel (Ho et al., 2013) with bound ``staleness``.

    Workers cache rows; a cached row serves a read while it is fresh enough.
    """

    staleness: int = 1
    lazy: LazyPull | None = None
    eager = False

    def __post_init__(self) -> None:
        _staleness("SSP", self.staleness)

    @property
    def bound(self) -> int:
        return self.staleness


@dataclass(frozen=True)
class ESSP:
    """Eager SSP (Dai et al., 2015): same bound, but servers push changed rows to the
    workers that cache them as soon as an iteration is fully aggregated."""

    staleness: int = 1
    lazy: LazyPull | None = None
    eager = True

    def __post_init__(self) -> None:
        _staleness("ESSP", self.staleness)

    @property
    def bound(self) -> int:
        return self.staleness


Consistency = ASP | BSP | SSP | ESSP

_KINDS: dict[str, type] = {"asp": ASP, "bsp": BSP, "ssp": SSP, "essp": ESSP}


def consistency_to_dict(model: Consistency) -> dict[str, Any]:
    kind = next(k for k, cls in _KINDS.items() if type(model) is cls)
    data: dict[str, Any] = {"kind": kind}
    if isinstance(model, (SSP, ESSP)):
        data["staleness"] = model.staleness
    if model.lazy is not None:
        data["lazy"] = {"max_pushes": model.lazy.max_pushes, "timeout_ms": model.lazy.timeout_ms}
    return data


def consistency_from_dict(data: Any) -> Consistency:
    if not isinstance(data, dict) or not isinstance(data.get("kind"), str) or data["kind"] not in _KINDS:
        raise ConfigError(f"consistency must be a dict with kind in {sorted(_KINDS)}, got {data!r}")
    fields = dict(data)
    cls = _KINDS[fields.pop("kind")]
    lazy = fields.pop("lazy", None)
    try:
        if lazy is not None:
            if not isinstance(lazy, dict):
                raise ConfigError(f"lazy must be a dict, got {lazy!r}")
            fields["lazy"] = LazyPull(**lazy)
        return cls(**fields)  # type: ignore[no-any-return]
    except TypeError as exc:
        raise ConfigError(f"bad consistency {data!r}: {exc}") from exc


def is_consistency(value: Any) -> bool:
    return type(value) in _KINDS.values()


__all__ = ["ASP", "BSP", "ESSP", "SSP", "Consistency", "LazyPull", "consistency_from_dict", "consistency_to_dict"]
