"""ComplEx (Trouillon et al., 2016) with negative sampling on both sides and a logistic loss, compiled.

An embedding row is ``[re (d), im (d), acc_re (d), acc_im (d)]``: the last half
holds Adagrad accumulators, so the update a worker pushes is additive (a
change of the embedding and of its accumulator) and any parameter server
rule that sums, or a replica that syncs deltas, applies it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np


@dataclass(frozen=True)
class Hyper:
    dim: int = 100  # complex dimensions: a row holds 4 * dim floats
    negatives: int = 6  # per side: each triple is scored against 6 corrupted tails and 6 corrupted heads
    batch: int = 1000
    lr: float = 0.1
    reg: float = 1e-3  # L2, on every row a score reads
    init_std: float = 0.1


def row_width(h: Hyper) -> int:
    return 4 * h.dim


def score(head: np.ndarray, rel: np.ndarray, tail: np.ndarray, d: int) -> np.ndarray:
    """Re(<h, r, conj(t)>) for rows of the embedding halves (broadcasting over leading axes)."""
    hr, hi = head[..., :d], head[..., d:2 * d]
    rr, ri = rel[..., :d], rel[..., d:2 * d]
    tr, ti = tail[..., :d], tail[..., d:2 * d]
    return np.sum(hr * (rr * tr + ri * ti) + hi * (rr * ti - ri * tr), axis=-1)


@numba.njit(nogil=True, fastmath=True, cache=True)
def _softplus(x: float) -> float:
    return x + np.log1p(np.exp(-x)) if x > 0 else np.log1p(np.exp(x))


@numba.njit(nogil=True, fastmath=True, cache=True)
def complex_step(ent: np.ndarray, rel: np.ndarray, heads: np.ndarray, rels: np.ndarray, tails: np.ndarray,
                 tail_negs: np.ndarray, head_negs: np.ndarray, ent_slot: np.ndarray, rel_slot: np.ndarray, d: int,
                 reg: float, g_ent: np.ndarray, g_rel: np.ndarray) -> float:
    """Gradients of the mean logistic loss for a batch, compiled.

    Each triple ``(heads[b], rels[b], tails[b])`` is scored against its corruptions on both sides, as
    filtered MRR ranks both: ``tail_negs[b]`` replace its tail, ``head_negs[b]`` its head (``B x N``
    each, rows of ``ent``; ``rels`` index rows of ``rel``). L2 regularisation ``reg`` applies to every
    row a score reads, once per score. The gradient of row ``i`` is added to ``g_ent[ent_slot[i]]``
    (and ``g_rel[rel_slot[i]]``), so rows of the same key share one accumulator. Returns the mean loss
    per score.
    """
    batch, num_neg = tail_negs.shape
    scale = 1.0 / (batch * (1 + 2 * num_neg))
    loss = 0.0
    for b in range(batch):
        r = rels[b]
        sr = rel_slot[r]
        for j in range(2 * num_neg + 1):
            h = heads[b] if j <= num_neg else head_negs[b, j - num_neg - 1]
            t = tails[b] if j == 0 or j > num_neg else tail_negs[b, j - 1]
            sh, st = ent_slot[h], ent_slot[t]
            s = 0.0
            for k in range(d):
                hr, hi = ent[h, k], ent[h, d + k]
                rr, ri = rel[r, k], rel[r, d + k]
                tr, ti = ent[t, k], ent[t, d + k]
                s += hr * (rr * tr + ri * ti) + hi * (rr * ti - ri * tr)
            if j == 0:
                loss += _softplus(-s)
                g = -1.0 / (1.0 + np.exp(s))
            else:
                loss += _softplus(s)
                g = 1.0 / (1.0 + np.exp(-s))
            g *= scale
            w = reg * scale
            for k in range(d):
                hr, hi = ent[h, k], ent[h, d + k]
                rr, ri = rel[r, k], rel[r, d + k]
                tr, ti = ent[t, k], ent[t, d + k]
                g_ent[sh, k] += g * (rr * tr + ri * ti) + w * hr
                g_ent[sh, d + k] += g * (rr * ti - ri * tr) + w * hi
                g_rel[sr, k] += g * (hr * tr + hi * ti) + w * rr
                g_rel[sr, d + k] += g * (hr * ti - hi * tr) + w * ri
                g_ent[st, k] += g * (hr * rr - hi * ri) + w * tr
                g_ent[st, d + k] += g * (hi * rr + hr * ri) + w * ti
    return loss * scale


# The Adagrad kernels divide as numpy does and index rows through views: with Python's zero-division
# check in the loop, or 2-d indexing into two halves of a row, LLVM left the loop scalar (5x the time).
@numba.njit(nogil=True, fastmath=True, cache=True, error_model="numpy")
def adagrad_delta(rows: np.ndarray, grads: np.ndarray, lr: float, d: int, out: np.ndarray) -> None:
    """``out`` = the additive change of one Adagrad step: ``[-lr g / sqrt(acc + g^2), g^2]``."""
    w = 2 * d
    for i in range(grads.shape[0]):
        grad, acc, change, squares = grads[i], rows[i, w:], out[i, :w], out[i, w:]
        for k in range(w):
            g = grad[k]
            sq = g * g
            change[k] = -lr * g / (np.sqrt(acc[k] + sq) + 1e-10)
            squares[k] = sq


@numba.njit(nogil=True, fastmath=True, cache=True, error_model="numpy")
def complex_steps_in_place(ent: np.ndarray, rel: np.ndarray, heads: np.ndarray, rels: np.ndarray,
                           tails: np.ndarray, tail_negs: np.ndarray, head_negs: np.ndarray, which: np.ndarray,
                           step: int, d: int, lr: float, reg: float, ent_map: np.ndarray, rel_map: np.ndarray
                           ) -> float:
    """Adagrad steps of ``step`` triples each on the rows where they lie (``step=1``: one per triple,
    as AdaPM's app trains): the triples ``which`` in turn, each step's gradients as ``complex_step``
    sums them (rows of a key share one), then the step on each distinct row. Indices are rows of
    ``ent`` and ``rel``; ``ent_map`` and ``rel_map`` (one entry per row, all -1) are scratch, left all
    -1. Returns the mean loss per score."""
    num_neg = tail_negs.shape[1]
    total = 0.0
    for first in range(0, which.shape[0], step):
        chunk = which[first:first + step]
        used_e = np.empty((2 + 2 * num_neg) * chunk.shape[0], np.int64)
        used_r = np.empty(chunk.shape[0], np.int64)
        ne = 0
        nr = 0
        for b in chunk:
            r = rels[b]
            if rel_map[r] < 0:
                rel_map[r] = nr
                used_r[nr] = r
                nr += 1
            for j in range(-2, 2 * num_neg):
                e = heads[b] if j == -2 else tails[b] if j == -1 else (
                    tail_negs[b, j] if j < num_neg else head_negs[b, j - num_neg])
                if ent_map[e] < 0:
                    ent_map[e] = ne
                    used_e[ne] = e
                    ne += 1
        g_ent = np.zeros((ne, 2 * d), np.float32)
        g_rel = np.zeros((nr, 2 * d), np.float32)
        total += complex_step(ent, rel, heads[chunk], rels[chunk], tails[chunk], tail_negs[chunk],
                              head_negs[chunk], ent_map, rel_map, d, reg, g_ent, g_rel) * chunk.shape[0]
        for u in range(ne):
            _adagrad_in_place(ent, used_e[u], g_ent[u], lr, d)
            ent_map[used_e[u]] = -1
        for u in range(nr):
            _adagrad_in_place(rel, used_r[u], g_rel[u], lr, d)
            rel_map[used_r[u]] = -1
    return total / max(1, which.shape[0])


@numba.njit(nogil=True, fastmath=True, cache=True, inline="always", error_model="numpy")
def _adagrad_in_place(table: np.ndarray, row: int, grad: np.ndarray, lr: float, d: int) -> None:
    """The step ``adagrad_delta`` computes, applied to ``table[row]`` where it lies."""
    w = 2 * d
    values, accums = table[row, :w], table[row, w:]
    for k in range(w):
        g = grad[k]
        acc = accums[k] + g * g
        values[k] -= lr * g / (np.sqrt(acc) + 1e-10)
        accums[k] = acc


def warm_up(h: Hyper) -> None:
    """Compile the step's kernels now (or load them from numba's cache), so no timed step does."""
    rows = np.zeros((2, row_width(h)), np.float32)
    grads = np.zeros((2, 2 * h.dim), np.float32)
    one = np.zeros(1, np.int64)
    negs = np.zeros((1, 1), np.int64)
    complex_step(rows, rows, one, one, one, negs, negs, np.arange(2), np.arange(2), h.dim, h.reg, grads, grads)
    adagrad_delta(rows, grads, h.lr, h.dim, np.empty_like(rows))
    unmapped = np.full(2, -1, np.int64)
    complex_steps_in_place(rows, rows, one, one, one, negs, negs, np.arange(1), 1, h.dim, h.lr, h.reg, unmapped,
                           unmapped.copy())


def filtered_ranks(ent: np.ndarray, rel: np.ndarray, triples: np.ndarray, known: set[tuple[int, int, int]],
                   d: int) -> np.ndarray:
    """Filtered rank of the true tail and of the true head of each triple among all entities: one
    less than the entities scored above it, other known triples left out. Each side's scores are one
    product of matrices (for a tail: Re(<h, r, conj(t)>) = <h*r, t> over the real and imaginary halves)."""
    e = ent[:, : 2 * d].astype(np.float64)
    heads, rels, tails = (triples[:, i] for i in range(3))
    hr, hi = e[heads, :d], e[heads, d:]
    rr, ri = rel[rels, :d].astype(np.float64), rel[rels, d:2 * d].astype(np.float64)
    tr, ti = e[tails, :d], e[tails, d:]
    # einsum's own loop, not BLAS: BLAS threads spin on after a product, on cores the workers train on.
    tail_scores = np.einsum("ij,kj->ik", np.hstack([hr * rr - hi * ri, hr * ri + hi * rr]), e)  # all as tail
    head_scores = np.einsum("ij,kj->ik", np.hstack([rr * tr + ri * ti, rr * ti - ri * tr]), e)  # all as head
    tails_of: dict[tuple[int, int], list[int]] = {}
    heads_of: dict[tuple[int, int], list[int]] = {}
    for h, r, t in known:
        tails_of.setdefault((h, r), []).append(t)
        heads_of.setdefault((r, t), []).append(h)
    ranks = np.empty(2 * len(triples), dtype=np.int64)
    for i, (h, r, t) in enumerate(triples.tolist()):
        for j, (scores, true, others) in enumerate(((tail_scores[i], t, tails_of.get((h, r), [])),
                                                    (head_scores[i], h, heads_of.get((r, t), [])))):
            above = scores > scores[true]
            ranks[2 * i + j] = 1 + int(above.sum()) - int(above[others].sum())  # a known triple is no rival
    return ranks


def mrr_hits(ranks: np.ndarray) -> tuple[float, float]:
    return float(np.mean(1.0 / ranks)), float(np.mean(ranks <= 10))
