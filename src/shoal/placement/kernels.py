"""Compiled passes over a batch of keys instead of several numpy passes: routing, and counting a
replica's syncs in flight. Compiled as ``storage.kernels`` are (``storage.jit``): integer division
and remainder without a zero check (the slice counts they divide by are never zero)."""

from __future__ import annotations

import numpy as np

from shoal.storage.jit import kernel


@kernel
def range_locate(keys: np.ndarray, bounds: np.ndarray, shard: np.ndarray, row: np.ndarray) -> None:
    """Shard and row of each key under contiguous ranges ``bounds[s] <= key < bounds[s + 1]``."""
    num_shards = bounds.shape[0] - 1
    for i in range(keys.shape[0]):
        k = keys[i]
        lo, hi = 0, num_shards - 1
        while lo < hi:  # binary search for the last bound <= k
            mid = (lo + hi + 1) // 2
            if bounds[mid] <= k:
                lo = mid
            else:
                hi = mid - 1
        shard[i] = lo
        row[i] = k - bounds[lo]


@kernel
def owners_of(shard: np.ndarray, owner_of_shard: np.ndarray, owner: np.ndarray, num_owners: int) -> np.ndarray:
    """Fill ``owner[i] = owner_of_shard[shard[i]]``; returns the count of keys per owner."""
    counts = np.zeros(num_owners, dtype=np.int64)
    for i in range(shard.shape[0]):
        o = owner_of_shard[shard[i]]
        owner[i] = o
        counts[o] += 1
    return counts


@kernel
def lookup_locate(keys: np.ndarray, shard_of: np.ndarray, row_of: np.ndarray, shard: np.ndarray,
                  row: np.ndarray) -> None:
    """Shard and row of each key from per-key tables."""
    for i in range(keys.shape[0]):
        k = keys[i]
        shard[i] = shard_of[k]
        row[i] = row_of[k]


@kernel
def rows_in_range(keys: np.ndarray, start: int, stop: int, rows: np.ndarray) -> bool:
    """``rows = keys - start`` if every key lies in ``[start, stop)``; False otherwise."""
    for i in range(keys.shape[0]):
        k = keys[i]
        if k < start or k >= stop:
            return False
        rows[i] = k - start
    return True


@kernel
def rows_in_stride(keys: np.ndarray, shard: int, num_shards: int, rows: np.ndarray) -> bool:
    """``rows = keys // S`` if every key has ``key % S == shard``; False otherwise."""
    for i in range(keys.shape[0]):
        k = keys[i]
        if k % num_shards != shard:
            return False
        rows[i] = k // num_shards
    return True


@kernel
def rows_in_lookup(keys: np.ndarray, shard: int, shard_of: np.ndarray, row_of: np.ndarray,
                   rows: np.ndarray) -> bool:
    """Rows from per-key tables if every key lies in ``shard``; False otherwise."""
    for i in range(keys.shape[0]):
        k = keys[i]
        if shard_of[k] != shard:
            return False
        rows[i] = row_of[k]
    return True


@kernel
def distinct(keys: np.ndarray, seen: np.ndarray, out: np.ndarray) -> int:
    """Write each key of ``keys`` once to ``out``, in the order they first come; returns how many.
    ``seen`` (a flag per key of the table, all clear) is left clear again. One pass, where
    ``np.unique`` sorts: 4 µs against 130 for an intent of 2,000 keys."""
    n = 0
    for i in range(keys.shape[0]):
        k = keys[i]
        if not seen[k]:
            seen[k] = True
            out[n] = k
            n += 1
    for i in range(n):
        seen[out[i]] = False
    return n


@kernel
def take_in_intents(keys: np.ndarray, bounds: np.ndarray, ends: np.ndarray, until: np.ndarray, announced: np.ndarray,
                    out: np.ndarray) -> int:
    """Intents come into the action window, intent ``i`` over ``keys[bounds[i]:bounds[i + 1]]``
    (distinct) until clock ``ends[i]``: each key is held until its intents' last end at least, and
    those not announced yet are now, written to ``out`` once each; returns how many. One pass, where
    numpy took six over each intent's keys (each a gather from the table's flags)."""
    n = 0
    for j in range(ends.shape[0]):
        end = ends[j]
        for i in range(bounds[j], bounds[j + 1]):
            k = keys[i]
            if until[k] < end:
                until[k] = end
            if not announced[k]:
                announced[k] = True
                out[n] = k
                n += 1
    return n


@kernel
def take_out_intents(keys: np.ndarray, clock: int, until: np.ndarray, announced: np.ndarray, out: np.ndarray) -> int:
    """Intents over ``keys`` ended by ``clock``: those announced and held by no intent past it are no
    longer announced, written to ``out`` once each; returns how many."""
    n = 0
    for i in range(keys.shape[0]):
        k = keys[i]
        if announced[k] and until[k] <= clock:
            announced[k] = False
            out[n] = k
            n += 1
    return n


@kernel
def count_answered(unanswered: np.ndarray, settled: np.ndarray, keys: np.ndarray) -> bool:
    """The keys ``settled`` have one sync fewer unanswered; whether any of ``keys`` still has one."""
    for i in range(settled.shape[0]):
        unanswered[settled[i]] -= 1
    for i in range(keys.shape[0]):
        if unanswered[keys[i]] > 0:
            return True
    return False


def warm_up() -> None:
    """Load these kernels now (as ``storage.kernels.warm_up`` does the row kernels), each for keys
    a process made and for keys read from the wire: those are read-only, a form numba compiles apart,
    which a server would otherwise compile (a fresh install) or load at its first request."""
    mine = np.zeros(1, dtype=np.int64)
    wire = mine.copy()
    wire.flags.writeable = False
    out = np.zeros(1, dtype=np.int64)
    bounds = np.array([0, 1], dtype=np.int64)
    for keys in (mine, wire):
        range_locate(keys, bounds, out, out.copy())
        lookup_locate(keys, out, out, out.copy(), out.copy())
        rows_in_range(keys, 0, 1, out)
        rows_in_stride(keys, 0, 1, out)
        rows_in_lookup(keys, 0, out, out, out.copy())
        distinct(keys, np.zeros(1, dtype=np.bool_), out)
        take_out_intents(keys, 1, out.copy(), np.zeros(1, dtype=np.bool_), out.copy())
    take_in_intents(out, bounds, out.copy(), out.copy(), np.zeros(1, dtype=np.bool_), out.copy())
    owners_of(out, out.copy(), out.copy(), 1)
    count_answered(np.zeros(1, dtype=np.int32), out, out)  # a replica's first sync answered: mid-training
