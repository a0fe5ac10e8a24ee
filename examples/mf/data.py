"""MovieLens 100k, read from the copy that the ``recbole`` package ships.

Install it without its dependencies (the data is all we need):

    pip install --no-deps recbole==1.2.1
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Ratings:
    users: np.ndarray  # int64, 0..num_users-1
    items: np.ndarray  # int64, 0..num_items-1
    values: np.ndarray  # float32

    def __len__(self) -> int:
        return int(self.users.shape[0])

    def take(self, index: np.ndarray) -> Ratings:
        return Ratings(self.users[index], self.items[index], self.values[index])


@dataclass(frozen=True)
class MovieLens:
    train: Ratings
    test: Ratings
    num_users: int
    num_items: int


def movielens_path() -> Path:
    spec = importlib.util.find_spec("recbole")
    if spec is None or spec.origin is None:
        raise SystemExit("MovieLens 100k comes from the recbole package: pip install --no-deps recbole==1.2.1")
    path = Path(spec.origin).parent / "dataset_example" / "ml-100k" / "ml-100k.inter"
    if not path.exists():
        raise SystemExit(f"recbole is installed but {path} is missing")
    return path


def load_movielens(test_fraction: float = 0.2, seed: int = 0) -> MovieLens:
    """All 100,000 ratings, split at random (seeded) into train and test."""
    raw = np.loadtxt(movielens_path(), skiprows=1, usecols=(0, 1, 2), dtype=np.int64)
    user_ids, users = np.unique(raw[:, 0], return_inverse=True)
    item_ids, items = np.unique(raw[:, 1], return_inverse=True)
    ratings = Ratings(users.astype(np.int64), items.astype(np.int64), raw[:, 2].astype(np.float32))
    order = np.random.default_rng(seed).permutation(len(ratings))
    cut = int(round(len(ratings) * (1 - test_fraction)))
    return MovieLens(ratings.take(order[:cut]), ratings.take(order[cut:]), len(user_ids), len(item_ids))


def synthetic_zipf(num_users: int = 20_000, num_items: int = 5_000, num_ratings: int = 500_000,
                   rank: int = 8, exponent: float = 1.1, test_fraction: float = 0.1, seed: int = 0) -> MovieLens:
    """A larger rating matrix with Zipf-distributed item popularity and a low-rank truth.

    Ratings are ``3.5 + p_u . q_i + noise``, clipped to [1, 5]; item ``i`` is
    drawn with probability proportional to ``(i + 1) ** -exponent``.
    """
    rng = np.random.default_rng(seed)
    weights = np.arange(1, num_items + 1, dtype=np.float64) ** -exponent
    items = rng.choice(num_items, size=num_ratings, p=weights / weights.sum())
    users = rng.integers(0, num_users, num_ratings)
    p = rng.standard_normal((num_users, rank)) * 0.4
    q = rng.standard_normal((num_items, rank)) * 0.4
    values = np.clip(3.5 + np.einsum("ij,ij->i", p[users], q[items]) + rng.standard_normal(num_ratings) * 0.3, 1, 5)
    ratings = Ratings(users.astype(np.int64), items.astype(np.int64), values.astype(np.float32))
    cut = int(round(num_ratings * (1 - test_fraction)))
    return MovieLens(ratings.take(np.arange(cut)), ratings.take(np.arange(cut, num_ratings)), num_users, num_items)


def by_popularity(data: MovieLens) -> MovieLens:
    """The same ratings with items numbered by how often they are rated in training (item 0 most):
    a range of item ids is then a range of popularity, and so is a slice of the item table."""
    counts = np.bincount(data.train.items, minlength=data.num_items)
    new_id = np.empty(data.num_items, dtype=np.int64)
    new_id[np.argsort(-counts, kind="stable")] = np.arange(data.num_items)

    def renumbered(r: Ratings) -> Ratings:
        return Ratings(r.users, new_id[r.items], r.values)

    return MovieLens(renumbered(data.train), renumbered(data.test), data.num_users, data.num_items)


def load(name: str) -> MovieLens:
    """``ml-100k`` (MovieLens 100k) or ``zipf`` (the synthetic matrix)."""
    if name == "ml-100k":
        return load_movielens()
    if name == "zipf":
        return synthetic_zipf()
    raise SystemExit(f"unknown data set {name!r}: use ml-100k or zipf")
