"""How a table's rows start out.

Values are drawn per key from a counter-based generator (see
``shoal.storage.initialize``), so a key's initial row is the same however the
table is sharded or relocated.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from shoal.api.errors import ConfigError


def _finite(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be finite, got {value!r}")
    return value


@dataclass(frozen=True)
class Constant:
    """Every value starts at ``value``."""

    value: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "value", _finite("Constant.value", self.value))


def _count(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name} must be an int >= 0, got {value!r}")
    return value


@dataclass(frozen=True)
class Uniform:
    """Values drawn uniformly from ``[low, high)``.

    With ``columns=k`` only the first ``k`` columns are drawn and the rest
    start at zero (e.g. optimiser accumulators kept in the row itself). With
    ``keys=n`` only the rows of keys below ``n`` are drawn and the others start
    at zero (a table that keeps two kinds of rows, the drawn kind first).
    """

    low: float = -0.01
    high: float = 0.01
    columns: int = 0
    keys: int = 0

    def __post_init__(self) -> None:
        _count("Uniform.columns", self.columns)
        _count("Uniform.keys", self.keys)
        low = _finite("Uniform.low", self.low)
        high = _finite("Uniform.high", self.high)
        if not low < high:
            raise ConfigError(f"Uniform needs low < high, got low={low!r}, high={high!r}")
        object.__setattr__(self, "low", low)
        object.__setattr__(self, "high", high)


@dataclass(frozen=True)
class Normal:
    """Values drawn from a normal distribution (only the first ``columns`` columns, and only the rows of
    keys below ``keys``, where they are set: as ``Uniform``'s)."""

    mean: float = 0.0
    std: float = 0.01
    columns: int = 0
    keys: int = 0

    def __post_init__(self) -> None:
        _count("Normal.columns", self.columns)
        _count("Normal.keys", self.keys)
        mean = _finite("Normal.mean", self.mean)
        std = _finite("Normal.std", self.std)
        if std < 0:
            raise ConfigError(f"Normal.std must be >= 0, got {std!r}")
        object.__setattr__(self, "mean", mean)
        object.__setattr__(self, "std", std)


Initializer = Constant | Uniform | Normal

_KINDS: dict[str, type] = {"constant": Constant, "uniform": Uniform, "normal": Normal}


def initializer_to_dict(init: Initializer) -> dict[str, Any]:
    kind = next(k for k, cls in _KINDS.items() if isinstance(init, cls))
    return {"kind": kind, **asdict(init)}


def initializer_from_dict(data: dict[str, Any]) -> Initializer:
    """Parse what ``initializer_to_dict`` wrote; bad input raises ``ConfigError``."""
    if not isinstance(data, dict) or "kind" not in data:
        raise ConfigError(f"initializer must be a dict with a 'kind', got {data!r}")
    fields = dict(data)
    cls = _KINDS.get(fields.pop("kind"))
    if cls is None:
        raise ConfigError(f"unknown initializer kind {data['kind']!r}; expected one of {sorted(_KINDS)}")
    try:
        return cls(**fields)  # type: ignore[no-any-return]
    except TypeError as exc:
        raise ConfigError(f"bad fields for initializer {data!r}: {exc}") from exc
