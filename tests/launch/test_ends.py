"""How jobs end, with real processes: signals to ``shoal run`` (the cold and the warm launcher), a
worker that exits without its goodbye, a job that cannot start, malformed variables under torchrun.
Each docstring says what went wrong before."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import shoal
from tests.support.waiting import wait_for_json

SRC = str(Path(shoal.__file__).resolve().parents[1])  # this checkout's src, absolute (a warm launcher's cwd differs)
PY = sys.executable


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": SRC, **extra}
    for name in ("SHOAL_SECRET", "SHOAL_SECRET_FILE"):
        env.pop(name, None)
    return env


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# A worker that, like many training scripts (data loaders, tensorboard, a shell-out), starts a helper
# process of its own, then trains (sleeps) until stopped.
WITH_HELPER = """
import json, os, subprocess, sys, time
import shoal
ps = shoal.init()
helper = subprocess.Popen(["sleep", "30"])
info = {"pid": os.getpid(), "helper": helper.pid, "secret_file": os.environ.get("SHOAL_SECRET_FILE")}
path = os.path.join(sys.argv[1], f"w{ps.rank}.json")
with open(path + ".part", "w") as fh:
    json.dump(info, fh)
os.replace(path + ".part", path)
time.sleep(30)
"""


def _job_with_helper(where: Path, info_dir: Path, home: Path, stderr: int) -> subprocess.Popen[str]:
    """``shoal run`` of one node running ``WITH_HELPER`` (written to ``where``), which tells its pids in
    ``info_dir``, with ``home`` as TMPDIR (where the run files and a warm launcher live)."""
    script = where / "job.py"
    script.write_text(WITH_HELPER)
    return subprocess.Popen([PY, "-m", "shoal.launch.cli", "run", "--nodes", "1", "--connect-timeout", "30", "--",
                             PY, str(script), str(info_dir)], env=_env(TMPDIR=str(home)),
                            stdout=subprocess.PIPE, stderr=stderr, text=True)


def test_sighup_to_shoal_run_tears_the_job_down_as_sigterm_does(tmp_path: Path) -> None:
    """Closing the terminal (SIGHUP to ``shoal run``) kills the launcher outright: it installs handlers
    for SIGINT and SIGTERM only (local.py, LocalCluster.run), so its teardown never runs. The workers
    die by PDEATHSIG, but what they started (reached by a teardown's killpg of their group) is
    orphaned, and the job's secret file and run file stay behind. SIGTERM cleans all of it up."""
    home = tmp_path / "home"
    home.mkdir()
    proc = _job_with_helper(tmp_path, tmp_path, home, subprocess.STDOUT)
    helper = None
    try:
        info = wait_for_json(tmp_path / "w0.json")
        helper = info["helper"]
        runs = home / f"shoal-runs-{os.getuid()}"
        assert Path(info["secret_file"]).exists() and list(runs.glob("*.json"))
        proc.send_signal(signal.SIGHUP)
        out, _ = proc.communicate(timeout=60)
        left = _wait_gone([info["pid"], helper], timeout=10)
        assert not left, f"processes of the job outlived it after SIGHUP: {left} (worker {info['pid']}, " \
                         f"its helper {helper}); launcher status {proc.returncode}; output: {out[-2000:]}"
        assert not Path(info["secret_file"]).exists(), "the job's secret file stayed behind after SIGHUP"
        assert not list(runs.glob("*.json")), "the job's run file stayed behind after SIGHUP"
        assert proc.returncode == 128 + signal.SIGHUP, (proc.returncode, out[-2000:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
        if helper is not None:
            _kill([helper])


@pytest.fixture
def warm_home() -> Iterator[Path]:
    """A short private TMPDIR with a warm launcher of this checkout running in it."""
    home = Path(tempfile.mkdtemp(prefix="swr", dir="/tmp"))
    started = subprocess.run([PY, "-m", "shoal.launch.cli", "warm", "start", "--idle-minutes", "2"],
                             env=_env(TMPDIR=str(home)), capture_output=True, text=True, timeout=120)
    pid = None
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        pid = int(re.search(r"launcher (\d+)", started.stdout).group(1))  # type: ignore[union-attr]
        yield home
    finally:
        subprocess.run([PY, "-m", "shoal.launch.cli", "warm", "stop"], env=_env(TMPDIR=str(home)),
                       capture_output=True, text=True, timeout=60)
        if pid is not None and _wait_gone([pid], timeout=10):
            _kill([pid])
        shutil.rmtree(home, ignore_errors=True)


def test_a_job_launcher_killed_on_the_warm_launcher_gives_shoal_run_a_signal_status_and_a_message(
        warm_home: Path) -> None:
    """The launcher forked for a job dies of a signal (the OOM killer, an operator's kill -9): the warm
    launcher reports ``os.waitstatus_to_exitcode(status)``, i.e. -9 (warm_server.py, _ended), and
    ``shoal run`` returns it as is (warm.py, run: ``int(message["exit"])``), so it exits with
    status 247 (-9 & 0xFF) and says nothing; a cold ``shoal run`` killed the same way ends with 137."""
    info_dir = warm_home / "info"
    info_dir.mkdir()
    proc = _job_with_helper(warm_home, info_dir, warm_home, subprocess.PIPE)
    helper = None
    try:
        info = wait_for_json(info_dir / "w0.json")
        helper = info["helper"]
        launcher = int(Path(f"/proc/{info['pid']}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert launcher != proc.pid, "the job did not run on the warm launcher"
        os.kill(launcher, signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGKILL and "shoal:" in err.split("rendezvous", 1)[-1], \
            f"shoal run exited with status {proc.returncode} after its job's launcher was killed; stderr: {err!r}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
        if helper is not None:
            _kill([helper])


LEAVES_WITHOUT_SHUTDOWN = """
import sys, time
import shoal
ps = shoal.init()
if ps.rank == 0:
    sys.exit(0)  # done: exits without ps.shutdown()
started = time.monotonic()
try:
    ps.barrier()
    print("barrier completed", flush=True)
except shoal.ShoalError as exc:
    print(f"barrier failed after {time.monotonic() - started:.1f}s: {type(exc).__name__}: {exc}", flush=True)
    sys.exit(5)
ps.shutdown()
"""


def test_a_barrier_that_an_exited_worker_never_reached_fails_at_once(tmp_path: Path) -> None:
    """Worker 0 exits with status 0 without calling ``ps.shutdown()``. The launcher sees the exit at
    once (local.py, _watch) but tells the rendezvous nothing (it does for a server: server_exited), so
    worker 1's barrier, which can never complete, waits out the whole barrier timeout (600 s by
    default) and ends with a RequestTimeoutError saying "finished []", instead of failing at once
    naming rank 0 as README promises for a barrier a finished worker never reached."""
    script = tmp_path / "job.py"
    script.write_text(LEAVES_WITHOUT_SHUTDOWN)
    started = time.monotonic()
    done = subprocess.run([PY, "-m", "shoal.launch.cli", "run", "--nodes", "2", "--connect-timeout", "30",
                           "--barrier-timeout", "25", "--", PY, str(script)], env=_env(),
                          capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    line = next((ln for ln in done.stdout.splitlines() if "barrier" in ln), done.stdout + done.stderr)
    assert done.returncode != 0, done.stdout + done.stderr
    assert "ClusterError" in line and "0" in line and took < 15, f"after {took:.1f}s: {line}"


LIBRARY_RUN = """
import os, sys, time
from pathlib import Path
import shoal.launch.local as local
from shoal.api.errors import ConfigError

def children():
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == str(os.getpid()) and fields[0] != "Z":
                found.append(int(entry.name))
    return found

try:
    local.run([sys.executable, "-c", "pass"], nodes=2, fork_from_launcher=True)
    outcome = "ran"
except ConfigError as exc:
    outcome = f"ConfigError: {exc}"
time.sleep(3)  # a child told to give up exits at once
left = children()
print(outcome)
print("children left:", left, flush=True)
for pid in left:
    os.kill(pid, 9)
for pid in left:
    os.waitpid(pid, 0)
"""


def test_a_job_that_cannot_start_reaps_the_children_it_forked(tmp_path: Path) -> None:
    """``local.run(..., fork_from_launcher=True)`` (as the MF demo calls it) forks the servers and
    workers first (local.py, _fork_children), then makes the secret file with ``keep_secret`` outside
    the try that reaps them (local.py, LocalCluster.run). When the run directory is refused
    (ConfigError: another user could enter it), the forked children are never told to give up: they
    wait on their environment pipe for as long as the calling process lives."""
    home = tmp_path / "home"
    home.mkdir()
    runs = home / f"shoal-runs-{os.getuid()}"
    runs.mkdir()
    runs.chmod(0o777)
    script = tmp_path / "lib.py"
    script.write_text(LIBRARY_RUN)
    done = subprocess.run([PY, str(script)], env=_env(TMPDIR=str(home)), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ConfigError" in done.stdout and "no one else may enter" in done.stdout, done.stdout + done.stderr
    assert "children left: []" in done.stdout, done.stdout


@pytest.mark.parametrize("name, value", [("SHOAL_RENDEZVOUS_PORT", "29501x"), ("SHOAL_CONNECT_TIMEOUT", "30s")])
def test_a_malformed_shoal_variable_under_torchrun_is_a_config_error_naming_it(name: str, value: str) -> None:
    """README: "A missing or malformed variable fails at once with its name", and every error is a
    ShoalError. Under torchrun, ``role`` parses SHOAL_RENDEZVOUS_PORT with a bare ``int(...)`` and
    SHOAL_CONNECT_TIMEOUT with a bare ``float(...)`` (torchrun.py, role), so a typo reaches the user
    as a ValueError ("invalid literal for int() with base 10") that names neither variable."""
    from shoal.api.errors import ConfigError
    from shoal.launch import torchrun

    environ = {"TORCHELASTIC_RUN_ID": "r1", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
               "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
               "SHOAL_SECRET": "00" * 32, name: value}
    try:
        torchrun.role(environ)
    except ConfigError as exc:
        assert name in str(exc)
    except Exception as exc:  # noqa: BLE001 - what reaches the user instead
        pytest.fail(f"{type(exc).__name__} (not a ShoalError) for {name}={value!r}: {exc}")
    else:
        pytest.fail(f"{name}={value!r} was accepted")


# Rank 0 kills node 1's server each time it is back (its pid from the server's stats), at most six
# times, and says how many it killed; rank 1 only waits for the end.
KILLS_SERVER_1 = """
import os, signal, time
import shoal
ps = shoal.init()
ps.barrier()
kills = 0
deadline = time.monotonic() + 60
while ps.rank == 0 and kills < 6 and time.monotonic() < deadline:
    status = ps.cluster_status()
    if status["alive"][1] and status["incarnations"][1] == kills + 1:
        pid = next(s["pid"] for s in ps.server_stats() if s.get("node") == 1 and not s.get("unreachable"))
        os.kill(pid, signal.SIGKILL)
        kills += 1
        print("killed", kills, flush=True)
    time.sleep(0.05)
time.sleep(60 if ps.rank == 1 else 0)
print("worker done", ps.rank, kills, flush=True)
"""


def test_a_server_that_keeps_dying_under_the_restart_policy_ends_the_job_after_its_restarts(tmp_path: Path) -> None:
    """``--on-server-failure restart`` started a dead server again at once, every time and for good
    (local.py, ``_watch``): a server that crashes at each start was restarted in a tight loop while
    the job hung on it. Like torchrun's ``--max-restarts``, a server is now started again at most
    ``--max-server-restarts`` times (3 by default), each a little later than the one before; its
    next death ends the job, naming the server and its restarts."""
    script = tmp_path / "killer.py"
    script.write_text(KILLS_SERVER_1)
    started = time.monotonic()
    done = subprocess.run([PY, "-m", "shoal.launch.cli", "run", "--nodes", "2", "--connect-timeout", "30",
                           "--on-server-failure", "restart", "--", PY, str(script)],
                          env=_env(), capture_output=True, text=True, timeout=180)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "killed 4" in out and "killed 5" not in out, out
    assert "server s1 exited" in out and "restarted 3 times" in out, out
    assert "worker done 1" not in out, out  # the job ended; rank 1 was still waiting
    assert time.monotonic() - started < 60, out
