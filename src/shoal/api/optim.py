"""Update rules applied where a row lives (server, or a co-located worker).

A push carries gradients (or, for ``Sum``, plain deltas). Duplicate keys in one
push are summed first, then the rule runs once per distinct key.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from shoal.api.errors import ConfigError


def _positive(name: str, value: float) -> float:
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be a positive finite number, got {value!r}")
    return value


def _fraction(name: str, value: float) -> float:
    value = float(value)
    if not 0.0 <= value < 1.0:
        raise ConfigError(f"{name} must lie in [0, 1), got {value!r}")
    return value


@dataclass(frozen=True)
class Sum:
    """``w += delta``: the raw additive parameter server."""


@dataclass(frozen=True)
class SGD:
    """``w -= lr * g``."""

    lr: float = 0.01

    def __post_init__(self) -> None:
        object.__setattr__(self, "lr", _positive("SGD.lr", self.lr))


@dataclass(frozen=True)
class Adagrad:
    """``h += g*g; w -= lr * g / (sqrt(h) + eps)``, with ``h`` kept per value."""

    lr: float = 0.1
    eps: float = 1e-10
    initial_accumulator: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "lr", _positive("Adagrad.lr", self.lr))
        object.__setattr__(self, "eps", _positive("Adagrad.eps", self.eps))
        acc = float(self.initial_accumulator)
        if not (math.isfinite(acc) and acc >= 0):
            raise ConfigError(f"Adagrad.initial_accumulator must be >= 0, got {acc!r}")
        object.__setattr__(self, "initial_accumulator", acc)


@dataclass(frozen=True)
class Adam:
    """Adam with per-key step counts, so rarely pushed keys get correct bias correction."""

    lr: float = 0.001
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self) -> None:
        object.__setattr__(self, "lr", _positive("Adam.lr", self.lr))
        object.__setattr__(self, "beta1", _fraction("Adam.beta1", self.beta1))
        object.__setattr__(self, "beta2", _fraction("Adam.beta2", self.beta2))
        object.__setattr__(self, "eps", _positive("Adam.eps", self.eps))


Optimizer = Sum | SGD | Adagrad | Adam

_KINDS: dict[str, type] = {"sum": Sum, "sgd": SGD, "adagrad": Adagrad, "adam": Adam}


def optimizer_kind(opt: Optimizer) -> str:
    return next(k for k, cls in _KINDS.items() if isinstance(opt, cls))


def optimizer_to_dict(opt: Optimizer) -> dict[str, Any]:
    return {"kind": optimizer_kind(opt), **asdict(opt)}


def optimizer_from_dict(data: dict[str, Any]) -> Optimizer:
    """Parse what ``optimizer_to_dict`` wrote; bad input raises ``ConfigError``."""
    if not isinstance(data, dict) or "kind" not in data:
        raise ConfigError(f"optimizer must be a dict with a 'kind', got {data!r}")
    fields = dict(data)
    cls = _KINDS.get(fields.pop("kind"))
    if cls is None:
        raise ConfigError(f"unknown optimizer kind {data['kind']!r}; expected one of {sorted(_KINDS)}")
    try:
        return cls(**fields)  # type: ignore[no-any-return]
    except TypeError as exc:
        raise ConfigError(f"bad fields for optimizer {data!r}: {exc}") from exc
