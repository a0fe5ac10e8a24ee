"""Keeping a dense model's parameters in Shoal (Bösen-style: workers push changes, pull values)."""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch
from torch import nn

from shoal.api.consistency import ASP, Consistency
from shoal.api.errors import ConfigError, DTypeError
from shoal.api.optim import Sum
from shoal.client.dense import DenseTable
from shoal.client.worker import Worker
from shoal.integrations.torch.embedding import Embedding

# The model each prefix of a worker's DenseSyncs belongs to: two models under one prefix would share
# (sum) their parameters' tables without a word.
_prefixes: weakref.WeakKeyDictionary[Worker, dict[str, weakref.ref[nn.Module]]] = weakref.WeakKeyDictionary()


def _table_dtype(name: str, p: torch.Tensor) -> torch.dtype:
    """The dtype a parameter is kept in: float64 as itself, every narrower float as float32 (tables
    hold float32 or float64; a float16 or bfloat16 model's sums are kept more precisely than it)."""
    if not p.is_floating_point():
        raise DTypeError(f"DenseSync keeps floating-point parameters, {name!r} is {p.dtype}")
    return torch.float64 if p.dtype == torch.float64 else torch.float32


class DenseSync:
    """Every parameter of ``model`` lives in a dense Shoal table (``Sum`` rule, the given consistency).

    Workers keep using their own torch optimiser. ``step()`` (after
    ``optimizer.step()``) pushes the change the optimiser made since the last
    sync, advances the clock, and pulls the parameters' current values; under
    SSP or BSP that pull waits as the bound requires. Rank 0's values at
    construction become everyone's (a second DenseSync of the same model starts
    again from them). Parameters of any shape are kept, 0-d scalars too; float64
    ones in float64 tables, other floats in float32 ones; those of Shoal's own
    modules (an ``Embedding``, whose rows live in their table already) are left
    out. Each model needs its own ``prefix``.
    """

    def __init__(self, ps: Worker, model: nn.Module, prefix: str = "dense",
                 consistency: Consistency | None = None, slice_size: int = 4096, **options: Any) -> None:
        self.ps = ps
        self.model = model
        owners = _prefixes.setdefault(ps, {})
        owner = owners.get(prefix)
        if owner is not None and owner() not in (None, model):
            raise ConfigError(f"DenseSync prefix {prefix!r} is another model's: give each model its own prefix")
        owners[prefix] = weakref.ref(model)
        own = {id(p) for m in model.modules() if isinstance(m, Embedding) for p in m.parameters()}
        self.params = [(name, p) for name, p in model.named_parameters() if p.requires_grad and id(p) not in own]
        self._dtypes = [_table_dtype(name, p) for name, p in self.params]
        self.tables: list[DenseTable] = [
            ps.dense(f"{prefix}.{name}", tuple(p.shape), optimizer=Sum(), consistency=consistency or ASP(),
                     slice_size=slice_size, dtype=str(dtype).removeprefix("torch."), **options)
            for (name, p), dtype in zip(self.params, self._dtypes, strict=True)
        ]
        if ps.rank == 0:  # rank 0 sets the tables to its values (they may hold an earlier sync's)
            held = [table.pull_async() for table in self.tables]
            for table, values, f in zip(self.tables, self._values(), held, strict=True):
                table.push(values - f.wait())
        ps.barrier()
        self.reload()
        ps.barrier()  # nobody changes a parameter before everyone has read the initial values
        ps.after_restore(self.reload)  # a restore comes after the tables are made: read its values

    def _values(self) -> list[np.ndarray]:
        """The parameters as the tables keep them (no copy for a contiguous CPU tensor of that dtype)."""
        return [p.detach().to("cpu", dtype).contiguous().numpy()
                for (_, p), dtype in zip(self.params, self._dtypes, strict=True)]

    def reload(self) -> None:
        """Read the parameters' current values into the model (the next ``step`` pushes changes from
        these)."""
        self._load([table.pull() for table in self.tables])

    def _load(self, pulled: list[np.ndarray]) -> None:
        with torch.no_grad():
            for (_, p), values in zip(self.params, pulled, strict=True):
                # reshape: ascontiguousarray makes a 0-d array 1-d
                p.copy_(torch.from_numpy(np.ascontiguousarray(values).reshape(p.shape)))
        # The change a step pushes is measured from what the model holds, not from what was pulled:
        # a narrower model rounds the pulled values, and that rounding is no change of its own.
        self._synced = [values if p.dtype == dtype else now.copy()
                        for (_, p), dtype, values, now in zip(self.params, self._dtypes, pulled, self._values(),
                                                              strict=True)]

    def step(self, advance_clock: bool = True) -> None:
        """Push the local change since the last sync, (advance the clock,) pull current values."""
        futures = []
        for table, values, synced in zip(self.tables, self._values(), self._synced, strict=True):
            futures.append(table.push_async(values - synced.reshape(values.shape)))
        for f in futures:
            f.wait()
        if advance_clock:
            self.ps.advance_clock()
        pulls = [table.pull_async() for table in self.tables]
        self._load([f.wait() for f in pulls])
