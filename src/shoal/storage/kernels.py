"""Hot loops over rows, compiled with numba (on first use: ``jit``).

numpy's generic paths are far from the memory bound here: ``np.add.at`` is
about twenty times slower than a compiled scatter-add loop, and a compiled
gather beats ``np.take`` by about 2x (DESIGN.md §9). Every kernel releases the
GIL (``nogil``) so a worker's receive path and compute can overlap, and divides as
numpy does, with no zero check to keep a loop from being vectorised (``jit``).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from shoal.storage.fences import acquire_fence, release_fence
from shoal.storage.jit import kernel

# ---------------------------------------------------------------- row movement


@kernel
def gather_rows(src: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
    """``out[i] = src[rows[i]]``."""
    dim = src.shape[1]
    for i in range(rows.shape[0]):
        r = rows[i]
        for j in range(dim):
            out[i, j] = src[r, j]


@kernel
def place_rows(dst: np.ndarray, positions: np.ndarray, src: np.ndarray) -> None:
    """``dst[positions[i]] = src[i]``: put a destination's reply back in caller order."""
    dim = src.shape[1]
    for i in range(positions.shape[0]):
        p = positions[i]
        for j in range(dim):
            dst[p, j] = src[i, j]


@kernel
def gather_place(src: np.ndarray, rows: np.ndarray, positions: np.ndarray, out: np.ndarray) -> None:
    """``out[positions[i]] = src[rows[i]]``: a local gather straight into caller order."""
    dim = src.shape[1]
    for i in range(rows.shape[0]):
        r = rows[i]
        p = positions[i]
        for j in range(dim):
            out[p, j] = src[r, j]


@kernel
def add_rows(dst: np.ndarray, rows: np.ndarray, src: np.ndarray, alpha: float) -> None:
    """``dst[rows[i]] += alpha * src[i]``; duplicates accumulate."""
    dim = dst.shape[1]
    a = dst.dtype.type(alpha)
    for i in range(rows.shape[0]):
        r = rows[i]
        for j in range(dim):
            dst[r, j] += a * src[i, j]


# ---------------------------------------------------------- adaptive placement

ABSENT, OWNED, REPLICA = 0, 1, 2

# A row held in place by a worker's kernel is pinned: ``pinned[r]`` names the hold (a byte per row,
# read beside every row a push touches: 0 for none, else the hold's place in the store's table of
# holds, ``holds``, which keeps each hold's process id, 0 for a free place). The kernel writes a
# pinned row with no lock, so every other writer (the node's server, its other workers) leaves its
# value alone and adds what it would write to ``incoming[r]`` instead, marking ``arrived[r]``. What
# arrived is part of the row: readers read value plus incoming, and the first writer that finds the
# row no longer pinned (under the row lock, as every writer) folds it into the value, as does the
# next hold. A hold pins under the row lock and lets go without it (``release``: one store per row,
# fenced after its kernel's writes), so no writer waits for a hold and a hold pays one lock round;
# nothing written to a held row is lost.


@kernel
def read_present(values: np.ndarray, presence: np.ndarray, arrived: np.ndarray, incoming: np.ndarray,
                 rows: np.ndarray, out: np.ndarray, absent_at: np.ndarray) -> int:
    """``out[i] = values[rows[i]]`` (plus what arrived for it beside) for present rows; the positions
    of the others go to the front of ``absent_at``, and their count is returned (a call that finds
    every row here allocates nothing more). The row copy is written out here, not in a helper kernel:
    numba does not inline one, and calling it tripled the time of a 10,000-row read."""
    dim = values.shape[1]
    absent = 0
    for i in range(rows.shape[0]):
        r = rows[i]
        if presence[r] == 0:
            absent_at[absent] = i
            absent += 1
            continue
        if arrived[r]:
            for j in range(dim):
                out[i, j] = values[r, j] + incoming[r, j]
        else:
            for j in range(dim):
                out[i, j] = values[r, j]
    return absent


@kernel
def add_present(values: np.ndarray, changed: np.ndarray, presence: np.ndarray, pinned: np.ndarray,
                arrived: np.ndarray, incoming: np.ndarray, rows: np.ndarray, grads: np.ndarray, scale: float,
                absent_at: np.ndarray) -> int:
    """Additive update of present rows (of a held row: beside it, in what arrived for it); a replica's
    row is also marked changed (its change for the owner is what its value moved since its last
    sync). The positions of absent rows go to the front of ``absent_at``; returns their count. Written
    out in one kernel, as ``read_present`` is."""
    dim = values.shape[1]
    a = values.dtype.type(scale)
    absent = 0
    for i in range(rows.shape[0]):
        r = rows[i]
        state = presence[r]
        if state == 0:
            absent_at[absent] = i
            absent += 1
            continue
        if state == 2:
            changed[r] = 1
        if pinned[r]:
            if arrived[r]:
                for j in range(dim):
                    incoming[r, j] += a * grads[i, j]
            else:
                arrived[r] = 1
                for j in range(dim):
                    incoming[r, j] = a * grads[i, j]
            continue
        acquire_fence()  # a hold that let go of the row: its writes first
        if arrived[r]:
            arrived[r] = 0
            for j in range(dim):
                values[r, j] += incoming[r, j] + a * grads[i, j]
        else:
            for j in range(dim):
                values[r, j] += a * grads[i, j]
    return absent


@kernel
def add_owned_and_read(values: np.ndarray, presence: np.ndarray, pinned: np.ndarray, arrived: np.ndarray,
                       incoming: np.ndarray, waits: np.ndarray, rows: np.ndarray, deltas: np.ndarray,
                       out: np.ndarray) -> bool:
    """A replica's change at its owner, the usual case in one call: if every row is owned here and none
    waits for a state (``waits``), add the change to them as ``add_present`` does and read them after
    into ``out`` as ``read_present`` does; else change nothing and return False."""
    for i in range(rows.shape[0]):
        r = rows[i]
        if presence[r] != 1 or waits[r]:
            return False
    dim = values.shape[1]
    for i in range(rows.shape[0]):
        r = rows[i]
        if pinned[r]:
            if arrived[r]:
                for j in range(dim):
                    incoming[r, j] += deltas[i, j]
            else:
                arrived[r] = 1
                for j in range(dim):
                    incoming[r, j] = deltas[i, j]
            continue
        acquire_fence()  # a hold that let go of the row: its writes first
        if arrived[r]:
            arrived[r] = 0
            for j in range(dim):
                values[r, j] += incoming[r, j] + deltas[i, j]
        else:
            for j in range(dim):
                values[r, j] += deltas[i, j]
    # Read after every add (a row named twice is read with both); every row is present: none is absent.
    read_present(values, presence, arrived, incoming, rows, out, np.empty(0, dtype=np.int64))
    return True


@kernel
def take_changes(values: np.ndarray, base: np.ndarray, changed: np.ndarray, pinned: np.ndarray,
                 arrived: np.ndarray, incoming: np.ndarray, rows: np.ndarray, also: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, bool]:
    """A replica sync's payload: the rows among ``rows`` marked changed (or marked in ``also``), in
    the order of ``rows``, their changes since the last sync (``values - base``, what arrived beside
    included), and whether any change is not zero; their ``base`` becomes that value and their marks
    are cleared. A held row's kernel may write it meanwhile: each value is read once, so a write lands
    either in this change or in the next (a held row stays marked changed). No row-sized temporaries."""
    dim = values.shape[1]
    chosen = np.zeros(rows.shape[0], dtype=np.bool_)
    count = 0
    for i in range(rows.shape[0]):
        take = also[i] or changed[rows[i]] != 0
        chosen[i] = take
        count += take
    taken = np.empty(count, dtype=np.int64)
    deltas = np.empty((count, dim), dtype=values.dtype)
    k = 0
    moved = False
    for i in range(rows.shape[0]):
        if chosen[i]:
            r = rows[i]
            taken[k] = r
            held = pinned[r] != 0
            if not held:
                acquire_fence()
            changed[r] = held
            fold = arrived[r] != 0 and not held
            beside = arrived[r] != 0 and held
            for j in range(dim):
                v = values[r, j]
                if fold:
                    v += incoming[r, j]
                    values[r, j] = v
                elif beside:
                    v += incoming[r, j]
                d = v - base[r, j]
                deltas[k, j] = d
                moved |= d != 0
                base[r, j] = v
            if fold:
                arrived[r] = 0
            k += 1
    return taken, deltas, moved


@kernel
def apply_synced(values: np.ndarray, base: np.ndarray, changed: np.ndarray, presence: np.ndarray,
                 pinned: np.ndarray, arrived: np.ndarray, incoming: np.ndarray, rows: np.ndarray,
                 owner_rows: np.ndarray, drop: np.ndarray, gone: np.ndarray) -> int:
    """An owner's answer to a replica's sync, in one pass: each row still a replica here becomes the
    owner's row plus the change made here since the sync left (what its value moved from ``base``
    since), and the owner's row its new ``base``; a row whose replica was to go (``drop``) and saw no
    change since goes now (absent), unless it is held in place (it goes with a later sync). A held
    row's value is left to its kernel: the owner's part arrives beside it. The rows that went are
    written to the front of ``gone``; returns how many."""
    dim = values.shape[1]
    went = 0
    for i in range(rows.shape[0]):
        r = rows[i]
        if presence[r] != 2:
            continue
        if pinned[r]:
            more = arrived[r] != 0
            arrived[r] = 1
            for j in range(dim):
                o = owner_rows[i, j]
                came = o - base[r, j]
                incoming[r, j] = incoming[r, j] + came if more else came
                base[r, j] = o
            continue
        acquire_fence()
        fold = arrived[r] != 0
        for j in range(dim):
            o = owner_rows[i, j]
            v = values[r, j] + incoming[r, j] if fold else values[r, j]
            values[r, j] = o + (v - base[r, j])
            base[r, j] = o
        arrived[r] = 0
        if drop[i] != 0 and changed[r] == 0:
            presence[r] = 0
            gone[went] = r
            went += 1
    return went


@kernel
def receive_rows(values: np.ndarray, base: np.ndarray, changed: np.ndarray, presence: np.ndarray,
                 pinned: np.ndarray, arrived: np.ndarray, incoming: np.ndarray, rows: np.ndarray,
                 new_rows: np.ndarray) -> None:
    """Rows that come to be owned here (a relocation's state): each becomes the row that came, plus,
    where a replica was here, the change made to it since its last sync (what its value moved from
    ``base``: not sent yet, so it stays in). A held replica's value is left to its kernel: the
    difference arrives beside it."""
    dim = values.shape[1]
    for i in range(rows.shape[0]):
        r = rows[i]
        replica = presence[r] == 2
        if pinned[r]:
            more = arrived[r] != 0
            arrived[r] = 1
            for j in range(dim):
                # a held replica keeps its change; a held row that was not one (not a move's way) takes the new row
                came = new_rows[i, j] - (base[r, j] if replica else values[r, j] + (incoming[r, j] if more else 0))
                incoming[r, j] = incoming[r, j] + came if more else came
        else:
            acquire_fence()
            fold = arrived[r] != 0
            if replica:
                for j in range(dim):
                    v = values[r, j] + incoming[r, j] if fold else values[r, j]
                    values[r, j] = new_rows[i, j] + (v - base[r, j])
            else:
                for j in range(dim):
                    values[r, j] = new_rows[i, j]
            arrived[r] = 0
        changed[r] = 0
        presence[r] = 1


@kernel
def receive_replicas(values: np.ndarray, base: np.ndarray, presence: np.ndarray, rows: np.ndarray,
                     owner_rows: np.ndarray, taken: np.ndarray) -> int:
    """Replicas that come from their owner: each row absent here becomes the owner's row, as of this
    sync (its ``base``); a row present here already (owned, or a replica that came first) is left as
    it is. The rows taken are written to the front of ``taken``; returns how many."""
    dim = values.shape[1]
    count = 0
    for i in range(rows.shape[0]):
        r = rows[i]
        if presence[r] != 0:
            continue
        for j in range(dim):
            values[r, j] = owner_rows[i, j]
            base[r, j] = owner_rows[i, j]
        presence[r] = 2
        taken[count] = r
        count += 1
    return count


@kernel
def give_unheld(values: np.ndarray, presence: np.ndarray, pinned: np.ndarray, arrived: np.ndarray,
                incoming: np.ndarray, rows: np.ndarray, out: np.ndarray, kept_at: np.ndarray) -> int:
    """Rows leaving this node: each not held in place is copied to ``out[i]`` (with what arrived beside
    it) and marked absent; the positions of the held ones (they stay until their hold ends) go to the
    front of ``kept_at``, and their count is returned."""
    dim = values.shape[1]
    kept = 0
    for i in range(rows.shape[0]):
        r = rows[i]
        if pinned[r]:
            kept_at[kept] = i
            kept += 1
            continue
        acquire_fence()
        if arrived[r]:
            for j in range(dim):
                out[i, j] = values[r, j] + incoming[r, j]
            arrived[r] = 0
        else:
            for j in range(dim):
                out[i, j] = values[r, j]
        presence[r] = 0
    return kept


@kernel
def fold_arrived(values: np.ndarray, pinned: np.ndarray, arrived: np.ndarray, incoming: np.ndarray) -> int:
    """Fold what arrived beside each row no longer held into its value (before reading values
    directly: a checkpoint); returns how many rows are still held."""
    held = 0
    for r in range(values.shape[0]):
        if pinned[r]:
            held += 1
            continue
        if arrived[r]:
            acquire_fence()
            for j in range(values.shape[1]):
                values[r, j] += incoming[r, j]
            arrived[r] = 0
    return held


@kernel
def pin_in_place(values: np.ndarray, presence: np.ndarray, changed: np.ndarray, pinned: np.ndarray,
                 holds: np.ndarray, arrived: np.ndarray, incoming: np.ndarray, pid: int, rows: np.ndarray,
                 slots: np.ndarray, absent_at: np.ndarray) -> tuple[int, int, int]:
    """Hold rows for a kernel (under the row lock): takes a free place in ``holds`` for process ``pid``, and
    ``slots[i] = rows[i]`` where that row is on this node and no other hold has it (it is pinned for
    this hold, with what arrived beside it folded in), -1 where not; the positions of the others go to
    the front of ``absent_at``; replica rows are marked changed (what is written to them in place is
    their next sync's change). Returns how many rows are elsewhere or held, how many are replicas,
    and the hold's place (0: every place is taken, and nothing is pinned)."""
    hold = 0
    for h in range(1, holds.shape[0]):
        if holds[h] == 0:
            hold = h
            break
    if hold == 0:
        return 0, 0, 0
    holds[hold] = pid
    acquire_fence()  # the place's last hold let go of its rows before the place: those stores first
    absent = 0
    replicas = 0
    fold = False
    for i in range(rows.shape[0]):
        r = rows[i]
        state = presence[r]
        pin = pinned[r]
        if state == 0 or (pin != 0 and pin != hold):
            slots[i] = -1
            absent_at[absent] = i
            absent += 1
            continue
        if pin == 0:
            pinned[r] = hold
            if arrived[r]:
                fold = True
        slots[i] = r
        if state == 2:
            changed[r] = 1
            replicas += 1
    acquire_fence()  # the last hold of a row let go without the lock: its writes come first
    if fold:  # in a pass of its own: checking for it in the pass above cost that pass a third more
        for i in range(rows.shape[0]):
            r = slots[i]
            if r >= 0 and arrived[r]:
                for j in range(values.shape[1]):
                    values[r, j] += incoming[r, j]
                arrived[r] = 0
    return absent, replicas, hold


@kernel
def release(pinned: np.ndarray, holds: np.ndarray, hold: int, rows: np.ndarray) -> None:
    """Let go of the rows among ``rows`` (-1: none) that hold ``hold`` pinned, then of its place in
    ``holds``, with no row lock: a row's next writer folds in what arrived beside it. Fenced: the
    hold's writes to the rows are seen before the rows are let go, and the rows before the place."""
    release_fence()
    for i in range(rows.shape[0]):
        r = rows[i]
        if r >= 0 and pinned[r] == hold:
            pinned[r] = 0
    release_fence()
    holds[hold] = 0


@kernel
def slice_slots_in_place(shards: np.ndarray, rows: np.ndarray, shard: int, slots: np.ndarray,
                         absent_at: np.ndarray) -> int:
    """``slots[i] = rows[i]`` where key ``i`` lies in slice ``shard``, -1 where it does not; the
    positions of the others go to the front of ``absent_at``, and their count is returned."""
    absent = 0
    for i in range(rows.shape[0]):
        if shards[i] == shard:
            slots[i] = rows[i]
        else:
            slots[i] = -1
            absent_at[absent] = i
            absent += 1
    return absent


# ------------------------------------------------------------- key bookkeeping


@kernel
def partition_by_owner(owners: np.ndarray, num_owners: int) -> tuple[np.ndarray, np.ndarray]:
    """Stable counting sort of positions by owner.

    Returns ``(order, starts)``: the positions of owner ``o`` are
    ``order[starts[o]:starts[o + 1]]``, in their original relative order.
    """
    starts = np.zeros(num_owners + 1, dtype=np.int64)
    for i in range(owners.shape[0]):
        starts[owners[i] + 1] += 1
    for o in range(num_owners):
        starts[o + 1] += starts[o]
    fill = starts[:-1].copy()
    order = np.empty(owners.shape[0], dtype=np.int64)
    for i in range(owners.shape[0]):
        o = owners[i]
        order[fill[o]] = i
        fill[o] += 1
    return order, starts


@kernel
def first_out_of_range(keys: np.ndarray, num_keys: int) -> int:
    """Index of the first key outside ``[0, num_keys)``, or -1."""
    for i in range(keys.shape[0]):
        k = keys[i]
        if k < 0 or k >= num_keys:
            return i
    return -1


@kernel
def _any_nonfinite(values: np.ndarray) -> bool:
    flat = values.reshape(-1)
    found = False
    for i in range(flat.shape[0]):
        v = flat[i]
        found |= (v - v) != 0  # 0 for every finite v; NaN for NaN and for either Inf
    return found


def any_nonfinite(values: np.ndarray) -> bool:
    """True if a float array holds a NaN or an Inf.

    One branch-free pass over the array as it lies, flat, which the compiler
    vectorises: 1.7 us for a push of 1,000 x 65 float32, where viewing the
    array as integers to test the exponent bits cost numpy's reshape and view
    per call (3.4 us in all).
    """
    return bool(_any_nonfinite(values if values.flags.c_contiguous else np.ascontiguousarray(values)))


@kernel
def nonfinite_rows(values: np.ndarray) -> np.ndarray:
    """Boolean mask of rows that hold a NaN or an Inf."""
    bad = np.zeros(values.shape[0], dtype=np.bool_)
    dim = values.shape[1]
    for i in range(values.shape[0]):
        for j in range(dim):
            if not np.isfinite(values[i, j]):
                bad[i] = True
                break
    return bad


@kernel
def any_shared(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether the int64 keys ``a`` and ``b`` have a key in common: the shorter sorted, each key of the
    longer looked up in it by bisection. ``np.isin(a, b).any()`` sorts both together; with a few keys
    against thousands (a worker's pushes still open against a pull's keys) it cost 1.4 ms where this
    costs tens of microseconds."""
    short, long = (a, b) if a.shape[0] <= b.shape[0] else (b, a)
    if short.shape[0] == 0:
        return False
    ordered = np.sort(short)
    lowest, highest = ordered[0], ordered[-1]
    for i in range(long.shape[0]):
        key = long[i]
        if lowest <= key <= highest and ordered[np.searchsorted(ordered, key)] == key:
            return True
    return False


@kernel
def is_strictly_increasing(rows: np.ndarray) -> bool:
    for i in range(1, rows.shape[0]):
        if rows[i] <= rows[i - 1]:
            return False
    return True


@kernel
def sum_duplicates(rows: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct rows (ascending) and the sum of each one's gradients."""
    order = np.argsort(rows, kind="mergesort")
    distinct = 0
    for i in range(order.shape[0]):
        if i == 0 or rows[order[i]] != rows[order[i - 1]]:
            distinct += 1
    out_rows = np.empty(distinct, dtype=np.int64)
    out = np.zeros((distinct, grads.shape[1]), dtype=grads.dtype)
    d = -1
    for i in range(order.shape[0]):
        src = order[i]
        if i == 0 or rows[src] != rows[order[i - 1]]:
            d += 1
            out_rows[d] = rows[src]
        for j in range(grads.shape[1]):
            out[d, j] += grads[src, j]
    return out_rows, out


# -------------------------------------------------------------------- sampling


@kernel
def alias_table(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Walker's alias table of non-negative ``weights`` with a positive sum (Vose's construction):
    key ``k`` keeps its column with probability ``prob[k]`` and gives it to ``alias[k]`` otherwise,
    so a draw costs one uniform and one comparison where a binary search over the CDF mispredicts
    a branch per level (``alias_draw``)."""
    n = weights.shape[0]
    scaled = weights * (n / weights.sum())
    prob = np.ones(n, dtype=np.float64)
    alias = np.arange(n)
    small = np.empty(n, dtype=np.int64)
    large = np.empty(n, dtype=np.int64)
    num_small = num_large = 0
    for k in range(n):
        if scaled[k] < 1.0:
            small[num_small] = k
            num_small += 1
        else:
            large[num_large] = k
            num_large += 1
    while num_small > 0 and num_large > 0:
        num_small -= 1
        s = small[num_small]
        big = large[num_large - 1]
        prob[s] = scaled[s]
        alias[s] = big
        scaled[big] = (scaled[big] + scaled[s]) - 1.0
        if scaled[big] < 1.0:  # it gave away more than its excess: now a small column itself
            num_large -= 1
            small[num_small] = big
            num_small += 1
    return prob, alias  # columns left over hold (up to rounding) exactly 1: they keep prob 1


@kernel
def alias_draw(prob: np.ndarray, alias: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """Keys drawn from an ``alias_table``, one per uniform in ``[0, 1)``: its integer part (times the
    number of columns) picks the column, its fraction decides between the column's two keys."""
    n = prob.shape[0]
    out = np.empty(uniforms.shape[0], dtype=np.int64)
    for i in range(uniforms.shape[0]):
        x = uniforms[i] * n
        k = min(int(x), n - 1)
        out[i] = k if x - k < prob[k] else alias[k]
    return out


# --------------------------------------------------------------- update rules


@kernel
def adagrad_rows(
    values: np.ndarray, accum: np.ndarray, rows: np.ndarray, grads: np.ndarray, lr: float, eps: float
) -> None:
    """Adagrad on distinct ``rows``."""
    dim = values.shape[1]
    for i in range(rows.shape[0]):
        r = rows[i]
        for j in range(dim):
            g = grads[i, j]
            h = accum[r, j] + g * g
            accum[r, j] = h
            values[r, j] -= lr * g / (np.sqrt(h) + eps)


@kernel
def adam_rows(
    values: np.ndarray,
    first: np.ndarray,
    second: np.ndarray,
    steps: np.ndarray,
    rows: np.ndarray,
    grads: np.ndarray,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
) -> None:
    """Adam on distinct ``rows`` with a step count per row."""
    dim = values.shape[1]
    for i in range(rows.shape[0]):
        r = rows[i]
        t = steps[r] + 1
        steps[r] = t
        step = lr / (1.0 - beta1**t)
        root_correction = np.sqrt(1.0 - beta2**t)
        for j in range(dim):
            g = grads[i, j]
            m = beta1 * first[r, j] + (1.0 - beta1) * g
            v = beta2 * second[r, j] + (1.0 - beta2) * g * g
            first[r, j] = m
            second[r, j] = v
            values[r, j] -= step * m / (np.sqrt(v) / root_correction + eps)


# -------------------------------------------------------------- initialisation

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


@kernel
def _splitmix64(x: np.uint64) -> np.uint64:
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


@kernel
def _unit(x: np.uint64) -> float:
    """A uniform double in [0, 1) from 64 random bits."""
    return float(x >> np.uint64(11)) * (1.0 / 9007199254740992.0)


@kernel
def seeded_uniform(seed: np.uint64, keys: np.ndarray, out: np.ndarray, low: float, high: float) -> None:
    """Row ``i`` of ``out`` depends only on ``(seed, keys[i])``."""
    dim = out.shape[1]
    base = _splitmix64(seed)
    for i in range(keys.shape[0]):
        row_seed = _splitmix64(base ^ np.uint64(keys[i]))
        for j in range(dim):
            u = _unit(_splitmix64(row_seed + np.uint64(j)))
            out[i, j] = low + (high - low) * u


@kernel
def seeded_normal(seed: np.uint64, keys: np.ndarray, out: np.ndarray, mean: float, std: float) -> None:
    """Box-Muller on two counter-derived uniforms per value."""
    dim = out.shape[1]
    base = _splitmix64(seed)
    two = np.uint64(2)
    for i in range(keys.shape[0]):
        row_seed = _splitmix64(base ^ np.uint64(keys[i]))
        for j in range(dim):
            c = row_seed + two * np.uint64(j)
            u1 = _unit(_splitmix64(c))
            u2 = _unit(_splitmix64(c + np.uint64(1)))
            radius = np.sqrt(-2.0 * np.log(1.0 - u1))
            out[i, j] = mean + std * radius * np.cos(2.0 * np.pi * u2)


def warm_up(dtype: Any = np.float32) -> None:
    """Load numba and the kernels rows of ``dtype`` go through now: numba's import and first call cost
    a process about 0.5 s even from the cache and each kernel after that 3-20 ms, which would
    otherwise land on a job's first batches (the row paths of every table kind: checks, gathers,
    adds, present rows, a replica's changes; the initial rows)."""
    keys = np.zeros(1, dtype=np.int64)
    rows = np.zeros((1, 1), dtype=dtype)
    flags = np.zeros(1, dtype=np.uint8)
    absent_at = np.zeros(1, dtype=np.int64)
    first_out_of_range(keys, 1)
    any_shared(keys, keys)
    partition_by_owner(keys, 1)  # a batch split over nodes (a static table's remote rows) or slices
    any_nonfinite(rows)
    gather_rows(rows, keys, rows.copy())
    gather_place(rows, keys, keys, rows.copy())
    place_rows(rows.copy(), keys, rows)
    add_rows(rows.copy(), keys, rows, 1.0)
    pins = np.zeros(1, dtype=np.uint8)
    holds = np.zeros(2, dtype=np.int64)
    read_present(rows, flags, pins, rows, keys, rows.copy(), absent_at)
    add_present(rows.copy(), flags.copy(), flags, pins, flags.copy(), rows.copy(), keys, rows, 1.0, absent_at)
    take_changes(rows.copy(), rows.copy(), flags.copy(), pins, flags.copy(), rows, keys, np.zeros(1, dtype=np.bool_))
    receive_replicas(rows.copy(), rows.copy(), flags.copy(), keys, rows, absent_at.copy())
    add_owned_and_read(rows.copy(), flags.copy(), pins, flags.copy(), rows.copy(), flags.copy().astype(np.bool_), keys,
                       rows, rows.copy())
    apply_synced(rows.copy(), rows.copy(), flags.copy(), flags.copy(), pins, flags.copy(), rows.copy(), keys, rows,
                 flags, absent_at.copy())
    receive_rows(rows.copy(), rows.copy(), flags.copy(), flags.copy(), pins, flags.copy(), rows.copy(), keys, rows)
    give_unheld(rows, flags.copy(), pins, flags.copy(), rows, keys, rows.copy(), absent_at.copy())
    pin_in_place(rows.copy(), flags, flags.copy(), pins.copy(), holds.copy(), flags.copy(), rows, 1, keys,
                 absent_at.copy(), absent_at.copy())
    release(pins.copy(), holds, 1, keys)
    fold_arrived(rows.copy(), pins, flags.copy(), rows)
    slice_slots_in_place(keys, keys, 0, absent_at.copy(), absent_at.copy())
    seeded_uniform(np.uint64(0), keys, rows.copy(), 0.0, 1.0)  # a table's initial rows, at its build
    seeded_normal(np.uint64(0), keys, rows.copy(), 0.0, 1.0)


def warm_up_meanwhile(dtype: Any = np.float32) -> threading.Thread:
    """``warm_up`` on a thread of its own, while the caller waits on the network (a table's servers
    building it); join it before the first pull or push that is timed."""
    thread = threading.Thread(target=warm_up, args=(dtype,), name="shoal-numba-warm-up", daemon=True)
    thread.start()
    return thread
