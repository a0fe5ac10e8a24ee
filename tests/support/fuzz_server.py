"""A real server fed fuzzed frames, and what must hold whatever arrives.

``FuzzServer`` builds a ``ParameterServer`` the way ``tests/support/cluster.py``
does (node 0 of two, in-process transport) but never starts its loop: the
caller's thread is the only one touching it, calling ``handle`` directly and
reading what the server sent back. Every reply must decode and be OK, VALUES,
ROWS, TOTALS or an ERROR with a known code other than ``ServerError`` (which
the server sends only when a handler raised something unexpected). The table
``PROTECTED`` holds known values: fuzzed requests name other tables, and
``protected_frames`` sends it only requests that must be refused or that
cannot change it, so at the end it must be bit-identical.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import shutil
import time
import uuid
from collections import Counter
from typing import Any

import numpy as np
from hypothesis import strategies as st

from shoal import ClusterSpec
from shoal.api.config import Timeouts
from shoal.api.errors import ERRORS_BY_CODE, AuthError, ServerError, ShoalError
from shoal.cluster.replay import new_incarnation
from shoal.server.server import ParameterServer
from shoal.storage.checkpoint import FORMAT, MANIFEST
from shoal.transport.inproc import InProcConnection, InProcTransport
from shoal.wire import Codec, Flag, Message, Op
from shoal.wire.schema import Moved
from tests.support.fuzz_frames import broken_frames, random_frames
from tests.support.fuzzing import (
    BAD_CHECKPOINTS,
    FINITE_TABLES,
    FUZZ_DIR,
    FUZZ_TABLES,
    INCARNATIONS,
    LIMITS,
    NUM_NODES,
    PROTECTED,
    REQUESTS,
    SERVED_OPS,
    SMALL_INTS,
    STAGING,
    encoded,
    on_the_wire,
    op_messages,
    spec_dicts,
)

#: ops a server may send to a requester (ROWS: unasked ESSP updates; TOTALS: replicated pulls; FENCE: a
#: push refused because its slice is elsewhere, its sender's clock held until it confirms)
REPLY_OPS = {Op.OK, Op.VALUES, Op.ERROR, Op.ROWS, Op.TOTALS, Op.FENCE}
HANDLE_SLOW_S = 5.0  # one message handled slower than this is a hang, not a slow machine
TICK_EVERY = 25  # run the loop's timers this often, as a busy loop would between bursts


def _npz(**arrays: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.savez(out, **arrays)  # type: ignore[arg-type]
    return out.getvalue()


def write_bad_checkpoints() -> None:
    """Checkpoints a RESTORE may be pointed at, each broken in its own way, under ``FUZZ_DIR``."""
    spec = FINITE_TABLES[0].to_dict()
    keys = np.arange(32, dtype=np.int64)
    parts = {"part-garbage": b"PK\x03\x04 not a zip at all",
             "part-strings": _npz(keys=keys, values=np.full((32, 4), "abc")),
             "part-keys": _npz(keys=keys.astype(np.float32), values=np.zeros((32, 4), np.float32))}
    manifests: dict[str, Any] = {
        "list": [],
        "no-format": {"tables": {}},
        "tables-list": {"format": FORMAT, "tables": []},
        "entry-int": {"format": FORMAT, "tables": {spec["name"]: 5}},
        "parts-hostile": {"format": FORMAT, "tables": {spec["name"]: {"spec": spec, "parts": [
            {"file": "../../outside.npz", "bytes": 1, "sha256": "0"}, 7, {"file": 3}]}}},
        "part-missing": {"format": FORMAT, "tables": {spec["name"]: {"spec": spec, "parts": [
            {"file": "t0/n0-s0.npz", "rows": 32, "bytes": 10, "sha256": "0" * 64}]}}},
    }
    for name, data in parts.items():
        (FUZZ_DIR / name / "t0").mkdir(parents=True, exist_ok=True)
        (FUZZ_DIR / name / "t0" / "n0-s0.npz").write_bytes(data)
        manifests[name] = {"format": FORMAT, "tables": {spec["name"]: {"spec": spec, "parts": [
            {"file": "t0/n0-s0.npz", "rows": 32, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}]}}}
    assert set(manifests) == set(BAD_CHECKPOINTS)
    for name, manifest in manifests.items():
        (FUZZ_DIR / name).mkdir(exist_ok=True)
        (FUZZ_DIR / name / MANIFEST).write_text(json.dumps(manifest))


class FuzzServer:
    """A ``ParameterServer`` (node 0 of two) fed frames by the caller's thread."""

    def __init__(self, secret: bytes | None = None) -> None:
        self.secret = secret
        STAGING.mkdir(parents=True, exist_ok=True)
        write_bad_checkpoints()
        self.transport = InProcTransport()
        self.cluster = ClusterSpec("fz" + uuid.uuid4().hex[:10], NUM_NODES, 1, "inproc://fuzz-rendezvous", secret,
                                   LIMITS, Timeouts(request_s=30.0))
        self.server = ParameterServer(0, self.cluster, self.transport, bind="inproc://*", share_memory=False)
        self.codec = Codec(LIMITS, secret, local=True)  # decodes as the server does, to know what it must answer
        self.unsigned = Codec(LIMITS)
        self.conn = self._connect()
        self.tally: Counter[str] = Counter()
        self.cases = 0
        self.slowest_s = 0.0
        self._req = 0
        self.incarnation = new_incarnation()
        #: (sender, incarnation, request) of every decodable request fed, and whether the last one
        #: repeated an earlier one: the server answers a repeat with the reply it kept, whatever it asks
        self.ids: set[tuple[int, int, int]] = set()
        self.repeated = False
        for spec in (PROTECTED, *FUZZ_TABLES):
            reply = self.call(Message(Op.CREATE_TABLE, table=spec.name, body={"spec": spec.to_dict()}))
            assert reply.op == Op.OK, reply.body
        table = self.server.tables[PROTECTED.name]
        owner = table.layout.route(np.arange(PROTECTED.num_keys, dtype=np.int64))[0]
        self.owned = np.flatnonzero(owner == 0).astype(np.int64)
        self.elsewhere = np.flatnonzero(owner != 0).astype(np.int64)
        grads = np.linspace(-2, 2, self.owned.size * PROTECTED.dim, dtype=np.float32).reshape(-1, PROTECTED.dim)
        assert self.call(Message(Op.PUSH, table=PROTECTED.name, arrays=[self.owned, grads])).op == Op.OK
        self.expected = self.pull_protected()
        self.layout = (table.layout.epoch, table.layout.owners.tolist())
        self.state = self._protected_state()
        self.tally.clear()  # count what the fuzz sends, not the setting up
        self.cases = 0

    # -------------------------------------------------------------- feeding

    def _connect(self) -> InProcConnection:
        conn = self.transport.connect(self.server.address)
        assert isinstance(conn, InProcConnection)
        self.server.listener.peers[conn.peer] = conn  # what its first send would do
        return conn

    def call(self, msg: Message) -> Message:
        """A well-formed request (with a request id of its own) and its one reply."""
        self._req += 1
        msg.req, msg.sender, msg.incarnation = self._req, 0, self.incarnation  # as worker 0
        replies = self.feed(on_the_wire(self.codec.encode(msg)))
        assert len(replies) == 1 and replies[0].req == msg.req, replies
        return replies[0]

    def feed(self, frames: list[bytes], same_peer: bool = False) -> list[Message]:
        """Hand ``frames`` to the server; check and return what it sent back.

        Each case comes from a new peer unless ``same_peer``. A server answers a
        request id it has seen from the same sender and incarnation with the reply
        it sent then, whatever the request is now and whatever connection it comes
        by (``repeated`` says the case was such a repeat).
        """
        if not same_peer:
            self.server.listener.peers.pop(self.conn.peer, None)  # gone: what is still sent to it is dropped
            self.conn = self._connect()
        while self.conn.recv(0) is not None:
            pass  # left by a case that failed before reading them (Hypothesis then replays cases)
        try:
            request: Message | ShoalError = self.codec.decode(frames)
        except ShoalError as exc:
            request = exc
        self.repeated = False
        if isinstance(request, Message):
            stream_id = (request.sender, request.incarnation, request.req)
            self.repeated = stream_id in self.ids
            self.ids.add(stream_id)
        started = time.perf_counter()
        self.server.handle(self.conn.peer, frames)
        self.server.install_built(wait=True)  # a table it asked for: built off the loop, answered here
        elapsed = time.perf_counter() - started
        self.slowest_s = max(self.slowest_s, elapsed)
        assert elapsed < HANDLE_SLOW_S, f"handling took {elapsed:.1f}s: {request!r}"
        self.cases += 1
        replies = self._replies(self.unsigned if isinstance(request, AuthError) else self.codec)
        if isinstance(request, ShoalError):
            self.tally[f"refused:{request.code}"] += 1
            if getattr(request, "flags", 0) & Flag.NO_REPLY:
                assert not replies, replies
            else:
                assert [(r.op, r.body["code"], r.req) for r in replies] == [
                    (Op.ERROR, request.code, getattr(request, "req", None) or 0)], (request, replies)
            return replies
        if request.op == Op.SHUTDOWN:  # the loop would end here (unless this repeats a request); there is none
            self.server._stop.clear()
        assert not self.server._stop.is_set(), f"{request.op.name} stopped the server"
        for reply in replies:
            self.tally[f"{request.op.name}:{reply.body['code'] if reply.op == Op.ERROR else reply.op.name}"] += 1
        if not replies:
            self.tally[f"{request.op.name}:no reply"] += 1
        return replies

    def _replies(self, codec: Codec) -> list[Message]:
        out = []
        for _ in range(10_000):  # a request releases at most the pulls held so far
            frames = self.conn.recv(0)
            if frames is None:
                return out
            reply = codec.decode(frames)
            assert reply.op in REPLY_OPS, reply
            if reply.op == Op.ERROR:
                code = reply.body["code"]
                assert code in ERRORS_BY_CODE and code != ServerError.code, f"handler failed: {reply.body}"
            out.append(reply)
        raise AssertionError("the server sent over 10,000 messages for one request")

    def tick(self) -> None:
        """Run the loop's timers (held pulls, gossip, placement, slice moves) as the loop would."""
        self.server.sync.tick()
        self.server.replication.tick()
        self.server.adaptive.tick()
        self.server.slicing.tick()
        self._replies(self.codec)

    # -------------------------------------------------------------- checking

    def pull(self, table: str, keys: np.ndarray) -> np.ndarray:
        reply = self.call(Message(Op.PULL, table=table, arrays=[keys]))
        assert reply.op == Op.VALUES, reply.body
        return reply.arrays[0].copy()

    def pull_protected(self) -> np.ndarray:
        return self.pull(PROTECTED.name, self.owned)

    def _protected_state(self) -> dict[tuple[int, str], bytes]:
        table = self.server.tables[PROTECTED.name]
        return {(shard, name): arr.tobytes() for shard, store in table.stores.items()
                for name, arr in store.state_arrays().items()}

    def check_intact(self, finite: bool = True) -> None:
        """The protected table is bit-identical, the others finite, and the server still reads and writes.

        Pass ``finite=False`` when pushes may carry any finite value: the NaN/Inf policy
        is about what a push carries, so sums of huge values may still overflow to Inf.
        """
        table = self.server.tables[PROTECTED.name]
        assert (table.layout.epoch, table.layout.owners.tolist()) == self.layout
        assert self._protected_state() == self.state, "protected table changed"
        np.testing.assert_array_equal(self.pull_protected(), self.expected)
        for spec in FINITE_TABLES if finite else ():
            for shard, store in self.server.tables[spec.name].stores.items():
                for name, arr in store.state_arrays().items():
                    assert np.isfinite(arr).all(), f"{spec.name} slice {shard} {name} holds NaN/Inf"
        plain, key, grads = FINITE_TABLES[0].name, np.array([0]), np.ones((1, 4), dtype=np.float32)
        before = self.pull(plain, key)  # and it still takes writes (Sum: a push adds)
        assert self.call(Message(Op.PUSH, table=plain, arrays=[key, grads])).op == Op.OK
        np.testing.assert_array_equal(self.pull(plain, key), before + grads)

    def close(self) -> None:
        self.server.close()
        shutil.rmtree(FUZZ_DIR, ignore_errors=True)

    def __enter__(self) -> FuzzServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------ attacks on the protected table

#: what a request to the protected table may do without changing it
READ_ONLY = op_messages(ops=[op for op in SERVED_OPS if op not in (Op.PUSH, Op.PUSH_PULL, Op.SLICE_STATE,
                                                                     Op.RESTORE)],
                        tables=st.just(PROTECTED.name))
PROTECTED_SPECS = st.just(PROTECTED.to_dict()) | spec_dicts(st.just(PROTECTED.name))
DEFECTS = st.sampled_from(["nan", "inf", "key past the end", "negative key", "huge key", "key on the other server",
                           "float64 values", "narrow rows", "more rows", "integer values", "3-D rows"])


def _with_defect(defect: str, keys: np.ndarray, rows: np.ndarray, at: int, elsewhere: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    if defect in ("nan", "inf"):
        rows[at, at % rows.shape[1]] = math.nan if defect == "nan" else (-1) ** at * math.inf
    elif defect in ("key past the end", "negative key", "huge key", "key on the other server"):
        keys[at] = {"key past the end": PROTECTED.num_keys, "negative key": -1, "huge key": 2**62,
                    "key on the other server": elsewhere}[defect]
    elif defect == "float64 values":
        rows = rows.astype(np.float64)
    elif defect == "narrow rows":
        rows = rows[:, :-1]
    elif defect == "more rows":
        rows = np.concatenate([rows, rows[:1]])
    elif defect == "integer values":
        rows = rows.astype(np.int64)
    else:
        rows = rows.reshape(*rows.shape, 1)
    return keys, rows


@st.composite
def protected_frames(draw: st.DrawFn, owned: np.ndarray, elsewhere: np.ndarray,
                     secret: bytes | None = None) -> tuple[list[bytes], bool]:
    """A request to the protected table, and whether it must be refused.

    Either a push with exactly one defect (which must be refused whole), or any
    request of an op that cannot change the table.
    """
    if draw(st.booleans()):
        msg = draw(READ_ONLY)
        if msg.op == Op.CREATE_TABLE and draw(st.booleans()):
            msg.body["spec"] = draw(PROTECTED_SPECS)
        return encoded(msg, secret), False
    n = draw(st.integers(1, 8))
    keys = owned[np.frombuffer(draw(st.binary(min_size=n, max_size=n)), dtype=np.uint8) % owned.size]
    rows = np.frombuffer(draw(st.binary(min_size=8 * n, max_size=8 * n)), dtype=np.int16).reshape(n, 4) / 64
    keys, rows = _with_defect(draw(DEFECTS), keys.copy(), rows.astype(np.float32), draw(st.integers(0, n - 1)),
                              int(elsewhere[0]))
    msg = Message(draw(st.sampled_from([Op.PUSH, Op.PUSH_PULL])), req=draw(REQUESTS), table=PROTECTED.name,
                  clock=draw(SMALL_INTS), sender=draw(st.sampled_from([-1, 0, 1, 1])),
                  incarnation=draw(INCARNATIONS), arrays=[keys, rows])
    return encoded(msg, secret), True


# ------------------------------------------------------------------ the server's property

#: a case for a fuzzed server: frames, whether they must be refused, whether they come from the last case's peer
ServerCase = tuple[list[bytes], bool, bool]


def server_cases(fuzz: FuzzServer) -> st.SearchStrategy[ServerCase]:
    """What a fuzzed server is fed: decodable requests of every op for the fuzz tables, broken
    ones, garbage, and attacks on the protected table (which must be refused)."""
    requests = op_messages().map(lambda m: encoded(m, fuzz.secret))
    anything = st.tuples(st.one_of(requests, requests, requests, requests, broken_frames(fuzz.secret), random_frames),
                         st.just(False), st.integers(0, 7).map(lambda i: i == 7))
    attacks = protected_frames(fuzz.owned, fuzz.elsewhere, fuzz.secret).map(lambda t: (*t, False))
    return st.one_of(anything, anything, attacks)


def _refused_whole(reply: Message) -> bool:
    """An error, or "moved" for every key (a key of a slice held elsewhere: nothing is applied)."""
    if reply.op == Op.ERROR:
        return True
    moved = Moved.in_reply(reply, 1 << 62)
    return reply.op == Op.OK and moved is not None and moved.positions.tolist() == list(range(len(moved.positions)))


def feed_case(fuzz: FuzzServer, case: ServerCase) -> None:
    frames, must_refuse, same_peer = case
    replies = fuzz.feed(frames, same_peer)
    answers = [r for r in replies if r.op != Op.ROWS]  # ROWS: the request's clock let an ESSP table push its changes
    if must_refuse and not fuzz.repeated:
        assert len(answers) == 1 and _refused_whole(answers[0]), replies
    elif must_refuse:  # the kept reply of the request it repeats, if kept (the table is checked at the end)
        assert len(answers) <= 1, replies
    if fuzz.cases % TICK_EVERY == 0:
        fuzz.tick()
