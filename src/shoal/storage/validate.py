"""Checks on keys and rows that every entry point (server, co-located worker) runs."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from shoal.api.config import TableSpec
from shoal.api.errors import DTypeError, KeyRangeError, NonFiniteError, ShapeError
from shoal.storage import kernels


def as_keys(keys: Any, spec: TableSpec) -> np.ndarray:
    """Keys as a contiguous int64 vector inside ``[0, num_keys)``."""
    if type(keys) is np.ndarray and keys.dtype == np.int64 and keys.ndim == 1 and keys.flags.c_contiguous:
        arr = keys  # what an app usually passes: nothing to convert, only the range to check
    else:
        arr = _as_int64_vector(keys, spec)
    bad = kernels.first_out_of_range(arr, spec.num_keys)
    if bad >= 0:
        raise KeyRangeError(
            f"key {int(arr[bad])} (position {bad}) is outside [0, {spec.num_keys}) of table {spec.name!r}"
        )
    return arr


def as_array(values: Any, what: str) -> np.ndarray:
    """``values`` as a numpy array; ``ShapeError`` for what is none (ragged lists, say)."""
    try:
        return np.asarray(values)
    except (ValueError, TypeError) as exc:
        raise ShapeError(f"{what} must be an array, got {type(values).__name__}: {exc}") from None


def _as_int64_vector(keys: Any, spec: TableSpec) -> np.ndarray:
    arr = as_array(keys, f"keys of table {spec.name!r}")
    if arr.dtype.kind not in "iu":
        if arr.size == 0:
            arr = arr.astype(np.int64)
        else:
            raise DTypeError(f"keys of table {spec.name!r} must be integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        if arr.ndim == 0:
            arr = arr.reshape(1)
        else:
            raise ShapeError(f"keys of table {spec.name!r} must be a vector, got shape {arr.shape}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def as_rows(values: Any, n: int, spec: TableSpec, strict_dtype: bool = False) -> np.ndarray:
    """Values for ``n`` keys as a contiguous ``(n, dim)`` array of the table's dtype.

    The API converts between float dtypes; the wire (``strict_dtype``) does not.
    """
    want = _numpy_dtype(spec.dtype)
    if type(values) is np.ndarray and values.dtype == want and values.shape == (n, spec.dim) \
            and values.flags.c_contiguous:
        return values  # what an app usually passes: nothing to convert
    arr = as_array(values, f"values for table {spec.name!r}")
    if arr.dtype != want:
        if strict_dtype or arr.dtype.kind != "f":
            raise DTypeError(f"values for table {spec.name!r} must be {want}, got {arr.dtype}")
        arr = arr.astype(want)
    if arr.shape != (n, spec.dim):
        raise ShapeError(
            f"values for table {spec.name!r} must have shape ({n}, {spec.dim}) for {n} key(s), got {arr.shape}"
        )
    return np.ascontiguousarray(arr)


@functools.cache
def _numpy_dtype(name: str) -> np.dtype:
    """The dtype named ``name``, made once: ``np.dtype`` parses the name at every call."""
    return np.dtype(name)


def drop_nonfinite(keys: np.ndarray, values: np.ndarray, spec: TableSpec) -> tuple[np.ndarray, np.ndarray, int]:
    """Apply the table's NaN/Inf policy to a whole push before any of it lands.

    Returns the keys and values to apply and how many rows were skipped.
    """
    bad = _nonfinite_rows(values, spec)
    if bad is None:
        return keys, values, 0
    keep = ~bad
    return keys[keep], values[keep], int(bad.sum())


def zero_nonfinite(values: np.ndarray, spec: TableSpec) -> tuple[np.ndarray, int]:
    """The NaN/Inf policy for a push whose rows must keep their positions (an adaptive table's
    answer names positions): under ``skip`` the bad rows become zeros, which add nothing."""
    bad = _nonfinite_rows(values, spec)
    if bad is None:
        return values, 0
    values = values.copy()
    values[bad] = 0
    return values, int(bad.sum())


def _nonfinite_rows(values: np.ndarray, spec: TableSpec) -> np.ndarray | None:
    """The rows holding NaN/Inf under the ``skip`` policy (None if there are none); ``reject`` raises."""
    if not kernels.any_nonfinite(values):
        return None
    bad = kernels.nonfinite_rows(values)
    if spec.nonfinite == "reject":
        raise NonFiniteError(
            f"push to table {spec.name!r} has NaN/Inf in {int(bad.sum())} row(s); rejected, nothing applied "
            "(set nonfinite='skip' to drop such rows instead)"
        )
    return bad
