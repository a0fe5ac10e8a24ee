"""Dense parameters: a weight tensor kept as a table whose rows are slices of the flattened tensor.

A tensor of ``n`` values becomes ``ceil(n / width)`` rows of ``width`` values
(the last one padded). Rows spread over the servers like any table's keys, so
one big tensor does not land on one server (the MXNet complaint), and a pull or
push of the whole tensor is one message per server.
"""

from __future__ import annotations

from math import prod
from typing import Any

import numpy as np

from shoal.api.errors import ShapeError
from shoal.client.context import TableView
from shoal.cluster.requests import Future

DEFAULT_SLICE = 4096  # values per row: 16 KB of float32, well above per-message overheads


class DenseTable:
    """A tensor of ``shape`` stored in ``table`` as rows of ``width`` values."""

    def __init__(self, table: TableView, shape: tuple[int, ...], width: int) -> None:
        self.table = table
        self.shape = shape
        self.size = prod(shape)
        self.width = width
        self.keys = np.arange(table.num_keys, dtype=np.int64)

    @property
    def name(self) -> str:
        return self.table.name

    def pull(self, out: np.ndarray | None = None) -> np.ndarray:
        return self.pull_async(out).wait()

    def pull_async(self, out: np.ndarray | None = None) -> Future[np.ndarray]:
        future = self.table.pull_async(self.keys)
        if out is not None and (out.shape != self.shape or out.dtype != self.table.dtype):
            raise ShapeError(f"out must be {self.shape} {self.table.dtype}, got {out.shape} {out.dtype}")

        def finish() -> np.ndarray:
            flat = future.wait().reshape(-1)[: self.size]
            if out is None:
                return flat.reshape(self.shape)
            out.reshape(-1)[...] = flat
            return out

        return Future.running(finish, future.done)

    def push(self, values: Any) -> None:
        self.push_async(values).wait()

    def push_async(self, values: Any) -> Future[None]:
        """Push a whole tensor of changes (or gradients, under a server-side rule)."""
        arr = np.asarray(values, dtype=self.table.dtype)
        if arr.shape != self.shape:
            raise ShapeError(f"dense {self.name!r} has shape {self.shape}, got {arr.shape}")
        rows = np.zeros(self.table.num_keys * self.width, dtype=self.table.dtype)
        rows[: self.size] = arr.reshape(-1)
        return self.table.push_async(self.keys, rows.reshape(-1, self.width))
