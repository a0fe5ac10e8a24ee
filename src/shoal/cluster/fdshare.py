"""Handing shared-memory descriptors to co-located processes.

A node's server listens on an abstract Unix socket (no file to clean up; it
vanishes with the process) and passes segment descriptors with SCM_RIGHTS.
Only processes of the same user may connect (checked with SO_PEERCRED).
Requests and replies are length-prefixed msgpack maps (msgspec).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

import msgspec

from shoal.api.errors import AuthError, ClusterError, RequestTimeoutError, ShoalError, error_from_code

log = logging.getLogger(__name__)

_LEN = struct.Struct("<I")
_MAX_REQUEST = 64 * 1024
_MAX_FDS = 64

Provider = Callable[[dict[str, Any]], tuple[dict[str, Any], list[int]]]


def socket_name(cluster_id: str, node: int) -> str:
    return f"\0shoal-{cluster_id}-node{node}"


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        data += chunk
    return bytes(data)


class FdShareServer:
    """Answers descriptor requests from local processes, in a background thread."""

    def __init__(self, name: str, provider: Provider) -> None:
        self.name = name
        self.provider = provider
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.sock.bind(name)
        self.sock.listen(64)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="shoal-fdshare", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()  # blocks until a request, or until close shuts the socket
            except OSError:
                break
            with conn:
                try:
                    self._answer(conn)
                except (OSError, ValueError, ConnectionError) as exc:  # msgspec.DecodeError is a ValueError
                    log.warning("fd share: dropped a request: %s", exc)
                except Exception:  # a bug must not end the node's share: every later attach would wait
                    log.exception("fd share: failed answering a request")

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(5.0)
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        if uid != os.getuid():
            log.warning("fd share: refused a process of uid %d", uid)
            self._send(conn, {"ok": False, "code": AuthError.code, "message": "different user"}, [])
            return
        head = conn.recv(_LEN.size, socket.MSG_PEEK)
        if not head:
            return  # a liveness probe: connected and left
        (length,) = _LEN.unpack(_recv_exact(conn, _LEN.size))
        if length > _MAX_REQUEST:
            raise ValueError(f"request of {length} bytes is too large")
        request = msgspec.msgpack.decode(_recv_exact(conn, length))
        if not isinstance(request, dict):
            raise ValueError("request must be a map")
        try:
            reply, fds = self.provider(request)
            reply = {"ok": True, **reply}
        except ShoalError as exc:
            reply, fds = {"ok": False, "code": exc.code, "message": str(exc)}, []
        self._send(conn, reply, fds)

    @staticmethod
    def _send(conn: socket.socket, reply: dict[str, Any], fds: list[int]) -> None:
        payload = msgspec.msgpack.encode(reply)
        socket.send_fds(conn, [_LEN.pack(len(payload)) + payload], fds)

    def close(self) -> None:
        """Wakes the thread's ``accept`` at once (Linux ends it with EINVAL once the socket is shut),
        rather than after a polling timeout that every exit would wait out."""
        self._stop.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._thread.join(timeout=2)
        self.sock.close()


def fetch_fds(name: str, request: dict[str, Any], timeout: float = 10.0) -> tuple[dict[str, Any], list[int]]:
    """Ask the server at ``name`` for descriptors; the caller owns (and must close) them."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(name)
        except OSError as exc:
            raise ClusterError(f"no local server listening at {name[1:]!r}: {exc}") from exc
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        if struct.unpack("3i", creds)[1] != os.getuid():  # only our own user's server may hand us memory
            raise AuthError(f"the process listening at {name[1:]!r} belongs to another user")
        payload = msgspec.msgpack.encode(request)
        sock.sendall(_LEN.pack(len(payload)) + payload)
        data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, _MAX_FDS)
        if len(data) < _LEN.size:
            raise ClusterError(f"local server at {name[1:]!r} closed the connection")
        (length,) = _LEN.unpack(data[: _LEN.size])
        body = data[_LEN.size :]
        if len(body) < length:
            body += _recv_exact(sock, length - len(body))
        reply = msgspec.msgpack.decode(body)
    except TimeoutError as exc:
        raise RequestTimeoutError(f"local server at {name[1:]!r} did not answer within {timeout}s") from exc
    finally:
        sock.close()
    if not reply.get("ok"):
        for fd in fds:
            os.close(fd)
        raise error_from_code(str(reply.get("code")), str(reply.get("message")))
    reply.pop("ok")
    return reply, list(fds)
