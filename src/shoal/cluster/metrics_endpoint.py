"""A process's metrics endpoint: its port bound at start, its HTTP machinery loaded at the first scrape.

The port is bound at once because its URL is registered with the job; the
exposition (``prometheus_client``, which brings ``http``, ``email`` and ``ssl``
with it) costs every process 0.07 s of its start, so it waits for a scrape.
"""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Callable, Iterable

from shoal.api.errors import ConfigError
from shoal.cluster.metrics import Family, Labels
from shoal.transport.base import is_loopback_host


class MetricsEndpoint:
    """Serves ``GET /metrics`` on ``host:port`` from ``families()``, in a daemon thread.

    With a ``token``, a request must carry ``Authorization: Bearer <token>``; without one the
    endpoint is open and ``host`` must be a loopback address. The port is bound at once (its URL is
    registered with the job); the HTTP machinery (``exposition``) loads on the first scrape.
    """

    def __init__(self, families: Callable[[], Iterable[Family]], common: Labels | None = None,
                 host: str = "127.0.0.1", port: int = 0, token: str | None = None) -> None:
        if token is None and not is_loopback_host(host):
            raise ConfigError(f"metrics bind {host!r}, off loopback, only for a job with a shared secret "
                              "(SHOAL_SECRET or SHOAL_SECRET_FILE): scrapers then present a token derived from it")
        self._socket = socket.create_server((host, port))
        self.url = f"http://{host}:{self._socket.getsockname()[1]}/metrics"
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(families, common, token), name="shoal-metrics",
                                        daemon=True)
        self._thread.start()

    def _serve(self, families: Callable[[], Iterable[Family]], common: Labels | None, token: str | None) -> None:
        waiting = select.poll()  # not select.select: a process may hold descriptors past its 1024 limit
        waiting.register(self._socket, select.POLLIN)
        waiting.poll()  # until the first scrape, or close
        if self._closing.is_set():
            return
        from shoal.cluster import exposition

        exposition.serve(self._socket, families, common, token, self._closing)

    def close(self) -> None:
        """Stop at once: shutting the listening socket wakes the thread's wait for a connection
        (Linux ends it with EINVAL), where a polling loop would notice only at its next poll."""
        self._closing.set()
        try:
            self._socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._thread.join(timeout=5)
        self._socket.close()
