"""The warm launcher with real processes: a job forked from it behaves as a cold ``shoal run`` (its
caller's streams, environment, directory and exit status), ends with its caller, and is refused
where it would differ from one."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

JOB = """
import os, sys, time, shoal
ps = shoal.init()
launcher = os.getppid()
with open(f"/proc/{launcher}/stat") as fh:
    above = fh.read().rsplit(")", 1)[1].split()[1]  # the launcher's parent
print(f"rank {ps.rank} pid {os.getpid()} X={os.environ.get('X')} cwd={os.getcwd()} above={above}", flush=True)
ps.barrier()
if sys.argv[1] == "sleep":
    time.sleep(120)
ps.shutdown()
sys.exit(3 if ps.rank == 1 else 0)
"""


def _env(home: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "TMPDIR": str(home), **extra}


def _shoal(home: Path, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shoal.launch.cli", *args], env=_env(home, **extra),
                          capture_output=True, text=True, timeout=120)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_gone(pids: list[int], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(_gone(p) for p in pids):
        assert time.monotonic() < deadline, f"still running: {[p for p in pids if not _gone(p)]}"
        time.sleep(0.05)


@pytest.fixture
def home() -> Iterator[Path]:
    """A private temporary directory for the test's warm launcher (its socket path must stay short)."""
    path = Path(tempfile.mkdtemp(prefix="sw", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def warm(home: Path) -> Iterator[int]:
    """A warm launcher of this environment for the test; its pid."""
    started = _shoal(home, "warm", "start", "--idle-minutes", "5")
    assert started.returncode == 0, started.stdout + started.stderr
    pid = int(re.search(r"launcher (\d+)", started.stdout).group(1))  # type: ignore[union-attr]
    yield pid
    _shoal(home, "warm", "stop")
    try:
        _wait_gone([pid], timeout=10)
    finally:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


def _run(home: Path, script: Path, mode: str, **extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", "2", "--", sys.executable,
                             str(script), mode], env=_env(home, **extra), cwd=script.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _ranks(lines: str) -> dict[int, dict[str, str]]:
    found = re.findall(r"rank (\d) pid (\d+) X=(\S+) cwd=(\S+) above=(\d+)", lines)
    return {int(r): {"pid": p, "X": x, "cwd": c, "above": a} for r, p, x, c, a in found}


@pytest.fixture
def script(home: Path) -> Path:
    folder = home / "job"
    folder.mkdir()
    path = folder / "job.py"
    path.write_text(JOB)
    return path


def test_shoal_run_forks_its_job_from_the_warm_launcher_with_the_callers_streams_environment_and_status(
        home: Path, warm: int, script: Path) -> None:
    proc = _run(home, script, "end", X="from-the-caller")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, out + err  # rank 1's status, as a cold launcher reports it
    ranks = _ranks(out)
    assert sorted(ranks) == [0, 1], out + err
    for seen in ranks.values():
        assert seen["X"] == "from-the-caller" and seen["cwd"] == str(script.parent)
    launchers = {seen["above"] for seen in ranks.values()}
    assert launchers == {str(warm)}, f"the job's launcher was forked by {launchers}, not the warm launcher {warm}"
    assert "worker w1 exited with status 3" in err
    status = _shoal(home, "warm", "status")
    assert "0 job(s) running, 1 served" in status.stdout, status.stdout


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL], ids=["interrupted", "killed"])
def test_a_job_on_the_warm_launcher_ends_with_the_shoal_run_that_started_it(
        home: Path, warm: int, script: Path, how: signal.Signals) -> None:
    proc = _run(home, script, "sleep")
    assert proc.stdout is not None
    lines = ""
    deadline = time.monotonic() + 60
    while len(_ranks(lines)) < 2:
        assert time.monotonic() < deadline, lines
        lines += proc.stdout.readline()
    workers = [int(seen["pid"]) for seen in _ranks(lines).values()]
    proc.send_signal(how)
    try:
        code = proc.wait(timeout=30)
    finally:
        proc.kill()
    if how == signal.SIGINT:
        assert code == 128 + signal.SIGINT  # the launcher's status for an interrupted job
    _wait_gone(workers)
    deadline = time.monotonic() + 20
    while "0 job(s) running" not in (status := _shoal(home, "warm", "status").stdout):
        assert time.monotonic() < deadline, status
        time.sleep(0.1)


def test_a_warm_launcher_started_under_other_settings_is_not_used(home: Path, warm: int, script: Path) -> None:
    proc = _run(home, script, "end", NUMBA_OPT="1")  # numba reads it as it is imported
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, out + err
    assert "not using the warm launcher: it was started with other values of NUMBA_OPT" in err
    assert {seen["above"] for seen in _ranks(out).values()} != {str(warm)}
    assert "0 served" in _shoal(home, "warm", "status").stdout


def test_a_warm_launcher_running_under_other_interpreter_options_is_not_used(home: Path, warm: int,
                                                                            script: Path) -> None:
    """``python -O -W error -m shoal.launch.cli run ...``: a job forked from the warm launcher (started
    without them) would keep its asserts and its warnings as they were."""
    proc = subprocess.Popen([sys.executable, "-O", "-W", "error", "-m", "shoal.launch.cli", "run", "--nodes", "2",
                             "--", sys.executable, str(script), "end"], env=_env(home), cwd=script.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, out + err
    assert "not using the warm launcher: it runs under other interpreter options: -W, sys.flags.optimize" in err
    assert {seen["above"] for seen in _ranks(out).values()} != {str(warm)}
    assert "0 served" in _shoal(home, "warm", "status").stdout


def test_once_stopped_or_idle_a_warm_launcher_exits_and_jobs_start_cold(home: Path, script: Path) -> None:
    started = _shoal(home, "warm", "start", "--idle-minutes", "0.05")  # long enough to be seen ready when busy
    assert started.returncode == 0, started.stdout + started.stderr
    idle = int(re.search(r"launcher (\d+)", started.stdout).group(1))  # type: ignore[union-attr]
    _wait_gone([idle])  # 3 s without a job
    started = _shoal(home, "warm", "start")
    stopping = int(re.search(r"launcher (\d+)", started.stdout).group(1))  # type: ignore[union-attr]
    assert "stops once its 0 job(s) end" in _shoal(home, "warm", "stop").stdout
    _wait_gone([stopping])
    assert _shoal(home, "warm", "status").returncode == 1
    proc = _run(home, script, "end")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3 and sorted(_ranks(out)) == [0, 1], out + err
    assert "warm launcher" not in err


def _fake_warm_launcher(home: Path, folder_mode: int, as_uid: int | None) -> tuple[socket.socket, int | None]:
    """A listening socket where ``shoal run`` looks for its warm launcher; listening as ``as_uid``
    (a child process that binds, drops to that user, then listens: the peer's credentials are taken
    at listen) or as this process."""
    folder = home / f"shoal-runs-{os.getuid()}"
    folder.mkdir(mode=0o700)
    folder.chmod(folder_mode)
    code = ("import sys; sys.path[:0] = sys.argv[1:2]; from shoal.launch.warm import socket_path; "
            "print(socket_path())")
    path = subprocess.run([sys.executable, "-c", code, str(Path(__file__).resolve().parents[2] / "src")],
                          env=_env(home), capture_output=True, text=True, check=True).stdout.strip()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    if as_uid is None:
        listener.listen(8)
        return listener, None
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child only listens, then waits to be killed
        try:
            os.setuid(as_uid)
            listener.listen(8)
            time.sleep(120)
        finally:
            os._exit(0)
    return listener, pid


def _received(listener: socket.socket) -> bytes:
    """What callers that connected sent (they have all hung up by now)."""
    listener.setblocking(False)
    got = b""
    while True:
        try:
            conn = listener.accept()[0]
        except BlockingIOError:
            return got
        with conn:
            conn.settimeout(5)
            while chunk := conn.recv(65536):
                got += chunk


def test_a_socket_where_other_users_can_reach_it_is_never_used(home: Path, script: Path) -> None:
    listener, _ = _fake_warm_launcher(home, 0o777, None)
    with listener:
        proc = _run(home, script, "end")
        out, err = proc.communicate(timeout=120)
        assert _received(listener) == b"", "shoal run handed its environment to a socket others could have made"
    assert proc.returncode == 2 and "no one else may enter" in err, out + err  # as a cold start refuses it


@pytest.mark.skipif(os.getuid() != 0, reason="listening as another user needs root")
def test_a_warm_launcher_of_another_user_is_never_used(home: Path, script: Path) -> None:
    listener, pid = _fake_warm_launcher(home, 0o700, 65534)
    assert pid is not None
    try:
        proc = _run(home, script, "end")
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 3 and sorted(_ranks(out)) == [0, 1], out + err  # started cold
        assert "warm launcher" not in err
        assert _received(listener) == b""  # the client hung up once it read the peer's uid
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        listener.close()


def test_jobs_run_side_by_side_on_one_warm_launcher(home: Path, warm: int, script: Path) -> None:
    procs = [_run(home, script, "end", X=f"job{i}") for i in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for i, (proc, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        ranks = _ranks(out)
        assert proc.returncode == 3 and sorted(ranks) == [0, 1], out + err
        assert {seen["X"] for seen in ranks.values()} == {f"job{i}"}
        assert {seen["above"] for seen in ranks.values()} == {str(warm)}
    assert "2 served" in _shoal(home, "warm", "status").stdout


def test_a_killed_warm_launcher_ends_its_jobs_and_leaves_nothing_in_the_way(home: Path, warm: int,
                                                                             script: Path) -> None:
    proc = _run(home, script, "sleep")
    assert proc.stdout is not None
    lines = ""
    deadline = time.monotonic() + 60
    while len(_ranks(lines)) < 2:
        assert time.monotonic() < deadline, lines
        lines += proc.stdout.readline()
    workers = [int(seen["pid"]) for seen in _ranks(lines).values()]
    os.kill(warm, signal.SIGKILL)
    try:
        code = proc.wait(timeout=30)
    finally:
        proc.kill()
    assert code == 1 and "the warm launcher ended before the job did" in (proc.stderr.read() if proc.stderr else "")
    _wait_gone(workers)
    cold = _run(home, script, "end")  # its socket is left behind: refused, so this job starts here
    out, err = cold.communicate(timeout=120)
    assert cold.returncode == 3 and sorted(_ranks(out)) == [0, 1] and "warm launcher" not in err, out + err
    again = _shoal(home, "warm", "start", "--idle-minutes", "5")
    assert again.returncode == 0 and "ready" in again.stdout, again.stdout + again.stderr
    _shoal(home, "warm", "stop")


def test_a_warm_launcher_whose_sources_changed_refuses_the_job_and_stops(home: Path, warm: int,
                                                                         script: Path) -> None:
    source = Path(__file__).resolve().parents[2] / "src" / "shoal" / "launch" / "user_dir.py"
    before = source.stat()
    os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))  # as an edit would
    try:
        proc = _run(home, script, "end")
        out, err = proc.communicate(timeout=120)
    finally:
        os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert proc.returncode == 3 and sorted(_ranks(out)) == [0, 1], out + err  # started here instead
    assert "Shoal's source files changed since it started; it stops" in err, err
    _wait_gone([warm])
