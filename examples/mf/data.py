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
