"""The probabilistic consistency model of a W=1, gossip-synchronised store, and read-quorum choice.

After PBS (Bailis et al., VLDB 2012). A push accepted at origin ``o`` at age
``a`` (seconds before a read is issued) is missing from replica ``j`` when the
read arrives there (``r_j`` later) with probability ``P(T_oj > a + r_j)``,
where ``T_oj`` is the propagation delay from ``o`` to ``j`` (zero when ``j`` is
the origin). A read merging quorum ``Q`` misses it with probability
``prod_{j in Q} P(T_oj > a + r_j)``. With pushes arriving at rate ``lambda_o``,
the number of missing pushes is Poisson with mean
``mu_Q = sum_o lambda_o * integral prod_{j in Q} P(T_oj > a + r_j) da``, so
``P(missing <= k) = sum_{i <= k} exp(-mu) mu^i / i!`` (``kind="poisson"``).

Gossip delivers in rounds, so misses are not independent: a read misses
exactly the pushes accepted since the last round that reached its replicas.
``kind="mixture"`` (the default) models that: with ``V`` the time since that
round, ``P(V > v) = prod_{j in Q} P(T_oj > v + r_j)`` (the same survival
functions), and given ``V`` the count is Poisson with mean ``lambda_o V``. The
mean is the same ``mu_Q``; the spread matches batched delivery.

Quorums of size ``R`` are drawn uniformly from the live replicas, so
predictions average over them.
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

    def measured(self) -> bool:
        """Whether pushes have been seen and the delay from every replica that takes them to every other
        has been sampled: before that the model knows nothing, and predicts no miss."""
        origins = [o for o, rate in self.rates.items() if rate > 0]
        return bool(origins) and all(
            (o, j) in self.delays and len(self.delays[(o, j)]) for o in origins for j in self.replicas if j != o)

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


def missing_pmf(model: ShardModel, quorum: Sequence[int], kmax: int) -> np.ndarray:
    """P(a read of ``quorum`` misses exactly n pushes), n = 0..kmax, under the mixture model."""
    latency = {j: model.mean_read_latency(j) for j in quorum}
    total = np.zeros(kmax + 1)
    total[0] = 1.0
    for origin, rate in model.rates.items():
        if rate <= 0 or origin in quorum:
            continue
        if any((origin, j) not in model.delays or not len(model.delays[(origin, j)]) for j in quorum):
            continue  # never measured: assume it arrives at once, as expected_missing does
        horizon = max(model.delays[(origin, j)].quantile(1.0) for j in quorum)
        edges = np.linspace(0.0, max(horizon, 1e-9), _GRID + 1)
        survival = np.ones_like(edges)
        for j in quorum:
            survival *= model.delays[(origin, j)].survival(edges + latency[j])
        # V = 0 with probability 1 - S(0); else V falls in a grid cell with probability S(lo) - S(hi).
        weights = np.concatenate([[1.0 - survival[0]], survival[:-1] - survival[1:]])
        windows = np.concatenate([[0.0], (edges[:-1] + edges[1:]) / 2])
        means = rate * windows
        n = np.arange(kmax + 1)
        log_factorial = np.array([math.lgamma(i + 1) for i in n])
        pmf = np.exp(n[:, None] * np.log(np.maximum(means, 1e-300))[None, :] - means[None, :]
                     - log_factorial[:, None])
        pmf[:, means == 0] = 0.0
        pmf[0, means == 0] = 1.0  # an empty window misses nothing
        origin_pmf = pmf @ weights
        total = np.convolve(total, origin_pmf)[: kmax + 1]
    return total


def predict(model: ShardModel, live: Sequence[int], size: int, k: int, kind: str = "mixture") -> float:
    """P(a read of ``size`` random live replicas misses at most ``k`` pushes)."""
    quorums = list(itertools.combinations(sorted(live), size))
    if not quorums:
        return 0.0
    if kind == "poisson":
        return float(np.mean([poisson_at_most(expected_missing(model, q), k) for q in quorums]))
    return float(np.mean([min(1.0, missing_pmf(model, q, k).sum()) for q in quorums]))


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
