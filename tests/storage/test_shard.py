"""An adaptive store's reads and updates of the rows present on its node."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

import shoal
from shoal.api.config import TableSpec
from shoal.storage.kernels import OWNED
from shoal.storage.shard import ShardStore


@pytest.fixture
def store() -> Iterator[ShardStore]:
    spec = TableSpec("present", num_keys=64, dim=3, techniques="relocation", init=shoal.Constant(1.0))
    store = ShardStore.create(spec, 0, np.arange(64), "shard-test")
    assert store.presence is not None
    store.presence[::2] = OWNED  # the even keys are here
    yield store
    store.close()


def test_the_absent_positions_a_call_returns_are_its_own_whatever_calls_come_after(store):
    # The positions are noted in room the store reuses under its locks: what a call returns must not
    # change with the next call's (a smaller and a larger one, the room grown in between).
    out = np.empty((3, 3), np.float32)
    first = store.read_present(np.array([1, 2, 3]), out)
    assert first.tolist() == [0, 2]
    second = store.update_present(np.array([5, 7, 9, 11, 13, 4]), np.ones((6, 3), np.float32), 1.0)
    third = store.read_present(np.array([8, 15]), np.empty((2, 3), np.float32))
    assert first.tolist() == [0, 2] and second.tolist() == [0, 1, 2, 3, 4] and third.tolist() == [1]
    assert store.values[4].tolist() == [2.0, 2.0, 2.0]  # the present row updated, the others not
    assert store.values[5].tolist() == [1.0, 1.0, 1.0]
    assert store.read_present(np.array([0, 2]), np.empty((2, 3), np.float32)).size == 0


def test_threads_of_one_process_reading_and_updating_at_once_each_get_their_own_absent_positions(store):
    # The room is the store's, shared by the process's threads: the row locks keep each call's to itself.
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 64, size=int(rng.integers(1, 200))) for _ in range(40)]
    errors: list[str] = []

    def work(offset: int) -> None:
        for n in range(300):
            keys = batches[(n + offset) % len(batches)]
            want = np.flatnonzero(keys % 2 == 1).tolist()
            if n % 2:
                got = store.update_present(keys, np.zeros((keys.size, 3), np.float32), 1.0)
            else:
                got = store.read_present(keys, np.empty((keys.size, 3), np.float32))
            if got.tolist() != want:
                errors.append(f"thread {offset}, call {n}: {got.tolist()} against {want}")

    threads = [threading.Thread(target=work, args=(offset,)) for offset in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
