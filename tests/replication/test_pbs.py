"""The probabilistic consistency model against cases with known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from shoal.api.replication import Dynamic
from shoal.replication.delays import DelaySamples
from shoal.replication.pbs import ShardModel, choose_read_quorum, expected_missing, poisson_at_most, predict


def uniform_delays(low: float, high: float, n: int = 4000) -> DelaySamples:
    d = DelaySamples(n)
    d.extend(list(np.linspace(low, high, n)))
    return d


def model(period: float, rate: float) -> ShardModel:
    m = ShardModel(replicas=[0, 1, 2])
    for o in range(3):
        m.rates[o] = rate
        for j in range(3):
            if o != j:
                m.delays[(o, j)] = uniform_delays(0.0, period)
    return m


def test_poisson_cdf():
    assert poisson_at_most(0.0, 0) == 1.0
    assert poisson_at_most(2.0, 0) == pytest.approx(math.exp(-2))
    assert poisson_at_most(2.0, 1) == pytest.approx(3 * math.exp(-2))


def test_expected_missing_for_uniform_delays_matches_the_integral():
    # One other origin pushing at rate r, delay ~ U(0, P): mu = r * P / 2 for a one-replica read.
    m = model(0.1, 100.0)
    assert expected_missing(m, [0]) == pytest.approx(2 * 100 * 0.1 / 2, rel=0.02)
    # Two replicas: a push from origin 2 is missing from both with prob (1 - a/P)^2: integral P/3;
    # pushes from origins 0 and 1 are at one of them at once.
    assert expected_missing(m, [0, 1]) == pytest.approx(100 * 0.1 / 3, rel=0.02)
    assert expected_missing(m, [0, 1, 2]) == 0.0


def test_more_replicas_and_faster_gossip_mean_fewer_missing_pushes():
    slow, fast = model(0.2, 50.0), model(0.02, 50.0)
    for size in (1, 2):
        assert predict(fast, [0, 1, 2], size, 0) > predict(slow, [0, 1, 2], size, 0)
    assert predict(slow, [0, 1, 2], 1, 0) < predict(slow, [0, 1, 2], 2, 0) < predict(slow, [0, 1, 2], 3, 0) == 1.0


def test_read_latency_narrows_the_window():
    m = model(0.1, 100.0)
    m.read_latency = {j: uniform_delays(0.05, 0.05, 10) for j in range(3)}
    assert expected_missing(m, [0]) < expected_missing(model(0.1, 100.0), [0])


def test_choose_read_quorum_picks_the_smallest_size_that_meets_the_target():
    m = model(0.1, 5.0)
    m.read_latency = {j: uniform_delays(0.0001, 0.0002, 50) for j in range(3)}
    r, predicted = choose_read_quorum(m, [0, 1, 2], Dynamic(p=0.9, k=0, latency_ms=50))
    assert predicted[r] >= 0.9 and all(predicted[s] < 0.9 for s in range(1, r))
    strict, _ = choose_read_quorum(m, [0, 1, 2], Dynamic(p=0.999, k=0, latency_ms=50))
    assert strict >= r
    # No size meets a 1 ms budget (round trips take 2 ms): "consistency" still meets p with
    # the smallest R that can, "latency" falls back to R=1.
    m.read_latency = {j: uniform_delays(0.001, 0.001, 10) for j in range(3)}
    assert choose_read_quorum(m, [0, 1, 2], Dynamic(p=0.999, latency_ms=1, prefer="latency"))[0] == 1
    assert choose_read_quorum(m, [0, 1, 2], Dynamic(p=0.999, latency_ms=1))[0] == 3


def test_the_mixture_model_keeps_the_mean_and_sums_to_one():
    from shoal.replication.pbs import missing_pmf

    m = model(0.1, 50.0)
    pmf = missing_pmf(m, [0], 200)
    assert pmf.sum() == pytest.approx(1.0, abs=1e-6)
    assert (np.arange(201) * pmf).sum() == pytest.approx(expected_missing(m, [0]), rel=0.02)
    # Batched delivery spreads the count: more reads miss nothing than a Poisson of the same mean says.
    assert predict(m, [0, 1, 2], 1, 0) > predict(m, [0, 1, 2], 1, 0, kind="poisson")


def test_a_replica_reports_the_delays_of_the_last_seconds_so_the_model_follows_a_change():
    """Delays of 10 ms for a minute, then of 200 ms (the gossip period went up): the samples of the
    last 5 s are the slow ones, which the model must see; the last 512 of all were mostly fast."""
    t = [0.0]
    d = DelaySamples(4096, now=lambda: t[0])
    for _ in range(600):
        t[0] += 0.1
        d.add(0.010)
    for _ in range(40):
        t[0] += 0.125
        d.add(0.200)
    assert d.recent(4.9, 32, 512) == [0.2] * 40
    assert d.values()[-512:].count(0.2) == 40  # the old way: 472 fast ones besides
    assert len(d.recent(0.01, 32, 512)) == 32  # too few that recent: the latest 32 all the same
    assert len(d.recent(1000.0, 32, 512)) == 512


def test_the_delays_reported_of_a_gossip_round_are_spread_over_it_not_its_shortest():
    """A round brings 2,000 updates at once, oldest first: delays from 2 s down to 0. The replica
    reported the latest 512 of them, delays under 0.5 s, and the model promised fresh reads that the
    round's longer delays broke. The samples are thinned evenly; and a window that holds no whole
    round takes the last round whole rather than its last samples."""
    t = [0.0]
    d = DelaySamples(4096, now=lambda: t[0])
    d.extend([2.0 * (1 - i / 2000) for i in range(2000)])
    reported = d.recent(5.0, 32, 512)
    assert len(reported) == 512 and max(reported) > 1.9 and abs(float(np.mean(reported)) - 1.0) < 0.05
    t[0] += 6.0  # the window holds nothing since
    assert max(d.recent(5.0, 32, 512)) > 1.9
