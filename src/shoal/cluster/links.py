"""Ordered, acknowledged one-way messages between processes over a network that may lose, repeat or
reorder them.

ZeroMQ over TCP delivers in order while a connection lives, but what was in
flight when one breaks is gone, and the fault-injecting transport drops, repeats
and reorders arrivals on purpose. Adaptive placement's messages between servers
carry the only copy of rows (a relocated key's state, a replica's change since
its last sync): one lost would lose updates, or leave a replica waiting for the
answer to its sync for good. So a sender numbers its messages to each peer and
keeps each until the peer acknowledges it, sending again what stays
unacknowledged; a receiver passes them on in the order sent, once each.

Acknowledgements are cumulative and ride on the messages going the other way
(placement traffic runs both ways every sync period); one goes alone only after
``ACK_DELAY_S`` without any. A gap goes at once: a receiver holding messages that
arrived after a missing one says so (``held``), and the sender sends the missing
one again then, not after ``RESEND_S`` (with traffic every few milliseconds, a
lost message is seen missing at the next one; its rows waited 0.2 s and more).
A process started again numbers afresh, under a channel of its own; a receiver
that has heard the new channel drops what still arrives on the earlier ones.
Unlike requests (``cluster.requests``), nothing is answered: the traffic is a
stream of events, and an answer to each would double it. Pure bookkeeping: the
caller sends, with the ``Header`` asked for here, and hands over what arrives;
time is injected.
"""

from __future__ import annotations

import math
import secrets
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")

#: how long an acknowledgement owed to a peer waits for a message to ride on
ACK_DELAY_S = 0.05
#: a message unacknowledged this long after it was sent goes again; the wait doubles with each try
RESEND_S = 0.2
RESEND_MAX_S = 4.0
#: a message the receiver reports missing goes again at once, unless a copy went this recently
MISSING_RESEND_S = 0.002
#: messages held per peer while an earlier one is missing; later ones are dropped (and come again)
MAX_HELD = 1024
#: messages kept per peer until acknowledged: past this the peer is gone or stuck for minutes (a few
#: dozen go a second), and the oldest is given up rather than memory (``stats["given_up"]``)
MAX_UNACKED = 4096
#: channels of a peer's earlier processes remembered, so that a late copy from one is dropped
RETIRED = 16


@dataclass(frozen=True)
class Header:
    """What travels with each message: the sender's channel (its numbered stream to the receiver,
    named afresh by each process) and the message's number in it (0: an acknowledgement alone), the
    lowest number of it not yet acknowledged (``base``: where a receiver that never heard the channel
    starts), and, of the receiver's channel ``acks``, every message up to ``acked`` arrived (``acks``
    0: nothing heard of it yet) and so did ``held`` (0: none past ``acked``), so the ones between
    are missing."""

    channel: int
    seq: int
    base: int
    acks: int
    acked: int
    held: int = 0


@dataclass
class _Unacked(Generic[T]):
    payload: T
    sent_at: float | None = None  # None: not sent yet (the peer's address is not known)
    tries: int = 0
    missing: bool = False  # the receiver reported it missing since it was last sent

    def due_at(self) -> float:
        if self.sent_at is None:
            return math.inf
        if self.missing:
            return self.sent_at
        return self.sent_at + min(RESEND_S * 2 ** max(self.tries - 1, 0), RESEND_MAX_S)


@dataclass
class _Outbound(Generic[T]):
    next_seq: int = 1
    unacked: dict[int, _Unacked[T]] = field(default_factory=dict)  # by number, in the order sent
    acked_at: float = -math.inf  # when an acknowledgement last took messages off ``unacked``

    def waiting(self) -> list[tuple[int, _Unacked[T]]]:
        """The messages whose waits count now. Once the oldest was sent again and nothing has been
        acknowledged since, the peer is cut off (or its answers are): only the oldest goes again, a
        probe, and the rest when it is answered, not every one at every turn of the backoff (copies
        the receiver would drop, all at once when the link came back)."""
        if not self.unacked:
            return []
        seq, oldest = next(iter(self.unacked.items()))
        if oldest.tries >= 2 and oldest.sent_at is not None and self.acked_at < oldest.sent_at:
            return [(seq, oldest)]
        return list(self.unacked.items())


@dataclass
class _Inbound(Generic[T]):
    channel: int = 0
    expected: int = 1
    held: dict[int, T] = field(default_factory=dict)  # arrived before one still missing
    owed_since: float | None = None  # an acknowledgement is owed since then


class Links(Generic[T]):
    """This process's channels to its peers, and what it heard of theirs."""

    def __init__(self, now: Callable[[], float]) -> None:
        self.now = now
        self.channel = secrets.randbits(62) | 1  # a process started again numbers afresh, under another
        self._out: dict[int, _Outbound[T]] = {}
        self._in: dict[int, _Inbound[T]] = {}
        #: per peer, the channels of its earlier processes, newest last
        self._retired: dict[int, deque[int]] = {}
        self.stats = {"repeats_dropped": 0, "held_out_of_order": 0, "dropped_out_of_order": 0, "resent": 0,
                      "given_up": 0, "retired_dropped": 0}

    # -------------------------------------------------------------- sending

    def add(self, peer: int, payload: T) -> int:
        """Number ``payload`` for ``peer`` and keep it until acknowledged; returns its number."""
        out = self._out.setdefault(peer, _Outbound())
        seq = out.next_seq
        out.next_seq += 1
        out.unacked[seq] = _Unacked(payload)
        if len(out.unacked) > MAX_UNACKED:  # the receiver skips it: the next header's base is past it
            del out.unacked[next(iter(out.unacked))]
            self.stats["given_up"] += 1
        return seq

    def header(self, peer: int, seq: int) -> Header:
        """The header for message ``seq`` to ``peer`` sent now (0: an acknowledgement alone); it carries
        the acknowledgement owed to ``peer``, which is then no longer owed."""
        out = self._out.get(peer)
        if seq:
            assert out is not None
            unacked = out.unacked[seq]
            unacked.sent_at = self.now()
            unacked.tries += 1
            unacked.missing = False
            if unacked.tries > 1:
                self.stats["resent"] += 1
        base = next(iter(out.unacked), out.next_seq) if out is not None else 1
        inbound = self._in.get(peer)
        if inbound is None:
            return Header(self.channel, seq, base, 0, 0)
        inbound.owed_since = None
        return Header(self.channel, seq, base, inbound.channel, inbound.expected - 1, max(inbound.held, default=0))

    def unsent(self, peer: int) -> list[tuple[int, T]]:
        """Messages for ``peer`` never sent (its address was not known), in order."""
        out = self._out.get(peer)
        return [] if out is None else [(s, u.payload) for s, u in out.unacked.items() if u.sent_at is None]

    def due(self) -> list[tuple[int, int, T]]:
        """``(peer, seq, payload)`` of each message to send again now, in order per peer."""
        now = self.now()
        return [(peer, seq, u.payload) for peer, out in self._out.items() for seq, u in out.waiting()
                if u.due_at() <= now]

    def acks_due(self) -> list[int]:
        """Peers owed an acknowledgement that found no message to ride on for ``ACK_DELAY_S``."""
        now = self.now()
        return [peer for peer, inbound in self._in.items()
                if inbound.owed_since is not None and inbound.owed_since + ACK_DELAY_S <= now]

    def next_deadline(self) -> float | None:
        """When ``due`` or ``acks_due`` next has something (None: nothing is waiting)."""
        times = [u.due_at() for out in self._out.values() for _, u in out.waiting()]
        times += [i.owed_since + ACK_DELAY_S for i in self._in.values() if i.owed_since is not None]
        soonest = min(times, default=math.inf)
        return None if soonest == math.inf else soonest

    def unacknowledged(self, peer: int | None = None) -> int:
        """Messages (to ``peer``, or to any) not acknowledged yet."""
        outs = self._out.values() if peer is None else [self._out[peer]] if peer in self._out else []
        return sum(len(out.unacked) for out in outs)

    # ------------------------------------------------------------ receiving

    def receive(self, peer: int, header: Header, payload: T) -> list[T]:
        """Take what ``peer`` sent under ``header``: the messages now ready, in the order sent (none for
        a repeat, for one that arrived before an earlier one, or for an acknowledgement alone)."""
        inbound = self._in.get(peer)
        if inbound is not None and inbound.channel != header.channel and header.channel in self._retired.get(peer, ()):
            # A late copy from an earlier process of the peer (sent again, or slow): taken for a restart, it
            # would start the channel over and pass on again what the new process's channel already did.
            self.stats["retired_dropped"] += 1
            return []
        self._acknowledged(peer, header)
        if not header.seq:
            return []
        if inbound is None or inbound.channel != header.channel:  # first heard, or the peer started again
            if inbound is not None:
                self._retired.setdefault(peer, deque(maxlen=RETIRED)).append(inbound.channel)
            inbound = self._in[peer] = _Inbound(channel=header.channel, expected=header.base)
        elif header.base > inbound.expected:  # given up by the sender: never to come
            inbound.expected = header.base
            inbound.held = {s: p for s, p in inbound.held.items() if s >= header.base}
        if inbound.owed_since is None:
            inbound.owed_since = self.now()
        ready = []
        if header.seq < inbound.expected or header.seq in inbound.held:
            self.stats["repeats_dropped"] += 1
        elif header.seq > inbound.expected:
            if len(inbound.held) >= MAX_HELD:
                self.stats["dropped_out_of_order"] += 1
            else:
                inbound.held[header.seq] = payload
                self.stats["held_out_of_order"] += 1
            inbound.owed_since = self.now() - ACK_DELAY_S  # a gap: the sender hears of it at once
        else:
            ready.append(payload)
            inbound.expected += 1
        while inbound.expected in inbound.held:  # those that waited for it (or for what was given up)
            ready.append(inbound.held.pop(inbound.expected))
            inbound.expected += 1
        return ready

    def _acknowledged(self, peer: int, header: Header) -> None:
        out = self._out.get(peer)
        if out is None or header.acks != self.channel:  # about an earlier process of ours: nothing kept of it
            return
        while out.unacked:
            seq = next(iter(out.unacked))
            if seq > header.acked:
                break
            del out.unacked[seq]
            out.acked_at = self.now()
        if header.held > header.acked:  # the ones between are missing (or the copy sent just now is on its way)
            now = self.now()
            for seq, unacked in out.unacked.items():
                if seq >= header.held:
                    break
                if unacked.sent_at is not None and now - unacked.sent_at >= MISSING_RESEND_S:
                    unacked.missing = True
