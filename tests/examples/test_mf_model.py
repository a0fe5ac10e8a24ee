"""The MF example's SGD step on rows where they lie against its batch gradient, and the initial rows a
model trained outside a job starts from against those of the job's tables."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.cluster import ThreadCluster

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "mf"))
from model import ITEMS, ONE_TABLE, USERS, Hyper, gradients, initial_rows, initializer, sgd_in_place  # noqa: E402


def test_a_step_in_place_per_rating_is_the_gradient_step_taken_rating_after_rating():
    rng = np.random.default_rng(0)
    users, items = rng.standard_normal((4, 5)).astype(np.float32), rng.standard_normal((3, 5)).astype(np.float32)
    user_of, item_of = np.array([2, 0, 2]), np.array([1, 1, 0])
    ratings = np.array([4.0, 1.0, 5.0], np.float32)
    mu, lr, reg = 3.5, 0.05, 0.1
    expected_u, expected_i, expected_error = users.copy(), items.copy(), 0.0
    for n in range(3):  # the second rating of user 2 sees the first one's step
        u, i = user_of[n], item_of[n]
        grad_u, grad_i, squared = gradients(expected_u[[u]], expected_i[[i]], ratings[[n]], mu, reg)
        expected_u[u] -= lr * grad_u[0]
        expected_i[i] -= lr * grad_i[0]
        expected_error += squared
    error = sgd_in_place(users, items, user_of, item_of, ratings, np.arange(3), mu, lr, reg)
    np.testing.assert_allclose(users, expected_u, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(items, expected_i, rtol=1e-5, atol=1e-6)
    assert abs(error - expected_error) < 1e-4


def test_only_the_ratings_asked_for_step():
    users, items = np.ones((2, 3), np.float32), np.ones((2, 3), np.float32)
    sgd_in_place(users, items, np.array([0, 1]), np.array([0, 1]), np.array([5.0, 5.0], np.float32), np.array([1]),
                 0.0, 0.1, 0.0)
    np.testing.assert_array_equal(users[0], 1.0)
    assert (users[1] > 1.0).all() and (items[1] > 1.0).all()


@pytest.mark.parametrize("one_table", [True, False])
def test_the_initial_rows_are_those_the_jobs_tables_start_from(one_table):
    """``initial_rows`` (the demo's baseline starts from them) against the rows two nodes' tables made as
    ``train.py`` makes them hold before any push: one adaptive table, the items' keys after the users',
    or a static table each."""
    hyper, seed, num_users, num_items = Hyper(rank=6), 3, 11, 7
    options = dict(init=initializer(hyper), seed=seed)

    def body(worker):
        if one_table:
            table = worker.table(ONE_TABLE, num_users + num_items, hyper.rank + 1, techniques="auto", **options)
            rows = table.pull(np.arange(num_users + num_items))
            return rows[:num_users], rows[num_users:]
        users = worker.table(USERS, num_users, hyper.rank + 1, **options)
        items = worker.table(ITEMS, num_items, hyper.rank + 1, **options)
        return users.pull(np.arange(num_users)), items.pull(np.arange(num_items))

    with ThreadCluster(nodes=2) as cluster:
        held = cluster.run_workers(body)
    users, items = initial_rows(num_users, num_items, hyper, seed, one_table)
    for held_users, held_items in held:
        np.testing.assert_array_equal(held_users, users)
        np.testing.assert_array_equal(held_items, items)
    assert users.std() > 0.05 and not np.array_equal(users[:num_items], items)  # drawn, and per key
