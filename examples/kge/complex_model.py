"""ComplEx (Trouillon et al., 2016) with negative sampling and a logistic loss, vectorised over a batch.

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
    negatives: int = 6
    batch: int = 1000
    lr: float = 0.1
    reg: float = 1e-6
    init_std: float = 0.1


def row_width(h: Hyper) -> int:
    return 4 * h.dim


def score(head: np.ndarray, rel: np.ndarray, tail: np.ndarray, d: int) -> np.ndarray:
    """Re(<h, r, conj(t)>) for rows of the embedding halves (broadcasting over leading axes)."""
    hr, hi = head[..., :d], head[..., d:2 * d]
    rr, ri = rel[..., :d], rel[..., d:2 * d]
    tr, ti = tail[..., :d], tail[..., d:2 * d]
    return np.sum(hr * (rr * tr + ri * ti) + hi * (rr * ti - ri * tr), axis=-1)


def batch_gradients(ent: np.ndarray, rel: np.ndarray, heads: np.ndarray, rels: np.ndarray, tails: np.ndarray,
                    negs: np.ndarray, d: int, reg: float) -> tuple[np.ndarray, np.ndarray, float]:
    """Gradients of the mean logistic loss w.r.t. the embedding halves.

    ``ent``/``rel`` hold the rows; ``heads``, ``rels``, ``tails`` index them
    (shape ``B``), ``negs`` the corrupted tails (``B x N``). Returns per-index
    gradients for entity rows (heads, tails, negatives concatenated, shape
    ``(2B + BN, 2d)``), for relation rows (``(B, 2d)``), and the loss.
    """
    h, r, t = ent[heads, : 2 * d], rel[rels, : 2 * d], ent[tails, : 2 * d]
    n = ent[negs, : 2 * d]  # (B, N, 2d)
    pos = score(h, r, t, d)
    neg = score(h[:, None, :], r[:, None, :], n, d)
    # d/ds of softplus(-y s) = -y * sigmoid(-y s)
    gp = -1.0 / (1.0 + np.exp(pos))  # y = +1
    gn = 1.0 / (1.0 + np.exp(-neg))  # y = -1
    scale = 1.0 / (pos.shape[0] * (1 + negs.shape[1]))
    gp = (gp * scale).astype(ent.dtype)
    gn = (gn * scale).astype(ent.dtype)
    loss = float((np.logaddexp(0, -pos).sum() + np.logaddexp(0, neg).sum()) * scale)

    hr, hi, rr, ri, tr, ti = h[:, :d], h[:, d:], r[:, :d], r[:, d:], t[:, :d], t[:, d:]
    nr, ni = n[..., :d], n[..., d:]
    # positive triple
    g_h = np.concatenate([rr * tr + ri * ti, rr * ti - ri * tr], axis=1) * gp[:, None]
    g_r = np.concatenate([hr * tr + hi * ti, hr * ti - hi * tr], axis=1) * gp[:, None]
    g_t = np.concatenate([hr * rr - hi * ri, hi * rr + hr * ri], axis=1) * gp[:, None]
    # negatives: the head and relation of each gather N contributions
    gnw = gn[..., None]
    g_h += np.concatenate([(rr[:, None] * nr + ri[:, None] * ni) * gnw,
                           (rr[:, None] * ni - ri[:, None] * nr) * gnw], axis=2).sum(axis=1)
    g_r += np.concatenate([(hr[:, None] * nr + hi[:, None] * ni) * gnw,
                           (hr[:, None] * ni - hi[:, None] * nr) * gnw], axis=2).sum(axis=1)
    g_n = np.concatenate([(hr * rr - hi * ri)[:, None] * gnw, (hi * rr + hr * ri)[:, None] * gnw], axis=2)
    g_ent = np.concatenate([g_h, g_t, g_n.reshape(-1, 2 * d)]) + reg * np.concatenate(
        [h, t, n.reshape(-1, 2 * d)])
    return g_ent, g_r + reg * r, loss


@numba.njit(nogil=True, fastmath=True, cache=True)
def _softplus(x: float) -> float:
    return x + np.log1p(np.exp(-x)) if x > 0 else np.log1p(np.exp(x))


@numba.njit(nogil=True, fastmath=True, cache=True)
def complex_step(ent: np.ndarray, rel: np.ndarray, heads: np.ndarray, rels: np.ndarray, tails: np.ndarray,
                 negs: np.ndarray, ent_slot: np.ndarray, rel_slot: np.ndarray, d: int, reg: float,
                 g_ent: np.ndarray, g_rel: np.ndarray) -> float:
    """Gradients of the mean logistic loss for a batch, compiled.

    ``heads``, ``tails``, ``negs`` (``B x N``) index rows of ``ent``, ``rels`` rows
    of ``rel``. The gradient of row ``i`` is added to ``g_ent[ent_slot[i]]`` (and
    ``g_rel[rel_slot[i]]``), so rows of the same key share one accumulator.
    Returns the mean loss.
    """
    batch, num_neg = negs.shape
    scale = 1.0 / (batch * (1 + num_neg))
    loss = 0.0
    for b in range(batch):
        h, r = heads[b], rels[b]
        sh, sr = ent_slot[h], rel_slot[r]
        for j in range(num_neg + 1):
            t = tails[b] if j == 0 else negs[b, j - 1]
            st = ent_slot[t]
            s = 0.0
            for k in range(d):
                hr, hi = ent[h, k], ent[h, d + k]
                rr, ri = rel[r, k], rel[r, d + k]
                tr, ti = ent[t, k], ent[t, d + k]
                s += hr * (rr * tr + ri * ti) + hi * (rr * ti - ri * tr)
            if j == 0:
                loss += _softplus(-s)
                g = -scale / (1.0 + np.exp(s))
            else:
                loss += _softplus(s)
                g = scale / (1.0 + np.exp(-s))
            # L2 regularisation once per row occurrence: head and relation with the positive only.
            own = reg if j == 0 else 0.0
            for k in range(d):
                hr, hi = ent[h, k], ent[h, d + k]
                rr, ri = rel[r, k], rel[r, d + k]
                tr, ti = ent[t, k], ent[t, d + k]
                g_ent[sh, k] += g * (rr * tr + ri * ti) + own * hr
                g_ent[sh, d + k] += g * (rr * ti - ri * tr) + own * hi
                g_rel[sr, k] += g * (hr * tr + hi * ti) + own * rr
                g_rel[sr, d + k] += g * (hr * ti - hi * tr) + own * ri
                g_ent[st, k] += g * (hr * rr - hi * ri) + reg * tr
                g_ent[st, d + k] += g * (hi * rr + hr * ri) + reg * ti
    return loss * scale


@numba.njit(nogil=True, fastmath=True, cache=True)
def adagrad_delta(rows: np.ndarray, grads: np.ndarray, lr: float, d: int, out: np.ndarray) -> None:
    """``out`` = the additive change of one Adagrad step: ``[-lr g / sqrt(acc + g^2), g^2]``."""
    for i in range(grads.shape[0]):
        for k in range(2 * d):
            g = grads[i, k]
            sq = g * g
            out[i, k] = -lr * g / (np.sqrt(rows[i, 2 * d + k] + sq) + 1e-10)
            out[i, 2 * d + k] = sq


def sum_by_key(keys: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct keys and the sum of their gradients (sort and reduce)."""
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
    return sorted_keys[starts], np.add.reduceat(grads[order], starts, axis=0)


def adagrad_update(rows: np.ndarray, grads: np.ndarray, lr: float, d: int, eps: float = 1e-10) -> np.ndarray:
    """The additive change to ``rows`` (embedding and accumulator halves) of one Adagrad step."""
    sq = grads * grads
    acc = rows[:, 2 * d:] + sq
    return np.concatenate([-lr * grads / (np.sqrt(acc) + eps), sq], axis=1)


def filtered_ranks(ent: np.ndarray, rel: np.ndarray, triples: np.ndarray, known: set[tuple[int, int, int]],
                   d: int) -> np.ndarray:
    """Filtered rank of the true tail and of the true head of each triple among all entities."""
    ranks = []
    for h, r, t in triples:
        for side in ("tail", "head"):
            if side == "tail":
                s = score(ent[h, : 2 * d], rel[r, : 2 * d], ent[:, : 2 * d], d)
                true, others = t, [x for x in range(ent.shape[0]) if (h, r, x) in known and x != t]
            else:
                s = score(ent[:, : 2 * d], rel[r, : 2 * d], ent[t, : 2 * d], d)
                true, others = h, [x for x in range(ent.shape[0]) if (x, r, t) in known and x != h]
            s = s.copy()
            s[others] = -np.inf
            ranks.append(1 + int((s > s[true]).sum()))
    return np.array(ranks)


def mrr_hits(ranks: np.ndarray) -> tuple[float, float]:
    return float(np.mean(1.0 / ranks)), float(np.mean(ranks <= 10))
