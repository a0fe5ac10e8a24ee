"""Replicas of a shard, without a network: pushes, numbered retries, gossip rounds, convergence."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from shoal.api.config import TableSpec
from shoal.api.ids import worker_origin
from shoal.api.initializers import Normal
from shoal.api.optim import SGD, Adagrad
from shoal.replication.gossip import ANSWER, DIGEST, FINAL, GossipPayload, GossipSchedule
from shoal.replication.replica import ShardReplica

KEYS = np.arange(20, dtype=np.int64)


def replicas(spec: TableSpec, n: int = 3) -> list[ShardReplica]:
    ticks = itertools.count()
    return [ShardReplica(spec, 0, KEYS, node, now=lambda: next(ticks) * 0.001) for node in range(n)]


class Pusher:
    """A worker numbering its pushes to one shard, as the client does."""

    def __init__(self, rank: int = 0, incarnation: int = 1) -> None:
        self.origin = worker_origin(rank, incarnation)
        self.seq = 0

    def push(self, replica: ShardReplica, rows, values, token=None):
        self.seq += 1
        return replica.push(np.asarray(rows), np.asarray(values, dtype=np.float64), self.origin, self.seq, token)


def holding(version: dict[int, int]) -> GossipPayload:
    """A peer's digest: it holds ``version``, no gaps."""
    return GossipPayload(0, version, DIGEST)


def wire(payload: GossipPayload, dim: int) -> GossipPayload:
    body, arrays = payload.to_wire(dim)
    return GossipPayload.from_wire(body, arrays, len(KEYS), dim)


def round_between(a: ShardReplica, b: ShardReplica, dim: int) -> None:
    """A full push-pull round a -> b -> a -> b, through the wire format."""
    digest = wire(a.digest(), dim)
    assert digest.stage == DIGEST
    answer = wire(b.answer(a.node, digest, ANSWER), dim)
    a.absorb(answer)
    final = wire(a.answer(b.node, answer, FINAL), dim)
    b.absorb(final)


@pytest.mark.parametrize("optimizer", [SGD(lr=0.1), Adagrad(lr=0.1)], ids=["sgd", "adagrad"])
def test_multi_master_replicas_converge_bit_identically(optimizer):
    spec = TableSpec("t", 20, 3, init=Normal(std=1.0), optimizer=optimizer, replicas=3)
    reps = replicas(spec)
    pushers = [Pusher(rank) for rank in range(3)]  # each worker writes to its own replica (W=1)
    rng = np.random.default_rng(0)
    for step in range(60):
        rows = rng.integers(0, 20, 5)
        pushers[step % 3].push(reps[step % 3], rows, rng.standard_normal((5, 3)))
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
    worker = worker_origin(4, 1)
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
    worker = worker_origin(1, 1)
    one = np.ones((1, 1))
    for seq in (1, 2):
        a.push(np.array([0]), one, worker, seq)
    assert b.push(np.array([0]), one, worker, 2, token="late") is None  # b missed push 1
    assert b.push(np.array([0]), one, worker, 2, token="retry") is None
    b.absorb(wire(a.answer(b.node, b.digest(), ANSWER), 1))  # gossip brings 1 and 2
    assert sorted(t for t, *_ in b.release_held()) == ["late", "retry"]
    assert b.read(np.array([0]))[0, 0] == -2.0 and not b.held[worker]


def test_a_lagging_replica_gets_whole_states_when_logs_no_longer_reach_back():
    spec = TableSpec("t", 20, 2, replicas=2)
    a, b = replicas(spec, 2)
    pusher = Pusher()
    for _ in range(5):
        pusher.push(a, [3], np.ones((1, 2)))
    a.lattice.truncate_log(pusher.origin, 4)  # as if every peer but b already had 1..4
    answer = a.answer(b.node, b.digest(), ANSWER)
    assert answer.states and not answer.deltas
    b.absorb(wire(answer, 2))
    assert b.read(np.array([3])).tolist() == a.read(np.array([3])).tolist()


def test_absorbing_measures_propagation_delay_from_the_accepting_replica():
    spec = TableSpec("t", 20, 2, replicas=2)
    a, b = replicas(spec, 2)
    Pusher().push(a, [0], np.ones((1, 2)))
    b.absorb(wire(a.answer(b.node, b.digest(), ANSWER), 2))
    assert len(b.delays[a.node]) == 1
    b.absorb(wire(a.answer(b.node, holding({}), ANSWER), 2))  # a duplicate: no new sample
    assert len(b.delays[a.node]) == 1


def test_a_push_sent_again_to_another_replica_after_a_failover_is_counted_once():
    """Replica a took push 2 and gossiped it, but its answer was lost (or it paused): the worker
    sends push 2 to b. b recognises it whichever arrives first, and both agree on one count."""
    spec = TableSpec("t", 20, 1, replicas=2)
    a, b = replicas(spec, 2)
    worker = Pusher()
    worker.push(a, [0], np.ones((1, 1)))
    round_between(a, b, 1)
    worker.push(a, [0], np.ones((1, 1)))  # push 2, at a only
    late = b.push(np.array([0]), np.ones((1, 1)), worker.origin, 2)  # the same push 2, sent to b
    assert late is not None  # b has push 1, so it applies push 2 itself
    round_between(a, b, 1)
    round_between(b, a, 1)
    assert a.read(np.array([0]))[0, 0] == b.read(np.array([0]))[0, 0] == 2.0


def test_a_push_waiting_for_one_only_a_dead_replica_had_is_applied_when_the_gap_is_given_up():
    spec = TableSpec("t", 20, 1, replicas=3)
    a, b, c = replicas(spec, 3)
    worker = Pusher()
    for _ in range(3):
        worker.push(a, [0], np.ones((1, 1)))  # pushes 1-3 at a, and a dies before gossiping 3
    round_between(a, c, 1)
    a.push(np.array([0]), np.ones((1, 1)), worker.origin, 4)  # (a's copy of 4, lost with it)
    c.lattice.truncate_log(worker.origin, 1)
    assert b.push(np.array([0]), np.ones((1, 1)), worker.origin, 4, token="four") is None  # b lacks 1-3: held
    assert b.waiting()
    round_between(b, c, 1)  # the live peer gives what it has: 1-3 (a whole state, its log was cut)
    assert [t for t, *_ in b.release_held()] == ["four"]
    assert b.read(np.array([0]))[0, 0] == 4.0 and not b.waiting()
    worker.seq = 4
    worker.push(a, [0], np.ones((1, 1)))  # 5 at the dead a only
    assert worker.push(b, [0], np.ones((1, 1)), token="six") is None  # 6 at b waits for 5
    assert not b.skip_gaps()  # the worker has not said 5 was acknowledged: it may still be on its way
    b.note_floor(worker.origin, 6)  # as push 6 says once a has acknowledged 5
    assert [t for t, *_ in b.skip_gaps()] == ["six"]  # 5 died with a: given up, 6 applied
    assert b.read(np.array([0]))[0, 0] == 5.0 and b.version()[worker.origin] == 6
    round_between(b, c, 1)  # a gap leaves no log behind it: c gets b's whole running sum
    assert c.read(np.array([0]))[0, 0] == 5.0


def test_a_replica_that_gave_up_a_peers_push_takes_it_when_the_peer_comes_back():
    """A replica that gave up push 5, which only a peer taken for dead had (paused, not dead), held
    another sum under the same version as that peer once it came back: gossip compared sequence
    numbers only, and the two never converged (a read returned 5 or 6 by the replica it asked).
    A state now counts the updates it gave up; of two at one version the fuller one wins."""
    spec = TableSpec("t", 20, 1, replicas=2)
    a, b = replicas(spec, 2)
    worker = Pusher()
    for _ in range(4):
        worker.push(a, [0], np.ones((1, 1)))
    round_between(a, b, 1)  # both hold 1-4
    worker.push(a, [0], np.ones((1, 1)))  # 5 at a only, then a stalls
    assert worker.push(b, [0], np.ones((1, 1)), token="six") is None  # 6 at b waits for 5
    b.note_floor(worker.origin, 6)
    assert [t for t, *_ in b.skip_gaps()] == ["six"]  # a taken for dead: 5 given up
    assert b.read(np.array([0]))[0, 0] == 5.0 and b.lattice.gaps() == {worker.origin: (5,)}
    for first, second in ((a, b), (b, a), (a, b)):  # a resumes: rounds either way
        round_between(first, second, 1)
    assert a.version() == b.version() == {worker.origin: 6}
    assert a.read(np.array([0]))[0, 0] == b.read(np.array([0]))[0, 0] == 6.0  # every push once
    assert a.lattice.gaps() == b.lattice.gaps() == {}


def test_a_restarted_worker_is_a_new_origin_its_pushes_are_not_taken_for_retries():
    spec = TableSpec("t", 20, 1, replicas=2)
    a, _ = replicas(spec, 2)
    first, restarted = Pusher(rank=3, incarnation=1), Pusher(rank=3, incarnation=2)
    for _ in range(3):
        first.push(a, [0], np.ones((1, 1)))
    assert restarted.push(a, [0], np.ones((1, 1))) is not None
    assert a.read(np.array([0]))[0, 0] == 4.0


@pytest.mark.parametrize("mutate", [
    lambda body, arrays: body.update(stage=9),
    lambda body, arrays: body["deltas"][0].update(nrows=[99]),
    lambda body, arrays: arrays.__setitem__(0, np.array([1000], dtype=np.int64)),
    lambda body, arrays: body.update(vv=[["x", 1]]),
    lambda body, arrays: arrays.__setitem__(1, np.full_like(arrays[1], np.nan)),
    lambda body, arrays: body["vv"][0].append([1, 1]),  # gaps that do not ascend
    lambda body, arrays: body["vv"][0].append([1]),  # a gap at the state's own seq
    lambda body, arrays: body.update(fills=[[body["vv"][0][0], 1, 5, 0.0, 0]]),  # a fill past the rows
    lambda body, arrays: body.update(fills=[[body["vv"][0][0], 0, 0, 0.0, 0]]),  # update number 0
])
def test_malformed_gossip_is_refused(mutate):
    spec = TableSpec("t", 20, 2, replicas=2)
    a, _ = replicas(spec, 2)
    Pusher().push(a, [0], np.ones((1, 2)))
    body, arrays = a.answer(1, holding({}), ANSWER).to_wire(2)
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


def test_updates_on_their_way_to_a_peer_are_not_sent_to_it_again():
    """Every digest of a peer whose queue is backed up still shows the version it had: answering each
    with all it lacks sent every update again and again (servers of a 3-replica MF job grew to 5 GB
    each, mostly gossip queued for peers). An update goes once, and again only if it seems lost."""
    clock = [0.0]
    spec = TableSpec("t", 20, 3, optimizer=SGD(lr=0.1), replicas=2)
    a = ShardReplica(spec, 0, KEYS, 0, now=lambda: clock[0])
    pusher = Pusher()
    for _ in range(3):
        pusher.push(a, [1, 2], np.ones((2, 3)))
    stale = holding({})  # the peer's digest, before anything arrived there
    first = a.answer(1, stale, ANSWER)
    assert [u.seq for d in first.deltas for u in d.updates] == [1, 2, 3]
    clock[0] += 0.1
    assert not a.answer(1, stale, ANSWER).deltas  # on their way: not again
    pusher.push(a, [3], np.ones((1, 3)))
    again = a.answer(1, stale, ANSWER)
    assert [(d.from_seq, [u.seq for u in d.updates]) for d in again.deltas] == [(3, [4])]  # only the new one
    clock[0] += 1.0  # nothing arrived: taken as lost, sent again
    assert [u.seq for d in a.answer(1, stale, ANSWER).deltas for u in d.updates] == [1, 2, 3, 4]


def _on_the_wire(payload: GossipPayload, dim: int) -> GossipPayload:
    body, arrays = payload.to_wire(dim)
    return GossipPayload.from_wire(body, arrays, len(KEYS), dim)


def _two_replicas() -> tuple[list[float], ShardReplica, ShardReplica, int]:
    """Two replicas of one shard on a clock moved by hand, and a worker's origin."""
    clock = [0.0]
    spec = TableSpec("t", 20, 1, replicas=2)
    return (clock, ShardReplica(spec, 0, KEYS, 0, now=lambda: clock[0]),
            ShardReplica(spec, 0, KEYS, 1, now=lambda: clock[0]), worker_origin(0, 1))


def test_a_lost_gossip_answer_goes_again_while_pushes_go_on():
    # One answer from a to b is lost; a takes a push and b gossips every 100 ms. What was sent is not
    # sent again while on its way (0.5 s); measured from each answer, that window never closed, and b,
    # unable to apply any later delta (each began past what it held), stayed at version 0 for good.
    clock, a, b, origin = _two_replicas()
    a.push(np.array([0]), np.ones((1, 1)), origin, 1)
    a.answer(b.node, b.digest(), ANSWER)  # lost
    for seq in range(2, 102):
        clock[0] += 0.1
        a.push(np.array([0]), np.ones((1, 1)), origin, seq)
        b.absorb(_on_the_wire(a.answer(b.node, b.digest(), ANSWER), 1))
    assert b.version()[origin] >= 95


def test_a_lost_gossip_answer_goes_again_when_nothing_new_follows():
    # The peer took the first of two answers in, and the second was lost: it goes again once the peer
    # shows no more progress for the window, though nothing new came since.
    clock, a, b, origin = _two_replicas()
    a.push(np.array([0]), np.ones((1, 1)), origin, 1)
    b.absorb(_on_the_wire(a.answer(b.node, b.digest(), ANSWER), 1))
    a.push(np.array([1]), np.ones((1, 1)), origin, 2)
    a.answer(b.node, b.digest(), ANSWER)  # lost
    for _ in range(20):
        clock[0] += 0.1
        b.absorb(_on_the_wire(a.answer(b.node, b.digest(), ANSWER), 1))
    assert b.version()[origin] == 2


def test_an_answer_of_deltas_and_a_whole_state_keeps_within_its_budget():
    # 15 small updates of one origin take most of the budget; another origin, its log trimmed, goes as a
    # whole state that fits a message alone. Checked only before it was added, the state went into the
    # same answer, over the message limit: the send failed, and the same answer was built every round.
    dim = 256
    spec = TableSpec("t", 20, dim, replicas=2)
    a = ShardReplica(spec, 0, KEYS, 0, now=lambda: 0.0)
    wa, wb = worker_origin(0, 1), worker_origin(1, 1)
    for seq in range(1, 16):
        a.push(np.array([seq % 20]), np.ones((1, dim)), wa, seq)
    a.push(np.arange(20), np.ones((20, dim)), wb, 1)
    a.lattice.truncate_log(wb, 1)
    budget = 32 * 1024
    first = a.answer(1, holding({}), ANSWER, budget)
    used = sum(u.values.nbytes + u.rows.nbytes for d in first.deltas for u in d.updates)
    used += sum(total.nbytes for _, _, total, _, _ in first.states)
    assert used <= budget and first.deltas and not first.states
    second = a.answer(1, holding({wa: 15}), ANSWER, budget)  # the state alone, the next round
    assert [origin for origin, *_ in second.states] == [wb]


def _settle(reps: list[ShardReplica], dim: int, passes: int = 100) -> list[tuple]:
    """Full rounds between every pair, either way, until the replicas stand at one version and no push
    waits, or ``passes`` ran (what was sent and lost goes again only after ``_IN_FLIGHT_S`` of the
    replicas' clock); returns the held pushes answered."""
    answered: list[tuple] = []
    for _ in range(passes):
        for first, second in itertools.permutations(reps, 2):
            round_between(first, second, dim)
            for rep in reps:
                answered += rep.release_held()
        states = {repr((r.version(), r.lattice.gaps(), r.lattice.filled())) for r in reps}
        if len(states) == 1 and not any(r.waiting() for r in reps):
            break
    return answered


def test_two_replicas_that_each_gave_up_the_others_push_both_end_with_every_push():
    """A partition between two replicas (W=1, each takes the other for dead): b gave up push 5, which
    only a had, and a gave up push 6, which only b had. Both then stood at version 8 with one gap each,
    a without 6 and b without 5: gossip compared how many updates each state lacked, not which, so
    the two never converged, and each lost an acknowledged push for good."""
    spec = TableSpec("t", 20, 1, replicas=2)
    a, b = replicas(spec, 2)
    worker = Pusher()
    for _ in range(4):
        worker.push(a, [0], [[float(worker.seq + 1)]])  # push k adds k
    round_between(a, b, 1)
    worker.push(a, [0], [[5.0]])  # 5 at a only
    assert worker.push(b, [0], [[6.0]], token="six") is None  # 6 at b waits for 5
    b.note_floor(worker.origin, 6)
    assert [t for t, *_ in b.skip_gaps()] == ["six"]  # a taken for dead: 5 given up at b
    assert worker.push(a, [0], [[7.0]], token="seven") is None  # 7 at a waits for 6
    a.note_floor(worker.origin, 7)
    assert [t for t, *_ in a.skip_gaps()] == ["seven"]  # b taken for dead: 6 given up at a
    worker.push(a, [0], [[8.0]])
    _settle([a, b], 1)  # the partition heals
    assert a.version() == b.version() == {worker.origin: 8}
    assert a.read(np.array([0]))[0, 0] == b.read(np.array([0]))[0, 0] == sum(range(1, 9))  # every push once
    assert a.lattice.gaps() == b.lattice.gaps() == {}


@pytest.mark.parametrize(("num_replicas", "seed"), [(n, seed) for n in (3, 4) for seed in range(40)])
def test_replicas_that_give_up_pushes_at_random_end_with_every_acknowledged_push_once_and_the_same_bits(
        num_replicas, seed):
    """Three or four replicas, two workers pushing with W=1 to replicas at random, gossip between random
    pairs (some answers lost), and replicas giving up the pushes they wait for at random (a peer taken
    for dead that was not). Once gossip runs between every pair, every replica holds every acknowledged
    push exactly once (counted in column 0: each push adds its own power of two) and the same bits
    (column 1: arbitrary floats, whose sum depends on the order of the additions)."""
    rng = random.Random(seed)
    spec = TableSpec("t", 20, 2, replicas=num_replicas)
    reps = replicas(spec, num_replicas)
    workers = [Pusher(rank) for rank in range(2)]
    acknowledged = {w.origin: 0.0 for w in workers}
    values: dict[tuple[int, int], float] = {}  # pushes not answered yet

    def note(answers):
        for _, origin, seq, _ in answers:
            acknowledged[origin] += values.pop((origin, seq), 0.0)

    def floor(origin: int) -> int:  # the worker's lowest push still open, as it tells the replicas
        return min(seq for o, seq in values if o == origin)

    for step in range(40 * num_replicas):
        event = rng.random()
        if event < 0.45:
            worker, rep = rng.choice(workers), rng.choice(reps)
            value = float(2 ** (step % 40))
            values[(worker.origin, worker.seq + 1)] = value
            rep.note_floor(worker.origin, floor(worker.origin))
            if worker.push(rep, [rng.randrange(3)], [[value, rng.random()]]) is not None:
                note([(None, worker.origin, worker.seq, 0.0)])
        elif event < 0.75:
            first, second = rng.sample(reps, 2)
            digest = wire(first.digest(), 2)
            answer = wire(second.answer(first.node, digest, ANSWER), 2)
            if rng.random() < 0.75:  # else the answer is lost
                first.absorb(answer)
                note(first.release_held())
        else:
            note(rng.choice(reps).skip_gaps())
    note(_settle(reps, 2))
    expected = sum(acknowledged.values())
    for rep in reps:
        assert not rep.waiting()
        assert sum(state.total[:, 0].sum() for state in rep.lattice.origins.values()) == expected, rep.node
        assert rep.lattice.value().tobytes() == reps[0].lattice.value().tobytes(), rep.node  # the same bits
