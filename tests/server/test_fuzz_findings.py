"""Requests the fuzzer found a handler failing on (tests/wire/test_fuzz.py, benchmarks/fuzz.py).

Each was answered with a ``ServerError`` (a handler raised something untyped) or
broke a timer later; now each gets a typed error, and the server keeps its
tables and goes on serving.
"""

from __future__ import annotations

import os
import resource

import numpy as np
import pytest

from shoal import CheckpointError, ProtocolError, ShoalError, TableError, TableSpec
from shoal.api.ids import SERVERS
from shoal.cluster.replay import new_incarnation
from shoal.wire import Message, Op
from tests.support.fuzz_server import FuzzServer
from tests.support.fuzzing import FUZZ_DIR, STAGING, encoded

PEER_SERVER = SERVERS + 1


STREAMS: dict[int, int] = {}


def as_member(msg: Message) -> list[bytes]:
    """``msg`` as a member of the fuzz cluster sends it: worker 0 unless it names another sender, each
    sender in one stream of requests (the findings' request numbers are all different)."""
    if msg.sender == -1:
        msg.sender = 0
    msg.incarnation = STREAMS.setdefault(msg.sender, new_incarnation())
    return encoded(msg)


def rows(n: int, dtype: type = np.float32) -> np.ndarray:
    return np.ones((n, 4), dtype=dtype)


def restore(name: str) -> Message:
    return Message(Op.RESTORE, req=9, body={"path": str(FUZZ_DIR / name), "commit": True})


def slice_chunk(first: int, subscribers: list[object]) -> Message:
    """Two rows of slice 0 of ``fz_essp`` (Adagrad, ESSP) moving here."""
    masks = [np.ones(2, dtype=np.uint8) for _ in subscribers]
    return Message(Op.SLICE_STATE, req=9 + first, table="fz_essp", sender=PEER_SERVER, body={
        "shard": 0, "epoch": 1, "first_row": first, "num_rows": 32, "names": ["values", "accum", "dirty"],
        "subscribers": subscribers, "last": False},
        arrays=[rows(2), rows(2), np.zeros(2, dtype=np.uint8), *masks])


FINDINGS = [
    pytest.param([Message(Op.CLOCK, req=9, sender=0, clock=2**64 - 1, body={"rank": 0})], ProtocolError,
                 id="worker clock past 64 bits"),
    pytest.param([Message(Op.PUSH, req=9, table="fz_plain", sender=0, clock=2**64 - 2,
                          arrays=[np.array([1]), rows(1)])], ProtocolError, id="push at a clock past 64 bits"),
    pytest.param([Message(Op.INTENT, req=9, table="fz_adapt", body={"starts": [0], "ends": [2**64 - 1]},
                          arrays=[np.array([1, 2])])], ProtocolError, id="intent ending past 64 bits"),
    pytest.param([restore("list")], CheckpointError, id="restore: manifest is a list"),
    pytest.param([restore("tables-list")], CheckpointError, id="restore: manifest tables are a list"),
    pytest.param([restore("entry-int")], CheckpointError, id="restore: manifest entry is a number"),
    pytest.param([restore("part-garbage")], CheckpointError, id="restore: part is not an npz"),
    pytest.param([restore("part-strings")], CheckpointError, id="restore: part holds strings"),
    pytest.param([Message(Op.CHECKPOINT, req=r, body={"staging": str(STAGING), "tables": ["fz_plain"]})
                  for r in (9, 10)], CheckpointError, id="checkpoint into the same staging twice"),
    pytest.param([Message(Op.GOSSIP, req=9, table="fz_repl", sender=PEER_SERVER, body={
        "shard": 0, "vv": [], "stage": 0, "deltas": [[0, 0]], "states": []},
        arrays=[np.zeros(0, dtype=np.int64), np.zeros((0, 4))])], ProtocolError, id="gossip delta not a map"),
    pytest.param([slice_chunk(0, []), slice_chunk(2, [0])], ProtocolError,
                 id="slice chunk with a subscriber the first chunk lacked"),
    pytest.param([slice_chunk(0, ["x"])], ProtocolError, id="slice subscribers not numbers"),
    pytest.param([slice_chunk(-2, [])], ProtocolError, id="slice chunk before row 0"),
]


@pytest.mark.parametrize(("requests", "error"), FINDINGS)
def test_found_request_gets_a_typed_error_and_changes_nothing(requests: list[Message],
                                                              error: type[ShoalError]) -> None:
    with FuzzServer() as fuzz:
        for msg in requests[:-1]:
            assert [r.op for r in fuzz.feed(as_member(msg))] == [Op.OK]

        replies = fuzz.feed(as_member(requests[-1]))

        assert [(r.op, r.body["code"]) for r in replies] == [(Op.ERROR, error.code)]
        fuzz.tick()  # the timers, too, survive what was sent
        fuzz.check_intact()


def test_table_of_more_slices_than_descriptors_is_refused_whole() -> None:
    # Each slice is a memfd and a mapping: enough of them run a server out of descriptors.
    # Before, the slices made so far were kept (descriptors and memory leaked) and the
    # reply was a ServerError.
    spec = TableSpec("many", num_keys=4000, dim=1, slices=4000)  # 2000 slices here
    with FuzzServer() as fuzz:
        open_before = len(os.listdir("/proc/self/fd"))
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (open_before + 500, hard))
        try:
            replies = fuzz.feed(as_member(Message(Op.CREATE_TABLE, req=9, table="many", body={"spec": spec.to_dict()})))
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

        assert [(r.op, r.body["code"]) for r in replies] == [(Op.ERROR, TableError.code)]
        assert len(os.listdir("/proc/self/fd")) <= open_before + 2  # the reply's connection, give or take
        assert "many" not in fuzz.server.tables
        fuzz.check_intact()


def test_a_repeated_pull_held_for_moving_keys_is_held_once_and_times_out() -> None:
    # Found when a request could carry id 0, which was not told apart as a repeat: two identical
    # pulls waited for keys on their way here, and telling them apart compared them field by
    # field, arrays included, which raised on every tick of the adaptive timer. Every request now
    # has a number in its sender's stream, so the repeat is dropped while the first waits.
    with FuzzServer() as fuzz:
        table = fuzz.server.adaptive.tables["fz_adapt"]
        odd = np.array([1, 3])  # homed on node 1: asked here by a local worker, they are on their way
        assert [r.op for r in fuzz.feed(as_member(Message(Op.LOCALIZE, req=9, table="fz_adapt", arrays=[odd])))] \
            == [Op.OK]
        pull = as_member(Message(Op.PULL, req=10, table="fz_adapt", arrays=[odd]))
        assert fuzz.feed(pull) == [] and fuzz.feed(pull, same_peer=True) == []
        (held,) = table.held
        held.since -= 60  # long overdue

        fuzz.server.adaptive.tick()

        assert table.held == []
        fuzz.check_intact()


def test_an_attack_reusing_an_answered_request_id_gets_the_kept_reply_and_changes_nothing() -> None:
    # Found by `make fuzz`: a NaN push to the protected table carrying the sender, incarnation and
    # number of a request answered before (on another connection) got that request's kept reply, an
    # OK. That is the replay window doing its work (a number is served once, whatever connection
    # it comes by): the push itself is never applied, and the fuzzer now expects the kept reply.
    with FuzzServer() as fuzz:
        first = Message(Op.LOCALIZE, req=4294967296, table="fz_adapt", sender=0, incarnation=4294967296,
                        arrays=[np.array([0, 2])])
        assert [r.op for r in fuzz.feed(encoded(first))] == [Op.OK]
        nan = rows(2)
        nan[1, 1] = np.nan
        attack = Message(Op.PUSH, req=4294967296, table="protected", sender=0, incarnation=4294967296,
                         arrays=[fuzz.owned[:2], nan])

        replies = fuzz.feed(encoded(attack))

        assert fuzz.repeated and [(r.op, r.table) for r in replies] == [(Op.OK, "fz_adapt")]
        fuzz.check_intact()
