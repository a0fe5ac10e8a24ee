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

This module is ``shoal run``'s side (and ``shoal warm``'s), imported by every ``shoal run``, so
kept light; the warm launcher itself is ``warm_server``. Messages are JSON lines; nothing here can
run code from the socket.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import stat
import struct
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shoal.launch.user_dir import private_runs_dir, runs_dir

_PACKAGE = Path(__file__).resolve().parents[1]  # Shoal's own source folder

RELAYED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Read by libraries as they are imported (once, in the warm launcher): a run that sets them otherwise
# would get what the warm launcher loaded under its own.
_IMPORT_TIME_PREFIXES = ("NUMBA_", "NUMPY_", "OMP_", "KMP_", "GOMP_", "OPENBLAS_", "MKL_", "BLIS_", "VECLIB_",
                         "PYTHON", "LD_", "TMPDIR")
_REQUEST_LIMIT = 1 << 22  # an environment and arguments: a few KB; anything near this is broken
REQUEST_TIMEOUT_S = 5.0  # a client that connected sends its request at once
_READY_TIMEOUT_S = 60.0  # numba's first compilation on a fresh install can take this long


def launcher_key() -> str:
    """Which warm launcher serves this interpreter and this Shoal: one per environment and checkout."""
    where = f"{os.path.realpath(sys.executable)}\0{_PACKAGE}"
    return hashlib.blake2b(where.encode(), digest_size=8).hexdigest()


def socket_path() -> Path:
    return runs_dir() / f"warm-{launcher_key()}.sock"


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
        "options": interpreter_options(),
        "environment": {k: v for k, v in os.environ.items() if k.startswith(_IMPORT_TIME_PREFIXES)},
    }


def interpreter_options() -> dict[str, Any]:
    """The command-line options this interpreter runs under (``-O``, ``-X dev``, ``-W error``, ``-B``,
    ...), by name: a job forked from the warm launcher runs under the warm launcher's, where one
    started cold runs under its caller's (its asserts, its warnings, its dev-mode checks)."""
    flags = dict(zip(sys.flags.__match_args__, sys.flags, strict=True))
    flags.pop("quiet", None)  # the banner of an interactive interpreter: no job sees it
    options: dict[str, Any] = {f"-X {name}": value for name, value in sorted(sys._xoptions.items())}
    options.update({f"sys.flags.{name}": value for name, value in flags.items()})
    options["-W"] = list(sys.warnoptions)
    return options


def what_differs(ours: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """What differs between two fingerprints, in words; None if nothing."""
    labels = {"interpreter": "it runs another interpreter", "path": "it was started with another sys.path",
              "sources": "Shoal's source files changed since it started"}
    for part, label in labels.items():
        if ours.get(part) != theirs.get(part):
            return label
    for part, label in (("options", "it runs under other interpreter options: {}"),
                        ("environment", "it was started with other values of {}")):
        mine, other = ours.get(part, {}), theirs.get(part, {})
        names = sorted(k for k in set(mine) | set(other) if mine.get(k) != other.get(k))
        if names:
            return label.format(", ".join(names))
    return None


def peer_is_us(conn: socket.socket) -> bool:
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


def send(conn: socket.socket, message: dict[str, Any]) -> bool:
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
        return True
    except OSError:
        return False


class Lines:
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
    if not peer_is_us(conn):
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
        lines = Lines()
        messages: list[dict[str, Any]] = []
        previous = {s: signal.signal(s, lambda signum, _: send(conn, {"signal": signum})) for s in RELAYED}
        try:
            while True:
                while messages:
                    message = messages.pop(0)
                    if "refused" in message:
                        print(f"shoal: not using the warm launcher: {message['refused']}; starting the job here",
                              file=sys.stderr, flush=True)
                        return None
                    if "exit" in message:
                        return _exit_status(int(message["exit"]))
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
        if not peer_is_us(conn):
            return None
        send(conn, message)
        lines = Lines()
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


def command(action: str, idle_minutes: float) -> int:
    """``shoal warm start | stop | status`` (``serve``, the warm launcher itself, is ``warm_server``)."""
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
    import subprocess  # only here: every ``shoal run`` imports this module

    log_path = private_runs_dir() / f"warm-{launcher_key()}.log"
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


def _exit_status(code: int) -> int:
    """The shell's status for the job launcher's exit ``code`` (negative: killed by that signal, said
    here, as the shell would for a process of its own: 128 + the signal)."""
    if code >= 0:
        return code
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    print(f"shoal: the job's launcher was killed by {name}", file=sys.stderr, flush=True)
    return 128 - code
