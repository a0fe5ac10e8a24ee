"""The KGE example's compiled ComplEx step: the gradient of its loss, both sides corrupted."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "kge"))
from complex_model import complex_step  # noqa: E402


def _loss_and_grads(ent: np.ndarray, rel: np.ndarray, reg: float) -> tuple[float, np.ndarray, np.ndarray]:
    d = ent.shape[1] // 2
    heads, rels, tails = np.array([0, 1]), np.array([0, 1]), np.array([2, 3])
    tail_negs, head_negs = np.array([[4, 5], [5, 6]]), np.array([[6, 7], [4, 7]])
    g_e, g_r = np.zeros_like(ent), np.zeros_like(rel)
    loss = complex_step(ent, rel, heads, rels, tails, tail_negs, head_negs, np.arange(ent.shape[0]),
                        np.arange(rel.shape[0]), d, reg, g_e, g_r)
    return loss, g_e, g_r


def test_the_step_returns_the_gradient_of_its_loss_over_both_sides_corruptions():
    rng = np.random.default_rng(0)
    ent, rel = rng.standard_normal((8, 6)), rng.standard_normal((2, 6))
    loss, g_e, g_r = _loss_and_grads(ent, rel, 0.0)
    eps = 1e-6
    for table, grads in ((ent, g_e), (rel, g_r)):
        for i, k in np.ndindex(table.shape):
            table[i, k] += eps
            up = _loss_and_grads(ent, rel, 0.0)[0]
            table[i, k] -= 2 * eps
            down = _loss_and_grads(ent, rel, 0.0)[0]
            table[i, k] += eps
            assert abs((up - down) / (2 * eps) - grads[i, k]) < 1e-6, (i, k)
    # Rows 6 and 7 appear only as corrupted heads: the heads' side is trained.
    assert np.abs(g_e[7]).sum() > 0


def test_regularisation_pulls_every_row_a_score_reads_towards_zero():
    rng = np.random.default_rng(1)
    ent, rel = rng.standard_normal((8, 6)), rng.standard_normal((2, 6))
    _, plain, plain_r = _loss_and_grads(ent, rel, 0.0)
    _, regular, regular_r = _loss_and_grads(ent, rel, 0.5)
    # Row 7 is read by two scores (a corrupted head of each triple), each of the 2 x 5 = 10 scores
    # weighing 1/10: its pull is 2 x 0.5 x row / 10.
    np.testing.assert_allclose(regular[7] - plain[7], 2 * 0.5 * ent[7] / 10, rtol=1e-9)
    # Relation 0 is read by the 5 scores of the first triple.
    np.testing.assert_allclose(regular_r[0] - plain_r[0], 5 * 0.5 * rel[0] / 10, rtol=1e-9)
