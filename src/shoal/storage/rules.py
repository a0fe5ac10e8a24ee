"""Update rules: what a push does to the rows it names.

Each rule declares the per-row state it keeps next to the values (so the state
lives in the same shared-memory segment and moves with the row) and applies a
batch of distinct rows through a compiled kernel.
"""

from __future__ import annotations

import numpy as np

from shoal.api.optim import SGD, Adagrad, Adam, Optimizer, Sum
from shoal.storage import kernels
from shoal.storage.state import StateArray, state_of


class UpdateRule:
    """Base: apply ``grads`` to ``values`` at ``rows``."""

    state: tuple[StateArray, ...] = ()
    #: whether duplicate rows may go straight to the kernel (it accumulates them)
    accepts_duplicates = False
    #: for additive rules, the factor a push is scaled by (``w += scale * g``); None otherwise
    scale: float | None = None

    def apply(
        self, values: np.ndarray, state: dict[str, np.ndarray], rows: np.ndarray, grads: np.ndarray
    ) -> None:
        raise NotImplementedError

    def prepare(self, rows: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Sum duplicate rows, unless the rule's kernel already accumulates them."""
        if self.accepts_duplicates or kernels.is_strictly_increasing(rows):
            return rows, grads
        return kernels.sum_duplicates(rows, grads)


class SumRule(UpdateRule):
    accepts_duplicates = True
    scale = 1.0

    def apply(self, values, state, rows, grads):  # type: ignore[no-untyped-def]
        kernels.add_rows(values, rows, grads, 1.0)


class SGDRule(UpdateRule):
    accepts_duplicates = True

    def __init__(self, opt: SGD) -> None:
        self.lr = opt.lr
        self.scale = -opt.lr

    def apply(self, values, state, rows, grads):  # type: ignore[no-untyped-def]
        kernels.add_rows(values, rows, grads, -self.lr)


class AdagradRule(UpdateRule):
    def __init__(self, opt: Adagrad) -> None:
        self.opt = opt
        self.state = state_of(opt)

    def apply(self, values, state, rows, grads):  # type: ignore[no-untyped-def]
        kernels.adagrad_rows(values, state["accum"], rows, grads, self.opt.lr, self.opt.eps)


class AdamRule(UpdateRule):
    def __init__(self, opt: Adam) -> None:
        self.opt = opt
        self.state = state_of(opt)

    def apply(self, values, state, rows, grads):  # type: ignore[no-untyped-def]
        o = self.opt
        kernels.adam_rows(
            values, state["first"], state["second"], state["steps"], rows, grads, o.lr, o.beta1, o.beta2, o.eps
        )


def rule_for(opt: Optimizer) -> UpdateRule:
    if isinstance(opt, Sum):
        return SumRule()
    if isinstance(opt, SGD):
        return SGDRule(opt)
    if isinstance(opt, Adagrad):
        return AdagradRule(opt)
    if isinstance(opt, Adam):
        return AdamRule(opt)
    raise TypeError(f"no update rule for {opt!r}")
