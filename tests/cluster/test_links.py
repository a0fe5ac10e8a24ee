"""Channels between two processes (``cluster.links``): every message passed on once, in the order sent,
over a network that loses, repeats and reorders them; driven by hand, no sockets."""

from __future__ import annotations

import random

import pytest

from shoal.cluster.links import ACK_DELAY_S, MAX_HELD, MAX_UNACKED, RESEND_S, Header, Links
from tests.support.clock import ManualClock

A, B = 0, 1  # the two peers' numbers as each other knows them


class Network:
    """Two processes' links, and what is on the wire between them: each transmission is lost, doubled
    or delivered, in an order shuffled within each step."""

    def __init__(self, seed: int, loss: float = 0.0, duplicate: float = 0.0) -> None:
        self.rng = random.Random(seed)
        self.loss, self.duplicate = loss, duplicate
        self.clock = ManualClock()
        self.links = {A: Links[str](self.clock), B: Links[str](self.clock)}
        self.wire: list[tuple[int, Header, str | None]] = []  # (to, header, payload)
        self.delivered: dict[int, list[str]] = {A: [], B: []}

    def send(self, frm: int, payload: str) -> None:
        to = B if frm == A else A
        seq = self.links[frm].add(to, payload)
        self.transmit(frm, seq, payload)

    def transmit(self, frm: int, seq: int, payload: str | None) -> None:
        to = B if frm == A else A
        header = self.links[frm].header(to, seq)
        if self.rng.random() < self.loss:
            return
        copies = 2 if self.rng.random() < self.duplicate else 1
        self.wire += [(to, header, payload)] * copies

    def step(self, seconds: float = 0.01) -> None:
        """Deliver what is on the wire (shuffled), move the clock, send what is due again."""
        arriving, self.wire = self.wire, []
        self.rng.shuffle(arriving)
        for to, header, payload in arriving:
            frm = B if to == A else A
            self.delivered[to] += self.links[to].receive(frm, header, payload)
        self.clock.advance(seconds)
        for frm, links in self.links.items():
            for _, seq, payload in links.due():
                self.transmit(frm, seq, payload)
            for _ in links.acks_due():
                self.transmit(frm, 0, None)


@pytest.mark.parametrize("seed", range(20))
def test_every_message_arrives_once_in_the_order_sent_over_a_network_that_loses_repeats_and_reorders(seed):
    net = Network(seed, loss=0.2, duplicate=0.1)
    sent: dict[int, list[str]] = {A: [], B: []}
    for i in range(300):
        frm = A if net.rng.random() < 0.7 else B  # mostly one way: acknowledgements must also go alone
        payload = f"{frm}:{i}"
        sent[frm].append(payload)
        net.send(frm, payload)
        if net.rng.random() < 0.5:
            net.step()
    for _ in range(3000):
        if not (net.links[A].unacknowledged() or net.links[B].unacknowledged() or net.wire):
            break
        net.step(0.05)
    assert net.delivered[B] == sent[A]
    assert net.delivered[A] == sent[B]
    assert net.links[A].unacknowledged() == net.links[B].unacknowledged() == 0
    assert net.links[A].stats["resent"] > 0 and net.links[B].stats["repeats_dropped"] > 0


def test_acknowledgements_ride_on_messages_going_back_and_go_alone_only_after_a_while():
    clock = ManualClock()
    a, b = Links[str](clock), Links[str](clock)
    seq = a.add(B, "request")
    assert b.receive(A, a.header(B, seq), "request") == ["request"]
    seq = b.add(A, "answer")
    assert a.receive(B, b.header(A, seq), "answer") == ["answer"]  # and acknowledges "request"
    assert a.unacknowledged() == 0 and b.acks_due() == []
    clock.advance(ACK_DELAY_S / 2)
    assert a.acks_due() == []  # not yet: something may still go B's way
    clock.advance(ACK_DELAY_S / 2)
    assert a.acks_due() == [B]
    seq = a.add(B, "next")  # a message going there carries it after all
    b.receive(A, a.header(B, seq), "next")
    assert a.acks_due() == [] and b.unacknowledged() == 0


def test_a_message_is_sent_again_until_acknowledged_waiting_longer_each_time():
    clock = ManualClock()
    links = Links[str](clock)
    seq = links.add(B, "rows")
    links.header(B, seq)
    assert links.next_deadline() == pytest.approx(clock() + RESEND_S)
    clock.advance(RESEND_S)
    assert links.due() == [(B, seq, "rows")]
    links.header(B, seq)
    assert links.due() == []
    assert links.next_deadline() == pytest.approx(clock() + 2 * RESEND_S)
    assert links.stats["resent"] == 1
    links.receive(B, Header(channel=99, seq=0, base=1, acks=links.channel, acked=seq), None)  # type: ignore[arg-type]
    assert links.unacknowledged() == 0 and links.next_deadline() is None


def test_an_acknowledgement_for_an_earlier_process_acknowledges_nothing():
    clock = ManualClock()
    links = Links[str](clock)
    seq = links.add(B, "rows")
    links.header(B, seq)
    links.receive(B, Header(channel=99, seq=0, base=1, acks=links.channel + 2, acked=seq), None)  # type: ignore[arg-type]
    assert links.unacknowledged(B) == 1


def test_a_message_not_sent_for_want_of_an_address_waits_and_is_not_due_again():
    links = Links[str](ManualClock())
    links.add(B, "state")
    assert links.unsent(B) == [(1, "state")] and links.due() == [] and links.next_deadline() is None


def test_a_receiver_started_again_takes_up_where_the_sender_is_not_yet_acknowledged():
    clock = ManualClock()
    sender, receiver = Links[str](clock), Links[str](clock)
    for payload in ("a", "b", "c"):
        seq = sender.add(B, payload)
        header = sender.header(B, seq)
        assert receiver.receive(A, header, payload) == [payload]
    ack = receiver.header(A, 0)
    sender.receive(B, ack, None)  # type: ignore[arg-type]
    assert sender.unacknowledged() == 0
    seq = sender.add(B, "d")
    sender.header(B, seq)  # lost, and the receiver started again meanwhile
    seq = sender.add(B, "e")
    restarted = Links[str](clock)
    assert restarted.receive(A, sender.header(B, seq), "e") == []  # "d" (4) comes first
    assert restarted.receive(A, sender.header(B, 4), "d") == ["d", "e"]


def test_messages_ahead_of_a_missing_one_are_held_up_to_a_bound():
    clock = ManualClock()
    links = Links[str](clock)
    channel = 5
    for seq in range(2, MAX_HELD + 3):
        assert links.receive(A, Header(channel, seq, 1, 0, 0), str(seq)) == []
    assert links.stats["held_out_of_order"] == MAX_HELD and links.stats["dropped_out_of_order"] == 1
    ready = links.receive(A, Header(channel, 1, 1, 0, 0), "1")
    assert ready == [str(s) for s in range(1, MAX_HELD + 2)]  # the dropped one comes again later
    assert links.receive(A, Header(channel, MAX_HELD + 2, 1, 0, 0), "last") == ["last"]


def test_a_peer_that_never_acknowledges_costs_bounded_memory_and_its_receiver_skips_what_was_given_up():
    clock = ManualClock()
    sender, receiver = Links[str](clock), Links[str](clock)
    for i in range(1, MAX_UNACKED + 3):
        sender.header(B, sender.add(B, str(i)))  # all lost
    assert sender.unacknowledged(B) == MAX_UNACKED and sender.stats["given_up"] == 2  # 1 and 2
    last = MAX_UNACKED + 2
    assert receiver.receive(A, sender.header(B, last), str(last)) == []  # waits for 3, not for 1
    assert receiver.receive(A, sender.header(B, 3), "3") == ["3"]


def test_messages_held_behind_ones_the_sender_gave_up_go_on_once_it_says_so():
    clock = ManualClock()
    links = Links[str](clock)
    channel = 5
    links.receive(A, Header(channel, 1, 1, 0, 0), "1")
    assert links.receive(A, Header(channel, 4, 2, 0, 0), "4") == []  # 2 and 3 missing
    assert links.receive(A, Header(channel, 5, 2, 0, 0), "5") == []
    # 2 and 3 were given up (base 4): 4 and 5 go on with the next message, even a repeat of one held
    assert links.receive(A, Header(channel, 4, 4, 0, 0), "4") == ["4", "5"]
    assert links.receive(A, Header(channel, 6, 4, 0, 0), "6") == ["6"]


def test_a_silent_peer_gets_one_message_a_round_until_it_answers_then_the_rest():
    """50 messages into a partition: every one is sent again once, then, while nothing of them is
    acknowledged, only the oldest goes each time its wait runs out (a probe), where every one used to
    go every time (a long partition sent thousands of copies, all arriving as a burst of repeats once
    it healed). The probe's acknowledgement brings the rest at once, each arriving once and in order."""
    net = Network(seed=0)
    sent = [f"m{i}" for i in range(50)]
    for payload in sent:
        net.send(A, payload)
    net.wire.clear()  # the partition: nothing arrives
    resent = []
    for _ in range(100):  # 5 s: the waits double from 0.2 s to the longest
        before = net.links[A].stats["resent"]
        net.step(0.05)
        net.wire.clear()
        resent.append(net.links[A].stats["resent"] - before)
    rounds = [n for n in resent if n]
    assert rounds[0] == 50 and all(n == 1 for n in rounds[1:]) and len(rounds) >= 4, rounds
    deadline = net.links[A].next_deadline()
    assert deadline is not None and deadline > net.clock(), "the held-back messages must not wake a loop at once"
    for _ in range(200):  # healed
        if not (net.links[A].unacknowledged() or net.wire):
            break
        net.step(0.05)
    assert net.delivered[B] == sent
    assert net.links[B].stats["repeats_dropped"] <= 50 + len(rounds)


def test_a_message_lost_before_others_goes_again_once_the_receiver_reports_the_gap_not_after_the_timeout():
    """Placement traffic runs every few milliseconds: a lost state or sync is seen missing as soon as
    the next message arrives, and its rows must not wait ``RESEND_S`` (and the acknowledgement delay)
    for it; at most one extra copy goes per report."""
    clock = ManualClock()
    began = clock()
    sender, receiver = Links[str](clock), Links[str](clock)
    first = sender.add(B, "state")
    sender.header(B, first)  # lost on the way
    clock.advance(0.005)
    second = sender.add(B, "sync")
    assert receiver.receive(A, sender.header(B, second), "sync") == []  # held: "state" comes first
    assert receiver.acks_due() == [A]  # the gap is reported at once, not after ACK_DELAY_S
    report = receiver.header(A, 0)
    assert report.acked == 0 and report.held == second
    sender.receive(B, report, None)  # type: ignore[arg-type]
    assert sender.due() == [(B, first, "state")]  # long before RESEND_S
    resent = sender.header(B, first)
    assert sender.due() == []
    sender.receive(B, report, None)  # type: ignore[arg-type]  # the same report again: that copy is on its way
    assert sender.due() == []
    assert receiver.receive(A, resent, "state") == ["state", "sync"]
    assert receiver.header(A, 0).held == 0
    assert clock() - began < RESEND_S


def test_a_late_copy_from_a_peers_earlier_process_is_dropped_not_taken_for_a_restart():
    # A sends "x" twice (its acknowledgement was slow) and is started again; the new process's "y"
    # arrives, then the old process's late copy of "x". Taken for another restart it would pass "x" on
    # again, forget the new channel, and pass "y" on a second time when that is sent again.
    clock = ManualClock()
    receiver, old = Links[str](clock), Links[str](clock)
    seq = old.add(B, "x")
    first_copy = old.header(B, seq)
    clock.advance(RESEND_S)
    late_copy = old.header(B, seq)
    delivered = receiver.receive(A, first_copy, "x")
    new = Links[str](clock)
    seq_y = new.add(B, "y")
    delivered += receiver.receive(A, new.header(B, seq_y), "y")
    delivered += receiver.receive(A, late_copy, "x")
    seq_z = new.add(B, "z")
    delivered += receiver.receive(A, new.header(B, seq_z), "z")  # "y" not acknowledged yet: its base is 1
    clock.advance(RESEND_S)
    for _, seq, payload in new.due():
        delivered += receiver.receive(A, new.header(B, seq), payload)
    assert delivered == ["x", "y", "z"]
    assert receiver.stats["retired_dropped"] == 1
