"""The local launcher with real processes: output, exit status, teardown, lifecycle."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shoal.api.errors import ConfigError
from tests.conftest import shoal_segment_holders

PROBE = str(Path(__file__).resolve().parents[1] / "scripts" / "probe_worker.py")


def launch(info: Path, mode: str, nodes: int = 2, per_node: int = 1, extra: tuple[str, ...] = (),
           transport: str = "tcp") -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", str(nodes), "--workers-per-node",
           str(per_node), "--connect-timeout", "30", "--transport", transport, "--",
           sys.executable, PROBE, str(info), mode, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_infos(info: Path, count: int, timeout: float = 60) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = sorted(info.glob("w*.json"))
        if len(files) == count:
            try:
                return [json.loads(f.read_text()) for f in files]
            except json.JSONDecodeError:
                pass
        time.sleep(0.1)
    raise AssertionError(f"workers did not report within {timeout}s: {list(info.iterdir())}")


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def assert_all_gone(pids: list[int], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)], "processes outlived the job"


def job_pids(infos: list[dict]) -> list[int]:
    return [i["pid"] for i in infos] + infos[0]["server_pids"]


def test_a_job_runs_prefixes_output_and_exits_zero(tmp_path):
    proc = launch(tmp_path, "ok")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "[w0] worker 0 ready" in out and "[w1] worker 1 ready" in out
    infos = wait_for_infos(tmp_path, 2)
    assert_all_gone(job_pids(infos))
    assert not shoal_segment_holders(infos[0]["cluster_id"])


def test_lines_of_chatty_workers_stay_whole(tmp_path):
    """Four workers write lines in pieces at once: every line arrives whole under its own prefix
    (pieces of different workers were glued together), progress bars stay whole redraws, and a
    normal teardown prints no warning."""
    lines = 300
    done = subprocess.run([sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", "2", "--workers-per-node", "2",
                           "--connect-timeout", "30", "--", sys.executable,
                           str(Path(__file__).resolve().parents[1] / "scripts" / "chatty_worker.py"), str(lines)],
                          capture_output=True, timeout=120)
    out = done.stdout.decode()
    assert done.returncode == 0, out + done.stderr.decode()
    seen: dict[int, list[int]] = {r: [] for r in range(4)}
    for raw in out.replace("\r", "\n").splitlines():
        if not raw:
            continue
        match = re.fullmatch(r"\[w(\d)\] rank (\d) (?:line (\d+) (x*) end|progress (\d+)%)", raw)
        assert match, f"a line not whole: {raw!r}"
        assert match[1] == match[2], raw
        if match[3] is not None:
            assert len(match[4]) == int(match[3]) % 40, raw
            seen[int(match[1])].append(int(match[3]))
    assert all(numbers == list(range(lines)) for numbers in seen.values()), {r: len(n) for r, n in seen.items()}
    assert "WARNING" not in out + done.stderr.decode()


def test_a_job_over_unix_sockets_counts_every_push(tmp_path):
    """``--transport ipc``: servers listen on abstract Unix sockets (no file left behind), next to
    the sockets that pass shared memory to workers."""
    proc = launch(tmp_path, "count", per_node=2, extra=("20",), transport="ipc")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    counts = json.loads((tmp_path / "counts.json").read_text())
    expected = [4 * 20 * 4 * (2 if k in (7, 993) else 1) for k in range(1000)]
    assert counts == expected
    infos = wait_for_infos(tmp_path, 4)
    assert_all_gone(job_pids(infos))


def test_a_crashed_worker_ends_the_job_with_its_status(tmp_path):
    proc = launch(tmp_path, "crash")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 3, out
    assert "worker w1 exited with status 3" in out
    infos = wait_for_infos(tmp_path, 2)
    assert_all_gone(job_pids(infos))
    assert not shoal_segment_holders(infos[0]["cluster_id"])


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_or_sigterm_tears_everything_down(tmp_path, signum, status):
    proc = launch(tmp_path, "hang")
    infos = wait_for_infos(tmp_path, 2)
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == status, out
    assert_all_gone(job_pids(infos))
    assert not shoal_segment_holders(infos[0]["cluster_id"])


@pytest.mark.parametrize("victim", ["worker", "server"])
def test_a_killed_worker_or_server_frees_the_shared_memory(tmp_path, victim):
    proc = launch(tmp_path, "hang", nodes=2, per_node=2)
    infos = wait_for_infos(tmp_path, 4)
    cluster = infos[0]["cluster_id"]
    assert shoal_segment_holders(cluster), "workers should map their node's segments"
    os.kill(infos[1]["pid"] if victim == "worker" else infos[0]["server_pids"][1], signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0, out
    assert_all_gone(job_pids(infos))
    assert not shoal_segment_holders(cluster)


def test_killing_the_launcher_with_sigkill_ends_the_whole_job(tmp_path):
    proc = launch(tmp_path, "hang", nodes=2, per_node=2)
    infos = wait_for_infos(tmp_path, 4)
    proc.kill()
    proc.communicate(timeout=30)
    assert_all_gone(job_pids(infos))
    assert not shoal_segment_holders(infos[0]["cluster_id"])
    assert not list(Path("/dev/shm").glob("*shoal*"))


def test_a_missing_worker_command_is_a_clear_error():
    proc = subprocess.run([sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", "1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "no worker command given" in proc.stderr


def test_a_job_without_a_secret_gets_its_own_and_hands_it_over_by_a_private_file(tmp_path):
    """Every job is authenticated: ``shoal run`` makes a secret when none is given. The children get
    the path of a file only this user may read, never the secret on a command line or in a variable."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    for name in ("SHOAL_SECRET", "SHOAL_SECRET_FILE"):
        env.pop(name, None)
    job = subprocess.Popen([sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", "1", "--", sys.executable,
                            PROBE, str(tmp_path), "hang"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, env=env)
    try:
        infos = wait_for_infos(tmp_path, 1)
        pids = job_pids(infos)
        run_file = json.loads(next((tmp_path / f"shoal-runs-{os.getuid()}").glob("*.json")).read_text())
        secret_file = Path(run_file["secret_file"])
        assert secret_file.stat().st_mode & 0o777 == 0o600 and len(bytes.fromhex(secret_file.read_text())) == 32
        secret = secret_file.read_text()
        assert [(i["secret_file"], i["secret_in_environment"]) for i in infos] == [(str(secret_file), False)]
        for pid in pids:  # nor where other users' tools look (the environment a process was started with)
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert secret.encode() not in cmdline and not any(secret.encode() in e for e in environ)
    finally:
        job.send_signal(signal.SIGTERM)
        job.communicate(timeout=30)
    assert not secret_file.exists()  # gone with the job


def test_a_run_directory_another_user_could_enter_is_refused(tmp_path):
    from shoal.launch.user_dir import private_runs_dir

    folder = tmp_path / f"shoal-runs-{os.getuid()}"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", str(tmp_path))
        import tempfile
        patch.setattr(tempfile, "tempdir", None)
        with pytest.raises(ConfigError, match="no one else may enter"):
            private_runs_dir()


NO_TABLE_YET = """
import json, sys
import numpy as np
import shoal

def loaded(pid):  # numba's compiled extension modules are mapped once it is imported
    return "/numba/" in open(f"/proc/{pid}/maps").read()

ps = shoal.init()
servers = [s["pid"] for s in ps.server_stats()]
ps.barrier()
before = {"worker": "numba" in sys.modules, "prometheus": "prometheus_client" in sys.modules,
          "servers": [loaded(pid) for pid in servers]}
table = ps.table("t", 100, 4)
table.push(np.arange(100), np.ones((100, 4), np.float32))
after = {"worker": "numba" in sys.modules, "servers": [loaded(pid) for pid in servers]}
ps.barrier()
if ps.rank == 0:
    open(sys.argv[1], "w").write(json.dumps({"before": before, "after": after}))
ps.shutdown()
"""


def test_numba_and_prometheus_load_where_first_needed_not_at_start(tmp_path):
    """Fresh interpreters start without numba (about 0.5 s of CPU each) and without prometheus_client:
    a worker loads numba with its first table, a server while it builds one, the HTTP exposition on
    the first scrape; a barrier-only job never pays either. (Forked from the launcher, they start
    with numba loaded, for nothing: ``test_forked.py``.)"""
    script, out = tmp_path / "job.py", tmp_path / "out.json"
    script.write_text(NO_TABLE_YET)
    done = subprocess.run([sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", "2", "--connect-timeout", "30",
                           "--fresh-interpreters", "--", sys.executable, str(script), str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = json.loads(out.read_text())
    assert seen["before"] == {"worker": False, "prometheus": False, "servers": [False, False]}
    assert seen["after"] == {"worker": True, "servers": [True, True]}


def test_the_launcher_notices_a_child_exit_at_once():
    """It waits on the children's exits, not in polling sleeps that every job's end would wait out."""
    from shoal.launch.lifecycle import wait_for_an_exit

    quick = subprocess.Popen([sys.executable, "-c", "pass"])
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = time.monotonic()
        wait_for_an_exit([quick, slow], 30.0)
        assert time.monotonic() - started < 20.0
        assert quick.poll() == 0 and slow.poll() is None
    finally:
        slow.kill()
        slow.wait()
