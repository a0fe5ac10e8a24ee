"""The KGE example's compiled ComplEx step: the gradient of its loss, both sides corrupted, and its
steps on rows where they lie."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "kge"))
from complex_model import adagrad_delta, complex_step, complex_steps_in_place  # noqa: E402


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


def test_a_step_in_place_is_the_step_on_gathered_rows_with_its_change_added():
    rng = np.random.default_rng(2)
    d, num_entities = 3, 12
    ent = np.zeros((num_entities, 4 * d), np.float32)
    ent[:, : 2 * d] = rng.standard_normal((num_entities, 2 * d))
    rel = np.zeros((3, 4 * d), np.float32)
    rel[:, : 2 * d] = rng.standard_normal((3, 2 * d))
    ent[:, 2 * d:] = rel[:, 2 * d:] = 0.5  # accumulators already under way
    heads, rels, tails = np.array([0, 1, 2, 9]), np.array([0, 1, 2, 1]), np.array([3, 4, 5, 0])
    tail_negs, head_negs = rng.integers(0, num_entities, (4, 2)), rng.integers(0, num_entities, (4, 2))
    # As the baseline does: gather the distinct rows, one step, add the change.
    keys, inv = np.unique(np.concatenate([heads, tails, tail_negs.ravel(), head_negs.ravel()]), return_inverse=True)
    e, r = ent[keys], rel.copy()
    g_e, g_r = np.zeros((keys.size, 2 * d), np.float32), np.zeros((3, 2 * d), np.float32)
    complex_step(e, r, inv[:4], rels, inv[4:8], inv[8:16].reshape(4, 2), inv[16:].reshape(4, 2),
                 np.arange(keys.size), np.arange(3), d, 1e-3, g_e, g_r)
    delta_e, delta_r = np.empty_like(e), np.empty_like(r)
    adagrad_delta(e, g_e, 0.1, d, delta_e)
    adagrad_delta(r, g_r, 0.1, d, delta_r)
    expected_e, expected_r = ent.copy(), rel + delta_r
    expected_e[keys] += delta_e
    unmapped_e, unmapped_r = np.full(num_entities, -1), np.full(3, -1)
    complex_steps_in_place(ent, rel, heads, rels, tails, tail_negs, head_negs, np.arange(4), 4, d, 0.1, 1e-3,
                           unmapped_e, unmapped_r)
    np.testing.assert_allclose(ent, expected_e, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rel, expected_r, rtol=1e-5, atol=1e-6)
    assert (unmapped_e == -1).all() and (unmapped_r == -1).all()  # the scratch is left as it came


def test_steps_in_place_take_the_triples_asked_for_in_turn():
    rng = np.random.default_rng(3)
    d = 2
    ent = np.zeros((6, 4 * d), np.float32)
    ent[:, : 2 * d] = rng.standard_normal((6, 2 * d))
    rel = np.zeros((1, 4 * d), np.float32)
    rel[:, : 2 * d] = 1.0
    untouched = ent[5].copy()
    heads, rels, tails = np.array([0, 5, 2]), np.zeros(3, np.int64), np.array([1, 4, 3])
    negs = np.array([[2], [4], [0]])
    one_by_one = ent.copy(), rel.copy()
    for b in (0, 2):  # steps of one triple: the second reads the first's update
        complex_steps_in_place(*one_by_one, heads, rels, tails, negs, negs, np.array([b]), 1, d, 0.1, 0.0,
                               np.full(6, -1), np.full(1, -1))
    complex_steps_in_place(ent, rel, heads, rels, tails, negs, negs, np.array([0, 2]), 1, d, 0.1, 0.0,
                           np.full(6, -1), np.full(1, -1))
    np.testing.assert_array_equal(ent, one_by_one[0])
    np.testing.assert_array_equal(ent[5], untouched)  # triple 1 was not asked for
