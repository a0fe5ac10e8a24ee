"""The clocks a node's workers have reached, as they write them into their node's shared memory.

A server learns a worker's clock from the worker's messages. A server that was off the CPU for a
while reads its queue late and in no set order between senders: a placement message from another
node, read before a clock tick that waited beside it, is decided against a clock that is behind.
Adaptive placement wants its node's clock as it is now: a co-located worker also writes the clock
it reached into a slot of its own, beside the clock table, at every clock.

Intents travel as messages, sent as the clock advances. A clock taken before the intents that came
with it would end an intent that an unread one carries on, so a slot holds the clock together with
how many intent messages the worker had sent by then, in one 64-bit word (one store: nobody reads
one without the other), and the server takes the clock only once it has read that many of the
worker's intent messages; until then it goes by the clocks its messages told. Each intent message
carries its number among the worker's, and the server counts up to the highest it has read: one
delivered twice does not push the count ahead. One lost on the way (its intents are gone for good)
would hold the count back until the worker's next one, which an app that declares its intents at
the start never sends; so a clock tick also says how many intent messages the worker had sent, and
the count goes up to that: those sent before a tick travel ahead of it on the one connection, so
any not read by then were lost.

Beside each slot the server writes when it last took the clock there (``seen``, in seconds of the
host's monotonic clock, read before the slot): a worker whose server reads its clock this way on its
own needs no tick to tell it (``client.ticks``). A tick wakes the server and costs it a message; a
busy server looks at the slots many times a clock.
"""

from __future__ import annotations

import time

import numpy as np

#: the low bits of a slot: intent messages sent, counted modulo their range
INTENT_BITS = 20
_INTENTS = (1 << INTENT_BITS) - 1
_LARGEST = 1 << 62  # no worker numbers this many intent messages: a larger number is no count


def packed(clock: int, intents_sent: int) -> int:
    """A slot's word: ``clock`` reached, with ``intents_sent`` intent messages sent by then."""
    return (clock << INTENT_BITS) | (intents_sent & _INTENTS)


class ReachedClocks:
    """The server's side: every worker's slot (those of this node's workers are written), and how
    many intent messages of each it has read."""

    def __init__(self, slots: np.ndarray, seen: np.ndarray | None = None) -> None:
        self.slots = slots
        #: per worker, when this server last took the clock in its slot (0: never); None: not shared
        self.seen = seen
        self.intents_read = np.zeros(slots.shape[0], dtype=np.int64)
        #: per worker, the newest of its processes (``Message.incarnation``) heard from: a late message of
        #: an earlier one would count its intent messages against the new one's
        self._incarnations = [0] * slots.shape[0]

    def intent_read(self, worker: int, number: int | None, incarnation: int | None = None) -> None:
        """An intent message of ``worker`` was read: its ``number`` among the worker's (one more
        than those read so far where it carries none)."""
        if not self._current(worker, incarnation):
            return
        if isinstance(number, int) and 0 < number < _LARGEST:
            self.intents_read[worker] = max(int(self.intents_read[worker]), number)
        else:
            self.intents_read[worker] += 1

    def tick_read(self, worker: int, sent: int | None, incarnation: int | None = None) -> None:
        """A clock tick of ``worker`` was read, saying it had sent ``sent`` intent messages by then:
        those not read by now were lost, and are counted as read."""
        if self._current(worker, incarnation) and isinstance(sent, int) and 0 < sent < _LARGEST:
            self.intents_read[worker] = max(int(self.intents_read[worker]), sent)

    def _current(self, worker: int, incarnation: int | None) -> bool:
        """Whether a message of ``worker``'s process ``incarnation`` counts (None: any), noting the
        newest process heard from."""
        if not 0 <= worker < self.intents_read.shape[0]:
            return False
        if incarnation is None:
            return True
        if incarnation < self._incarnations[worker]:
            return False
        self._incarnations[worker] = incarnation
        return True

    def restarted(self, worker: int) -> None:
        """Worker ``worker`` was started again: its new process counts its intent messages from 0,
        and its slot holds the clock of the one before until the new one writes it."""
        self.intents_read[worker] = 0
        self.slots[worker] = 0
        if self.seen is not None:
            self.seen[worker] = 0.0

    def clocks(self, learned: list[int], first: int) -> list[int]:
        """The clocks of workers ``first, first + 1, ...`` (as many as ``learned``, the clocks their
        messages told): the one a worker reached where every intent it sent by then has been read.
        Plain ints: a node has a worker or two, and the server asks at every placement message and
        timer pass (numpy's calls on arrays of one or two cost it ~15 us a time)."""
        slots, read, seen = self.slots, self.intents_read, self.seen
        looked_at = time.monotonic()  # before the reads: a clock written before this time is among them
        reached = []
        for i, told in enumerate(learned):
            word = int(slots[first + i])  # one read: the worker may write its slot meanwhile
            caught_up = (word & _INTENTS) == (int(read[first + i]) & _INTENTS)
            reached.append(max(told, word >> INTENT_BITS) if caught_up else told)
            if caught_up and seen is not None:
                seen[first + i] = looked_at
        return reached
