"""Keeping a dense model's parameters in Shoal (Bösen-style: workers push changes, pull values)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from shoal.api.consistency import ASP, Consistency
from shoal.api.optim import Sum
from shoal.client.dense import DenseTable
from shoal.client.worker import Worker
from shoal.integrations.torch.embedding import Embedding, to_numpy


class DenseSync:
    """Every parameter of ``model`` lives in a dense Shoal table (``Sum`` rule, the given consistency).

    Workers keep using their own torch optimiser. ``step()`` (after
    ``optimizer.step()``) pushes the change the optimiser made since the last
    sync, advances the clock, and pulls the parameters' current values; under
    SSP or BSP that pull waits as the bound requires. Rank 0's initial values
    become everyone's. Parameters of any shape are kept, 0-d scalars too; those
    of Shoal's own modules (an ``Embedding``, whose rows live in their table
    already) are left out.
    """

    def __init__(self, ps: Worker, model: nn.Module, prefix: str = "dense",
                 consistency: Consistency | None = None, slice_size: int = 4096, **options: Any) -> None:
        self.ps = ps
        self.model = model
        own = {id(p) for m in model.modules() if isinstance(m, Embedding) for p in m.parameters()}
        self.params = [(name, p) for name, p in model.named_parameters() if p.requires_grad and id(p) not in own]
        self.tables: list[DenseTable] = [
            ps.dense(f"{prefix}.{name}", tuple(p.shape), optimizer=Sum(), consistency=consistency or ASP(),
                     slice_size=slice_size, **options)
            for name, p in self.params
        ]
        if ps.rank == 0:  # tables start at zero: rank 0 adds its initial values
            for table, (_, p) in zip(self.tables, self.params, strict=True):
                table.push(to_numpy(p))
        ps.barrier()
        self.reload()
        ps.barrier()  # nobody changes a parameter before everyone has read the initial values
        ps.after_restore(self.reload)  # a restore comes after the tables are made: read its values

    def reload(self) -> None:
        """Read the parameters' current values into the model (the next ``step`` pushes changes from
        these)."""
        self._synced = [table.pull() for table in self.tables]
        self._load()

    def _load(self) -> None:
        with torch.no_grad():
            for (_, p), values in zip(self.params, self._synced, strict=True):
                # reshape: ascontiguousarray makes a 0-d array 1-d
                p.copy_(torch.from_numpy(np.ascontiguousarray(values).reshape(p.shape)))

    def step(self, advance_clock: bool = True) -> None:
        """Push the local change since the last sync, (advance the clock,) pull current values."""
        futures = []
        for table, (_, p), synced in zip(self.tables, self.params, self._synced, strict=True):
            futures.append(table.push_async(to_numpy(p) - synced))
        for f in futures:
            f.wait()
        if advance_clock:
            self.ps.advance_clock()
        pulls = [table.pull_async() for table in self.tables]
        self._synced = [f.wait() for f in pulls]
        self._load()
