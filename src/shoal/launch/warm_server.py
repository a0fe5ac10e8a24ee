"""The warm launcher itself (``shoal warm serve``; ``shoal warm start`` runs it in the background):
see ``shoal.launch.warm``, the side every ``shoal run`` imports, kept light.

One thread, one ``selectors`` loop over its socket, its callers' connections and a pidfd per job's
launcher; a request is a fork, so nothing else may run here (a fork copies only the calling thread).
"""

from __future__ import annotations

import fcntl
import io
import logging
import os
import random
import selectors
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shoal.launch.forked import preload
from shoal.launch.lifecycle import die_with_parent, name_process
from shoal.launch.user_dir import private_runs_dir
from shoal.launch.warm import (
    RELAYED,
    REQUEST_TIMEOUT_S,
    Lines,
    fingerprint,
    launcher_key,
    peer_is_us,
    send,
    socket_path,
    what_differs,
)

_KILL_AFTER_S = 10.0  # a job whose caller went away: SIGTERM, then SIGKILL after this long


@dataclass
class _Client:
    conn: socket.socket
    lines: Lines = field(default_factory=Lines)
    pid: int | None = None  # the launcher forked for it
    pidfd: int | None = None
    kill_at: float | None = None  # its caller went away: SIGKILL at this time if still running


class _WarmLauncher:
    """The socket, the callers connected to it and the launchers forked for them (one per job)."""

    def __init__(self, idle_s: float, run_job: Callable[[list[str]], int]) -> None:
        self.idle_s = idle_s
        self.run_job = run_job
        self.started = time.monotonic()
        self.last_job = time.monotonic()
        self.served = 0
        self.stopping = False
        self.selector = selectors.DefaultSelector()
        self.clients: dict[socket.socket, _Client] = {}
        self.path = socket_path()
        self.lock = self._lock()
        self.fingerprint = fingerprint()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.path.unlink(missing_ok=True)  # left by one that was killed: the lock says none runs
        self.listener.bind(str(self.path))
        self.listener.listen(64)
        self.selector.register(self.listener, selectors.EVENT_READ)

    def _lock(self) -> int:
        """Held for the warm launcher's life: a second one for the same environment exits at once."""
        path = private_runs_dir() / f"warm-{launcher_key()}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SystemExit("a warm launcher already runs for this environment") from None
        return fd

    def serve(self) -> None:
        while True:
            jobs = [c for c in self.clients.values() if c.pid is not None]
            if not jobs and (self.stopping or time.monotonic() - self.last_job > self.idle_s):
                return
            for key, _ in self.selector.select(timeout=self._wait_s(jobs)):
                if key.fileobj is self.listener:
                    self._accept()
                elif isinstance(key.data, _Client) and key.fd == key.data.pidfd:
                    self._ended(key.data)
                else:
                    client = self.clients.get(key.fileobj)  # type: ignore[call-overload]
                    if client is not None and client.conn.fileno() >= 0:  # its job's end, in this batch, closes it
                        self._read(client)
            now = time.monotonic()
            for c in jobs:
                if c.kill_at is not None and now >= c.kill_at and c.pid is not None:
                    _kill(c.pid, signal.SIGKILL)
                    c.kill_at = None

    def _wait_s(self, jobs: list[_Client]) -> float:
        deadlines = [c.kill_at for c in jobs if c.kill_at is not None]
        if not jobs:
            deadlines.append(self.last_job + self.idle_s)
        return max(0.01, min(deadlines) - time.monotonic()) if deadlines else 60.0

    def close(self) -> None:
        self.selector.close()
        self.listener.close()
        if not self.stopping:
            self.path.unlink(missing_ok=True)
        os.close(self.lock)

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        if not peer_is_us(conn):  # the directory admits no one else; this is the second lock
            conn.close()
            return
        conn.settimeout(REQUEST_TIMEOUT_S)
        client = _Client(conn)
        fds: list[int] = []
        try:
            data, fds, _, _ = socket.recv_fds(conn, 65536, 3)
            messages = client.lines.feed(data)
            while not messages and data:
                data = conn.recv(65536)
                messages = client.lines.feed(data)
        except (OSError, ValueError):
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        try:
            if not messages:
                conn.close()
            elif "run" in messages[0]:
                self._launch(client, messages[0], fds)
                self._relay(client, messages[1:])  # a signal sent with the request
            else:
                self._answer(conn, messages[0])
        finally:
            for fd in fds:
                os.close(fd)

    def _stop(self) -> None:
        """Take no new job; exit once the running ones end."""
        if not self.stopping:
            self.stopping = True
            self.selector.unregister(self.listener)
            self.path.unlink(missing_ok=True)  # no new job reaches it

    def _answer(self, conn: socket.socket, message: dict[str, Any]) -> None:
        if message.get("stop"):
            self._stop()
        jobs = sum(c.pid is not None for c in self.clients.values())
        send(conn, {"pid": os.getpid(), "up_s": time.monotonic() - self.started, "jobs": jobs, "served": self.served})
        conn.close()

    def _launch(self, client: _Client, request: dict[str, Any], fds: list[int]) -> None:
        difference = what_differs(self.fingerprint, request.get("fingerprint") or {})
        if difference is None and len(fds) != 3:
            difference = "the standard streams did not come"
        if difference is not None:
            stale = (request.get("fingerprint") or {}).get("sources") != self.fingerprint["sources"]
            if stale:  # the caller just read the files: this process runs code that is no longer there
                self._stop()
                difference += "; it stops (`shoal warm start` starts one on the new code)"
            send(client.conn, {"refused": difference})
            client.conn.close()
            return
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # or the child would write them once more
        pid = os.fork()
        if pid == 0:
            self._become_launcher(request, fds)  # never returns
        self.served += 1
        self.last_job = time.monotonic()
        client.pid, client.pidfd = pid, os.pidfd_open(pid)
        client.conn.setblocking(False)
        self.clients[client.conn] = client
        self.selector.register(client.conn, selectors.EVENT_READ)
        self.selector.register(client.pidfd, selectors.EVENT_READ, client)
        send(client.conn, {"started": pid})

    def _read(self, client: _Client) -> None:
        try:
            data = client.conn.recv(65536)
            messages = client.lines.feed(data) if data else []
        except (OSError, ValueError):
            data, messages = b"", []
        if not data:  # the caller went away (killed, or its terminal closed): end its job
            self.selector.unregister(client.conn)
            client.conn.close()  # the client stays listed until its launcher is reaped
            if client.pid is not None:
                _kill(client.pid, signal.SIGTERM)
                client.kill_at = time.monotonic() + _KILL_AFTER_S
            return
        self._relay(client, messages)

    def _relay(self, client: _Client, messages: list[dict[str, Any]]) -> None:
        for message in messages:
            signum = message.get("signal")
            if client.pid is not None and isinstance(signum, int) and signum in {int(s) for s in RELAYED}:
                _kill(client.pid, signum)

    def _ended(self, client: _Client) -> None:
        assert client.pid is not None and client.pidfd is not None
        _, status = os.waitpid(client.pid, 0)
        self.selector.unregister(client.pidfd)
        os.close(client.pidfd)
        client.pid = client.pidfd = None
        self.last_job = time.monotonic()
        if client.conn.fileno() >= 0:
            self.selector.unregister(client.conn)
            client.conn.setblocking(True)
            send(client.conn, {"exit": os.waitstatus_to_exitcode(status)})
            client.conn.close()
        self.clients = {s: c for s, c in self.clients.items() if c is not client}

    def _become_launcher(self, request: dict[str, Any], fds: list[int]) -> None:
        """The forked launcher's whole life: ``shoal run`` as the caller would have run it, on its
        streams, in its directory and environment; exits with the job's status."""
        code = 1
        try:
            name_process("shoal-run")
            die_with_parent()
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            self.selector.close()
            self.listener.close()
            for other in self.clients.values():
                other.conn.close()
                if other.pidfd is not None:
                    os.close(other.pidfd)
            os.close(self.lock)
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update({str(k): str(v) for k, v in request["env"].items()})
            sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 - lives as long as the process
            sys.stdout = _stream(1, "strict")
            sys.stderr = _stream(2, "backslashreplace")
            for handler in logging.root.handlers[:]:
                logging.root.removeHandler(handler)
            random.seed()
            sys.path[0] = str(request.get("path0", ""))  # the ``shoal`` script's folder, as for a cold start
            sys.argv = ["shoal", *request["run"]]
            code = self.run_job(list(request["run"]))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except KeyboardInterrupt:
            code = 128 + signal.SIGINT
        except BaseException:  # noqa: BLE001 - the job's status is all the caller gets: say what ended it
            traceback.print_exc()
        finally:
            logging.shutdown()
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(code)


def _stream(fd: int, errors: str) -> io.TextIOWrapper:
    return io.TextIOWrapper(open(fd, "wb", closefd=False), encoding="utf-8", errors=errors,  # noqa: SIM115
                            line_buffering=True)


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def serve(idle_minutes: float, run_job: Callable[[list[str]], int]) -> int:
    """Be the warm launcher until ``idle_minutes`` pass without a job or ``shoal warm stop``: load what
    a cold ``shoal run`` loads before it forks its job's processes (the launcher's modules and
    ``forked.preload``), then serve."""
    import shoal.launch.env  # noqa: F401 - what ``cli.main`` imports to run a job
    import shoal.launch.local  # noqa: F401

    preload()
    launcher = _WarmLauncher(idle_minutes * 60, run_job)
    print(f"warm launcher {os.getpid()} serving {launcher.path}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        launcher.serve()
    finally:
        launcher.close()
    return 0
