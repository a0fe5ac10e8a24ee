"""The word2vec example's blocks (``sgns.phases``): every pair trained once, by its centre word's worker,
and no output row wanted by two workers in one phase nor by the next user while the last one has it."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "word2vec"))
from sgns import phases  # noqa: E402


def _schedules(workers: int, words: int, num_pairs: int, phase: int, batch: int, seed: int
               ) -> tuple[np.ndarray, np.ndarray, list[list[tuple[int, list[np.ndarray]]]]]:
    rng = np.random.default_rng(seed)
    group_of = np.arange(words) % (2 * workers)  # every group has a word
    rng.shuffle(group_of)
    all_pairs = rng.integers(0, words, (num_pairs, 2))
    return all_pairs, group_of, [phases(all_pairs, group_of, rank, workers, phase, batch) for rank in range(workers)]


@settings(max_examples=60, deadline=None)
@given(workers=st.integers(1, 4), words=st.integers(8, 60), num_pairs=st.integers(0, 3000), phase=st.integers(1, 6),
       batch=st.integers(1, 200), seed=st.integers(0, 2**32 - 1))
def test_every_pair_once_by_its_centre_words_worker_in_batches_of_at_most_batch(workers, words, num_pairs, phase,
                                                                                 batch, seed):
    all_pairs, group_of, schedules = _schedules(workers, words, num_pairs, phase, batch, seed)
    trained = []
    for rank, schedule in enumerate(schedules):
        for group, batches in schedule:
            for b in batches:
                assert b.shape[0] <= batch
                assert (group_of[b[:, 0]] % workers == rank).all()  # its own centre words
                assert (group_of[b[:, 1]] == group).all()  # contexts of the phase's group
                trained.append(b)
    got = np.concatenate(trained) if trained else np.empty((0, 2), np.int64)
    order = np.lexsort(got.T[::-1])
    want = np.lexsort(all_pairs.T[::-1])
    np.testing.assert_array_equal(got[order], all_pairs[want])


@settings(max_examples=60, deadline=None)
@given(workers=st.integers(2, 4), words=st.integers(8, 60), num_pairs=st.integers(0, 3000), phase=st.integers(1, 6),
       batch=st.integers(1, 200), seed=st.integers(0, 2**32 - 1))
def test_phases_change_together_and_no_group_has_two_users_or_goes_to_the_next_while_in_use(workers, words, num_pairs,
                                                                                             phase, batch, seed):
    _, _, schedules = _schedules(workers, words, num_pairs, phase, batch, seed)
    lengths = {tuple(len(batches) for _, batches in schedule) for schedule in schedules}
    assert len(lengths) == 1, "every worker's phases as long as every other's"
    groups = np.array([[group for group, _ in schedule] for schedule in schedules])  # [worker, phase]
    for now in range(groups.shape[1]):
        assert len(set(groups[:, now])) == workers, "one user per group in a phase"
        # The group each worker takes next (in the next pass, the first phase's) is one nobody uses now.
        assert not set(groups[:, (now + 1) % groups.shape[1]]) & set(groups[:, now])
