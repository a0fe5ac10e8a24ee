"""Planning slice moves, and the rendezvous's rebalancer judging load windows."""

from __future__ import annotations

import numpy as np
import pytest

from shoal.api.config import RebalancePolicy, TableSpec
from shoal.cluster.slices import SliceAuthority
from shoal.placement.layout import TableLayout, slice_count
from shoal.placement.rebalance import SliceInfo, imbalance, plan_drain, plan_moves
from tests.support.clock import ManualClock


def _loads(slices, moves, servers):
    owner = {(i.table, i.shard): i.owner for i in slices}
    for m in moves:
        owner[(m.table, m.shard)] = m.target
    loads = dict.fromkeys(servers, 0.0)
    for i in slices:
        loads[owner[(i.table, i.shard)]] += i.load
    return loads


def test_skewed_load_is_evened_out_with_few_cheap_moves():
    slices = [SliceInfo("t", s, 0, 10.0, 1000) for s in range(8)] + [SliceInfo("u", s, 1, 1.0, 10) for s in range(4)]
    moves = plan_moves(slices, [0, 1, 2], threshold=1.1)
    assert imbalance(_loads(slices, [], [0, 1, 2])) > 2.5
    assert imbalance(_loads(slices, moves, [0, 1, 2])) <= 1.25
    assert all(m.source == 0 for m in moves) and len(moves) <= 6


def test_moves_prefer_load_per_byte():
    # Two slices would each fix the imbalance; the one with less state to move is chosen.
    slices = [SliceInfo("t", 0, 0, 5.0, 10_000), SliceInfo("t", 1, 0, 5.0, 100), SliceInfo("t", 2, 1, 0.0, 1)]
    moves = plan_moves(slices, [0, 1], threshold=1.05)
    assert [(m.shard, m.target) for m in moves] == [(1, 1)]


def test_a_slice_hotter_than_the_gap_is_not_moved_back_and_forth():
    slices = [SliceInfo("t", 0, 0, 100.0, 10), SliceInfo("t", 1, 1, 1.0, 10)]
    assert plan_moves(slices, [0, 1], threshold=1.1) == []


def test_draining_sends_every_slice_to_the_others_by_bytes():
    slices = [SliceInfo("t", s, s % 3, 0.0, 100 * (s + 1)) for s in range(9)]
    moves = plan_drain(slices, 1, [0, 1, 2])
    assert {m.shard for m in moves} == {1, 4, 7} and all(m.target in (0, 2) for m in moves)


def test_bounded_mapping_caps_slice_bytes_and_whole_placement_uses_one_server():
    spec = TableSpec("fc6", num_keys=1000, dim=256, mapping="bounded", slice_bytes=100 * 1024)
    assert slice_count(spec, 3) == 10  # 1000 rows x 1 KiB / 100 KiB
    layout = TableLayout.initial(spec, 3)
    assert max(layout.slice_bytes(s) for s in range(layout.num_shards)) <= 100 * 1024
    whole = TableLayout.initial(TableSpec("fc6", 1000, 256, slices=8, placement="whole"), 3)
    assert len(set(whole.owners.tolist())) == 1


def test_the_rebalancer_moves_slices_only_after_the_imbalance_persists():
    clock = ManualClock(0.0)
    policy = RebalancePolicy(threshold=1.3, windows=3, window_s=1.0, min_bytes_per_s=1.0, max_moves=8)
    authority = SliceAuthority(2, policy, now=clock)
    authority.add_table(TableSpec("t", 800, 4, slices=8, placement="whole"))
    owner = int(authority.layouts["t"].owners[0])
    hot = [[s, 1000.0, 1, 0.0] for s in range(8)]
    for window in range(3):
        authority.on_load(owner, {"t": hot})
        clock.advance(1.0)
        authority.tick()
        assert bool(authority.active) == (window == 2), window  # the third hot window triggers
    moved = []
    while authority.active:
        move = authority.active["t"]
        moved.append(move.move.shard)
        authority.move_done("t", move.move.shard, move.move.target, move.epoch, ok=True)
    owners = authority.layouts["t"].owners
    assert np.count_nonzero(owners == owner) == 4 and authority.layouts["t"].epoch == len(moved) == 4


def test_a_drain_waits_for_a_table_planned_over_its_server_but_not_for_a_worker_that_never_registers_it():
    from shoal.api.errors import ClusterError
    from shoal.cluster.slices import PLAN_HOLDS_DRAIN_S

    clock = ManualClock(0.0)
    authority = SliceAuthority(2, now=clock)
    spec = TableSpec("t", 400, 1, slices=4)
    planned = authority.plan(spec)
    assert planned is not None and planned["owners"] == [0, 0, 1, 1]
    done: list[ClusterError | None] = []
    authority.drain(1, done.append)
    authority.tick()
    assert done == [] and 1 not in authority.departed  # the planned table may still come
    clock.advance(PLAN_HOLDS_DRAIN_S + 1)  # its worker died before registering it
    authority.tick()
    assert done == [None] and 1 in authority.departed
    with pytest.raises(ClusterError, match="left before it was registered"):
        authority.add_table(spec, planned)
