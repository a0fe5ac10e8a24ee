"""Prometheus metrics: families built at scrape time from a process's own counters, served over HTTP
by ``prometheus_client`` (its text exposition and WSGI app).

Nothing on the hot path takes a lock for metrics: servers and workers keep
plain counters (and :class:`LatencyHistogram` buckets) as they always do; a
scrape copies them (``dict(counter)`` is one C-level copy under the GIL) into
:class:`Family` objects, which a custom collector hands to ``prometheus_client``.
A job whose messages are signed also guards its metrics: a scrape must present
a bearer token derived from the shared secret (one-way, so the token reveals
nothing of the secret). Without a secret the endpoint is open, and binds a
loopback address only.
"""

from __future__ import annotations

import bisect
import hashlib
import hmac
import logging
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import numpy as np
from prometheus_client.core import Metric
from prometheus_client.exposition import make_wsgi_app
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from shoal.api.errors import ConfigError
from shoal.transport.base import is_loopback_host

log = logging.getLogger(__name__)

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

    def metric(self, common: Labels) -> Metric:
        """This family for ``prometheus_client``, with the ``common`` labels on every sample."""
        base = self.name.removesuffix("_total") if self.kind == "counter" else self.name
        metric = Metric(base, self.help, self.kind)
        for labels, value in self.samples:
            metric.add_sample(self.name, _strings({**common, **labels}), value)
        for labels, bounds, total, count in self.histograms:
            merged = _strings({**common, **labels})
            for bound, cumulative in bounds:
                metric.add_sample(f"{base}_bucket", {**merged, "le": floatToGoString(bound)}, cumulative)
            metric.add_sample(f"{base}_sum", merged, total)
            metric.add_sample(f"{base}_count", merged, count)
        return metric


def _strings(labels: Labels) -> dict[str, str]:
    return {k: str(v) for k, v in labels.items()}


class FamilyCollector(Collector):
    """A ``prometheus_client`` collector that builds its families at each scrape."""

    def __init__(self, families: Callable[[], Iterable[Family]], common: Labels | None = None) -> None:
        self.families = families
        self.common = dict(common or {})

    def collect(self) -> Iterator[Metric]:
        for family in self.families():
            yield family.metric(self.common)


class LatencyHistogram:
    """Counts of observed durations per label value, in :data:`LATENCY_BUCKETS` (plus +Inf)."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts: dict[str, np.ndarray] = {}
        self.sums: dict[str, float] = {}

    def observe(self, label: str, seconds: float) -> None:
        counts = self.counts.get(label)
        if counts is None:
            counts = self.counts[label] = np.zeros(len(self.buckets) + 1, dtype=np.int64)
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


def counters(name: str, help: str, values: Mapping[str, float], label: str) -> Family:
    """A counter family with one sample per entry of ``values``."""
    fam = Family(name, "counter", help)
    for key, value in sorted(values.items()):
        fam.add(value, **{label: key})
    return fam


def metrics_token(secret: bytes) -> str:
    """The bearer token a scraper presents to a job with this shared secret (``shoal metrics-token``)."""
    return hmac.new(secret, b"shoal metrics token", hashlib.sha256).hexdigest()


class MetricsEndpoint:
    """Serves ``GET /metrics`` on ``host:port`` from ``families()``, in a daemon thread.

    With a ``token``, a request must carry ``Authorization: Bearer <token>``; without one the
    endpoint is open and ``host`` must be a loopback address.
    """

    def __init__(self, families: Callable[[], Iterable[Family]], common: Labels | None = None,
                 host: str = "127.0.0.1", port: int = 0, token: str | None = None) -> None:
        if token is None and not is_loopback_host(host):
            raise ConfigError(f"metrics bind {host!r}, off loopback, only for a job with a shared secret "
                              "(SHOAL_SECRET or SHOAL_SECRET_FILE): scrapers then present a token derived from it")
        registry = CollectorRegistry(auto_describe=False)
        registry.register(FamilyCollector(families, common))
        app = _guarded(make_wsgi_app(registry), None if token is None else f"Bearer {token}".encode())
        self._http = make_server(host, port, app, server_class=_ThreadingWSGIServer, handler_class=_QuietHandler)
        self.url = f"http://{host}:{self._http.server_address[1]}/metrics"
        self._thread = threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="shoal-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=5)


def _guarded(app: Any, expected: bytes | None) -> Any:
    """``app`` behind the bearer token (if any), on ``/metrics`` only; a failing scrape answers 500."""

    def guarded(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        if expected is not None and not hmac.compare_digest(environ.get("HTTP_AUTHORIZATION", "").encode(),
                                                            expected):
            start_response("401 a bearer token is required (shoal metrics-token prints it)",
                           [("WWW-Authenticate", 'Bearer realm="shoal"'), ("Content-Length", "0")])
            return [b""]
        if environ.get("PATH_INFO", "/") not in ("/metrics", "/"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"only /metrics is served here\n"]
        try:
            return app(environ, start_response)  # type: ignore[no-any-return]
        except Exception:  # a scrape must never take the process down
            log.exception("metrics: collecting failed")
            start_response("500 Internal Server Error", [("Content-Type", "text/plain")], sys.exc_info())
            return [b"collecting metrics failed\n"]

    return guarded


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # scrapes every few seconds would flood the job's output
