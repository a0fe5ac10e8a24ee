"""Metrics as the loops keep them: families built at scrape time from a process's own counters.

Nothing on the hot path takes a lock for metrics: servers and workers keep
plain counters (and :class:`LatencyHistogram` buckets) as they always do; a
scrape copies them (``dict(counter)`` is one C-level copy under the GIL) into
:class:`Family` objects, which ``exposition`` hands to ``prometheus_client``
(served by ``metrics_endpoint``, which loads it at the first scrape).
A job whose messages are signed also guards its metrics: a scrape must present
a bearer token derived from the shared secret (one-way, so the token reveals
nothing of the secret).
"""

from __future__ import annotations

import bisect
import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

#: request latency buckets in seconds: 10 µs .. 10 s
LATENCY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
                   0.5, 1.0, 2.5, 5.0, 10.0)

Labels = Mapping[str, str | int]


@dataclass
class Family:
    """One metric family: ``kind`` is ``counter``, ``gauge`` or ``histogram``; a counter's name
    ends in ``_total``."""

    name: str
    kind: str
    help: str
    samples: list[tuple[Labels, float]] = field(default_factory=list)
    #: histograms: (labels, cumulative counts per bucket bound, sum, count)
    histograms: list[tuple[Labels, list[tuple[float, float]], float, float]] = field(default_factory=list)

    def add(self, value: float, **labels: str | int) -> Family:
        self.samples.append((labels, float(value)))
        return self


class LatencyHistogram:
    """Counts of observed durations per label value, in :data:`LATENCY_BUCKETS` (plus +Inf)."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        # Python lists: a request observes one duration, and a numpy element costs more to bump
        self.counts: dict[str, list[int]] = {}
        self.sums: dict[str, float] = {}

    def observe(self, label: str, seconds: float) -> None:
        counts = self.counts.get(label)
        if counts is None:
            counts = self.counts[label] = [0] * (len(self.buckets) + 1)
            self.sums[label] = 0.0
        counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.sums[label] += seconds

    def family(self, name: str, help: str, label: str) -> Family:
        fam = Family(name, "histogram", help)
        for value, counts in list(self.counts.items()):
            cumulative = np.cumsum(counts)
            bounds = [(b, float(c)) for b, c in zip(self.buckets, cumulative[:-1], strict=True)]
            bounds.append((float("inf"), float(cumulative[-1])))
            fam.histograms.append(({label: value}, bounds, self.sums.get(value, 0.0), float(cumulative[-1])))
        return fam


class CpuAccount:
    """CPU seconds of one thread (``time.thread_time``), charged per activity, with how often each ran.

    A thread's CPU, not the wall clock: on a machine with fewer cores than busy
    processes, a handler that was preempted halfway would otherwise be charged for
    the processes that ran meanwhile.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def charge(self, activity: str, seconds: float) -> None:
        self.counts[activity] = self.counts.get(activity, 0) + 1  # first: a reader of seconds finds a count
        self.seconds[activity] = self.seconds.get(activity, 0.0) + seconds

    def describe(self) -> dict[str, list[float]]:
        """``{activity: [times run, CPU seconds]}``."""
        return {name: [self.counts[name], seconds] for name, seconds in list(self.seconds.items())}

    def family(self, name: str, help: str, label: str) -> Family:
        return counters(name, help, dict(self.seconds), label)


def counters(name: str, help: str, values: Mapping[str, float], label: str) -> Family:
    """A counter family with one sample per entry of ``values``."""
    fam = Family(name, "counter", help)
    for key, value in sorted(values.items()):
        fam.add(value, **{label: key})
    return fam


def metrics_token(secret: bytes) -> str:
    """The bearer token a scraper presents to a job with this shared secret (``shoal metrics-token``)."""
    return hmac.new(secret, b"shoal metrics token", hashlib.sha256).hexdigest()

