"""The node's descriptor share: real Unix sockets, real descriptors, hostile requests."""

from __future__ import annotations

import os
import socket
import struct
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from shoal.api.errors import ShoalError, TableError
from shoal.cluster.fdshare import FdShareServer, fetch_fds, socket_name
from tests.support.cluster import ThreadCluster


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


def test_a_malformed_descriptor_request_does_not_stop_the_nodes_share():
    """fdshare drops a garbled request and keeps serving. A well-formed map whose ``shards`` is not a list
    (a string here) made the static table's share raise ``TypeError``, which nothing caught: the
    share's thread died, and every later request from a co-located worker (attaching a table, a new
    worker's clock table) waited out its timeout. It is a ProtocolError now, and the share's thread
    survives anything a request provokes."""
    with ThreadCluster(nodes=1) as c:
        w = c.worker(0)
        w.table("s", 100, 4)
        name = socket_name(c.spec.cluster_id, 0)
        try:
            _, fds = fetch_fds(name, {"table": "s", "shards": "0"}, timeout=5.0)
            for fd in fds:
                os.close(fd)
        except ShoalError:
            pass  # a typed refusal is fine
        try:
            reply, fds = fetch_fds(name, {"table": "s"}, timeout=5.0)
        except ShoalError as exc:
            pytest.fail(f"the node's descriptor share stopped serving after one malformed request: {exc!r}")
        for fd in fds:
            os.close(fd)
        assert [s["shard"] for s in reply["shards"]] == [0]
