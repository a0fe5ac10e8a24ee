"""The probabilistic consistency model of a W=1, gossip-synchronised store, and read-quorum choice.

After PBS (Bailis et al., VLDB 2012). A push accepted at origin ``o`` at age
``a`` (seconds before a read is issued) is missing from replica ``j`` when the
read arrives there (``r_j`` later) with probability ``P(T_oj > a + r_j)``,
where ``T_oj`` is the propagation delay from ``o`` to ``j`` (zero when ``j`` is
the origin). A read merging quorum ``Q`` misses it with probability
``prod_{j in Q} P(T_oj > a + r_j)``. With pushes arriving at rate ``lambda_o``,
the number of missing pushes is Poisson with mean
``mu_Q = sum_o lambda_o * integral prod_{j in Q} P(T_oj > a + r_j) da``, so
``P(missing <= k) = sum_{i <= k} exp(-mu) mu^i / i!``. Quorums of size ``R`` are
drawn uniformly from the live replicas, so predictions average over them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from shoal.api.replication import Dynamic
from shoal.replication.delays import DelaySamples

_GRID = 512


@dataclass
class ShardModel:
    """Measured inputs for one shard: push rates per origin replica, delays origin -> replica, read latencies."""

    replicas: list[int]
    rates: dict[int, float] = field(default_factory=dict)
    delays: dict[tuple[int, int], DelaySamples] = field(default_factory=dict)
    read_latency: dict[int, DelaySamples] = field(default_factory=dict)

    def mean_read_latency(self, replica: int) -> float:
        samples = self.read_latency.get(replica)
        return float(samples.sorted().mean()) if samples is not None and len(samples) else 0.0


def poisson_at_most(mu: float, k: int) -> float:
    if mu <= 0:
        return 1.0
    term = math.exp(-mu)
    total = term
    for i in range(1, k + 1):
        term *= mu / i
        total += term
    return min(1.0, total)


def expected_missing(model: ShardModel, quorum: Sequence[int], one_way_latency: Mapping[int, float] | None = None
                     ) -> float:
    """``mu_Q``: expected number of pushes a read of ``quorum`` misses."""
    latency = one_way_latency or {j: model.mean_read_latency(j) for j in quorum}
    mu = 0.0
    for origin, rate in model.rates.items():
        if rate <= 0 or origin in quorum:
            continue  # the origin holds its own pushes at once
        horizon = max((model.delays[(origin, j)].quantile(1.0) if (origin, j) in model.delays else 0.0)
                      for j in quorum)
        if horizon <= 0:
            continue
        ages = np.linspace(0.0, horizon, _GRID)
        missing = np.ones_like(ages)
        for j in quorum:
            samples = model.delays.get((origin, j))
            if samples is None or not len(samples):
                missing[:] = 0.0  # never measured: assume it arrives at once (optimistic, and flagged by tests)
                break
            missing *= samples.survival(ages + latency.get(j, 0.0))
        mu += rate * float(np.trapezoid(missing, ages))
    return mu


def predict(model: ShardModel, live: Sequence[int], size: int, k: int) -> float:
    """P(a read of ``size`` random live replicas misses at most ``k`` pushes)."""
    quorums = list(itertools.combinations(sorted(live), size))
    if not quorums:
        return 0.0
    return float(np.mean([poisson_at_most(expected_missing(model, q), k) for q in quorums]))


def latency_p99(model: ShardModel, live: Sequence[int], size: int, draws: int = 2000, seed: int = 0) -> float:
    """p99 of the slowest response among ``size`` random live replicas (Monte Carlo over samples)."""
    rng = np.random.default_rng(seed)
    replicas = sorted(live)
    if size > len(replicas) or not replicas:
        return math.inf
    pools = [model.read_latency[j].sorted() if j in model.read_latency else np.zeros(0) for j in replicas]
    # One latency draw per replica per trial; each trial reads a random subset of `size` replicas.
    draws_per = np.stack([rng.choice(p, draws) if p.size else np.zeros(draws) for p in pools])
    picks = np.argsort(rng.random((draws, len(replicas))), axis=1)[:, :size]
    slowest = np.take_along_axis(draws_per.T, picks, axis=1).max(axis=1)
    return float(np.quantile(slowest, 0.99)) * 2  # samples are one-way; a read is a round trip


def choose_read_quorum(model: ShardModel, live: Sequence[int], policy: Dynamic) -> tuple[int, dict[int, float]]:
    """The smallest R meeting ``policy``; returns R and the predicted probability per R."""
    sizes = range(1, len(live) + 1)
    probability = {r: predict(model, live, r, policy.k) for r in sizes}
    latency = {r: latency_p99(model, live, r) for r in sizes}
    for r in sizes:
        if probability[r] >= policy.p and latency[r] * 1000 <= policy.latency_ms:
            return r, probability
    if policy.prefer == "latency":
        fitting = [r for r in sizes if latency[r] * 1000 <= policy.latency_ms]
        return (max(fitting) if fitting else 1), probability
    meeting = [r for r in sizes if probability[r] >= policy.p]
    return (min(meeting) if meeting else len(live)), probability
