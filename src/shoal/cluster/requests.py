"""Request tracking: many requests in flight to many peers, matched to replies by id.

There is no receive thread. Whoever waits pumps the sockets and dispatches
every reply that arrives to the request it answers, so a worker's compute never
competes with a background thread for the GIL, and a call whose keys are all
local touches no socket at all.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from shoal.api.errors import (
    AuthError,
    ClosedError,
    NotServedError,
    ProtocolError,
    RequestTimeoutError,
    ShoalError,
    error_from_code,
)
from shoal.cluster.metrics import LatencyHistogram
from shoal.cluster.replay import new_incarnation
from shoal.cluster.throttle import ThrottledWarnings
from shoal.transport.base import Connection, Transport, is_loopback
from shoal.wire import bodies
from shoal.wire.codec import Codec, frames_nbytes
from shoal.wire.message import Message
from shoal.wire.ops import OP_NAMES, Flag, Op

log = logging.getLogger(__name__)

T = TypeVar("T")

RESEND_S = 1.0  # first resend of an unanswered request, until replies from its peer have been timed
RESEND_MIN_S = 0.05  # never sooner: a reply slowed by a busy peer must not look lost
#: nor before a request and its expected reply could cross a slow link: a large pull whose reply is
#: still on its way would otherwise be served again
RESEND_BYTES_PER_S = 50e6
RESEND_MAX_S = 8.0
#: how long a wait goes without looking at anything but its replies (a resend falls due sooner: then)
RESEND_CHECK_S = 0.05
ReplyHandler = Callable[[Message], None]


@dataclass(slots=True)
class _Pending:
    peer: int
    what: str
    on_reply: ReplyHandler
    op: str = ""
    started: float = 0.0
    error: ShoalError | None = None
    #: kept to send again if no reply comes (the receiver answers a repeat, never serves it twice)
    frames: list[Any] | None = None
    resend_at: float = float("inf")
    resends: int = 0
    #: bytes of the request and of the reply it expects: a floor for its resend timeout
    nbytes: int = 0
    #: nobody waits for it (``wait_all`` skips it) and its failure is not reported
    background: bool = False
    #: takes the request's error instead of keeping it for ``take_error``
    on_error: Callable[[ShoalError], None] | None = None
    #: runs once the request is over, however it ended: answered, failed, given up or forgotten
    on_end: Callable[[], None] | None = None
    #: its place in the sender's stream to the peer (``client.streams``), if it has one
    seq: int | None = None
    #: the request, while it has gone only another way (``register``): encoded if it is sent here
    message: Message | None = None


@dataclass
class RoundTrip:
    """Smoothed round-trip time of one peer's replies, and the resend timeout it implies (RFC 6298)."""

    srtt: float = 0.0
    rttvar: float = 0.0
    samples: int = 0

    def observe(self, rtt: float) -> None:
        if not self.samples:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt
        self.samples += 1

    def timeout(self, ceiling: float) -> float:
        """``srtt + 4 rttvar``, at least ``RESEND_MIN_S``, at most ``ceiling`` (all of it before any sample)."""
        if not self.samples:
            return ceiling
        return min(ceiling, max(RESEND_MIN_S, self.srtt + 4 * self.rttvar))


class RequestTracker:
    """Connections to a set of peers (by integer id) and the requests in flight to them."""

    def __init__(self, transport: Transport, codec: Codec, sender: int, resend_s: float | None = RESEND_S,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.transport = transport
        #: the clock of resends and reply latencies (tests move it by hand); waits keep real time
        self.now = now
        self.codec = codec
        self.sender = sender
        #: this tracker's stream of requests, as receivers tell it apart (born with its first request)
        self.incarnation = 0
        self._conns: dict[int, Connection] = {}
        self._codecs: dict[int, Codec] = {}  # per peer: the codec for the wire it is reached by
        self._peer_of: dict[int, int] = {}  # id(connection) -> peer
        self._poller = transport.poller()
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._errors: dict[int, ShoalError] = {}
        self._closed = False
        #: for metrics: requests and one-way messages sent per op, bytes each way, reply latency per op
        self.sent: Counter[str] = Counter()
        self.bytes_sent = 0
        self.bytes_received = 0
        self.latency = LatencyHistogram()
        self.resent = 0
        #: at most this many seconds before a request without a reply is sent again (then twice as
        #: long, up to ``RESEND_MAX_S``); sooner once the peer's round trips are known (``RoundTrip``).
        #: None: never (for peers that do not recognise repeats)
        self.resend_s = resend_s
        self.round_trips: dict[int, RoundTrip] = {}
        self._next_resend_at = math.inf  # the soonest a request in flight is due to be sent again
        #: called with (peer, message) for messages that answer no request (server pushes)
        self.on_unsolicited: Callable[[int, Message], None] | None = None
        #: called after each round of received messages, outside any reply handler, never nested: work
        #: a reply cannot do in place (a push sent again after a layout refresh, say); it must not wait
        #: for anything that needs it to run
        self.after_receive: Callable[[], None] | None = None
        self._in_after_receive = False
        #: called while a wait hears nothing (about every ``RESEND_CHECK_S``): what the waiter must keep
        #: doing however long it waits (a worker under a bound looks for servers that joined); cheap
        self.while_waiting: Callable[[], None] | None = None
        #: one-way messages dropped since the last warning, and when it was, per (peer, op)
        self._warnings = ThrottledWarnings(log)

    # ----------------------------------------------------------- connections

    def connect(self, peer: int, address: str) -> None:
        with self._lock:
            if peer in self._conns:
                if self._conns[peer].address == address:
                    return
                self.disconnect(peer)
            conn = self.transport.connect(address)
            self._conns[peer] = conn
            self._codecs[peer] = self.codec.for_wire(is_loopback(address))
            self._peer_of[id(conn)] = peer
            self._poller.register(conn)

    def disconnect(self, peer: int) -> None:
        with self._lock:
            conn = self._conns.pop(peer, None)
            self._codecs.pop(peer, None)
            if conn is not None:
                self._poller.unregister(conn)
                self._peer_of.pop(id(conn), None)
                conn.close()

    def connection(self, peer: int) -> Connection:
        """The connection to ``peer`` (connected)."""
        return self._conns[peer]

    def address_of(self, peer: int) -> str:
        conn = self._conns.get(peer)
        return conn.address if conn else "<not connected>"

    @property
    def peers(self) -> list[int]:
        return sorted(self._conns)

    # -------------------------------------------------------------- requests

    def request(self, peer: int, msg: Message, on_reply: ReplyHandler, what: str = "",
                background: bool = False, reply_bytes: int = 0,
                on_error: Callable[[ShoalError], None] | None = None,
                on_end: Callable[[], None] | None = None) -> int:
        """Send ``msg`` to ``peer``; ``on_reply`` runs (inside a later pump) with the reply.

        A ``background`` request is sent again like any other, but nobody waits for it: ``wait_all``
        skips it, and it ends silently if ``forget`` drops it (a newer one superseding it, say).
        ``reply_bytes``, the size of the expected reply, keeps a large read from being sent again
        while its reply is still arriving. ``on_error`` takes an error reply instead of ``take_error``;
        ``on_end`` runs once the request is over, however it ended.
        """
        with self._lock:
            conn = self._connection_for_request(peer)
            req = self._stamp(msg)
            frames = self._codecs[peer].encode(msg)
            conn.send(frames)  # bounded wait for room; raises if the peer is stuck
            self._track(req, peer, msg, frames, on_reply, what, background, reply_bytes, on_error, on_end)
            return req

    def register(self, peer: int, msg: Message, on_reply: ReplyHandler, what: str = "", reply_bytes: int = 0,
                 on_error: Callable[[ShoalError], None] | None = None,
                 on_end: Callable[[], None] | None = None) -> int:
        """``request``, for a request the caller sends another way first (a lane, ``client.lane``):
        numbered and waited for as the others, sent on this connection only by ``send_now`` (the
        other way did not take it) or once its reply is overdue; ``complete`` ends it with the
        reply that came the other way. The receiver serves either copy once."""
        with self._lock:
            self._connection_for_request(peer)
            req = self._stamp(msg)
            self._track(req, peer, msg, None, on_reply, what, False, reply_bytes, on_error, on_end)
            return req

    def send_now(self, req: int) -> None:
        """Send request ``req`` (``register``) on its connection now, if it is still in flight."""
        with self._lock:
            pending = self._pending.get(req)
            conn = self._conns.get(pending.peer) if pending is not None else None
            if pending is None or conn is None:
                return  # over, or its peer gone (what ends its requests ends this one)
            conn.send(self._frames_of(pending))
            if self.resend_s is not None:
                pending.resend_at = self.now() + self._resend_after(pending)
                self._next_resend_at = min(self._next_resend_at, pending.resend_at)

    def complete(self, req: int, reply: Message) -> None:
        """End request ``req`` with ``reply``, which came another way; nothing if it is over already
        (its copy sent here was answered first)."""
        with self._lock:
            if req in self._pending:
                self._finish(req, reply)

    def _connection_for_request(self, peer: int) -> Connection:
        if self._closed:
            raise ClosedError("this handle has been shut down")
        conn = self._conns.get(peer)
        if conn is None:
            raise ClosedError(f"not connected to peer {peer}")
        return conn

    def _track(self, req: int, peer: int, msg: Message, frames: list[Any] | None, on_reply: ReplyHandler, what: str,
               background: bool, reply_bytes: int, on_error: Callable[[ShoalError], None] | None,
               on_end: Callable[[], None] | None) -> None:
        """Keep request ``req`` in flight (``frames``: as sent; None: not sent on its connection yet)."""
        op = OP_NAMES[msg.op]
        now = self.now()
        size = frames_nbytes(frames) if frames is not None else sum(a.nbytes for a in msg.arrays)
        pending = _Pending(peer, what or f"{op} {msg.table!r}".strip(), on_reply, op, now, background=background,
                           nbytes=size + reply_bytes, on_error=on_error, on_end=on_end,
                           seq=stream[1] if (stream := msg.body.get("stream")) else None)
        pending.message = msg if frames is None else None
        if self.resend_s is not None:
            pending.frames, pending.resend_at = frames, now + self._resend_after(pending)
            self._next_resend_at = min(self._next_resend_at, pending.resend_at)
        self._pending[req] = pending
        self.sent[op] += 1
        if frames is not None:
            self.bytes_sent += size

    def _frames_of(self, pending: _Pending) -> list[Any]:
        """The frames ``pending`` goes as on its connection (encoded once, when first sent there)."""
        if pending.frames is None:
            assert pending.message is not None
            pending.frames = self._codecs[pending.peer].encode(pending.message)
            pending.message = None
            self.bytes_sent += frames_nbytes(pending.frames)
        return pending.frames

    def notify(self, peer: int, msg: Message, block: bool = False) -> bool:
        """Send a one-way message; nothing will answer it.

        By default it never blocks: False if it was dropped (no connection, or
        the peer's queue is full because it stopped reading). With ``block``
        it waits a bounded time for room and raises ``ClusterError`` after.
        """
        with self._lock:
            conn = self._conns.get(peer)
            if conn is None or self._closed:
                return False
            self._stamp(msg)
            msg.flags |= Flag.NO_REPLY
            frames = self._codecs[peer].encode(msg)
            sent = conn.send(frames, block=block)
            if sent:
                self.sent[msg.op.name] += 1
                self.bytes_sent += frames_nbytes(frames)
            if not sent:
                self._note_dropped(peer, msg.op.name)
            return sent

    def number(self) -> tuple[int, int]:
        """A request number in this tracker's sequence and its incarnation, for a request sent
        another way (a lane, ``client.lane``): receivers tell repeats by them as by the others."""
        with self._lock:
            if not self.incarnation:
                self.incarnation = new_incarnation()
            return next(self._ids), self.incarnation

    def _stamp(self, msg: Message) -> int:
        """Number ``msg`` in this tracker's stream: receivers serve each number once."""
        if not self.incarnation:
            self.incarnation = new_incarnation()
        msg.req, msg.sender, msg.incarnation = next(self._ids), self.sender, self.incarnation
        return msg.req

    def _note_dropped(self, peer: int, op: str) -> None:
        """A peer that reads slowly (an overloaded machine) fills its queue again and again."""
        self._warnings.warn(("dropped", peer, op), "dropped a one-way %s message to peer %s: its queue is full",
                            op, peer)

    def done(self, reqs: set[int]) -> bool:
        return not any(r in self._pending for r in reqs)

    def answered(self, reqs: set[int]) -> bool:
        """``done`` after taking in whatever has arrived."""
        self.pump(0)
        return self.done(reqs)

    def wait(self, reqs: set[int], timeout: float) -> None:
        """Pump until every request in ``reqs`` is answered, or raise ``RequestTimeoutError``."""
        self.wait_until(lambda: self.done(reqs), lambda: reqs, timeout)

    def wait_until(self, done: Callable[[], bool], awaited: Callable[[], set[int]], timeout: float,
                   step: Callable[[], None] | None = None) -> None:
        """Pump until ``done()``, or raise ``RequestTimeoutError`` naming the requests ``awaited()``
        still lists (a call whose set of requests grows while it waits: a part sent again elsewhere).
        ``step`` runs before each check: the waiter's own part of the work (it may wait itself)."""
        deadline = time.monotonic() + timeout
        idle = False
        with self._lock:
            while True:
                if step is not None:
                    step()
                if done():
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RequestTimeoutError(self._describe_missing(awaited(), timeout))
                peers = {self._pending[r].peer for r in awaited() if r in self._pending}
                # Wake at least every resend check: a lost request is sent again while we wait.
                if len(peers) == 1:
                    if self._receive_from(peers.pop(), min(remaining, self._until_resend())):
                        self._resend_due()
                        self._run_after_receive()
                    else:  # a long wait also hears the other peers (a fence, rows pushed eagerly)
                        self.pump(0)
                        self._run_while_waiting()
                elif not peers and not idle:  # nothing in flight: what is left is ours to do, now
                    idle = True
                    self.pump(0)
                else:
                    idle = False
                    if not self.pump(min(remaining, self._until_resend())):
                        self._run_while_waiting()

    def _receive_from(self, peer: int, timeout: float) -> int:
        """Wait on one peer's connection only: cheaper than polling them all. Returns the messages handled."""
        conn = self._conns.get(peer)
        if conn is None:
            return self.pump(timeout)
        handled = 0
        frames = conn.recv(timeout)
        while frames is not None:
            self._dispatch(peer, frames)
            handled += 1
            frames = conn.recv(0)
        return handled

    def wait_all(self, timeout: float, step: Callable[[], None] | None = None) -> None:
        """Pump until nothing is in flight (used before barriers and shutdown); ``step`` as in
        ``wait_until``.

        Raises the first error of a request nobody waited for (an async push
        that failed), so it does not vanish.
        """
        deadline = time.monotonic() + timeout  # waits keep real time, as ``wait_until`` does
        # Answers may send parts again (keys that moved): those are waited for too.
        while pending := {r for r, p in self._pending.items() if not p.background}:
            self.wait_until(functools.partial(self.done, pending), functools.partial(set, pending),
                            max(deadline - time.monotonic(), 0.0), step)
        if self._errors:
            errors, self._errors = self._errors, {}
            first = errors[min(errors)]
            if len(errors) > 1:
                log.warning("%d more request(s) failed unobserved; the first is raised", len(errors) - 1)
            raise first

    def gather(self, peers: list[int], make: Callable[[int], Message], what: str, timeout: float,
               partial: bool = False) -> dict[int, dict[str, Any]]:
        """Send ``make(peer)`` to every peer at once; the reply bodies by peer.

        Raises the first error (or the timeout) unless ``partial``: then peers that fail or do not
        answer within ``timeout`` are simply missing from the result.
        """
        replies: dict[int, dict[str, Any]] = {}

        def keep(peer: int) -> ReplyHandler:
            return lambda msg: replies.__setitem__(peer, msg.body)

        reqs = {self.request(p, make(p), keep(p), f"{what} to peer {p}") for p in peers}
        try:
            self.wait(reqs, timeout)
        except RequestTimeoutError:
            if not partial:
                raise
        errors = [e for r in sorted(reqs) if (e := self.take_error(r))]
        if errors and not partial:
            raise errors[0]
        return replies

    @property
    def closed(self) -> bool:
        return self._closed

    def forget(self, req: int) -> None:
        """Stop tracking ``req``: no resend, a late reply is dropped, no error is kept."""
        with self._lock:
            pending = self._pending.pop(req, None)
            self._errors.pop(req, None)
            if pending is not None and pending.on_end is not None:
                pending.on_end()

    def awaits(self, peer: int) -> bool:
        """Whether a request to ``peer`` is in flight."""
        return any(p.peer == peer for p in self._pending.values())

    def end_unserved(self, peer: int, handled: int) -> None:
        """``peer`` stopped reading after handling our stream's requests up to ``handled``: the later
        ones in flight to it end with ``NotServedError`` (their ``on_error`` sends them elsewhere;
        one without, a clock tick say, is over: what it told the peer no longer matters). Those up
        to ``handled`` were answered before it stopped: their answers are still on their way."""
        with self._lock:
            unserved = [r for r, p in self._pending.items() if p.peer == peer and p.seq is not None and p.seq > handled]
            for req in unserved:
                pending = self._pending[req]
                if pending.on_error is not None:
                    pending.error = NotServedError(f"server {peer} left before it read {pending.what}")
                self._finish(req, None)
            if unserved:
                self._run_after_receive()  # what the answers' handlers queued goes now

    def end_background(self, peer: int) -> None:
        """End every background request in flight to ``peer`` (clock ticks, say): nobody waits for
        them, and a peer that left has no use for them."""
        with self._lock:
            for req in [r for r, p in self._pending.items() if p.peer == peer and p.background]:
                self._finish(req, None)

    def fail_peer(self, peer: int, error: ShoalError) -> None:
        """End every request in flight to ``peer`` with ``error`` (it was a process that is gone: one
        started in its place must not get them)."""
        with self._lock:
            for req in [r for r, p in self._pending.items() if p.peer == peer]:
                self._pending[req].error = error
                self._finish(req, None)

    def _describe_missing(self, reqs: set[int], timeout: float) -> str:
        missing = [(r, self._pending[r]) for r in sorted(reqs) if r in self._pending]
        for r, p in missing:
            self._pending.pop(r, None)  # a late reply is dropped, not misrouted
            if p.on_end is not None:
                p.on_end()
        parts = [f"{p.what} (request {r}) to peer {p.peer} at {self.address_of(p.peer)}" for r, p in missing]
        return f"no reply within {timeout:.1f}s to: " + "; ".join(parts)

    def pump(self, timeout: float | None) -> int:
        """Receive and dispatch whatever arrives within ``timeout``; returns the number handled."""
        handled = 0
        with self._lock:
            for conn in self._poller.poll(timeout):
                peer = self._peer_of.get(id(conn), -1)
                while True:
                    frames = conn.recv(0)
                    if frames is None:
                        break
                    self._dispatch(peer, frames)
                    handled += 1
            self._resend_due()
            self._run_after_receive()
        return handled

    def _run_after_receive(self) -> None:
        if self.after_receive is None or self._in_after_receive:
            return
        self._in_after_receive = True
        try:
            self.after_receive()
        finally:
            self._in_after_receive = False

    def _run_while_waiting(self) -> None:
        if self.while_waiting is not None:
            self.while_waiting()

    def _until_resend(self) -> float:
        """Seconds a wait may go before a request falls due to be sent again (at most ``RESEND_CHECK_S``)."""
        return min(RESEND_CHECK_S, max(self._next_resend_at - self.now(), 0.0005))

    def _resend_due(self) -> None:
        """Send again the requests whose reply is overdue: a message lost on the way (or a peer that
        restarted) costs a delay, not the request. Looked at when the soonest falls due (looked at
        on a grid of ``RESEND_CHECK_S``, a lost request waited up to that long past its timeout)."""
        now = self.now()
        if self.resend_s is None or now < self._next_resend_at:
            return
        soonest = math.inf
        for req, pending in list(self._pending.items()):
            if pending.frames is None and pending.message is None:
                continue
            if pending.resend_at > now:
                soonest = min(soonest, pending.resend_at)
                continue
            conn = self._conns.get(pending.peer)
            if conn is None or not conn.send(self._frames_of(pending), block=False):
                soonest = min(soonest, now + RESEND_CHECK_S)  # gone, or its queue is full: tried again later
                continue
            pending.resends += 1
            pending.resend_at = now + min(self._resend_after(pending) * 2 ** pending.resends, RESEND_MAX_S)
            soonest = min(soonest, pending.resend_at)
            self.resent += 1
            log.debug("resent %s (request %d) to peer %s, time %d", pending.what, req, pending.peer,
                      pending.resends)
        self._next_resend_at = soonest

    def _resend_after(self, pending: _Pending) -> float:
        assert self.resend_s is not None
        trip = self.round_trips.get(pending.peer)
        timed = trip.timeout(self.resend_s) if trip is not None else self.resend_s
        return max(timed, pending.nbytes / RESEND_BYTES_PER_S)

    def _dispatch(self, peer: int, frames: list) -> None:
        try:
            self._dispatch_checked(peer, frames)
        except Exception:  # a reply we cannot make sense of must not surface in an unrelated call
            log.exception("dropping a message from peer %s that could not be handled", peer)

    def _dispatch_checked(self, peer: int, frames: list) -> None:
        self.bytes_received += frames_nbytes(frames)
        try:
            msg = self._codecs.get(peer, self.codec).decode(frames)
        except ShoalError as exc:
            req = getattr(exc, "req", None)
            if isinstance(req, int) and req in self._pending:
                # An unverifiable reply to our own request: most often a peer that
                # rejected our tag and answered unsigned. Fail that request.
                pending = self._pending[req]
                if isinstance(exc, AuthError):
                    exc = AuthError(f"{pending.what} to {self.address_of(peer)}: {exc} (do all processes share "
                                    "the same secret, SHOAL_SECRET or SHOAL_SECRET_FILE?)")
                pending.error = exc
                self._finish(req, None)
            else:
                log.warning("dropping undecodable message from peer %s: %s", peer, exc)
            return
        if msg.req == 0 or msg.req not in self._pending:
            if self.on_unsolicited is not None and msg.req == 0:
                self.on_unsolicited(peer, msg)
            else:
                log.debug("dropping reply to unknown request %s from peer %s", msg.req, peer)
            return
        pending = self._pending[msg.req]
        if msg.op == Op.ERROR:
            error = bodies.Error.of(msg)  # its body was checked on arrival (``wire.schema``)
            pending.error = error_from_code(error.code, f"peer {peer}: {error.message}")
            self._finish(msg.req, None, replied=True)
            return
        self._finish(msg.req, msg)

    def _finish(self, req: int, msg: Message | None, replied: bool = False) -> None:
        """End request ``req`` with its reply ``msg`` (None: with its error, an error reply if ``replied``)."""
        pending = self._pending.pop(req)
        if pending.started:
            elapsed = self.now() - pending.started
            self.latency.observe(pending.op, elapsed)
            # A reply to a request sent again could answer either copy (Karn); a request ended without
            # one (its peer failed, its sender gave up) timed nothing.
            if (msg is not None or replied) and not pending.resends:
                trip = self.round_trips.get(pending.peer)
                if trip is None:
                    trip = self.round_trips[pending.peer] = RoundTrip()
                trip.observe(elapsed)
        error = pending.error
        if msg is not None and error is None:
            try:
                pending.on_reply(msg)
            except ShoalError as exc:
                error = exc
            except Exception as exc:  # a reply that does not fit what we asked for
                error = ProtocolError(f"bad reply to {pending.what}: {exc!r}")
        if error is not None and pending.on_error is not None:
            pending.on_error(error)
        elif error is not None and not pending.background:
            self._errors[req] = error
        if pending.on_end is not None:
            pending.on_end()

    def take_error(self, req: int) -> ShoalError | None:
        return self._errors.pop(req, None)

    # -------------------------------------------------------------- shutdown

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for peer in list(self._conns):
                self.disconnect(peer)
            ended = [p.on_end for p in self._pending.values() if p.on_end is not None]
            self._pending.clear()
            for on_end in ended:
                on_end()


class Call(Protocol):
    """Requests that together make one call, possibly growing while it runs (a part sent again)."""

    def finished(self) -> bool: ...

    def awaited(self) -> set[int]: ...

    def step(self) -> None:
        """The waiter's part of the work, run while it waits (a read sent again after a move)."""


def _no_finish() -> Any:
    raise AssertionError("a future made with its result has nothing to finish")


class Future(Generic[T]):
    """The result of an ``*_async`` call; ``wait()`` returns it or raises its error.

    It waits for a set of requests, or for a ``Call`` whose requests may change while it waits.
    """

    def __init__(
        self,
        tracker: RequestTracker | None,
        reqs: set[int] | Call,
        finish: Callable[[], T],
        timeout: float,
        recover: Callable[[dict[int, ShoalError]], None] | None = None,
    ) -> None:
        self._tracker = tracker
        self._reqs = reqs
        self._finish = finish
        self._timeout = timeout
        #: given the failed requests, redo them (raising if it cannot) before ``finish``
        self._recover = recover
        self._result: T | None = None
        self._error: ShoalError | None = None
        self._settled = False
        self._ready: Callable[[], bool] | None = None

    @classmethod
    def done_with(cls, result: T) -> Future[T]:
        """A call that has its result already (every row was local)."""
        if result is None:  # a push's: one settled future serves them all (nothing changes it)
            return _DONE  # type: ignore[return-value]
        future = cls(None, set(), _no_finish, 0.0)
        future._result, future._settled = result, True
        return future

    @classmethod
    def completed(cls, finish: Callable[[], T]) -> Future[T]:
        """A call with no request in flight (every row was local): ``wait()`` only runs ``finish``,
        which returns the result or raises the call's error."""
        return cls(None, set(), finish, 0.0)

    @classmethod
    def running(cls, finish: Callable[[], T], ready: Callable[[], bool]) -> Future[T]:
        """A call whose ``finish`` does its own waiting and its own timeouts (a quorum that fails
        over to other replicas, keys that follow a move): ``done()`` asks ``ready`` whether every
        request sent so far is answered."""
        future = cls(None, set(), finish, 0.0)
        future._ready = ready
        return future

    def done(self) -> bool:
        """True once ``wait()`` would not wait for a request already sent."""
        if self._settled:
            return True
        if self._ready is not None:
            return self._ready()
        if self._tracker is None:
            return True
        if isinstance(self._reqs, set):
            return self._tracker.answered(self._reqs)
        self._tracker.pump(0)
        return self._reqs.finished()

    def wait(self, timeout: float | None = None) -> T:
        if not self._settled:
            try:
                limit = self._timeout if timeout is None else timeout
                reqs, tracker = self._reqs, self._tracker
                if tracker is not None and isinstance(reqs, set):
                    self._wait_requests(tracker, reqs, limit)
                elif tracker is not None and not isinstance(reqs, set):
                    tracker.wait_until(reqs.finished, reqs.awaited, limit, reqs.step)
                self._result = self._finish()
            except ShoalError as exc:
                self._error = exc
            self._settled = True
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]

    result = wait

    def _wait_requests(self, tracker: RequestTracker, reqs: set[int], limit: float) -> None:
        if not reqs:
            return
        tracker.wait(reqs, limit)
        errors = {r: e for r in sorted(reqs) if (e := tracker.take_error(r))}
        if errors and self._recover is None:
            raise next(iter(errors.values()))
        if errors:
            self._recover(errors)  # type: ignore[misc]


_DONE: Future[None] = Future(None, set(), _no_finish, 0.0)  # ``Future.done_with(None)``
_DONE._settled = True
