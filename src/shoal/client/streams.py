"""A worker's requests to each server, numbered so that the server handles them in order.

Requests about static tables' rows, and clock ticks, carry ``stream =
[incarnation, seq, floor, settled]``: ``seq`` numbers this worker's requests to
one server, ``floor`` is the lowest ``seq`` not over yet (everything below it was
answered or given up), and ``settled`` is the worker's settled
clock (every push of earlier iterations acknowledged), which a server goes by
while a slice that moved to it may still receive pushes sent elsewhere first. The server handles them in ``seq`` order
whatever order they arrive in (``server.streams``), so a read comes after this
worker's earlier pushes to that server and a clock tick after the pushes of the
iterations it closes, also when a lost request is sent again after later ones.
The incarnation comes from the rendezvous: a restarted worker starts a new
stream instead of reusing its earlier self's numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.wire.message import Message


@dataclass
class _Stream:
    next_seq: int = 1
    open: set[int] = field(default_factory=set)
    #: highest seq the server answered: it has handled every request of ours up to it
    answered: int = 0


class _Stamped:
    """The block of ``Streams.stamped`` (a plain class: a generator-based context manager costs a
    few microseconds more, on every request sent)."""

    __slots__ = ("streams", "server", "seq")

    def __init__(self, streams: Streams, server: int, seq: int) -> None:
        self.streams, self.server, self.seq = streams, server, seq

    def __enter__(self) -> int:
        return self.seq

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        if kind is not None:
            self.streams.ended(self.server, self.seq)


class Streams:
    """The numbering of this worker's requests to every server."""

    def __init__(self, incarnation: int) -> None:
        self.incarnation = incarnation
        self._streams: dict[int, _Stream] = {}

    def stamp(self, server: int, msg: Message, settled: int) -> int:
        """Number ``msg`` as this worker's next request to ``server``; returns its seq."""
        stream = self._stream(server)
        seq = stream.next_seq
        stream.next_seq += 1
        stream.open.add(seq)
        msg.body["stream"] = [self.incarnation, seq, min(stream.open), min(settled, msg.clock)]
        return seq

    def stamped(self, server: int, msg: Message, settled: int) -> _Stamped:
        """``stamp``, for a request sent inside the block: one that fails to go (its peer's queue stays
        full, the connection is gone) is over at once, or every later request would carry its seq as
        their floor and the server would wait for it for good."""
        return _Stamped(self, server, self.stamp(server, msg, settled))

    def _stream(self, server: int) -> _Stream:
        stream = self._streams.get(server)  # not setdefault: it would build a stream on every call
        if stream is None:
            stream = self._streams[server] = _Stream()
        return stream

    def ended(self, server: int, seq: int) -> None:
        """The request is over (answered or given up): it no longer holds the floor."""
        stream = self._streams.get(server)
        if stream is not None:
            stream.open.discard(seq)

    def answered(self, server: int, seq: int) -> None:
        """``server`` answered request ``seq`` (rows, an acknowledgement or an error)."""
        stream = self._stream(server)
        if seq > stream.answered:
            stream.answered = seq

    def handled(self, server: int) -> int:
        """``server`` has handled every request of ours up to this seq: what it sends after
        includes every push of ours before it, and every write we made here before sending it."""
        stream = self._streams.get(server)
        return 0 if stream is None else stream.answered

    def next_seq(self, server: int) -> int:
        """The seq our next request to ``server`` will carry."""
        stream = self._streams.get(server)
        return 1 if stream is None else stream.next_seq

    def reset(self, server: int) -> None:
        """``server`` is a new process (restarted, or another node's): its numbering starts over."""
        self._streams.pop(server, None)
