"""Key mappings: every key has exactly one (shard, row); rows are dense per shard."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.placement.mapping import MAPPINGS, make_mapping


@pytest.mark.parametrize("rule", sorted(MAPPINGS))
@given(num_keys=st.integers(1, 3000), num_shards=st.integers(1, 9))
@settings(max_examples=40, deadline=None)
def test_locate_is_a_bijection_onto_dense_rows(rule, num_keys, num_shards):
    m = make_mapping(rule, num_keys, num_shards)
    keys = np.arange(num_keys, dtype=np.int64)
    shard, row = m.locate(keys)
    assert ((0 <= shard) & (shard < num_shards)).all()
    seen = set()
    for s in range(num_shards):
        mine = m.keys_of(s)
        np.testing.assert_array_equal(shard[mine], s)
        np.testing.assert_array_equal(np.sort(row[mine]), np.arange(len(mine)))
        np.testing.assert_array_equal(row[mine], np.arange(len(mine)))
        seen.update(mine.tolist())
    assert seen == set(range(num_keys))


@pytest.mark.parametrize("rule", sorted(MAPPINGS))
def test_mappings_spread_keys_evenly(rule):
    m = make_mapping(rule, 100_000, 7)
    sizes = [m.shard_size(s) for s in range(7)]
    assert max(sizes) / (sum(sizes) / 7) < 1.05


def test_hash_mapping_spreads_a_hot_contiguous_range():
    m = make_mapping("hash", 100_000, 4)
    shard, _ = m.locate(np.arange(1000, dtype=np.int64))
    assert np.bincount(shard, minlength=4).min() > 200


@pytest.mark.parametrize("rule", sorted(MAPPINGS))
def test_rows_in_agrees_with_locate(rule):
    m = make_mapping(rule, 1000, 3)
    for shard in range(3):
        mine = m.keys_of(shard)[::7]
        np.testing.assert_array_equal(m.rows_in(mine, shard), m.locate(mine)[1])
        foreign = np.concatenate([mine, m.keys_of((shard + 1) % 3)[:1]])
        assert m.rows_in(foreign, shard) is None
