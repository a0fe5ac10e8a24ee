"""Ownership bookkeeping and intent decisions, without a network."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from shoal.placement.intent import Action, NodeIntents, OwnerInterest, smoothed_window
from shoal.placement.ownership import Directory, LocationCache


def test_home_directory_records_moves_and_who_must_hand_over():
    d = Directory(num_keys=10, num_nodes=2, node=0)
    assert d.owners(np.array([0, 2, 4])).tolist() == [0, 0, 0]
    handover = d.move(np.array([0, 2, 3]), to=1)  # key 3 is not a home key of node 0: ignored
    assert {k: (v.tolist(), e.tolist()) for k, (v, e) in handover.items()} == {0: ([0, 2], [1, 1])}
    again = d.move(np.array([0]), to=1)  # known there: the holder is asked anyway (it may have moved on)
    assert {k: (v.tolist(), e.tolist()) for k, (v, e) in again.items()} == {1: ([0], [2])}
    one = np.ones(1, np.int64)
    assert d.record(np.array([2]), owner=0, epochs=one, steps=one).tolist() == [2]  # moved on by its owner
    assert d.owners(np.array([0, 2])).tolist() == [1, 0]
    # Reports arrive in any order: the newest stays; one older than the home's latest decision is ignored.
    assert d.record(np.array([2]), owner=1, epochs=one, steps=one * 0).tolist() == []
    assert d.record(np.array([0]), owner=0, epochs=one, steps=one * 5).tolist() == []
    assert d.owners(np.array([0, 2])).tolist() == [1, 0]


def test_location_cache_falls_back_to_home_after_two_hops():
    cache = LocationCache(num_keys=6, num_nodes=3)
    cache.learn(np.array([4]), 2)
    assert cache.route(np.array([4]), hops=0).tolist() == [2]
    assert cache.route(np.array([4]), hops=2).tolist() == [1]  # 4 % 3
    cache.learn(np.array([4]), 0)  # what the home said
    assert cache.route(np.array([4]), hops=3).tolist() == [0]


def test_node_intents_enter_the_window_and_expire():
    book = NodeIntents(num_keys=20)
    book.add(np.array([1, 2, 3]), start=5, end=8)
    book.add(np.array([3, 4]), start=6, end=10)
    assert [a.tolist() for a in book.due(clock=2, window=2)] == [[], []]
    start, stop = book.due(clock=3, window=2)
    assert start.tolist() == [1, 2, 3] and stop.tolist() == []
    start, stop = book.due(clock=4, window=2)
    assert start.tolist() == [4]  # 3 was announced already
    start, stop = book.due(clock=8, window=2)
    assert stop.tolist() == [1, 2]  # 3 stays: wanted until 10
    assert book.due(clock=10, window=2)[1].tolist() == [3, 4]


def test_keys_withdrawn_ahead_of_their_round_are_not_withdrawn_again_and_are_announced_anew():
    book = NodeIntents(num_keys=20)
    book.add(np.array([1, 2, 3]), start=0, end=5)
    book.add(np.array([3]), start=0, end=9)
    assert book.due(clock=0, window=1)[0].tolist() == [1, 2, 3]
    book.add(np.array([2, 5]), start=6, end=7)  # 2 carried on from within the window
    assert book.ended_among(np.array([1, 3, 4]), clock=4, window=1).tolist() == []  # not over; 4 not announced
    assert book.ended_among(np.array([1, 2, 3]), clock=5, window=1).tolist() == [1]  # 3 is wanted until 9
    assert book.ended_among(np.array([2]), clock=5, window=0).tolist() == [2]  # 6 is past the window
    book.add(np.array([1]), start=7, end=8)
    start, stop = book.due(clock=6, window=1)
    assert start.tolist() == [2, 5, 1] and stop.tolist() == []  # 1 and 2 withdrawn once, announced anew
    assert sorted(book.due(clock=9, window=1)[1].tolist()) == [1, 2, 3, 5]


def test_an_intent_naming_keys_again_announces_and_withdraws_each_once():
    book = NodeIntents(num_keys=20)
    book.add(np.array([7, 3, 7, 7, 19, 3, 0]), start=1, end=3)
    book.add(np.array([0, 19, 19]), start=1, end=2)
    start, _ = book.due(clock=0, window=1)
    assert start.tolist() == [7, 3, 19, 0]  # as they first came, each once
    _, stop = book.due(clock=3, window=1)
    assert sorted(stop.tolist()) == [0, 3, 7, 19]
    book.add(np.array([5, 5]), start=4, end=5)  # the scratch flags were left clear: 5 and the others again
    book.add(np.array([3, 7, 3]), start=4, end=5)
    assert book.due(clock=4, window=0)[0].tolist() == [5, 3, 7]


def test_intents_ended_at_once_are_withdrawn_at_any_clock_and_those_not_started_dropped():
    # A worker of the node was started again at clock 0: intents of its earlier process (to clock 50)
    # would stay announced until the new one reached clock 50, and one starting at 40 would start.
    book = NodeIntents(num_keys=20)
    book.add(np.array([1, 2]), start=10, end=50)
    book.add(np.array([5]), start=40, end=60)
    assert book.due(clock=12, window=2)[0].tolist() == [1, 2]
    book.end_all()
    start, stop = book.due(clock=0, window=2)
    assert start.tolist() == [] and sorted(stop.tolist()) == [1, 2]
    assert [a.tolist() for a in book.due(clock=45, window=2)] == [[], []]
    assert not book.any_due(clock=100, window=2)
    book.add(np.array([2, 3]), start=1, end=4)  # the new process's own intents go on as usual
    assert book.due(clock=0, window=1)[0].tolist() == [2, 3]
    assert book.due(clock=4, window=1)[1].tolist() == [2, 3]


@pytest.mark.parametrize("seed", range(4))
def test_node_intents_announce_and_withdraw_as_a_model_of_their_keys_says(seed):
    """Random intents, rounds and early withdrawals against a model of what each key is owed: a key is
    announced once an intent holding it comes into the window, stays announced while any intent taken
    in holds it, and is withdrawn (once) at the first round at or past the end of the last of them."""
    rng = np.random.default_rng(seed)
    num_keys = 40
    book = NodeIntents(num_keys=num_keys)
    pending: list[tuple[int, int, set[int]]] = []  # (start, end, keys) not yet in the window
    until = dict.fromkeys(range(num_keys), 0)
    announced: set[int] = set()
    clock = 0
    for _ in range(300):
        if rng.random() < 0.5:
            keys = rng.integers(0, num_keys, rng.integers(1, 12))
            start = clock + int(rng.integers(0, 6))
            end = start + int(rng.integers(1, 6))
            book.add(keys, start, end)
            pending.append((start, end, set(keys.tolist())))
        window = int(rng.integers(0, 4))
        if rng.random() < 0.2:  # a round of another node's announcement withdraws what ended here first
            asked = np.unique(rng.integers(0, num_keys, 10))
            carried = set().union(*[k for start, end, k in pending if start <= clock + window and end > clock])
            expected = {k for k in asked.tolist() if k in announced and until[k] <= clock and k not in carried}
            got = book.ended_among(asked, clock, window).tolist()
            assert sorted(got) == sorted(expected)
            announced -= expected
        start_keys, stop_keys = book.due(clock, window)
        fresh: list[int] = []
        for _, end, keys in sorted((p for p in pending if p[0] <= clock + window), key=lambda p: p[0]):
            if end > clock:
                for k in keys:
                    until[k] = max(until[k], end)
                fresh += sorted(keys - announced)
                announced |= keys
        pending = [p for p in pending if p[0] > clock + window]
        over = {k for k in announced if until[k] <= clock}
        announced -= over
        assert sorted(start_keys.tolist()) == sorted(fresh) and len(set(fresh)) == len(fresh)
        assert sorted(stop_keys.tolist()) == sorted(over)
        clock += int(rng.integers(0, 3))


def test_owner_decisions_per_technique():
    interest = OwnerInterest(num_keys=10, num_nodes=3)
    keys = np.array([1, 2])
    interest.announce(keys, node=1)
    assert interest.decide("auto", keys, node=1, owner=0)[Action.RELOCATE].tolist() == [1, 2]
    interest.announce(np.array([2]), node=2)  # a second node wants key 2
    got = interest.decide("auto", keys, node=1, owner=0)
    assert got[Action.RELOCATE].tolist() == [1] and got[Action.REPLICATE].tolist() == [2]
    assert interest.decide("replication", keys, node=1, owner=0)[Action.REPLICATE].tolist() == [1, 2]
    interest.replicas[1] = 1 << 2
    assert interest.decide("relocation", keys, node=1, owner=0)[Action.RELOCATE].tolist() == [2]
    assert interest.decide("auto", keys, node=0, owner=0) == {Action.NOTHING: keys}


def test_action_window_follows_the_clock_rate():
    w = 1.0
    for _ in range(40):
        w = smoothed_window(action_s=0.01, clock_s=0.001, current=w)
    assert 9 <= math.ceil(w) <= 12
    assert smoothed_window(0.01, 1.0, 5) < 5


def test_action_window_grows_by_less_than_a_clock():
    # An action a seventh of a clock long must be started a clock earlier than its intent's
    # first clock: small steps add up instead of being rounded away.
    w = 1.0
    for _ in range(30):
        w = smoothed_window(action_s=0.005, clock_s=0.035, current=w)
    assert math.ceil(w) == 2


def test_a_node_started_again_numbers_its_announcements_past_its_earlier_process_whatever_the_clock(monkeypatch):
    # The numbers were counted from the time of day in microseconds: a process started again after
    # its clock was set back (an NTP step, a host moved) numbered below its earlier process, and every
    # owner holding that process's numbers refused its announcements as older, until the new count
    # passed them (an hour back: 3.6e9 announcements).
    owner = OwnerInterest(num_keys=10, num_nodes=2)
    keys = np.arange(10)
    earlier = NodeIntents(num_keys=10, incarnation=1)
    for _ in range(3):
        assert owner.take(keys, earlier.stamp(), node=1).all()
    real_ns = time.time_ns()
    monkeypatch.setattr(time, "time_ns", lambda: real_ns - 3_600 * 10**9)
    again = NodeIntents(num_keys=10, incarnation=2)
    assert owner.take(keys[:4], again.stamp(), node=1).all()
    assert owner.take(keys, again.stamp(), node=1).all()
    assert not owner.take(keys, earlier.stamp(), node=1).any()  # a late one of the earlier process: older
