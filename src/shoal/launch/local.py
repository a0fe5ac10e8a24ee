"""Run a whole cluster on this machine: rendezvous, one server per node, the workers.

The launcher owns every child. Each child dies with it (PR_SET_PDEATHSIG), runs
in its own process group (so a teardown also reaches what the child started),
and has its output prefixed with its role and rank. The job ends when all
workers exit (status 0), when one fails (its status), or on Ctrl-C / SIGTERM
(130 / 143); every child is reaped before the launcher returns.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import select
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO

from shoal.api.config import ClusterSpec, Limits, RebalancePolicy, Timeouts
from shoal.api.errors import ConfigError
from shoal.cluster.rendezvous import Rendezvous
from shoal.launch.env import child_env
from shoal.launch.forked import SERVER, ForkedProcess, preload, python_main, safe_to_fork
from shoal.launch.lifecycle import die_with_parent, wait_for_an_exit
from shoal.launch.report import LoadSampler, write_report
from shoal.launch.status import keep_secret, record_run
from shoal.transport.zmq_transport import ZmqTransport
from shoal.wire.codec import Codec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaunchOptions:
    """What ``shoal run`` was asked to do."""

    command: Sequence[str]
    nodes: int = 1
    workers_per_node: int = 1
    host: str = "127.0.0.1"
    transport: str = "tcp"
    secret: bytes | None = None
    local_access: bool = True
    limits: Limits = field(default_factory=Limits)
    timeouts: Timeouts = field(default_factory=Timeouts)
    prefix_output: bool = True
    grace_s: float = 3.0
    extra_env: dict[str, str] = field(default_factory=dict)
    #: what a server's death does: end the job ("fail"), nothing ("continue": replicated
    #: tables route around it), or start it again ("restart": it rejoins and catches up)
    on_server_failure: str = "fail"
    #: under "restart", how often one server is started again; its next death ends the job
    #: (a server that dies at every start would otherwise be restarted for good)
    max_server_restarts: int = 3
    #: move slices between servers when load is uneven (None: only when asked)
    rebalance: RebalancePolicy | None = None
    #: write a run report (plots and an HTML page) into this directory
    report: str | None = None
    #: load Shoal once in this process and fork the servers and the Python workers from it
    #: (``shoal.launch.forked``): for a process that runs the job and nothing else (``shoal run``);
    #: one that runs other threads (or ZeroMQ sockets) starts fresh interpreters instead
    fork_from_launcher: bool = False

    def __post_init__(self) -> None:
        if not self.command:
            raise ConfigError("no worker command given: shoal run [options] -- python train.py")
        if self.nodes < 1 or self.workers_per_node < 1:
            raise ConfigError(f"need at least 1 node and 1 worker per node, got {self.nodes} x {self.workers_per_node}")
        if self.transport not in ("tcp", "ipc"):
            raise ConfigError(f"transport must be 'tcp' or 'ipc', got {self.transport!r}")
        if self.on_server_failure not in ("fail", "continue", "restart"):
            raise ConfigError(f"on_server_failure must be fail, continue or restart, got {self.on_server_failure!r}")
        if not isinstance(self.max_server_restarts, int) or self.max_server_restarts < 0:
            raise ConfigError(f"max_server_restarts must be a whole number >= 0, got {self.max_server_restarts!r}")


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes] | ForkedProcess
    is_worker: bool
    command: list[str]
    env: dict[str, str]
    pump: threading.Thread | None = None
    restarts: int = 0
    #: when a dead server is started again (its restarts come later each time); None: not dead
    restart_at: float | None = None


# A line end: ``\n``, or a ``\r`` that redraws a progress bar (not the ``\r`` of ``\r\n``).
_LINE_END = re.compile(rb"(?<=\n)|(?<=\r)(?!\n)")
#: a server's first restart is at once, each later one waits twice as long as the one before (0, 0.5,
#: 1.5 s...), so a server that dies at every start does not spin the machine before its restarts run out
RESTART_BACKOFF_S = 0.5
#: a partial line (a prompt, a progress bar drawn without an end) waits at most this long
PARTIAL_LINE_S = 0.5


class LineWriter:
    """Copies a child's output to ours a whole line at a time, each prefixed.

    Children write concurrently; a line is written only once its end has arrived,
    so lines of different children never interleave. Progress bars redrawn with
    ``\r`` stay whole: each redraw is a line. A partial line is written once it
    has waited ``PARTIAL_LINE_S`` (``flush_partial``), so nothing is held back long.
    """

    lock = threading.Lock()

    def __init__(self, prefix: str, sink: IO[bytes]) -> None:
        self.prefix = prefix.encode()
        self.sink = sink
        self.pending = bytearray()
        self.mid_line = False  # the last write ended inside a line: its rest needs no prefix

    def feed(self, data: bytes) -> None:
        self.pending += data
        # A \r as the last byte may be the start of \r\n: it ends a line once the next byte is seen.
        end = max(self.pending.rfind(b"\n"), self.pending.rfind(b"\r", 0, len(self.pending) - 1))
        if end >= 0:
            self._write(bytes(self.pending[: end + 1]))
            del self.pending[: end + 1]

    def flush_partial(self) -> None:
        if self.pending:
            self._write(bytes(self.pending))
            self.pending.clear()

    def _write(self, text: bytes) -> None:
        out = bytearray()
        for line in _LINE_END.split(text):
            if not line:
                continue
            if not self.mid_line and line not in (b"\n", b"\r", b"\r\n"):  # an empty line stays empty
                out += self.prefix
            out += line
            self.mid_line = line[-1] not in b"\r\n"
        with self.lock:
            self.sink.write(bytes(out))
            self.sink.flush()


class LocalCluster:
    """Starts, watches and tears down one local job."""

    def __init__(self, options: LaunchOptions) -> None:
        self.options = options
        self.cluster_id = secrets.token_hex(6)
        self.children: list[Child] = []
        self._interrupted: int | None = None
        self._waiting: dict[str, ForkedProcess] = {}  # forked, waiting for their environment

    def _address(self, what: str) -> str:
        if self.options.transport == "ipc":
            return f"ipc://@shoal-{self.cluster_id}-{what}"
        return f"tcp://{self.options.host}:0"

    def run(self) -> int:
        """Run the job to the end; returns the exit status for the shell."""
        opts = self.options
        # Every job is authenticated: one secret per job unless given, in a file only this user reads
        # (made first: a run directory others may enter refuses the job before anything is forked).
        secret = opts.secret or secrets.token_bytes(32)
        secret_file = keep_secret(self.cluster_id, secret)
        transport: ZmqTransport | None = None
        try:
            if opts.fork_from_launcher:
                self._fork_children()  # before the transport's threads: a fork copies only this one
            transport = ZmqTransport()
            codec = Codec(opts.limits, secret)
            num_workers = opts.nodes * opts.workers_per_node
            rendezvous = Rendezvous(transport, codec, self._address("rendezvous"), self.cluster_id,
                                    opts.nodes, num_workers, rebalance=opts.rebalance)
        except BaseException:  # e.g. its address is taken: nothing of the job may stay behind
            secret_file.unlink(missing_ok=True)
            if transport is not None:
                transport.close()
            self._reap_waiting()
            raise
        cluster = ClusterSpec(self.cluster_id, opts.nodes, opts.workers_per_node, rendezvous.address,
                              secret, opts.limits, opts.timeouts)
        # SIGHUP too (the terminal closed): by default it ended the launcher before its teardown, and
        # what the workers had started outlived them, with the job's secret file.
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        run_file = None
        sampler: LoadSampler | None = None
        if opts.report:
            Path(opts.report).mkdir(parents=True, exist_ok=True)
        try:
            # Children are forked before any launcher thread exists, so the
            # pre-exec hook cannot deadlock on a lock held by another thread.
            for node in range(opts.nodes):
                self._spawn(f"s{node}", [sys.executable, "-m", "shoal.launch.server_main"],
                            child_env(cluster, node, None, opts.local_access, self._address(f"server{node}"),
                                      os.getpid(), secret_file), is_worker=False)
            for rank in range(num_workers):
                node = rank // opts.workers_per_node
                self._spawn(f"w{rank}", list(opts.command),
                            child_env(cluster, node, rank, opts.local_access, None, os.getpid(), secret_file),
                            is_worker=True)
            rendezvous.start()
            command = shlex.join(opts.command)
            run_file = record_run(self.cluster_id, rendezvous.address, secret_file,
                                  f"{opts.nodes} x {opts.workers_per_node}", command)
            print(f"shoal: job {self.cluster_id}: {opts.nodes} node(s) x {opts.workers_per_node} worker(s) running "
                  f"{command}; rendezvous {rendezvous.address}; watch it with: shoal status {self.cluster_id}",
                  file=sys.stderr, flush=True)
            if opts.report:
                sampler = LoadSampler(rendezvous.address, secret, Path(opts.report))
            for child in self.children:
                self._start_pump(child)
            status = self._watch(rendezvous)
            if status == 0:  # servers that joined the job (not this launcher's children) hear it ended too
                rendezvous.linger(host_node=-1, timeout_s=2 * rendezvous.dead_after_s)
            if sampler is not None:
                sampler.stop()
                sampler = None
                print(f"shoal: run report in {write_report(str(opts.report))}", file=sys.stderr)
            return status
        finally:
            if sampler is not None:
                sampler.stop()
            if run_file is not None:
                run_file.unlink(missing_ok=True)
            secret_file.unlink(missing_ok=True)
            self._teardown()
            rendezvous.stop()
            transport.close()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _fork_children(self) -> None:
        opts = self.options
        if not safe_to_fork():
            log.warning("this process runs other threads: the job's processes start as fresh interpreters")
            return
        worker = python_main(opts.command)
        names = [(f"s{node}", SERVER) for node in range(opts.nodes)]
        if worker is not None:
            names += [(f"w{rank}", worker) for rank in range(opts.nodes * opts.workers_per_node)]
        preload()
        try:
            for name, main in names:
                self._waiting[name] = ForkedProcess(name, main, capture_output=opts.prefix_output)
        except BaseException:
            self._reap_waiting()
            raise

    def _reap_waiting(self) -> None:
        """End the forked children whose job never started (each exits once its pipe closes)."""
        for proc in self._waiting.values():
            proc.abandon()
        for proc in self._waiting.values():
            try:
                proc.wait(timeout=self.options.grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self._waiting.clear()

    def _spawn(self, name: str, command: list[str], env: dict[str, str], is_worker: bool) -> None:
        forked = self._waiting.pop(name, None)
        if forked is not None:
            forked.start(self._full_env(env))
            self.children.append(Child(name, forked, is_worker, command, env))
        else:
            self.children.append(Child(name, self._popen(name, command, env), is_worker, command, env))

    def _full_env(self, env: dict[str, str]) -> dict[str, str]:
        full_env = {**os.environ, **self.options.extra_env, **env, "PYTHONUNBUFFERED": "1"}
        if self.options.report:
            full_env["SHOAL_RUN_DIR"] = str(Path(self.options.report).resolve())
        return full_env

    def _popen(self, name: str, command: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        try:
            return subprocess.Popen(
                command, env=self._full_env(env), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if self.options.prefix_output else None,
                stderr=subprocess.STDOUT if self.options.prefix_output else None,
                start_new_session=True, preexec_fn=die_with_parent,
            )
        except OSError as exc:
            raise ConfigError(f"cannot start {name} ({command[0]!r}): {exc}") from exc

    def _start_pump(self, child: Child) -> None:
        if self.options.prefix_output:
            child.pump = threading.Thread(target=self._pump, args=(child,), daemon=True)
            child.pump.start()

    def _pump(self, child: Child) -> None:
        assert child.proc.stdout is not None
        writer = LineWriter(f"[{child.name}] ", sys.stdout.buffer)
        fd = child.proc.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        try:
            while True:
                if writer.pending and not poller.poll(PARTIAL_LINE_S * 1000):
                    writer.flush_partial()
                    continue
                try:
                    data = os.read(fd, 65536)
                except OSError:
                    break
                if not data:
                    break
                writer.feed(data)
        finally:
            writer.flush_partial()

    def _watch(self, rendezvous: Rendezvous) -> int:
        workers = [c for c in self.children if c.is_worker]
        servers = [c for c in self.children if not c.is_worker]
        exited: set[str] = set()  # workers that ended well, told to the rendezvous
        while True:
            if self._interrupted is not None:
                print(f"shoal: interrupted; stopping {len(self.children)} process(es)", file=sys.stderr)
                return 128 + self._interrupted
            for w in workers:
                code = w.proc.poll()
                if code not in (None, 0):
                    print(f"shoal: worker {w.name} exited with status {code}; stopping the job", file=sys.stderr)
                    return code if code > 0 else 128 - code
                if code == 0 and w.name not in exited:  # said goodbye or not: barriers it never reached fail
                    exited.add(w.name)
                    rendezvous.worker_exited(int(w.name[1:]))
            for s in list(servers):
                if s.restart_at is not None:
                    if time.monotonic() >= s.restart_at:
                        self._restart(s)
                    continue
                code = s.proc.poll()
                if code is None or rendezvous.finished:
                    continue
                if code == 0 and int(s.name[1:]) in rendezvous.departed:
                    servers.remove(s)  # drained: it handed its slices over and left, as asked
                    continue
                rendezvous.server_exited(int(s.name[1:]))
                policy = self.options.on_server_failure
                if policy == "restart" and s.restarts >= self.options.max_server_restarts:
                    print(f"shoal: server {s.name} exited with status {code} before the workers finished, and was "
                          f"restarted {s.restarts} times already (--max-server-restarts); stopping the job",
                          file=sys.stderr)
                    return 1
                print(f"shoal: server {s.name} exited with status {code} before the workers finished; "
                      + {"fail": "stopping the job", "continue": "going on without it",
                         "restart": "starting it again"}[policy], file=sys.stderr)
                if policy == "fail":
                    return 1
                if policy == "continue":
                    servers.remove(s)
                    continue
                s.restart_at = time.monotonic() + RESTART_BACKOFF_S * (2 ** s.restarts - 1)
            if all(w.proc.poll() == 0 for w in workers):
                rendezvous.shutdown_requested = True  # servers see it in their next heartbeat
                deadline = time.monotonic() + 5.0
                while time.monotonic() < deadline and any(s.proc.poll() is None for s in servers):
                    wait_for_an_exit((s.proc for s in servers), 0.05)
                return 0
            wait_for_an_exit((c.proc for c in self.children), 0.05)

    def _restart(self, s: Child) -> None:
        """Start dead server ``s`` again, once its output pump has drained what the dead one wrote."""
        if s.pump is not None:
            s.pump.join(timeout=2)
        if s.proc.stdout is not None:
            s.proc.stdout.close()
        s.proc = self._popen(s.name, s.command, s.env)
        s.restarts += 1
        s.restart_at = None
        self._start_pump(s)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._interrupted = signum

    def _teardown(self) -> None:
        """SIGTERM every live child's process group, then SIGKILL what is left; reap all."""
        self._reap_waiting()
        live = [c for c in self.children if c.proc.poll() is None]
        for c in live:
            _signal_group(c.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.options.grace_s
        for c in live:
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for c in self.children:
            _signal_group(c.proc.pid, signal.SIGKILL)  # also reaches grandchildren of finished children
            c.proc.wait()
        for c in self.children:
            if c.pump is not None:
                c.pump.join(timeout=2)
            if c.proc.stdout is not None:
                c.proc.stdout.close()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run(command: Sequence[str], nodes: int = 1, workers_per_node: int = 1, **options: object) -> int:
    """Run ``command`` as every worker of a local cluster; returns the job's exit status."""
    return LocalCluster(LaunchOptions(command=command, nodes=nodes, workers_per_node=workers_per_node,
                                      **options)).run()  # type: ignore[arg-type]
