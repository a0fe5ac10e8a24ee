"""The clocks a node's workers reached, as their server reads them: taken only with the intents sent by then."""

from __future__ import annotations

import time

import numpy as np

from shoal.consistency.reached import INTENT_BITS, ReachedClocks, packed


def test_a_reached_clock_counts_once_every_intent_sent_by_then_was_read():
    reached = ReachedClocks(np.zeros(4, dtype=np.int64))
    learned = [3, 3]  # workers 2 and 3, as their messages told
    reached.slots[2] = packed(7, 0)  # no intent sent: the clock counts at once
    reached.slots[3] = packed(9, 2)  # two intent messages sent, one read so far
    reached.intent_read(3, 1)
    assert reached.clocks(learned, 2) == [7, 3]
    reached.intent_read(3, 2)
    assert reached.clocks(learned, 2) == [7, 9]


def test_the_server_says_when_it_last_took_each_workers_clock_and_only_when_it_took_it():
    # A worker ticks its node's server near its intents' boundaries unless the server took the clock in
    # its slot since it wrote it (``client.ticks``): a look that went by the clocks messages told (an
    # intent message unread) took nothing, and must not count as one.
    reached = ReachedClocks(np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.float64))
    reached.slots[0] = packed(7, 0)
    reached.slots[1] = packed(9, 1)  # an intent message sent, none read
    before = time.monotonic()
    assert reached.clocks([3, 3], 0) == [7, 3]
    assert before <= reached.seen[0] <= time.monotonic() and reached.seen[1] == 0.0
    reached.restarted(0)
    assert reached.seen[0] == 0.0


def test_a_tick_counts_the_intent_messages_sent_before_it_that_were_lost_as_read():
    # Intent message 2 of 3 was lost: the count stood at 1 until a later intent message came. A tick
    # says 3 were sent by then (they travel ahead of it): the clock counts again. An older tick (sent
    # again), or one that says nothing, takes nothing back.
    reached = ReachedClocks(np.zeros(1, dtype=np.int64))
    reached.slots[0] = packed(30, 3)
    reached.intent_read(0, 1)
    assert reached.clocks([20], 0) == [20]
    reached.tick_read(0, 3)
    assert reached.clocks([20], 0) == [30]
    for sent in (2, None, 0, -1, True):
        reached.tick_read(0, sent)  # type: ignore[arg-type]
    assert reached.intents_read.tolist() == [3]
    reached.tick_read(5, 9)  # no worker of this table of slots
    assert reached.intents_read.tolist() == [3]


def test_a_late_message_of_a_workers_earlier_process_counts_nothing_for_the_new_one():
    # A tick of the process before, read after the new process's first message: its count (500 intent
    # messages) would have held the new process's clock back for good.
    reached = ReachedClocks(np.zeros(1, dtype=np.int64))
    reached.tick_read(0, 500, incarnation=7)
    reached.restarted(0)
    reached.slots[0] = packed(3, 1)
    reached.intent_read(0, 1, incarnation=9)
    reached.tick_read(0, 500, incarnation=7)
    reached.intent_read(0, 501, incarnation=7)
    assert reached.intents_read.tolist() == [1]
    assert reached.clocks([0], 0) == [3]


def test_a_clock_told_by_messages_ahead_of_the_slot_is_kept():
    # A worker without local access writes no slot; a slot is behind what a later message told.
    reached = ReachedClocks(np.zeros(2, dtype=np.int64))
    reached.slots[1] = packed(4, 0)
    assert reached.clocks([5, 6], 0) == [5, 6]


def test_the_count_of_intents_wraps_alike_on_both_sides():
    reached = ReachedClocks(np.zeros(1, dtype=np.int64))
    sent = (1 << INTENT_BITS) + 3
    reached.slots[0] = packed(12, sent)
    reached.intents_read[0] = sent - 1
    assert reached.clocks([2], 0) == [2]
    reached.intent_read(0, sent)
    assert reached.clocks([2], 0) == [12]


def test_a_restarted_workers_slot_and_count_start_again():
    # The earlier process's clock would end the intents the new one declares from clock 0.
    reached = ReachedClocks(np.zeros(1, dtype=np.int64))
    reached.slots[0] = packed(500, 0)
    reached.restarted(0)
    assert reached.clocks([0], 0) == [0]
    reached.slots[0] = packed(2, 1)  # the new process, one intent message sent
    reached.intent_read(0, 1)
    assert reached.clocks([0], 0) == [2]


def test_a_sender_that_is_no_worker_counts_nothing():
    reached = ReachedClocks(np.zeros(2, dtype=np.int64))
    reached.intent_read(-1, 1)
    reached.intent_read(2, 1)
    assert reached.intents_read.tolist() == [0, 0]


def test_a_lost_intent_message_does_not_hold_the_count_back_nor_a_doubled_one_push_it_ahead():
    reached = ReachedClocks(np.zeros(1, dtype=np.int64))
    learned = [1]
    reached.intent_read(0, 1)
    # message 2 is lost on the way; message 3 comes, twice
    reached.intent_read(0, 3)
    reached.intent_read(0, 3)
    reached.slots[0] = packed(6, 3)
    assert reached.clocks(learned, 0) == [6]
    reached.intent_read(0, 2)  # a late one changes nothing
    assert reached.clocks(learned, 0) == [6]


def test_a_message_without_a_number_counts_one_and_a_number_past_any_count_is_none():
    reached = ReachedClocks(np.zeros(1, dtype=np.int64))
    reached.intent_read(0, None)
    reached.intent_read(0, 1 << 63)
    assert reached.intents_read.tolist() == [2]
