"""The consistency model of each slice of a table, as one reader holds them.

A table starts with one model for every slice (``TableSpec.consistency``); a
reader may change the model of some slices at run time (hot slices under a
tighter bound, cold ones under a looser one, eager pushes where rows are
re-read). The bound is a promise to the reader: the reader checks its cache
and this node's shared memory against the model of each row's slice, and every
pull it sends names the model the server must hold it to, so a read is never
answered under a looser bound than its reader set, wherever the slice lives.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shoal.api.consistency import BSP, ESSP, SSP, Consistency, LazyPull, consistency_to_dict
from shoal.api.errors import ConfigError

#: ESSP: how long a read of rows its servers push waits for the push its bound needs before it asks
#: for the rows instead (the server holds that pull to the bound): a push lost on the way, or dropped
#: at a full reply queue, costs a read this long; a wait for a slow worker, one pull more
EAGER_WAIT_S = 1.0


class SliceSchemes:
    """``models[s]``: the model reads of slice ``s`` are held to; ``bounds`` and ``eager`` per slice."""

    def __init__(self, table: str, default: Consistency, num_slices: int) -> None:
        self.table = table
        self.default = default
        self.models: list[Consistency] = [default] * num_slices
        bound = default.bound
        self.bounds = np.full(num_slices, -1 if bound is None else bound, dtype=np.int64)
        self.eager = np.full(num_slices, default.eager, dtype=np.bool_)
        #: every slice under the table's own model: messages need not name one
        self.uniform = True

    def check(self, model: Consistency, slices: list[int] | None, locking: str) -> list[int]:
        """The slices ``set`` would change (all: None), or ``ConfigError`` if it cannot."""
        if self.default.bound is None:
            raise ConfigError(f"table {self.table!r} is read under ASP: it has no bound to change per slice; "
                              "create it with BSP, SSP or ESSP")
        if not isinstance(model, (BSP, SSP, ESSP)):
            raise ConfigError(f"a slice's model must be shoal.BSP(), SSP(s) or ESSP(s), got {model!r}")
        if model.eager and locking != "exact":
            raise ConfigError("ESSP needs locking='exact'")
        if slices is None:
            return list(range(len(self.models)))
        if isinstance(slices, (str, bytes)) or not hasattr(slices, "__iter__"):
            raise ConfigError(f"slices must be a list of slice numbers, got {slices!r}")
        chosen = list(slices)
        for s in chosen:
            if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not 0 <= s < len(self.models):
                raise ConfigError(f"slices of table {self.table!r} are 0..{len(self.models) - 1}, got {s!r}")
        return [int(s) for s in chosen]

    def set(self, model: Consistency, slices: list[int] | None, locking: str) -> list[int]:
        """Read ``slices`` (all: None) under ``model`` from now on; returns the slices whose eager
        pushes start or stop (their cached rows must be forgotten). ``slices`` is read twice: pass
        a list (``check`` returns one)."""
        chosen = self.check(model, slices, locking)
        bound = model.bound
        assert bound is not None  # check() admits bounded models only
        switched = []
        for s in chosen:
            if bool(self.eager[s]) != model.eager:
                switched.append(s)
            self.models[s] = model
            self.bounds[s] = bound
            self.eager[s] = model.eager
        self.uniform = all(m == self.default for m in self.models)
        return sorted(set(switched))

    def bound_for(self, shards: np.ndarray | int) -> int:
        """The tightest bound among ``shards``."""
        return int(np.min(self.bounds[shards]))

    def named(self, shards: np.ndarray) -> dict[str, Any] | None:
        """The model a server must hold a pull of rows in ``shards`` to, as it travels (None: the
        table's own): the tightest bound among them, with eager pushes if any of them has them, and
        the lazy pull buffer of the tightest one that has it."""
        if self.uniform:
            return None
        touched = sorted({int(s) for s in np.unique(shards)}, key=lambda s: int(self.bounds[s]))
        models = [self.models[s] for s in touched]
        if all(m == self.default for m in models):
            return None
        bound = int(self.bounds[touched[0]])
        eager = any(m.eager for m in models)
        lazy: LazyPull | None = next((m.lazy for m in models if m.lazy is not None), None)
        model: Consistency
        if eager:
            model = ESSP(bound, lazy=lazy)
        elif bound == 0:
            model = BSP(lazy=lazy)
        else:
            model = SSP(bound, lazy=lazy)
        return consistency_to_dict(model)
