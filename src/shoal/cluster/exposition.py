"""Metrics served over HTTP by ``prometheus_client`` (its text exposition and WSGI app).

A process's :class:`~shoal.cluster.metrics.Family` objects, built at each scrape,
become ``prometheus_client`` metrics through a custom collector. Imported by
``metrics_endpoint`` at a process's first scrape only.
"""

from __future__ import annotations

import hmac
import logging
import socket
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client.core import Metric
from prometheus_client.exposition import make_wsgi_app
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from shoal.cluster.metrics import Family, Labels

log = logging.getLogger(__name__)


def to_metric(family: Family, common: Labels) -> Metric:
    """``family`` for ``prometheus_client``, with the ``common`` labels on every sample."""
    base = family.name.removesuffix("_total") if family.kind == "counter" else family.name
    metric = Metric(base, family.help, family.kind)
    for labels, value in family.samples:
        metric.add_sample(family.name, _strings({**common, **labels}), value)
    for labels, bounds, total, count in family.histograms:
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
            yield to_metric(family, self.common)


def serve(listening: socket.socket, families: Callable[[], Iterable[Family]], common: Labels | None,
          token: str | None, closing: threading.Event) -> None:
    """Answer scrapes on ``listening`` (bound and listening already) until ``closing`` is set and the
    socket is shut (which wakes the wait for the next connection)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FamilyCollector(families, common))
    app = _guarded(make_wsgi_app(registry), None if token is None else f"Bearer {token}".encode())
    http = _AdoptingServer(listening, app)
    try:
        while not closing.is_set():
            http.handle_request()  # waits for a connection (its timeout is None): no polling while idle
    finally:
        http.server_close()


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


class _AdoptingServer(ThreadingMixIn, WSGIServer):
    """A WSGI server on a socket bound earlier (``server_bind`` and ``server_activate`` are the
    documented hooks): it adopts the socket, and names itself by address, not by a DNS lookup."""

    daemon_threads = True

    def __init__(self, listening: socket.socket, app: Any) -> None:
        self._listening = listening
        super().__init__(listening.getsockname()[:2], _QuietHandler)
        self.set_app(app)

    def server_bind(self) -> None:
        self.socket.close()
        self.socket = self._listening
        self.server_address = self.socket.getsockname()
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])
        self.setup_environ()

    def server_activate(self) -> None:
        pass  # listening already


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # scrapes every few seconds would flood the job's output
