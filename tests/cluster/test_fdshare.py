"""The node's descriptor share: real Unix sockets, real descriptors, hostile requests."""

from __future__ import annotations

import os
import socket
import struct
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from shoal.api.errors import TableError
from shoal.cluster.fdshare import FdShareServer, fetch_fds


@pytest.fixture
def share() -> Iterator[FdShareServer]:
    memfd = os.memfd_create("fdshare-test")
    os.write(memfd, b"rows")

    def provide(request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        if request.get("table") != "t":
            raise TableError(f"no table {request.get('table')!r}")
        return {"label": "rows of t"}, [memfd]

    server = FdShareServer(f"\0shoal-test-{uuid.uuid4().hex}", provide)
    try:
        yield server
    finally:
        server.close()
        os.close(memfd)


def _send_raw(name: str, payload: bytes) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(name)
        sock.sendall(struct.pack("<I", len(payload)) + payload)
        sock.recv(1)  # the share drops the request and closes: an empty read


def test_a_request_gets_the_providers_answer_and_its_descriptors(share: FdShareServer) -> None:
    reply, fds = fetch_fds(share.name, {"table": "t"})
    try:
        assert reply == {"label": "rows of t"}
        assert len(fds) == 1
        assert os.pread(fds[0], 4, 0) == b"rows"  # the same memory, handed over
    finally:
        for fd in fds:
            os.close(fd)


def test_a_providers_error_comes_back_typed(share: FdShareServer) -> None:
    with pytest.raises(TableError, match="no table 'u'"):
        fetch_fds(share.name, {"table": "u"})


@pytest.mark.parametrize("payload", [b"\xc1\xc1\xc1", b"\x93\x01\x02\x03", b"\x81\xa1t"],
                         ids=["not msgpack", "not a map", "cut short"])
def test_a_garbled_request_is_dropped_and_the_share_keeps_serving(share: FdShareServer, payload: bytes) -> None:
    _send_raw(share.name, payload)
    reply, fds = fetch_fds(share.name, {"table": "t"})
    for fd in fds:
        os.close(fd)
    assert reply == {"label": "rows of t"}
