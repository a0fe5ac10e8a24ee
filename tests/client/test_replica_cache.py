"""The ESSP cache of a replicated table's rows: served only while its home's messages keep it current.

Rows are counted: each value is the number of updates it holds, so a row that
missed one, or holds one twice, shows.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

import shoal
from shoal.client.replica_cache import ReplicaCache

OWN = 7  # this worker's origin
OTHER = 9
HOME = 1
SERIES = "s1"


def cache(optimizer: object = None) -> tuple[ReplicaCache, Counter[str]]:
    spec = shoal.TableSpec("t", 8, 2, replicas=2, consistency=shoal.ESSP(1),
                           optimizer=optimizer or shoal.optim.Sum())
    counters: Counter[str] = Counter()
    return ReplicaCache(spec, [4, 4], lambda: OWN, counters), counters


def rows(*r: int) -> np.ndarray:
    return np.array(r, dtype=np.int64)


def values(*v: float) -> np.ndarray:
    return np.repeat(np.array(v, dtype=np.float32)[:, None], 2, axis=1)


def test_rows_are_served_while_they_cover_the_clock_a_read_needs():
    c, _ = cache()
    c.keep(0, HOME, SERIES, 0, rows(0, 1), values(3, 4), covers=5, version={OTHER: 3})
    assert c.serve(0, rows(0, 1), 5)[:, 0].tolist() == [3, 4]
    assert c.serve(0, rows(0, 1), 6) is None  # older than the bound allows
    assert c.serve(0, rows(2), 0) is None  # never read
    # Row 1 changed; row 0 did not, and covers clock 6 as well.
    c.on_rows(HOME, 0, 1, SERIES, 6, {OTHER: 4}, rows(1), values(5))
    assert c.serve(0, rows(0, 1), 6)[:, 0].tolist() == [3, 5]


def test_a_lost_message_drops_the_shard_until_its_rows_are_read_again():
    c, counters = cache()
    c.keep(0, HOME, SERIES, 0, rows(0, 1), values(3, 3), covers=5, version={})
    # Message 1 (row 0 -> 4) is lost; message 2 leaves row 0 out: it did not change since message 1.
    c.on_rows(HOME, 0, 2, SERIES, 7, {}, rows(1), values(5))
    assert c.serve(0, rows(0), 5) is None and c.serve(0, rows(1), 5) is None
    assert counters["eager_gaps"] == 1
    assert not c.follows(0, rows(0))
    c.keep(0, HOME, SERIES, 2, rows(0), values(4), covers=7, version={})
    assert c.serve(0, rows(0), 7)[:, 0].tolist() == [4]
    c.on_rows(HOME, 0, 2, SERIES, 7, {}, rows(1), values(5))  # delivered twice: ignored
    c.on_rows(HOME, 0, 3, SERIES, 8, {}, rows(0), values(6))
    assert c.serve(0, rows(0), 8)[:, 0].tolist() == [6]


def test_own_pushes_are_read_at_once_and_counted_once_whatever_the_home_has():
    c, _ = cache()
    c.keep(0, HOME, SERIES, 0, rows(0), values(2), covers=5, version={OWN: 2})
    c.own_push(0, rows(0), values(1), seq=3)
    c.own_push(0, rows(0, 0), values(1, 1), seq=4)
    assert c.serve(0, rows(0), 5)[:, 0].tolist() == [5]  # read-my-writes: 2 + 1 + 2
    # The home has push 3 but not 4 yet: its row (2 + 1 + an other's 1) gets push 4 added back.
    c.on_rows(HOME, 0, 1, SERIES, 6, {OWN: 3, OTHER: 1}, rows(0), values(4))
    assert c.serve(0, rows(0), 6)[:, 0].tolist() == [6]
    # Now it has both: nothing to add.
    c.on_rows(HOME, 0, 2, SERIES, 7, {OWN: 4, OTHER: 1}, rows(0), values(6))
    assert c.serve(0, rows(0), 7)[:, 0].tolist() == [6]


def test_a_read_answered_before_a_message_keeps_none_of_the_rows_that_message_changed():
    c, counters = cache()
    c.keep(0, HOME, SERIES, 0, rows(0), values(1), covers=4, version={})
    # The read of rows 1 and 2 was answered after message 0; message 1 (row 1 changed) came before
    # the read finished: row 1's value predates it, row 2's is still current.
    c.on_rows(HOME, 0, 1, SERIES, 5, {}, rows(1), values(9))
    c.keep(0, HOME, SERIES, 0, rows(1, 2), values(8, 2), covers=4, version={})
    assert c.serve(0, rows(1), 0) is None
    assert c.serve(0, rows(0, 2), 4)[:, 0].tolist() == [1, 2]
    assert counters["eager_gaps"] == 0


def test_a_new_home_or_a_restarted_one_starts_the_shard_again():
    c, _ = cache()
    c.keep(0, HOME, SERIES, 0, rows(0), values(1), covers=4, version={})
    c.keep(0, HOME + 1, SERIES, 0, rows(1), values(1), covers=4, version={})
    assert c.serve(0, rows(0), 0) is None and c.home_of(0) == HOME + 1
    c.on_rows(HOME + 1, 0, 1, "restarted", 5, {}, rows(1), values(3))  # another series: not this cache's
    assert c.serve(0, rows(1), 5) is None


def test_a_rule_that_is_not_additive_drops_the_rows_a_push_touches():
    c, _ = cache(shoal.optim.Adagrad(lr=0.1))
    c.keep(0, HOME, SERIES, 0, rows(0, 1), values(1, 1), covers=4, version={})
    c.own_push(0, rows(0), values(1), seq=1)
    assert c.serve(0, rows(0), 4) is None and c.serve(0, rows(1), 4) is not None
    # A read that lacks push 1 cannot be completed here: not kept.
    c.keep(0, HOME, SERIES, 0, rows(0), values(1), covers=4, version={OWN: 0})
    assert c.serve(0, rows(0), 4) is None
    c.keep(0, HOME, SERIES, 0, rows(0), values(0.9), covers=4, version={OWN: 1})
    assert c.serve(0, rows(0), 4) is not None
