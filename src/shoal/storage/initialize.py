"""Initial rows, a pure function of (table seed, key)."""

from __future__ import annotations

import zlib

import numpy as np

from shoal.api.config import TableSpec
from shoal.api.initializers import Constant, Normal, Uniform
from shoal.storage import kernels


def table_seed(spec: TableSpec) -> np.uint64:
    """Mix the user's seed with the table name so that tables differ."""
    return np.uint64((spec.seed << 32) ^ zlib.crc32(spec.name.encode()))


def fill_initial(spec: TableSpec, keys: np.ndarray, out: np.ndarray) -> None:
    """Write the initial rows of ``keys`` into ``out`` (shape ``(len(keys), dim)``)."""
    init = spec.init
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    if isinstance(init, Constant):
        out[...] = init.value
        return
    drawn = out if not init.columns or init.columns >= out.shape[1] else out[:, : init.columns]
    target = drawn if drawn.flags.c_contiguous else np.empty(drawn.shape, dtype=out.dtype)
    if isinstance(init, Uniform):
        kernels.seeded_uniform(table_seed(spec), keys, target, init.low, init.high)
    elif isinstance(init, Normal):
        kernels.seeded_normal(table_seed(spec), keys, target, init.mean, init.std)
    else:  # pragma: no cover - TableSpec validates this
        raise TypeError(f"unknown initializer {init!r}")
    if target is not out:
        out[...] = 0
        out[:, : init.columns] = target
    if init.keys:
        out[keys >= init.keys] = 0
