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

from shoal.api.errors import DTypeError, ShapeError
from shoal.client.context import TableView
from shoal.cluster.requests import Future
from shoal.storage.validate import as_array

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
        if out is not None and (not isinstance(out, np.ndarray) or out.shape != self.shape
                                or out.dtype != self.table.dtype or not out.flags.c_contiguous
                                or not out.flags.writeable):
            got = f"{out.shape} {out.dtype}" if isinstance(out, np.ndarray) else type(out).__name__
            raise ShapeError(f"out must be a writable C-contiguous {self.shape} {self.table.dtype} array, got {got}")
        future = self.table.pull_async(self.keys)

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
        arr = as_array(values, f"values for dense {self.name!r}")
        if arr.dtype.kind != "f":  # a cast would take bools, ints or complex values silently
            raise DTypeError(f"values for dense {self.name!r} must be floats, got {arr.dtype}")
        arr = arr.astype(self.table.dtype, copy=False)
        if arr.shape != self.shape:
            raise ShapeError(f"dense {self.name!r} has shape {self.shape}, got {arr.shape}")
        rows = np.zeros(self.table.num_keys * self.width, dtype=self.table.dtype)
        rows[: self.size] = arr.reshape(-1)
        return self.table.push_async(self.keys, rows.reshape(-1, self.width))
