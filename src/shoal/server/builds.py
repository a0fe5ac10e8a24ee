"""Tables allocated and initialised off the request loop.

Making a table of hundreds of megabytes (its shared memory, then every row
drawn from its initialiser) takes seconds; done in the request loop it would
hold every other table's requests that long. A ``CREATE_TABLE`` therefore hands
the work to one background thread and is answered when the table is ready, by
the loop, which meanwhile serves everything else. Building touches nothing the
loop reads: a service's ``build`` returns the table, its ``install`` (on the
loop's thread) starts serving it. numba's kernels are loaded there too, before
the first table is answered: a server that never holds a table never loads them.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from shoal.api.config import TableSpec
from shoal.server.service import TableService
from shoal.storage import kernels
from shoal.wire.message import Message


@dataclass
class Build:
    """A table being made, and the requests waiting for it (the first, and any repeats of its CREATE)."""

    spec: TableSpec
    service: TableService
    future: concurrent.futures.Future[Any]
    waiting: list[tuple[bytes, Message]] = field(default_factory=list)


class TableBuilds:
    def __init__(self, node: int) -> None:
        self.node = node
        self.pending: dict[str, Build] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def start(self, spec: TableSpec, service: TableService, peer: bytes, msg: Message,
              current: dict[str, Any] | None = None) -> None:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"shoal-build-{self.node}")
        future = self._pool.submit(_build, service, spec, current)
        self.pending[spec.name] = Build(spec, service, future, [(peer, msg)])

    def join(self, name: str, peer: bytes, msg: Message) -> None:
        """Another request to create a table being built: answered with the first."""
        self.pending[name].waiting.append((peer, msg))

    def spec(self, name: str) -> TableSpec | None:
        build = self.pending.get(name)
        return None if build is None else build.spec

    def pending_bytes(self) -> int:
        return sum(b.service.bytes_here(b.spec) for b in self.pending.values())

    def finished(self, wait: bool = False) -> Iterator[Build]:
        """Builds that have ended, well or not (``wait``: all of them, once they end)."""
        for name, build in list(self.pending.items()):
            if wait:
                concurrent.futures.wait([build.future])
            if build.future.done():
                del self.pending[name]
                yield build

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _build(service: TableService, spec: TableSpec, current: dict[str, Any] | None) -> Any:
    kernels.warm_up(spec.dtype)  # here, not on the loop at the table's first requests
    return service.build(spec, current)
