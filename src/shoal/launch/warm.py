"""A warm launcher: a background process that keeps Shoal, numba and the row kernels loaded and
starts each ``shoal run`` by forking.

A forked job (``shoal.launch.forked``) still loads, once per job, what it forks: the launcher's
imports (0.14 s) and its preload (0.3 s: numba and the kernels), most of a short job's start and
stop. ``shoal warm start`` pays that once per session: the warm launcher loads it all, then waits on
a Unix socket in the user's private run directory. ``shoal run`` asks it first, before importing
anything heavy: it sends its arguments, environment and working directory, and its standard
streams themselves (the descriptors, ``SCM_RIGHTS``); the warm launcher forks a launcher that runs
``shoal run`` as the command would have, writing to those streams; ``shoal run`` relays the
signals it gets and exits with the job's status.

What would make a forked launcher differ from a fresh one is refused: both sides compare the
interpreter, ``sys.path``, Shoal's source files (path, size, mtime) and the environment variables
that libraries read at import (numba's, the BLAS pools', Python's own); on any difference, or with
no warm launcher, ``shoal run`` starts the job itself, as it always did, and says why. Only the
same user reaches the socket (the directory is private; the peer's uid is checked too). A launcher
forked here dies with the warm launcher, and ends its job when ``shoal run``'s connection closes
(it was killed): no job outlives the command that started it. The warm launcher exits after
``--idle-minutes`` without a job, or at ``shoal warm stop`` once its jobs are over.

Messages are JSON lines; nothing here can run code from the socket.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import logging
import os
import random
import selectors
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.launch.forked import preload
from shoal.launch.lifecycle import die_with_parent, name_process
from shoal.launch.user_dir import private_runs_dir, runs_dir

_PACKAGE = Path(__file__).resolve().parents[1]  # Shoal's own source folder

_RELAYED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Read by libraries as they are imported (once, in the warm launcher): a run that sets them otherwise
# would get what the warm launcher loaded under its own.
_IMPORT_TIME_PREFIXES = ("NUMBA_", "OMP_", "OPENBLAS_", "MKL_", "PYTHON", "LD_", "TMPDIR")
_REQUEST_LIMIT = 1 << 22  # an environment and arguments: a few KB; anything near this is broken
_REQUEST_TIMEOUT_S = 5.0  # a client that connected sends its request at once
_KILL_AFTER_S = 10.0  # a job whose caller went away: SIGTERM, then SIGKILL after this long
_READY_TIMEOUT_S = 60.0  # numba's first compilation on a fresh install can take this long


def _key() -> str:
    """Which warm launcher serves this interpreter and this Shoal: one per environment and checkout."""
    where = f"{os.path.realpath(sys.executable)}\0{_PACKAGE}"
    return hashlib.blake2b(where.encode(), digest_size=8).hexdigest()


def socket_path() -> Path:
    return runs_dir() / f"warm-{_key()}.sock"


def fingerprint() -> dict[str, Any]:
    """What a forked launcher inherits from the warm one and a fresh ``shoal run`` would take from
    this process instead."""
    sources = hashlib.blake2b(digest_size=16)
    for path in sorted(_PACKAGE.rglob("*.py")):
        info = path.stat()
        sources.update(f"{path.relative_to(_PACKAGE)}\0{info.st_size}\0{info.st_mtime_ns}\n".encode())
    return {
        "interpreter": f"{os.path.realpath(sys.executable)} {sys.version}",
        "path": sys.path[1:],  # [0] is the script's folder (the warm launcher's is its module's)
        "sources": sources.hexdigest(),
        "environment": {k: v for k, v in os.environ.items() if k.startswith(_IMPORT_TIME_PREFIXES)},
    }


def _difference(ours: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """What differs between two fingerprints, in words; None if nothing."""
    labels = {"interpreter": "it runs another interpreter", "path": "it was started with another sys.path",
              "sources": "Shoal's source files changed since it started"}
    for part, label in labels.items():
        if ours.get(part) != theirs.get(part):
            return label
    env, other = ours.get("environment", {}), theirs.get("environment", {})
    names = sorted(k for k in set(env) | set(other) if env.get(k) != other.get(k))
    return f"it was started with other values of {', '.join(names)}" if names else None


def _peer_is_us(conn: socket.socket) -> bool:
    """Whether the process at the other end of a Unix socket runs as this user (``SO_PEERCRED``)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1] == os.getuid()


def _private(path: Path) -> bool:
    """Whether ``path``'s folder is ours and closed to everyone else: a socket another user could have
    put there would get our environment and our terminal."""
    try:
        info = path.parent.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077


def _send(conn: socket.socket, message: dict[str, Any]) -> bool:
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
        return True
    except OSError:
        return False


class _Lines:
    """JSON lines from a stream socket, as they complete."""

    def __init__(self) -> None:
        self.buffer = b""

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self.buffer += data
        if len(self.buffer) > _REQUEST_LIMIT:
            raise ValueError("message too long")
        *lines, self.buffer = self.buffer.split(b"\n")
        messages = [json.loads(line) for line in lines if line.strip()]
        if not all(isinstance(m, dict) for m in messages):
            raise ValueError("a message is not a JSON object")
        return messages


# ------------------------------------------------------------------ the client: ``shoal run``


def run(argv: Sequence[str]) -> int | None:
    """Run ``shoal <argv>`` on this user's warm launcher; its exit status, or None when there is no
    warm launcher for this environment or it refused (the caller then starts the job itself)."""
    path = socket_path()
    if not path.exists() or not _private(path):
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(path))
    except OSError:  # left behind by a warm launcher that was killed
        conn.close()
        return None
    if not _peer_is_us(conn):
        conn.close()
        return None
    with conn:
        streams, opened = _streams()
        request = {"run": list(argv), "env": dict(os.environ), "cwd": os.getcwd(), "path0": sys.path[0],
                   "fingerprint": fingerprint()}
        try:
            socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], streams)
        finally:
            for fd in opened:
                os.close(fd)
        lines = _Lines()
        messages: list[dict[str, Any]] = []
        previous = {s: signal.signal(s, lambda signum, _: _send(conn, {"signal": signum})) for s in _RELAYED}
        try:
            while True:
                while messages:
                    message = messages.pop(0)
                    if "refused" in message:
                        print(f"shoal: not using the warm launcher: {message['refused']}; starting the job here",
                              file=sys.stderr, flush=True)
                        return None
                    if "exit" in message:
                        return int(message["exit"])
                data = conn.recv(65536)
                if not data:
                    print("shoal: the warm launcher ended before the job did", file=sys.stderr, flush=True)
                    return 1
                messages += lines.feed(data)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def _streams() -> tuple[list[int], list[int]]:
    """This process's standard streams to hand over (``/dev/null`` for a closed one), and the
    descriptors opened for that."""
    streams, opened = [], []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            streams.append(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            opened.append(null)
            streams.append(null)
    return streams, opened


def _ask(message: dict[str, Any], timeout: float = 5.0) -> dict[str, Any] | None:
    """One question to the warm launcher and its answer; None if none runs."""
    path = socket_path()
    if not _private(path):
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(timeout)
    try:
        conn.connect(str(path))
        if not _peer_is_us(conn):
            return None
        _send(conn, message)
        lines = _Lines()
        while True:
            data = conn.recv(65536)
            if not data:
                return None
            answers = lines.feed(data)
            if answers:
                return answers[0]
    except OSError:
        return None
    finally:
        conn.close()


# ------------------------------------------------------------------ ``shoal warm``


def command(action: str, idle_minutes: float, run_job: Callable[[list[str]], int]) -> int:
    """``shoal warm start | stop | status | serve``; ``run_job`` runs ``shoal <argv>`` in a forked launcher."""
    if action == "serve":
        return serve(idle_minutes, run_job)
    if action == "status":
        state = _ask({"status": True})
        if state is None:
            print("shoal warm: no warm launcher runs for this environment")
            return 1
        print(f"shoal warm: launcher {state['pid']} up for {state['up_s']:.0f} s, {state['jobs']} job(s) running, "
              f"{state['served']} served; socket {socket_path()}")
        return 0
    if action == "stop":
        state = _ask({"stop": True})
        if state is None:
            print("shoal warm: no warm launcher runs for this environment")
            return 0
        print(f"shoal warm: launcher {state['pid']} stops once its {state['jobs']} job(s) end")
        return 0
    return _start(idle_minutes)


def _start(idle_minutes: float) -> int:
    state = _ask({"status": True})
    if state is not None:
        print(f"shoal warm: launcher {state['pid']} already runs; socket {socket_path()}")
        return 0
    log_path = private_runs_dir() / f"warm-{_key()}.log"
    began = time.monotonic()
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "shoal.launch.cli", "warm", "serve", "--idle-minutes",
                                 str(idle_minutes)],
                                stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file, start_new_session=True,
                                cwd=log_path.parent)
    while time.monotonic() - began < _READY_TIMEOUT_S:
        state = _ask({"status": True})
        if state is not None:
            print(f"shoal warm: launcher {state['pid']} ready in {time.monotonic() - began:.1f} s; `shoal run` starts "
                  f"jobs from it until {idle_minutes:g} minutes pass without one (`shoal warm stop` ends it)")
            return 0
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    print(f"shoal warm: the warm launcher did not start; see {log_path}", file=sys.stderr)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    return 1


# ------------------------------------------------------------------ the warm launcher


@dataclass
class _Client:
    conn: socket.socket
    lines: _Lines = field(default_factory=_Lines)
    pid: int | None = None  # the launcher forked for it
    pidfd: int | None = None
    kill_at: float | None = None  # its caller went away: SIGKILL at this time if still running


class _WarmLauncher:
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
        fd = os.open(private_runs_dir() / f"warm-{_key()}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
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
                    self._read(self.clients[key.fileobj])  # type: ignore[index]
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
        if not _peer_is_us(conn):  # the directory admits no one else; this is the second lock
            conn.close()
            return
        conn.settimeout(_REQUEST_TIMEOUT_S)
        client = _Client(conn)
        try:
            data, fds, _, _ = socket.recv_fds(conn, 65536, 3)
            messages = client.lines.feed(data)
            while not messages and data:
                data = conn.recv(65536)
                messages = client.lines.feed(data)
        except (OSError, ValueError):
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

    def _answer(self, conn: socket.socket, message: dict[str, Any]) -> None:
        if message.get("stop"):
            self.stopping = True
            self.selector.unregister(self.listener)
            self.path.unlink(missing_ok=True)  # no new job reaches it
        jobs = sum(c.pid is not None for c in self.clients.values())
        _send(conn, {"pid": os.getpid(), "up_s": time.monotonic() - self.started, "jobs": jobs, "served": self.served})
        conn.close()

    def _launch(self, client: _Client, request: dict[str, Any], fds: list[int]) -> None:
        difference = _difference(self.fingerprint, request.get("fingerprint") or {})
        if difference is None and len(fds) != 3:
            difference = "the standard streams did not come"
        if difference is not None:
            _send(client.conn, {"refused": difference})
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
        _send(client.conn, {"started": pid})

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
            if client.pid is not None and isinstance(signum, int) and signum in {int(s) for s in _RELAYED}:
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
            _send(client.conn, {"exit": os.waitstatus_to_exitcode(status)})
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
