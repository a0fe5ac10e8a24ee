"""Biased matrix factorisation: r = mu + p_u . q_i + b_u + b_i.

A user's row is ``[p_u, b_u]`` and an item's row is ``[q_i, b_i]``; both live in
tables of width ``rank + 1``. The gradient of one rating's squared error plus
L2 regularisation is computed for a whole batch at once (``gradients``: pushed,
or added to gathered rows), or the SGD step taken rating after rating on the
rows where they lie (``sgd_in_place``: no gather, no scatter).
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

import shoal
from shoal.storage.initialize import fill_initial


@dataclass(frozen=True)
class Hyper:
    rank: int = 64
    lr: float = 0.01
    reg: float = 0.05
    batch: int = 1000
    epochs: int = 20
    init_std: float = 0.1


#: the tables' names: users and items in one adaptive table (the items' keys after the users'), or in two
ONE_TABLE, USERS, ITEMS = "mf.factors", "mf.users", "mf.items"


def initializer(hyper: Hyper) -> shoal.Normal:
    """How the tables' rows start out."""
    return shoal.Normal(std=hyper.init_std)


def initial_rows(num_users: int, num_items: int, hyper: Hyper, seed: int, one_table: bool
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The user and item rows Shoal's tables start from with ``seed`` (``train.py --init-seed``), in one
    table or two: each key's row is drawn from the seed, the table's name and the key, so a model
    trained elsewhere (the baseline) can start where a job does. A seed's rows alone move the test
    RMSE after 20 epochs by as much as 0.005 here."""
    def rows(name: str, num_keys: int, keys: np.ndarray) -> np.ndarray:
        spec = shoal.TableSpec(name, num_keys, hyper.rank + 1, init=initializer(hyper), seed=seed)
        out = np.empty((keys.shape[0], spec.dim), np.float32)
        fill_initial(spec, keys, out)
        return out

    if one_table:
        total = num_users + num_items
        return rows(ONE_TABLE, total, np.arange(num_users)), rows(ONE_TABLE, total, np.arange(num_users, total))
    return rows(USERS, num_users, np.arange(num_users)), rows(ITEMS, num_items, np.arange(num_items))


def predict(user_rows: np.ndarray, item_rows: np.ndarray, mu: float) -> np.ndarray:
    k = user_rows.shape[1] - 1
    dot = np.einsum("ij,ij->i", user_rows[:, :k], item_rows[:, :k])
    return mu + dot + user_rows[:, k] + item_rows[:, k]


def gradients(
    user_rows: np.ndarray, item_rows: np.ndarray, ratings: np.ndarray, mu: float, reg: float,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, float]:
    """Gradients for the user and item rows of a batch, and the batch's squared error sum. With
    ``out`` (``2n`` rows) the users' gradients are written into its first ``n`` rows and the items'
    into the rest, for one push of both to one table."""
    k = user_rows.shape[1] - 1
    err = ratings - predict(user_rows, item_rows, mu)
    if out is None:
        grad_u = reg * user_rows
        grad_i = reg * item_rows
    else:
        n = user_rows.shape[0]
        grad_u = np.multiply(user_rows, reg, out=out[:n])
        grad_i = np.multiply(item_rows, reg, out=out[n : 2 * n])
    e = err[:, None]
    grad_u[:, :k] -= e * item_rows[:, :k]
    grad_i[:, :k] -= e * user_rows[:, :k]
    grad_u[:, k] -= err
    grad_i[:, k] -= err
    return grad_u, grad_i, float(err @ err)


def rmse(user_table: np.ndarray, item_table: np.ndarray, users: np.ndarray, items: np.ndarray,
         ratings: np.ndarray, mu: float) -> float:
    pred = np.clip(predict(user_table[users], item_table[items], mu), 1.0, 5.0)
    return float(np.sqrt(np.mean((ratings - pred) ** 2)))


@numba.njit(nogil=True, fastmath=True, cache=True)
def sgd_in_place(users: np.ndarray, items: np.ndarray, user_rows: np.ndarray, item_rows: np.ndarray,
                 ratings: np.ndarray, which: np.ndarray, mu: float, lr: float, reg: float) -> float:
    """One SGD step per rating ``n`` in ``which``, in turn, on rows ``user_rows[n]`` of ``users`` and
    ``item_rows[n]`` of ``items`` where they lie (``gradients``' gradient, scaled by ``lr``); returns
    the squared error sum, each rating's before its step."""
    k = users.shape[1] - 1
    squared = 0.0
    for n in which:
        u, i = user_rows[n], item_rows[n]
        pred = mu + users[u, k] + items[i, k]
        for j in range(k):
            pred += users[u, j] * items[i, j]
        err = ratings[n] - pred
        squared += err * err
        for j in range(k):
            pu, qi = users[u, j], items[i, j]
            users[u, j] = pu - lr * (reg * pu - err * qi)
            items[i, j] = qi - lr * (reg * qi - err * pu)
        users[u, k] -= lr * (reg * users[u, k] - err)
        items[i, k] -= lr * (reg * items[i, k] - err)
    return squared
