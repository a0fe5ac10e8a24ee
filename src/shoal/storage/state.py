"""The per-row state an optimiser keeps next to a table's values: what a row weighs, without the
kernels that update it (the rendezvous sizes slices with this, and never loads numba)."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.api.optim import Adagrad, Adam, Optimizer


@dataclass(frozen=True)
class StateArray:
    """A per-row array a rule keeps; ``per_value`` arrays have the row's width."""

    name: str
    per_value: bool
    dtype: str
    fill: float


def state_of(opt: Optimizer) -> tuple[StateArray, ...]:
    if isinstance(opt, Adagrad):
        return (StateArray("accum", True, "", opt.initial_accumulator),)
    if isinstance(opt, Adam):
        return (StateArray("first", True, "", 0.0), StateArray("second", True, "", 0.0),
                StateArray("steps", False, "float64", 0.0))
    return ()
