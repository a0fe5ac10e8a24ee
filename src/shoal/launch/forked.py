"""Job processes forked from a launcher that has loaded Shoal once, instead of fresh interpreters.

A fresh interpreter per process imports numpy, pyzmq and Shoal (0.25-0.3 s) and loads numba
with the row kernels (about 0.5 s more, at its first table); a 2-node job's four processes paid
that on 2 cores, two at a time, before training began. ``shoal run`` pays it once: it loads all
of it, then forks each server and each worker whose command is this interpreter running a
script, a module (``-m``) or code (``-c``); a child starts with everything loaded (shared
copy-on-write) in about 10 ms. Other commands are started as they are.

The children are forked before the launcher makes its first thread or socket (a fork copies only
the calling thread, and a lock another thread held would stay locked in the child). Their
environment, which names the rendezvous the launcher has not made yet, comes through a pipe:
each child waits on it, then becomes what a fresh interpreter running its command would have
been (its own session, output to the launcher's pipe, ``sys.argv``, ``sys.path[0]``, a fresh
``__main__``, reseeded random state, none of the launcher's exit handlers or finalizers), and
exits through ``os._exit`` with its command's status, never returning into the launcher's code.
A launcher running other threads starts fresh interpreters (``safe_to_fork``).
"""

from __future__ import annotations

import atexit
import gc
import io
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import types
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from shoal.api.errors import ConfigError
from shoal.launch.lifecycle import die_with_parent, name_process, wait_for_an_exit


@dataclass(frozen=True)
class PythonMain:
    """What ``python [-u] <script | -m module | -c code> args...`` runs as its ``__main__``."""

    kind: str  # "script", "module", "code" or "server" (Shoal's own server)
    what: str  # the script's path, the module's name or the code
    args: tuple[str, ...] = ()


SERVER = PythonMain("server", "shoal.launch.server_main")


def python_main(command: Sequence[str]) -> PythonMain | None:
    """``command`` as a ``PythonMain`` when it runs this very interpreter (same file, same
    environment's ``bin``) with no option but ``-u``; None otherwise (it is started as it is)."""
    if len(command) < 2:
        return None
    found = shutil.which(command[0])
    if found is None or not _same_interpreter(found):
        return None
    rest = list(command[1:])
    if rest[0] == "-u":
        rest.pop(0)
    if not rest:
        return None
    if rest[0] in ("-m", "-c"):
        if len(rest) < 2:
            return None
        return PythonMain("module" if rest[0] == "-m" else "code", rest[1], tuple(rest[2:]))
    if rest[0].startswith("-"):
        return None
    return PythonMain("script", rest[0], tuple(rest[1:]))


def _same_interpreter(path: str) -> bool:
    # A virtual environment's python is a link to the system's: the same file, but another sys.path.
    ours = os.path.abspath(sys.executable)
    try:
        return (os.path.dirname(os.path.abspath(path)) == os.path.dirname(ours)
                and os.path.samefile(path, ours))
    except OSError:
        return False


def safe_to_fork() -> bool:
    """Whether a fork of this process leaves no lock held in the child: no Python thread but this
    one and no ZeroMQ context's I/O threads (known by the names they give themselves as they start;
    a fork copies only the calling thread). OpenBLAS's pool, which numpy's import starts, shuts
    itself down around a fork."""
    if threading.active_count() != 1:
        return False
    try:
        names = [Path(f"/proc/self/task/{task}/comm").read_text() for task in os.listdir("/proc/self/task")]
    except OSError:  # pragma: no cover - no procfs: Python's own threads are all that can be seen
        return True
    return not any(name.startswith("ZMQbg") for name in names)


def preload() -> None:
    """Load what every job process needs: the worker's and the server's modules, numba, the row
    kernels of float32 tables (the default; a float64 table's load when it is built, off the
    requests' path: they made every job's start about 0.14 s later) and the routing kernels; then keep it
    all out of the cyclic collector's walks (which would also write to every shared page of every
    child)."""
    import numpy as np

    import shoal.client.worker  # noqa: F401
    import shoal.launch.server_main  # noqa: F401
    from shoal.placement import kernels as routing
    from shoal.storage import kernels

    kernels.warm_up(np.float32)
    routing.warm_up()
    gc.freeze()


class ForkedProcess:
    """A forked child waiting for its environment; then a process the launcher watches like a
    ``subprocess.Popen`` (``pid``, ``returncode``, ``stdout``, ``poll``, ``wait``)."""

    def __init__(self, name: str, main: PythonMain, capture_output: bool) -> None:
        self.name = name
        self.returncode: int | None = None
        self.stdout: IO[bytes] | None = None
        env_read, self._env_write = os.pipe()
        out_read, out_write = os.pipe() if capture_output else (-1, -1)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # or the child would write what the launcher had buffered once more
        launcher = os.getpid()
        try:
            self.pid = os.fork()
        except OSError as exc:
            for fd in (env_read, self._env_write, out_read, out_write):
                if fd >= 0:
                    os.close(fd)
            raise ConfigError(f"cannot start {name}: {exc}") from exc
        if self.pid == 0:
            _become(name, main, launcher, env_read, out_write)  # never returns
        os.close(env_read)
        if capture_output:
            os.close(out_write)
            self.stdout = os.fdopen(out_read, "rb", buffering=0)

    def start(self, env: dict[str, str]) -> None:
        """Hand the child its environment: it runs its command from here."""
        data = json.dumps(env).encode()
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._env_write, view):]
        except OSError:
            pass  # it died while waiting: its exit status tells the launcher
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Close the environment's pipe: a child still waiting on it exits with status 1."""
        if self._env_write >= 0:
            os.close(self._env_write)
            self._env_write = -1

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.name, timeout or 0.0)
            wait_for_an_exit([self], 1.0 if left is None else min(left, 1.0))
        assert self.returncode is not None
        return self.returncode


def _become(name: str, main: PythonMain, launcher: int, env_read: int, out_write: int) -> None:
    """The child's whole life: wait for the environment, run ``main`` as a fresh interpreter would,
    exit with its status. Nothing here returns into the launcher's stack."""
    code = 1
    try:
        name_process(f"shoal-{name}")
        os.setsid()  # its own process group: the launcher's teardown signals the group
        die_with_parent()
        if os.getppid() != launcher:  # it died before the call above took effect
            os._exit(1)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        if out_write >= 0:
            os.dup2(out_write, 1)
            os.dup2(out_write, 2)
        os.dup2(env_read, 3)
        os.closerange(4, os.sysconf("SC_OPEN_MAX"))  # the launcher's other descriptors
        env = _read_env(3)
        os.close(3)
        if env is None:
            os._exit(1)  # the launcher gave up before the job started
        _forget_the_launchers_cleanups()
        code = _run(main, env)
    except SystemExit as exc:
        code = _exit_status(exc.code)
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 - a child reports whatever ended it and exits, as python would
        traceback.print_exc()
        code = 1
    finally:
        os._exit(_finish(code))


def _forget_the_launchers_cleanups() -> None:
    """The launcher's exit handlers and finalizers are its own: run at a child's exit, they would
    clean up what the launcher goes on using (a ``TemporaryDirectory`` the workers write into)."""
    atexit._clear()  # type: ignore[attr-defined]
    weakref.finalize._registry.clear()  # type: ignore[attr-defined]
    weakref.finalize._registered_with_atexit = False  # type: ignore[attr-defined]  # the child's own register
    atexit.register(logging.shutdown)  # as logging's import did: the child's handlers flushed at its exit


def _read_env(fd: int) -> dict[str, str] | None:
    chunks = []
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    if not chunks:
        return None
    env = json.loads(b"".join(chunks))
    return {str(k): str(v) for k, v in env.items()}


def _run(main: PythonMain, env: dict[str, str]) -> int:
    os.environ.clear()
    os.environ.update(env)
    # A fresh interpreter's streams: unbuffered (PYTHONUNBUFFERED, as started children get), on
    # the descriptors just set; its logging unconfigured (the launcher configured its own).
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 - lives as long as the process
    sys.stdout, sys.stderr = _unbuffered(1, "strict"), _unbuffered(2, "backslashreplace")
    for handler in logging.root.handlers[:]:
        logging.root.removeHandler(handler)
    logging.root.setLevel(logging.WARNING)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    # Siblings forked from one launcher share its random state; a fresh interpreter draws its own.
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    if main.kind == "server":
        from shoal.launch import server_main

        sys.argv = [server_main.__file__ or "server_main"]
        return server_main.main()
    import runpy

    if main.kind == "script":
        sys.argv = [main.what, *main.args]
        sys.path[0] = os.path.dirname(os.path.realpath(main.what))
        runpy.run_path(main.what, run_name="__main__")
    elif main.kind == "module":
        sys.argv = [main.what, *main.args]
        sys.path[0] = os.getcwd()
        runpy.run_module(main.what, run_name="__main__", alter_sys=True)
    else:
        sys.argv = ["-c", *main.args]
        sys.path[0] = ""
        module = types.ModuleType("__main__")
        sys.modules["__main__"] = module
        exec(compile(main.what, "<string>", "exec"), module.__dict__)  # noqa: S102 - the user's own -c code
    return 0


def _unbuffered(fd: int, errors: str) -> io.TextIOWrapper:
    return io.TextIOWrapper(open(fd, "wb", buffering=0, closefd=False), encoding="utf-8",  # noqa: SIM115
                            errors=errors, line_buffering=True, write_through=True)


def _exit_status(code: object) -> int:
    """The status ``sys.exit(code)`` gives a python process."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _finish(code: int) -> int:
    """What an interpreter does at its end: wait for non-daemon threads, run exit handlers, flush."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # as multiprocessing's forked processes do
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    except BaseException:  # noqa: BLE001 - the status is decided; a failing handler only says so
        traceback.print_exc()
    return code
