"""Prometheus metrics: families built at scrape time from a process's own counters, served over HTTP.

Nothing on the hot path takes a lock for metrics: servers and workers keep
plain counters (and :class:`LatencyHistogram` buckets) as they always do; a
scrape copies them (``dict(counter)`` is one C-level copy under the GIL) and
renders the Prometheus text format. A job whose messages are signed also
guards its metrics: a scrape must present a bearer token derived from the
shared secret (one-way, so the token reveals nothing of the secret). Without a
secret the endpoint is open, and binds a loopback address only.
"""

from __future__ import annotations

import bisect
import hashlib
import hmac
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from shoal.api.errors import ConfigError
from shoal.transport.base import is_loopback_host

log = logging.getLogger(__name__)

#: request latency buckets in seconds: 10 µs .. 10 s
LATENCY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
                   0.5, 1.0, 2.5, 5.0, 10.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Labels = Mapping[str, str | int]


@dataclass
class Family:
    """One metric family: ``kind`` is ``counter``, ``gauge`` or ``histogram``."""

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


def _escape(value: str | int) -> str:
    return str(value).replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _labels(labels: Labels, extra: Labels | None = None) -> str:
    merged = {**labels, **(extra or {})}
    if not merged:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in merged.items()) + "}"


def _number(x: float) -> str:
    if x == float("inf"):
        return "+Inf"
    return repr(float(x)) if x != int(x) or abs(x) >= 1e15 else str(int(x))


def _bound(x: float) -> str:
    """A bucket's ``le`` label as Prometheus clients write it: ``0.005``, ``10.0``, ``+Inf``."""
    return "+Inf" if x == float("inf") else repr(float(x))


def render(families: Iterable[Family], common: Labels | None = None) -> str:
    """The Prometheus text exposition (format 0.0.4) of ``families``; ``common`` labels go on every sample."""
    lines: list[str] = []
    for fam in families:
        lines.append(f"# HELP {fam.name} " + fam.help.replace("\\", r"\\").replace("\n", r"\n"))
        lines.append(f"# TYPE {fam.name} {fam.kind}")
        for labels, value in fam.samples:
            lines.append(f"{fam.name}{_labels({**(common or {}), **labels})} {_number(value)}")
        for labels, bounds, total, count in fam.histograms:
            base = {**(common or {}), **labels}
            for bound, cumulative in bounds:
                lines.append(f"{fam.name}_bucket{_labels(base, {'le': _bound(bound)})} {_number(cumulative)}")
            lines.append(f"{fam.name}_sum{_labels(base)} {_number(total)}")
            lines.append(f"{fam.name}_count{_labels(base)} {_number(count)}")
    return "\n".join(lines) + "\n"


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
    """Serves ``GET /metrics`` on ``host:port`` from ``collect()``, in a daemon thread.

    With a ``token``, a request must carry ``Authorization: Bearer <token>``; without one the
    endpoint is open and ``host`` must be a loopback address.
    """

    def __init__(self, collect: Callable[[], str], host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None) -> None:
        if token is None and not is_loopback_host(host):
            raise ConfigError(f"metrics bind {host!r}, off loopback, only for a job with a shared secret "
                              "(SHOAL_SECRET or SHOAL_SECRET_FILE): scrapers then present a token derived from it")
        expected = None if token is None else f"Bearer {token}".encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server hook's name
                if expected is not None and not hmac.compare_digest(
                        self.headers.get("Authorization", "").encode(), expected):
                    self.send_response(401, "a bearer token is required (shoal metrics-token prints it)")
                    self.send_header("WWW-Authenticate", 'Bearer realm="shoal"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404, "only /metrics is served here")
                    return
                try:
                    body = collect().encode()
                except Exception:  # a scrape must never take the process down
                    log.exception("metrics: collecting failed")
                    self.send_error(500, "collecting metrics failed")
                    return
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass  # scrapes every few seconds would flood the job's output

        self._http = ThreadingHTTPServer((host, port), Handler)
        self._http.daemon_threads = True
        self.url = f"http://{host}:{self._http.server_address[1]}/metrics"
        self._thread = threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="shoal-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=5)
