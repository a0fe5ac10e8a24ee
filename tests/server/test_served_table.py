"""A server's table of several slices: requests that cross them."""

from __future__ import annotations

import uuid

import numpy as np

import shoal
from shoal.consistency.clocks import ClockTable
from shoal.placement.layout import TableLayout
from shoal.server.tables import ServedTable


def test_a_pull_across_the_slices_held_here_returns_each_row_in_the_order_asked():
    """A server holding several slices of a table answers a pull whose keys cross them in any order
    (each slice's rows are read straight into their places in the reply)."""
    spec = shoal.TableSpec("sliced", 1000, 3, optimizer=shoal.optim.Sum(), slices=8)
    table = ServedTable(spec, TableLayout.initial(spec, 1), 0, "t" + uuid.uuid4().hex[:10], ClockTable.fresh(1))
    try:
        every = np.arange(1000)
        table.push(every, np.stack([every, -every, 2 * every], axis=1).astype(np.float32))
        keys = np.random.default_rng(0).permutation(1000)[:300]
        assert len(table.split(keys)) == 8
        rows = table.pull(keys)
        np.testing.assert_array_equal(rows, np.stack([keys, -keys, 2 * keys], axis=1).astype(np.float32))
        for n in (1, 40):  # one row; a few in each slice, in scattered lock stripes
            np.testing.assert_array_equal(table.pull(keys[:n]), rows[:n])
    finally:
        table.close()
