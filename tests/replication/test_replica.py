"""Replicas of a shard, without a network: pushes, numbered retries, gossip rounds, convergence."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from shoal.api.config import TableSpec
from shoal.api.initializers import Normal
from shoal.api.optim import SGD, Adagrad
from shoal.replication.gossip import ANSWER, DIGEST, FINAL, GossipPayload, GossipSchedule
from shoal.replication.replica import WORKER_ORIGINS, ShardReplica, origin_node

KEYS = np.arange(20, dtype=np.int64)


def replicas(spec: TableSpec, n: int = 3) -> list[ShardReplica]:
    ticks = itertools.count()
    return [ShardReplica(spec, 0, KEYS, node, incarnation=1, now=lambda: next(ticks) * 0.001) for node in range(n)]


def wire(payload: GossipPayload, dim: int) -> GossipPayload:
    body, arrays = payload.to_wire(dim)
    return GossipPayload.from_wire(body, arrays, len(KEYS), dim)


def round_between(a: ShardReplica, b: ShardReplica, dim: int) -> None:
    """A full push-pull round a -> b -> a -> b, through the wire format."""
    digest = wire(a.digest(), dim)
    assert digest.stage == DIGEST
    answer = wire(b.answer(a.node, digest.version, ANSWER), dim)
    a.absorb(answer)
    final = wire(a.answer(b.node, answer.version, FINAL), dim)
    b.absorb(final)


@pytest.mark.parametrize("optimizer", [SGD(lr=0.1), Adagrad(lr=0.1)], ids=["sgd", "adagrad"])
def test_multi_master_replicas_converge_bit_identically(optimizer):
    spec = TableSpec("t", 20, 3, init=Normal(std=1.0), optimizer=optimizer, replicas=3)
    reps = replicas(spec)
    rng = np.random.default_rng(0)
    for step in range(60):
        target = reps[step % 3]
        rows = rng.integers(0, 20, 5)
        target.push(rows, rng.standard_normal((5, 3)))
        if step % 7 == 0:
            round_between(reps[rng.integers(3)], reps[rng.integers(3)], 3)
    for a in range(3):
        for b in range(3):
            if a != b:
                round_between(reps[a], reps[b], 3)
    values = [r.read(KEYS).tobytes() for r in reps]
    assert values[0] == values[1] == values[2]
    assert reps[0].version() == reps[1].version() == reps[2].version()
    assert sum(reps[0].version().values()) == 60


def test_numbered_pushes_are_applied_once_and_in_order():
    spec = TableSpec("t", 20, 1, optimizer=SGD(lr=1.0), replicas=3, write_quorum=2)
    rep = replicas(spec, 1)[0]
    worker = WORKER_ORIGINS + 4
    one = np.ones((2, 1))
    assert rep.push(np.array([1, 2]), one, worker, 1) is not None
    assert rep.push(np.array([1, 2]), one, worker, 1) is not None  # a retry: acknowledged, not applied
    assert rep.push(np.array([1, 2]), one, worker, 3, token="third") is None  # 2 has not arrived: held
    assert rep.read(np.array([1]))[0, 0] == -1.0
    assert rep.push(np.array([1, 2]), one, worker, 2) is not None
    released = rep.release_held()
    assert [(t, s) for t, _, s, _ in released] == [("third", 3)]
    assert rep.read(np.array([1, 2]))[:, 0].tolist() == [-3.0, -3.0]


def test_a_held_push_that_gossip_overtakes_is_answered_not_applied_twice():
    spec = TableSpec("t", 20, 1, optimizer=SGD(lr=1.0), replicas=3, write_quorum=2)
    a, b = replicas(spec, 2)
    worker = WORKER_ORIGINS + 1
    one = np.ones((1, 1))
    for seq in (1, 2):
        a.push(np.array([0]), one, worker, seq)
    assert b.push(np.array([0]), one, worker, 2, token="late") is None  # b missed push 1
    assert b.push(np.array([0]), one, worker, 2, token="retry") is None
    b.absorb(wire(a.answer(b.node, b.version(), ANSWER), 1))  # gossip brings 1 and 2
    assert sorted(t for t, *_ in b.release_held()) == ["late", "retry"]
    assert b.read(np.array([0]))[0, 0] == -2.0 and not b.held[worker]


def test_a_lagging_replica_gets_whole_states_when_logs_no_longer_reach_back():
    spec = TableSpec("t", 20, 2, replicas=2)
    a, b = replicas(spec, 2)
    for _ in range(5):
        a.push(np.array([3]), np.ones((1, 2)))
    a.lattice.truncate_log(a.origin, 4)  # as if every peer but b already had 1..4
    answer = a.answer(b.node, b.version(), ANSWER)
    assert answer.states and not answer.deltas
    b.absorb(wire(answer, 2))
    assert b.read(np.array([3])).tolist() == a.read(np.array([3])).tolist()


def test_absorbing_measures_propagation_delay_per_origin():
    spec = TableSpec("t", 20, 2, replicas=2)
    a, b = replicas(spec, 2)
    a.push(np.array([0]), np.ones((1, 2)))
    b.absorb(wire(a.answer(b.node, b.version(), ANSWER), 2))
    assert len(b.delays[origin_node(a.origin)]) == 1
    b.absorb(wire(a.answer(b.node, {}, ANSWER), 2))  # a duplicate: no new sample
    assert len(b.delays[origin_node(a.origin)]) == 1


@pytest.mark.parametrize("mutate", [
    lambda body, arrays: body.update(stage=9),
    lambda body, arrays: body["deltas"][0].update(nrows=[99]),
    lambda body, arrays: arrays.__setitem__(0, np.array([1000], dtype=np.int64)),
    lambda body, arrays: body.update(vv=[["x", 1]]),
    lambda body, arrays: arrays.__setitem__(1, np.full_like(arrays[1], np.nan)),
])
def test_malformed_gossip_is_refused(mutate):
    spec = TableSpec("t", 20, 2, replicas=2)
    a, _ = replicas(spec, 2)
    a.push(np.array([0]), np.ones((1, 2)))
    body, arrays = a.answer(1, {}, ANSWER).to_wire(2)
    mutate(body, arrays)
    with pytest.raises(ValueError):
        GossipPayload.from_wire(body, arrays, len(KEYS), 2)


def test_gossip_schedule_is_jittered_around_its_period():
    t = [0.0]
    schedule = GossipSchedule(0.1, random.Random(1), now=lambda: t[0])
    gaps, last = [], 0.0
    for _ in range(200):
        t[0] = schedule.next_at
        assert schedule.due()
        gaps.append(t[0] - last)
        last = t[0]
    assert 0.05 <= min(gaps) and max(gaps) <= 0.15 and abs(np.mean(gaps[1:]) - 0.1) < 0.01
